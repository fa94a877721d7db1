"""What the spec says about a sharded call, and the comparisons of the sharded properties.

The oracle of a sharded call is full-sequence attention on the unsharded arrays: the
output is ``spec.sdpa`` (causal over global positions: L == S, so upper-left and
lower-right coincide; a window as the attend mask ``spec.sharding.attend_mask``), the
LSE ``spec.flash_attention(return_lse=True)`` on the flash layout's transposes (its own
``window``), the gradients ``spec.sdpa_vjp``. A padded case is compared on its L real
positions (the runner drops the padding: ``spec.sharding.unshard(length=L)``). The error bounds are the SDPA
level's (``calls.sdpa.allowed_for``, ``grad_magnitudes``, ``tolerance.grad_allowed``) and
the flash level's for the LSE (``calls.flash_bounds.allowed_lse``) on the same case.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import spec
from conformance.calls import flash_bounds
from conformance.calls import sdpa as calls
from conformance.calls.call_specs import case_rng
from conformance.calls.equivalence import Side, compare_equivalent
from conformance.calls.flash_cases import FlashCase
from conformance.core import tolerance
from conformance.core.cases import SDPACase
from conformance.core.compare import PropertyFailure, compare_values
from conformance.core.target import Target
from conformance.sharded.cases import ShardedCase, ShardedResult
from spec import sharding
from spec.emulate import round_to

__all__ = ["as_sdpa", "bounds", "check_forward", "check_backward", "compare_runs", "grad_output_for",
           "rank_evidence"]


def as_sdpa(case: ShardedCase) -> SDPACase:
    """The unsharded problem as an SDPA case (heads-first, causal upper-left = global, a
    window as the attend mask)."""
    mask = None if case.window == (-1, -1) else sharding.attend_mask(case.L, window=case.window)
    return SDPACase(case.query, case.key, case.value, attend_mask=mask,
                    causal="upper_left" if case.causal else None,
                    scale=case.scale, dtype=case.dtype, device=case.device)


def _as_flash(case: ShardedCase) -> FlashCase:
    t = (0, 2, 1, 3)
    return FlashCase(case.query.transpose(t), case.key.transpose(t), case.value.transpose(t),
                     causal=case.causal, window=case.window, scale=case.scale, dtype=case.dtype,
                     device=case.device)


def rank_evidence(case: ShardedCase, actual: np.ndarray, expected: np.ndarray, allowed: Any,
                  axis: int = -2) -> str:
    """Which rank's shard holds the wrong positions (``axis``, the sequence axis of ``actual``):
    ``wrong positions by rank: rank 0: none of 2; rank 1: 2 of 2 (first 2, last 3)``."""
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    bound = np.broadcast_to(np.asarray(allowed, dtype=np.float64), actual.shape)
    with np.errstate(invalid="ignore"):
        same = (actual == expected) | (np.abs(actual - expected) <= bound) | (np.isnan(actual) & np.isnan(expected))
    wrong = ~np.moveaxis(same, axis, 0).reshape(actual.shape[axis], -1).all(axis=1)   # (L,)
    parts = []
    for rank in range(case.world_size):
        held = sharding.positions(case.padded_length, case.world_size, rank, case.layout)
        held = held[held < case.L]
        bad = held[wrong[held]]
        parts.append(f"rank {rank}: " + (f"{len(bad)} of {len(held)} (first {bad.min()}, last {bad.max()})"
                                          if len(bad) else f"none of {len(held)}"))
    return f"wrong positions by rank ({case.layout}, global positions): " + "; ".join(parts)


def _compare(case: ShardedCase, what: str, actual: Any, expected: Any, allowed: Any, axis: int = -2) -> float:
    """``compare_values``, a failure noting which ranks' positions are wrong."""
    __tracebackhide__ = True
    try:
        return compare_values(what, actual, expected, allowed).ratio
    except PropertyFailure as exc:
        if np.shape(actual) == np.shape(expected):
            exc.add_note(rank_evidence(case, actual, expected, allowed, axis))
        raise


def bounds(target: Target, case: ShardedCase) -> tuple[np.ndarray, np.ndarray]:
    """(expected output (B, N, L, Ev), allowed error elementwise)."""
    allowed, ref = calls.allowed_for(target, as_sdpa(case))
    return ref.output, allowed


def check_forward(target: Target, case: ShardedCase, result: ShardedResult) -> float:
    """The unsharded output (and LSE, where declared) against the spec; worst ratio."""
    __tracebackhide__ = True
    expected, allowed = bounds(target, case)
    worst = _compare(case, "output (unsharded)", result.output, expected, allowed)
    if result.lse is not None:
        flash = _as_flash(case)
        ref = flash_bounds.oracle(flash)
        worst = max(worst, _compare(case, "lse (unsharded)", result.lse, ref.lse,
                                    flash_bounds.allowed_lse(target, flash, ref), axis=-1))
    return worst


def grad_output_for(case: ShardedCase) -> np.ndarray:
    """A random upstream gradient (B, N, L, Ev), seeded by the case's contents, in its dtype."""
    rng = case_rng(as_sdpa(case), "grad")
    return round_to(rng.standard_normal((case.B, case.N, case.L, case.Ev)), case.dtype)


def check_backward(target: Target, case: ShardedCase, grad_out: np.ndarray, result: ShardedResult) -> float:
    """dq, dk, dv (unsharded) against ``spec.sdpa_vjp``; worst ratio."""
    __tracebackhide__ = True
    sdpa_case = as_sdpa(case)
    ref = calls.oracle(sdpa_case)
    grads = spec.sdpa_vjp(case.query, case.key, case.value, grad_out, attend_mask=sdpa_case.attend_mask,
                          causal=sdpa_case.causal, scale=case.scale)
    magnitudes = calls.grad_magnitudes(sdpa_case, ref, grad_out)
    logit_range = calls.grad_logit_range(sdpa_case, ref)
    worst = 0.0
    assert result.grads is not None
    for name, actual, expected in zip(("dquery", "dkey", "dvalue"), result.grads,
                                      (grads.dquery, grads.dkey, grads.dvalue), strict=True):
        allowed = tolerance.grad_allowed(case.dtype, magnitudes[name], logit_range, tf32=target.tf32)
        worst = max(worst, _compare(case, f"{name} (unsharded)", actual, expected, allowed))
    return worst


def compare_runs(target: Target, what: str, case: ShardedCase, first: Any, reference: Any,
                 names: tuple[str, str], paths: tuple[str, str]) -> float:
    """Two sharded outputs of the same sequence that must agree (each within the spec's
    bound, so within twice it of each other); a disagreement says which one is wrong."""
    __tracebackhide__ = True
    expected, allowed = bounds(target, case)
    sides = [Side(name, out.output, expected, allowed, None, path)
             for name, out, path in zip(names, (first, reference), paths, strict=True)]
    return compare_equivalent(what, *sides, 2 * allowed).ratio
