"""The problem a failing call states, for the variants of ``spec.variants`` to be fitted to:
the SDPA, MHA, sharded, flash, varlen or kvcache problem of the case as called, what was
observed, and the error each part of the result is allowed (``diagnose`` and ``ties`` both
state problems)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from conformance.core.observe import _EXAMPLE, _Call
from spec import variants as V

__all__ = ["sdpa_mask_kind"]

#: MHA forward arguments a call may override and a problem can describe.
_MHA_OVERRIDES = frozenset({"need_weights", "average_attn_weights", "is_causal"})


def sdpa_mask_kind(case: Any) -> str:
    """The fully-masked-row kind of an SDPA case as the implementation received it
    (``Capabilities.fully_masked_policy``): the causal flag alone, else the mask's kind."""
    return "causal" if case.causal is not None and case.mask_kind == "none" else \
        "additive" if case.additive_mask is not None else "bool"


def _sdpa_problem(target: Any, call: _Call) -> tuple[Any, Any, Callable] | None:
    from conformance.calls import sdpa as C
    from conformance.core import tolerance

    case, observed = call.case, call.output
    # The case as passed: causality still in it only when the flag carries it alone.
    policy = target.caps.fully_masked_policy(sdpa_mask_kind(case))
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
    from conformance.calls import mha as MC
    from conformance.calls import mha_bounds

    if getattr(call.module, "training", False) or set(call.overrides) - _MHA_OVERRIDES:
        return None                                              # random, or not a problem we can state
    case = call.case.replace(**call.overrides) if call.overrides else call.case
    problem = V.MHAProblem.from_case(case, fully_masked=MC.fully_masked_policy(target, case))
    weights = call.weights if MC.has_feature(target, "need_weights") else None
    # A row that attends no key has a bound of ~0 under a zero policy; a variant may make
    # it attend (a mask read inverted), or the policy fill it (uniform rows sum the values,
    # as the property's check allows them). Each row's bound is the larger of its bound
    # with those rows attending nothing and attending every key uniformly, so a variant's
    # output is matched within the rounding of the keys it attends.
    bounds = [mha_bounds.allowed_error(case, tf32=target.tf32, fully_masked=kind) for kind in ("zero", "uniform")]
    output_allowed, weights_allowed = (np.maximum(a, b) for a, b in zip(*bounds, strict=True))

    def allowed(part: str, result: V.VariantResult) -> np.ndarray:
        return output_allowed if part == "output" else weights_allowed

    return problem, (call.output, weights), allowed


def _sharded_problem(target: Any, call: _Call) -> tuple[Any, Any, Callable] | None:
    """A sharded call's whole-sequence problem, the unsharded output, and the SDPA level's
    tolerance rule on the unsharded case (``sharded.checks.bounds``) as the allowed error
    of every variant (each a full-sequence attention of the same sizes)."""
    from conformance.sharded.checks import bounds

    case = call.case
    problem = V.ShardedProblem.from_case(case)
    _, output_allowed = bounds(target, case)

    def allowed(part: str, result: V.VariantResult) -> np.ndarray:
        return output_allowed

    return problem, call.output, allowed


def _family_allowed(target: Any, dtype: str, base: dict[str, np.ndarray],
                    stored: str | None) -> Callable[[str, V.VariantResult], Any]:
    """The allowed error of each part at the FlashAttention levels: the level's own rule on
    the call (``base``, what the property compares with), and for a variant, at least the
    rounding floor of the rule at its own magnitude and scores (a variant that attends
    other keys rounds as those keys make it: ``tolerance.sdpa_allowed`` and
    ``tolerance.lse_allowed`` with no naive error; an LSE stored in a coarser dtype is
    allowed that dtype's rounding too)."""
    from conformance.core import tolerance

    def allowed(part: str, result: V.VariantResult) -> Any:
        bound = base[part]
        if result.score_size is None or part not in ("output", "lse"):
            return bound
        size = np.nan_to_num(np.asarray(result.score_size, dtype=np.float64), nan=0.0, posinf=0.0)
        if part == "output":
            magnitude = np.nan_to_num(np.asarray(result.magnitude, dtype=np.float64), nan=0.0, posinf=0.0)
            rows = np.swapaxes(size, -1, -2)[..., None]                  # (..., L, N, 1): the output's rows
            return np.maximum(bound, tolerance.sdpa_allowed(dtype, 0.0, magnitude, tf32=target.tf32,
                                                            logit_scale=rows))
        floor = tolerance.lse_allowed(dtype, 0.0, size, tf32=target.tf32)
        if stored is not None and stored in tolerance.EPS and tolerance.EPS[stored] > tolerance.EPS[dtype]:
            floor = np.maximum(floor, tolerance.lse_allowed(stored, 0.0, size))
        return np.maximum(bound, floor)

    return allowed


def _flash_policy(target: Any, case: Any) -> str:
    """The fully-masked-row policy a flash-level call is judged by (sinks: always zero)."""
    return "zero" if getattr(case, "sinks", None) is not None else target.caps.fully_masked


def _flash_problem(target: Any, call: _Call) -> tuple[Any, Any, Callable]:
    """A ``flash_attn_func`` call: the output and, when asked for, the LSE, each within the
    flash level's rule (``calls.flash_bounds``)."""
    from conformance.calls import flash_bounds

    case, lse, stored = call.case, call.extra.get("lse"), call.extra.get("lse_dtype")
    problem = V.FlashProblem.from_case(case, fully_masked=_flash_policy(target, case))
    ref = flash_bounds.oracle(case)
    observed = {"output": call.output, "lse": lse}
    base = {"output": flash_bounds.allowed_output(target, case, ref),
            "lse": flash_bounds.allowed_lse(target, case, ref, stored=stored)}
    return problem, observed, _family_allowed(target, case.dtype, base, stored)


def _varlen_problem(target: Any, call: _Call) -> tuple[Any, Any, Callable]:
    """A ``flash_attn_varlen_func`` call: the packed output (and LSE) within the varlen
    level's rule, sequence by sequence (``calls.varlen.varlen_bounds``)."""
    from conformance.calls.varlen import varlen_bounds, varlen_lse_bounds

    case, lse, stored = call.case, call.extra.get("lse"), call.extra.get("lse_dtype")
    problem = V.VarlenProblem.from_case(case, fully_masked=target.caps.fully_masked)
    observed = {"output": call.output, "lse": lse}
    base = {"output": varlen_bounds(target, case)[1], "lse": varlen_lse_bounds(target, case, stored)[1]}
    return problem, observed, _family_allowed(target, case.dtype, base, stored)


def _kvcache_problem(target: Any, call: _Call) -> tuple[Any, Any, Callable]:
    """A ``flash_attn_with_kvcache`` call as made (a paged call's pages and block table as
    handed over): the output (and LSE) within the kvcache level's rule
    (``calls.kvcache.kvcache_bounds``), the caches after the call exactly, rotated keys
    within a rotation's rounding (``tolerance.rotation_allowed`` at the largest rotated
    entry: the runner's ``check_cache_after``)."""
    from conformance.calls.kvcache import kvcache_bounds, kvcache_lse_bounds
    from conformance.calls.sequences.calling import as_pages
    from conformance.core import tolerance

    case, lse, stored = call.case, call.extra.get("lse"), call.extra.get("lse_dtype")
    pages = {}
    if call.extra.get("paged"):
        (k_pages, table), (v_pages, _) = as_pages(case, case.k_cache), as_pages(case, case.v_cache)
        pages = {"k_cache": k_pages, "v_cache": v_pages, "block_table": table}
    problem = V.KVCacheProblem.from_case(case, fully_masked=target.caps.fully_masked, **pages)
    observed = {"output": call.output, "lse": lse, "k_cache": call.extra.get("k_cache"),
                "v_cache": call.extra.get("v_cache")}
    base = {"output": kvcache_bounds(target, case)[1], "lse": kvcache_lse_bounds(target, case, stored)[1],
            "v_cache": 0.0, "k_cache": 0.0}
    if case.rotary_cos is not None and case.k_new is not None:
        table = np.abs(np.concatenate([case.rotary_cos, case.rotary_sin])).max()
        size = 2 * float(np.abs(case.k_new).max()) * table
        base["k_cache"] = tolerance.rotation_allowed(case.dtype, np.asarray(size))
    return problem, observed, _family_allowed(target, case.dtype, base, stored)


def problem_of(target: Any, call: _Call) -> tuple[Any, Any, Callable] | None:
    """The problem ``call`` states at its level (None: one that cannot be stated)."""
    if call.level == "sdpa":
        return _sdpa_problem(target, call)
    if call.level == "sharded":
        return _sharded_problem(target, call)
    if call.level == "flash":
        return _flash_problem(target, call)
    if call.level == "varlen":
        return _varlen_problem(target, call)
    if call.level == "kvcache":
        return _kvcache_problem(target, call)
    return _mha_problem(target, call)
