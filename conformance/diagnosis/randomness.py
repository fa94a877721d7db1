"""A random output's sign: an eval-mode MHA module whose output changes between two calls
on the same inputs is ``mha_dropout_in_eval``, the one variant with no ``compute``; seen
in the calls kept (:func:`_random_in_eval`) or by calling again (:func:`_random_on_recall`)."""

from __future__ import annotations

import zlib
from functools import partial
from typing import Any

import numpy as np

from conformance.core.observe import _Call
from conformance.diagnosis.verdict import Verdict, _cause, _line

#: The MHA variant whose output is random; it shows as two eval-mode calls that differ.
_RANDOM_IN_EVAL = "mha_dropout_in_eval"
#: Extra calls of an eval-mode module whose output is wrong and matches no variant,
#: looking for that sign (only then; every other diagnosis calls at most once).
RECALLS = 3


def _random_in_eval(calls: list[_Call]) -> Verdict | None:
    """Two eval-mode calls of one module on the same inputs that differ: the output is
    random, the sign of the one variant that has no ``compute``."""
    seen: dict[tuple[int, tuple], np.ndarray] = {}
    for call in calls:
        if call.level != "mha" or call.module is None or getattr(call.module, "training", True):
            continue
        key = (id(call.module), tuple(sorted(call.overrides.items())), id(call.case))
        if key in seen:
            if not np.array_equal(np.nan_to_num(seen[key], nan=7.0), np.nan_to_num(call.output, nan=7.0)):
                cause = dict(_cause(_RANDOM_IN_EVAL, None, None, "two eval-mode calls on the same inputs differ"),
                             finite_evidence=True, confirmed=True)  # the sign itself, not a fit
                return Verdict([cause], _line([cause]))
        else:
            seen[key] = call.output
    return None


def _random_on_recall(target: Any, calls: list[_Call], diagnose_call: Any) -> Verdict | None:
    """Call the module of the first eval-mode MHA call whose output is wrong again on the
    same inputs, up to RECALLS times (guarded calls), each time with torch's generator
    seeded differently; an output that changes is the sign of the random variant (an
    eval-mode module must not depend on the generator). The runner seeds dropout from
    the case's contents, so a plain second call would draw the same sample.
    ``diagnose_call``: ``diagnose._diagnose_call`` (whether the output is wrong)."""
    from conformance.calls import replay
    from conformance.core.target import call_guarded
    from conformance.core.tensors import to_numpy

    for call in calls:
        if call.level != "mha" or call.module is None or getattr(call.module, "training", True):
            continue
        if diagnose_call(target, call) is not True:
            continue
        for seed in range(RECALLS):
            spec = replay.MHACallSpec(call.case, dropout=call.module.dropout, training=False,
                                      dropout_seed=zlib.crc32(f"diagnosis/recall/{seed}".encode()))
            outcome = replay.run_mha_call(target.impl, spec, invoke=partial(call_guarded, target),
                                          module=call.module.module)
            again = _Call("mha", call.case, to_numpy(outcome.output), module=call.module)
            random = _random_in_eval([call, again])
            if random is not None:
                return random
        return None
    return None
