"""Diagnosis: the probable cause of a failure, and the failures of a run grouped by cause.

A failing property says *that* an implementation is wrong; ``spec.variants`` holds the
known ways of being wrong (the other causal alignment, tiled GQA heads, a float32
softmax, ...), each computed in float64 on the case's own inputs. On a failure the
runner calls :func:`annotate`, which adds one line to the failure message::

    probable cause: causal_lower_right — the causal flag applies the lower-right triangle ...
    probable cause: unknown — no variant of spec.variants matches the output on the shrunk case

and records the matches on the property's ``runner.Record`` (``causes``), from which the
certificate groups the failures of a run by cause (:func:`cause_groups`).

Where the output comes from, cheapest first:

1. While a property runs, ``calls.run_sdpa`` and ``mha_calls.run_mha`` hand each
   output to :func:`observe_sdpa` / :func:`observe_mha`, which keep it in the list of the
   current example (the runner starts a fresh list per example, :func:`start_example`):
   one list append per call, nothing else, so a passing run is not slowed.
2. On a failure, the calls of the final (shrunk) example are read in order; for each
   whose output disagrees with the oracle under the tolerance rule,
   :func:`spec.variants.rank` lists the variants it matches, and the first such call
   with a match gives the verdict. The implementation is not called again.
3. Only when the property made no observable call (it compares gradients, or expects
   an error) is the implementation called once more, on the shrunk case, through the
   runner's guarded path.
4. Where several variants match equally (a directed example is not shrunk, and a small
   case often fits several conventions), the property's failing case before shrinking
   orders them, then at most :data:`MAX_DISCRIMINATING` cases derived from the failing
   one on which the tied variants' outputs differ, each called once (:func:`_separate`).

Everything runs inside a guard: a diagnosis error becomes the line
``probable cause: (diagnosis failed: ...)`` and never hides the failure itself.
The allowed error is the runner's tolerance rule (``calls`` and ``mha_calls``), applied to
each variant's own weights. docs/DIAGNOSIS.md says how to read the result.

The parts: ``diagnosis_observe`` (the calls kept per example), ``diagnosis_ties`` (the
discriminating cases of step 4) and ``diagnosis_causes`` (the certificate's cause
table); their public names are importable from here.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from conformance.diagnosis_causes import (
    SHOWN,
    UNKNOWN,
    _order,  # noqa: F401 - diagnosis._order, as before the split
    cause_groups,
    cause_line,
    cause_lines,
    cause_markdown,
)
from conformance.diagnosis_observe import (
    _EXAMPLE,
    _FIRST_FAILURE,
    _Call,
    _Example,
    observe_mha,
    observe_sdpa,
    start_example,
)
from conformance.diagnosis_ties import (
    MAX_DISCRIMINATING,  # noqa: F401 - diagnosis.MAX_DISCRIMINATING, as before the split
    _discriminating_calls,
)
from spec import variants as V

__all__ = [
    "UNKNOWN",
    "Verdict",
    "start_example",
    "observe_sdpa",
    "observe_mha",
    "annotate",
    "diagnose",
    "cause_line",
    "cause_groups",
    "cause_lines",
    "cause_markdown",
]

#: MHA forward arguments a call may override and a problem can describe.
_MHA_OVERRIDES = frozenset({"need_weights", "average_attn_weights", "is_causal"})
#: The MHA variant whose output is random; it shows as two eval-mode calls that differ.
_RANDOM_IN_EVAL = "mha_dropout_in_eval"
#: Extra calls of an eval-mode module whose output is wrong and matches no variant,
#: looking for that sign (only then; every other diagnosis calls at most once).
RECALLS = 3
#: Cases derived from a failing case that the implementation is called on, at most,


@dataclass(frozen=True)
class Verdict:
    """What the diagnosis found: the matches (dicts as recorded) and the message line;
    ``call``: the observed call they were matched on (None when there is none)."""

    causes: list[dict[str, Any]]
    line: str
    call: Any = field(default=None, compare=False, repr=False)


def annotate(exc: BaseException, target: Any, record: Any, *, property_id: str = "",
             isolation: Any = None) -> None:
    """Diagnose the failure ``exc`` of ``record`` (its ``failing_case`` is the shrunk
    case): set ``record.causes`` and add the ``probable cause:`` line to ``exc``.
    Never raises. With ``isolation`` (the implementation's isolated worker, which alone
    may call it) the worker checks the shrunk case of ``property_id`` again, diagnoses
    it and picks the reproducer's call (``isolation.Worker.annotate``), unless the
    implementation raised, hung or crashed (no output to diagnose, nothing called)."""
    if isolation is not None and record.failing_case is not None and not _implementation_broke(exc):
        first = _FIRST_FAILURE.get()
        first_case = (first.case if first is not None and first.record is record
                      and first.case is not record.failing_case else None)
        line = isolation.annotate(property_id, target, record, first_case)
    else:
        try:
            verdict = diagnose(target, record, exc)
        except Exception as err:  # noqa: BLE001 - a diagnosis must never mask the failure
            verdict = Verdict([], f"probable cause: (diagnosis failed: {type(err).__name__}: {err})")
        line = verdict.line
        try:
            record.causes = verdict.causes
        except Exception:  # noqa: BLE001 - same: the failure itself must come through
            pass
    try:
        if hasattr(exc, "add_note"):
            exc.add_note(line)
    except Exception:  # noqa: BLE001 - same: the failure itself must come through
        pass


def diagnose(target: Any, record: Any, exc: BaseException | None = None) -> Verdict:
    """The probable cause of ``record``'s failure on its shrunk case (see the module doc).

    Where several variants match the shrunk case, those that also match the property's
    first failing example (the case before shrinking, usually larger) come first."""
    case = record.failing_case
    if case is None:
        return _unknown("no shrunk case was kept")
    if target.level not in ("sdpa", "mha"):  # varlen / kvcache: no spec.variants model them yet
        return _unknown(f"spec.variants has no {target.level}-level variants")
    example = _EXAMPLE.get()
    calls = list(example.calls) if example is not None and example.case is case else []
    if not calls:
        if exc is not None and _implementation_broke(exc):
            return _unknown("the implementation raised, hung or crashed, so there is no output to compare")
        calls = [_call_once(target, case)]
    verdict = _verdict(target, calls)
    first = _FIRST_FAILURE.get()
    if first is None or first.record is not record or first.case is case:
        first = None
    if len(verdict.causes) > 1:
        verdict = _separate(target, verdict, first)
    if not verdict.causes:
        # A random output can look deterministic on one case: two equal samples.
        random = (_random_in_eval(first.calls) if first is not None else None) or _random_on_recall(target, calls)
        verdict = random or verdict
    return verdict


def _verdict(target: Any, calls: list[_Call]) -> Verdict:
    random = _random_in_eval(calls)
    if random is not None:
        return random
    wrong = False
    for call in calls:
        found = _diagnose_call(target, call)
        if isinstance(found, Verdict):
            return found
        wrong = wrong or found
    if wrong:
        return _unknown("no variant of spec.variants matches the output on the shrunk case")
    return _unknown("every output on the shrunk case agrees with the oracle; the property fails on "
                    "something else (a relation between calls, gradients, an error)")


def _separate(target: Any, verdict: Verdict, first: _Example | None) -> Verdict:
    """``verdict``'s causes ordered by how many other cases they also explain.

    Several variants often match one small case equally (with one query, ignoring the
    causal flag and aligning it lower-right attend the same keys). The evidence, cheapest
    first: the property's failing case before shrinking (its calls are kept; no call);
    then, while the leaders still tie, up to :data:`MAX_DISCRIMINATING` discriminating
    cases derived from the failing call's case, on which the tied variants' outputs
    differ (chosen in pure NumPy), each called once through the guarded path. A
    cause's rank is the number of these cases it fits; equal counts keep ``rank``'s
    order (fit, then the table's). Each cause's note names the cases it fits."""
    ids = [c["variant"] for c in verdict.causes]
    fits: dict[str, list[str]] = {v: [] for v in ids}
    if first is not None:
        also = {c["variant"] for c in _verdict(target, first.calls).causes}
        for v in ids:
            if v in also:
                fits[v].append("the failing case before shrinking")
    best = max(len(f) for f in fits.values())
    leaders = [v for v in ids if len(fits[v]) == best]
    if len(leaders) > 1 and verdict.call is not None:
        for description, call in _discriminating_calls(target, verdict.call, leaders):
            prepared = _sdpa_problem(target, call)
            if prepared is None:
                continue
            problem, observed, allowed = prepared
            for v in ids:
                if V.variant_fit(observed, problem, v, allowed) <= 1.0:
                    fits[v].append(description)
    order = sorted(range(len(ids)), key=lambda i: -len(fits[ids[i]]))     # stable: rank's order on ties
    causes = [dict(verdict.causes[i], note=_fits_note(fits[ids[i]])) for i in order]
    return Verdict(causes, _line(causes), verdict.call)


def _fits_note(cases: list[str]) -> str:
    return "also fits " + " and ".join(cases) if cases else ""


def _implementation_broke(exc: BaseException) -> bool:
    """The implementation raised, hung or crashed its worker: there is no output to read."""
    from conformance.runner import ImplementationCrashed, ImplementationHung, ImplementationRaised

    if isinstance(exc, (ImplementationHung, ImplementationRaised, ImplementationCrashed)):
        return True
    return isinstance(exc, BaseExceptionGroup) and any(_implementation_broke(e) for e in exc.exceptions)


def _call_once(target: Any, case: Any) -> _Call:
    """The implementation's plain output on ``case``: one guarded call (it is observed)."""
    example = _EXAMPLE.get()
    if example is None or example.case is not case:
        start_example(case)
    if target.level == "mha":
        from conformance.mha_calls import run_mha

        run_mha(target, case)
    else:
        from conformance.calls import run_sdpa

        run_sdpa(target, case)
    return _EXAMPLE.get().calls[-1]


def _diagnose_call(target: Any, call: _Call) -> Verdict | bool:
    """A verdict when the call's output disagrees with the oracle and matches variants;
    else whether it disagrees (True: wrong, but no variant matches)."""
    prepared = _sdpa_problem(target, call) if call.level == "sdpa" else _mha_problem(target, call)
    if prepared is None:
        return False
    problem, observed, allowed = prepared
    if V.correct_fit(observed, problem, allowed) <= 1.0:
        return False
    matches = V.rank(observed, problem, allowed=allowed)
    if not matches:
        return True
    relative = _relative_error(observed, V.reference(problem))
    causes = [_cause(m.variant_id, m.fit, relative) for m in matches]
    return Verdict(causes, _line(causes), call)


def _cause(variant_id: str, fit: float | None, relative: float | None, note: str = "") -> dict[str, Any]:
    return {"variant": variant_id, "summary": V.VARIANTS[variant_id].summary,
            "fit": None if fit is None else float(fit), "relative_error": relative, "note": note}


def _line(causes: list[dict[str, Any]]) -> str:
    named = [f"{c['variant']} — {c['summary']}" + (f" ({c['note']})" if c["note"] else "")
             for c in causes[:SHOWN]]
    more = f"; and {len(causes) - SHOWN} more" if len(causes) > SHOWN else ""
    return "probable cause: " + "; or ".join(named) + more


def _unknown(why: str) -> Verdict:
    return Verdict([], f"probable cause: {UNKNOWN} — {why}")


def _relative_error(observed: Any, correct: V.VariantResult) -> float | None:
    """max |observed - oracle| / max |oracle| over the output elements finite in both;
    None when NaN or inf appear where the oracle has none (or the shapes differ)."""
    output = np.asarray(observed[0] if isinstance(observed, tuple) else observed, dtype=np.float64)
    expected = np.asarray(correct.output, dtype=np.float64)
    if output.shape != expected.shape:
        return None
    if (np.isfinite(output) != np.isfinite(expected)).any():
        return None
    finite = np.isfinite(expected)
    if not finite.any():
        return None
    error = float(np.abs(output - expected)[finite].max())
    size = float(np.abs(expected[finite]).max())
    return error / size if size > 0 else error


# --------------------------------------------------------------------------- problems and bounds


def _sdpa_problem(target: Any, call: _Call) -> tuple[Any, Any, Callable] | None:
    from conformance import calls as C
    from conformance import tolerance

    case, observed = call.case, call.output
    # The case as passed: causality still in it only when the flag carries it alone.
    kind = "causal" if case.causal is not None and case.mask_kind == "none" else \
        "additive" if case.additive_mask is not None else "bool"
    policy = target.caps.fully_masked_policy(kind)
    if call.dropout_p > 0:
        stacked = _unstacked(case, observed)
        if stacked is None:
            return None                                          # one random sample: nothing to compare
        case, observed, samples = stacked
    problem = V.SDPAProblem.from_case(case, fully_masked=policy, dropout_p=call.dropout_p)
    ref = C.oracle(case)
    naive = C.naive_error(case, ref.output, C.valid_rows(case))

    def allowed(part: str, result: V.VariantResult) -> np.ndarray:
        weights = ref.weights if result.weights is None else result.weights
        weights = np.nan_to_num(weights, nan=0.0, posinf=0.0, neginf=0.0)
        magnitude = C.magnitude(case, weights)
        if call.dropout_p > 0:
            c = magnitude / (1 - call.dropout_p)
            return tolerance.sdpa_dropout_allowed(c, samples, observed.size)
        return tolerance.sdpa_allowed(case.dtype, naive, magnitude, tf32=target.tf32,
                                      logit_scale=C.logit_scale(case, SimpleNamespace(weights=weights)))

    return problem, observed, allowed


def _unstacked(case: Any, output: np.ndarray) -> tuple[Any, np.ndarray, int] | None:
    """A dropout call on M stacked copies of one problem (along the batch): that problem,
    the mean of the M outputs, and M; None for any other dropout call."""
    example = _EXAMPLE.get()
    B = getattr(example.case, "B", 0) if example is not None else 0   # the drawn case's batch
    if not B or case.B <= B or case.B % B:
        return None
    M = case.B // B

    def copies(x: np.ndarray | None) -> bool:
        if x is None or x.ndim < 4 or x.shape[0] == 1:
            return True
        stacked = x.reshape(M, B, *x.shape[1:])
        return bool((stacked == stacked[:1]).all())

    if not all(copies(x) for x in (case.query, case.key, case.value, case.attend_mask, case.additive_mask)):
        return None

    def first(x: np.ndarray | None) -> np.ndarray | None:
        return x if x is None or x.ndim < 4 or x.shape[0] == 1 else x[:B]

    single = case.replace(query=case.query[:B], key=case.key[:B], value=case.value[:B],
                          attend_mask=first(case.attend_mask), additive_mask=first(case.additive_mask))
    mean = output.reshape(M, B, *output.shape[1:]).mean(axis=0)
    return single, mean, M


def _mha_problem(target: Any, call: _Call) -> tuple[Any, Any, Callable] | None:
    from conformance import mha_bounds
    from conformance import mha_calls as MC

    if getattr(call.module, "training", False) or set(call.overrides) - _MHA_OVERRIDES:
        return None                                              # random, or not a problem we can state
    case = call.case.replace(**call.overrides) if call.overrides else call.case
    problem = V.MHAProblem.from_case(case, fully_masked=MC.fully_masked_policy(target, case))
    weights = call.weights if MC.has_feature(target, "need_weights") else None
    output_allowed, weights_allowed = mha_bounds.allowed_error(case, tf32=target.tf32)

    def allowed(part: str, result: V.VariantResult) -> np.ndarray:
        return output_allowed if part == "output" else weights_allowed

    return problem, (call.output, weights), allowed


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
                cause = _cause(_RANDOM_IN_EVAL, None, None, "two eval-mode calls on the same inputs differ")
                return Verdict([cause], _line([cause]))
        else:
            seen[key] = call.output
    return None


def _random_on_recall(target: Any, calls: list[_Call]) -> Verdict | None:
    """Call the module of the first eval-mode MHA call whose output is wrong again on the
    same inputs, up to RECALLS times (guarded calls), each time with torch's generator
    seeded differently; an output that changes is the sign of the random variant (an
    eval-mode module must not depend on the generator). The runner seeds dropout from
    the case's contents, so a plain second call would draw the same sample."""
    from conformance import replay
    from conformance.runner import call_guarded
    from conformance.tensors import to_numpy

    for call in calls:
        if call.level != "mha" or call.module is None or getattr(call.module, "training", True):
            continue
        if _diagnose_call(target, call) is not True:
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
