"""What the module-level tolerance rule is applied to: sizes and naive errors of one call.

``conformance.core.tolerance`` holds the rule and its table (``MHA_TOLERANCES``,
``mha_bound``); this module computes its inputs for an ``nn.MultiheadAttention`` call,
as ``conformance.calls.sdpa`` does for SDPA. The error of a module's output against
``spec.mha_forward`` may be at most

    allowed = k × (error of a naive same-precision module call)
              + eps(dtype) × (floor × magnitude + value_floor × |expected|)

elementwise. The naive error is that of ``spec.emulate_mha`` on the very same stored
parameters and inputs (its largest absolute error over the rows with an attendable key
in every head), so the bound follows the case: what a plain computation in this dtype
gets wrong, an implementation may get wrong k times over.

``magnitude`` is per output element, from the oracle's own intermediates:

    |W_o| @ merge_heads((weights @ |v|) · (1 + logit scale)) + |b_o|

the size of what the element sums. ``|v|`` is the projected value's size: ``|v|`` itself
(its rounding) plus, where the projection accumulates in the storage precision (float32,
float64) or rounds its inputs (TF32), ``|W_v| @ |value| + |b_v|`` (a sum that cancels
keeps the error of its terms; a float32 accumulation under a 16-bit result adds only
2^-24 of it). A head row's logit scale is the largest ``scale · Σ|q_i||k_i| + |mask|``
over the keys it attends, from the same sizes of q and k: a logit's rounding error is
proportional to it, and a logit error δ moves the row's output by about δ times its
magnitude (where the table's ``logit_growth`` says so: not in bfloat16, whose naive error
already holds the rounding of every logit). ``|expected|`` pays for the one rounding of
the result itself.

The attention weights get the same rule at magnitude ``weights · (1 + logit scale)``
(averaged over heads when they are), times ``WEIGHTS_FACTOR``.

With ``tf32`` (float32 matmuls on TF32 tensor cores, CUDA only) the naive error is still
float32's and the floor is TF32's, at TF32's unit roundoff.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

import spec
from conformance.core.cases import MHACase
from conformance.core import tolerance
from conformance.core.tolerance import EPS

__all__ = ["MHAAllowed", "allowed_error", "pair_allowed", "logit_range"]


class MHAAllowed(NamedTuple):
    """Elementwise allowed errors: ``output`` shaped like the module output, ``weights``
    like the attention weights the case returns (averaged or per head; always given)."""

    output: np.ndarray
    weights: np.ndarray


def _steps(case: MHACase, dtype: str, fully_masked: str = "zero") -> spec.MHASteps:
    return spec.emulate_mha_steps(
        case.params, case.query, case.key, case.value, dtype=dtype,
        key_padding_mask=case.key_padding_mask, attn_mask=case.attn_mask,
        is_causal=case.is_causal, batch_first=case.batch_first, fully_masked=fully_masked)


def _sizes(case: MHACase, exact: spec.MHASteps, tf32: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(query, key, value) sizes (B, N, L|S', hd) of the projections: what each projected
    entry's rounding error is proportional to. ``|x|`` plus, where the matmul accumulates
    in the storage precision (float32, float64) or rounds its inputs (TF32), the size of
    its sum ``|W| @ |x| + |b|`` (a cancelling sum keeps the error of its terms); a float32
    accumulation under a 16-bit result adds only 2^-24 of it (weighed against eps)."""
    p = case.params
    absolute = dataclasses.replace(p, **{
        f.name: np.abs(getattr(p, f.name)) for f in dataclasses.fields(p)
        if isinstance(getattr(p, f.name), np.ndarray)})
    sums = spec.emulate_mha_steps(absolute, np.abs(case.query), np.abs(case.key),
                                  np.abs(case.value), dtype="float64", batch_first=case.batch_first)
    _, eps = tolerance.mha_tolerance_for(case.dtype, tf32=tf32)
    weight = EPS["float32"] / eps if case.dtype in ("float16", "bfloat16") else 1.0
    return tuple(np.abs(x) + weight * s for x, s in ((exact.query, sums.query), (exact.key, sums.key),
                                                      (exact.value, sums.value)))


def _logit_scale(exact: spec.MHASteps, query: np.ndarray, key: np.ndarray) -> np.ndarray:
    """(B, N, L, 1): the largest ``scale·Σ|q_i||k_i| + |mask|`` over the keys each head's
    row attends (0 for a row with none), from the projections' sizes."""
    size = abs(exact.scale) * (query @ np.swapaxes(key, -1, -2))    # (B, N, L, S')
    if exact.additive is not None:
        with np.errstate(invalid="ignore"):
            size = size + np.abs(exact.additive)
    attended = np.isfinite(size) & (np.nan_to_num(exact.weights) > 0)
    return np.where(attended, size, 0.0).max(axis=-1, keepdims=True)


def _valid_rows(case: MHACase) -> tuple[np.ndarray, np.ndarray]:
    """((B, L, 1) output rows with an attendable key in every head, (B, N, L, 1) head rows
    with one)."""
    dead = case.blocked_rows()                                         # (B, N, L)
    return ~dead.any(axis=1)[..., None], ~dead[..., None]


def _largest(diff: np.ndarray, rows: np.ndarray) -> float:
    diff = np.where(rows, diff, 0.0)
    finite = np.isfinite(diff)
    return float(diff[finite].max()) if finite.any() else 0.0


def _naive_errors(case: MHACase, exact: spec.MHASteps) -> tuple[float, float]:
    """Largest error of the naive ``case.dtype`` module call: (output, weights in the
    case's averaging), over the valid rows."""
    if case.dtype == "float64":
        return 0.0, 0.0
    naive = _steps(case, case.dtype)
    out_rows, head_rows = _valid_rows(case)
    out_error = _largest(np.abs(naive.output - exact.output), out_rows)
    average = case.average_attn_weights
    got = naive.weights_layout(naive.weights, average=average, dtype=case.dtype)
    want = exact.weights_layout(exact.weights, average=average)
    rows = out_rows if average else head_rows
    weight_error = _largest(np.abs(got - want), rows if exact.batched else rows[0])
    return out_error, weight_error


def allowed_error(case: MHACase, *, tf32: bool = False, fully_masked: str = "zero") -> MHAAllowed:
    """Elementwise allowed error of ``case``'s module output and attention weights against
    ``spec.mha_forward(..., fully_masked=fully_masked)`` (see the module docstring)."""
    tol, _ = tolerance.mha_tolerance_for(case.dtype, tf32=tf32)
    exact = _steps(case, "float64", fully_masked)
    query, key, value = _sizes(case, exact, tf32)
    growth = np.ones(1)
    if tol.logit_growth:
        growth = 1.0 + _logit_scale(exact, query, key)              # (B, N, L, 1)
    weights = np.nan_to_num(exact.weights)                           # (B, N, L, S')
    B, N, L, hd = exact.attended.shape
    per_head = (weights @ value) * growth                            # (B, N, L, hd)
    merged = per_head.transpose(0, 2, 1, 3).reshape(B, L, N * hd)    # (B, L, D)
    p = case.params
    out_bias = 0.0 if p.out_proj_bias is None else np.abs(p.out_proj_bias)
    magnitude = merged @ np.abs(p.out_proj_weight).T + out_bias      # (B, L, D)
    average = case.average_attn_weights
    naive_output, naive_weights = _naive_errors(case, exact)
    output = tolerance.mha_bound(case.dtype, naive_output, exact.layout(magnitude),
                                 exact.layout(exact.output), tf32=tf32)
    weights_allowed = tolerance.WEIGHTS_FACTOR * tolerance.mha_bound(
        case.dtype, naive_weights, exact.weights_layout(weights * growth, average=average),
        exact.weights_layout(weights, average=average), tf32=tf32)
    return MHAAllowed(output, weights_allowed)


def pair_allowed(case: MHACase, *, tf32: bool = False, fully_masked: str = "zero") -> MHAAllowed:
    """Allowed difference between two outputs (and weights) of the same module call by
    different paths (need_weights True/False, bool/float masks...): each is within
    :func:`allowed_error`, so twice it."""
    output, weights = allowed_error(case, tf32=tf32, fully_masked=fully_masked)
    return MHAAllowed(2 * output, 2 * weights)


def logit_range(case: MHACase, *, tf32: bool = False) -> float:
    """The case's largest per-row logit scale (``scale·Σ|q_i||k_i| + |mask|`` over
    attended keys, every head and row)."""
    exact = _steps(case, "float64")
    query, key, _ = _sizes(case, exact, tf32)
    scale = _logit_scale(exact, query, key)
    return float(scale.max()) if scale.size else 0.0
