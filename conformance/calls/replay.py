"""One call into an implementation, as data: what the runner calls, what a failure
saves, what its reproducer re-runs.

A property often calls the implementation on something other than the case
Hypothesis drew (V = identity, permuted keys, an invalid variant, large logits,
the case tiled into dropout samples, a module in train mode), and the runner hands
the case over in one particular way (causality as ``is_causal=True`` or folded
into ``attn_mask``, a memory layout, dropout, autograd). :class:`SDPACallSpec` and
:class:`MHACallSpec` hold exactly that: the case as called and every argument.

There is one path from a call spec to the implementation: ``calls.run_sdpa`` and
``mha_calls.run_mha`` make every call of the properties through
:func:`run_sdpa_call` / :func:`run_mha_call`, and a failure's reproducer snippet
runs the same functions through :func:`show_sdpa_call` / :func:`show_mha_call`,
which also print how the result differs from the oracle for the case as called.

Every random draw of a call that is not Hypothesis' own (dropout masks, upstream
gradients) is seeded from the case's contents (:func:`content_seed`), never from
Python's salted ``hash()``: a replay, another process or an xdist worker draws the
same.

This module is the public face of two: :mod:`conformance.calls.call_specs` (the call as
data and the one path that makes it) and :mod:`conformance.calls.call_reports` (how a
call's result differs from the oracle). Reproducer snippets import from here.
"""

from __future__ import annotations

from conformance.calls.call_reports import (
    CallReport,
    first_failing_call,
    report_mha_call,
    report_sdpa_call,
    show_mha_call,
    show_sdpa_call,
)
from conformance.calls.call_specs import (
    CallLog,
    Invoke,
    MHACallSpec,
    MHAOutcome,
    SDPACallSpec,
    SDPAOutcome,
    build_module,
    content_seed,
    fold_causal,
    mha_content_seed,
    mha_output_shape,
    run_mha_call,
    run_sdpa_call,
    tile_mha_case,
    tile_sdpa_case,
)

__all__ = [
    "Invoke",
    "SDPACallSpec",
    "MHACallSpec",
    "CallLog",
    "SDPAOutcome",
    "MHAOutcome",
    "CallReport",
    "fold_causal",
    "tile_sdpa_case",
    "tile_mha_case",
    "mha_output_shape",
    "content_seed",
    "mha_content_seed",
    "run_sdpa_call",
    "build_module",
    "run_mha_call",
    "report_sdpa_call",
    "report_mha_call",
    "show_sdpa_call",
    "show_mha_call",
    "first_failing_call",
]
