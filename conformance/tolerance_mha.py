"""The tolerance rule for a whole ``nn.MultiheadAttention`` call.

SDPA's rule (``conformance.tolerance``) at module level: the error of a module's output
against ``spec.mha_forward`` may be at most

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
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

import spec
from conformance.cases import MHACase
from conformance.tolerance import EPS, SUBNORMAL

__all__ = [
    "MHA_TOLERANCES",
    "MHATolerance",
    "WEIGHTS_FACTOR",
    "MHAAllowed",
    "mha_allowed",
    "mha_pair_allowed",
    "mha_logit_range",
    "mha_grad_allowed",
]


@dataclass(frozen=True)
class MHATolerance:
    """k: multiple of the naive module call's error; floor: ulps at the per-element
    magnitude; logit_growth: whether that magnitude carries the factor 1 + logit scale;
    value_floor: ulps at the expected value itself (the one rounding of the result no
    implementation avoids); grad_floor: ulps of a directional derivative's size (times
    1 + the case's largest logit scale; no emulation of the backward pass)."""

    k: float
    floor: float
    logit_growth: bool
    value_floor: float
    grad_floor: float


#: Chosen from ``benchmarks/mha_tolerance.py`` (results in
#: benchmarks/results/mha-tolerance-*.txt): the correct built-ins stay at or below about
#: 0.25 of the bound while a module 5 % off fails in every dtype. bfloat16's floor has no
#: logit growth: every bfloat16 logit is rounded, so the naive error already measures
#: what the logits cost, and 2^-8 × (1 + logit scale) alone would come near 5 %.
MHA_TOLERANCES: dict[str, MHATolerance] = {
    "float64": MHATolerance(k=2.0, floor=8.0, logit_growth=True, value_floor=8.0, grad_floor=256.0),
    "float32": MHATolerance(k=2.0, floor=2.0, logit_growth=True, value_floor=4.0, grad_floor=256.0),
    "tf32": MHATolerance(k=2.0, floor=4.0, logit_growth=True, value_floor=4.0, grad_floor=64.0),
    "float16": MHATolerance(k=2.0, floor=3.0, logit_growth=True, value_floor=4.0, grad_floor=256.0),
    "bfloat16": MHATolerance(k=2.0, floor=2.5, logit_growth=False, value_floor=2.0, grad_floor=256.0),
}

#: The attention weights are allowed this many times the rule at their own magnitude:
#: implementations round a 16-bit softmax in different orders, and a wrong weight is
#: wrong by far more (a sum instead of a mean, a missed mask).
WEIGHTS_FACTOR = 4.0

#: Smallest positive normal of each dtype: subnormal results need no more exactness.
_TINY = {"float64": 2.2e-308, "float32": 1.2e-38, "float16": 6.1e-5, "bfloat16": 1.2e-38}


class MHAAllowed(NamedTuple):
    """Elementwise allowed errors: ``output`` shaped like the module output, ``weights``
    like the attention weights the case returns (averaged or per head; always given)."""

    output: np.ndarray
    weights: np.ndarray


def _tolerance(dtype: str, tf32: bool) -> tuple[MHATolerance, float]:
    key = "tf32" if (tf32 and dtype == "float32") else dtype
    return MHA_TOLERANCES[key], EPS[key]


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
    _, eps = _tolerance(case.dtype, tf32)
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


def _bound(tol: MHATolerance, eps: float, naive: float, magnitude: np.ndarray,
           value: np.ndarray, tiny: float) -> np.ndarray:
    return tol.k * naive + eps * (tol.floor * np.maximum(magnitude, tiny)
                                  + tol.value_floor * np.nan_to_num(np.abs(value)))


def mha_allowed(case: MHACase, *, tf32: bool = False, fully_masked: str = "zero") -> MHAAllowed:
    """Elementwise allowed error of ``case``'s module output and attention weights against
    ``spec.mha_forward(..., fully_masked=fully_masked)`` (see the module docstring)."""
    tol, eps = _tolerance(case.dtype, tf32)
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
    tiny = _TINY[case.dtype]
    output = _bound(tol, eps, naive_output, exact.layout(magnitude), exact.layout(exact.output), tiny)
    weights_allowed = WEIGHTS_FACTOR * _bound(
        tol, eps, naive_weights, exact.weights_layout(weights * growth, average=average),
        exact.weights_layout(weights, average=average), tiny)
    return MHAAllowed(output, weights_allowed)


def mha_pair_allowed(case: MHACase, *, tf32: bool = False, fully_masked: str = "zero") -> MHAAllowed:
    """Allowed difference between two outputs (and weights) of the same module call by
    different paths (need_weights True/False, bool/float masks...): each is within
    :func:`mha_allowed`, so twice it."""
    output, weights = mha_allowed(case, tf32=tf32, fully_masked=fully_masked)
    return MHAAllowed(2 * output, 2 * weights)


def mha_logit_range(case: MHACase, *, tf32: bool = False) -> float:
    """The case's largest per-row logit scale (``scale·Σ|q_i||k_i| + |mask|`` over
    attended keys, every head and row)."""
    exact = _steps(case, "float64")
    query, key, _ = _sizes(case, exact, tf32)
    scale = _logit_scale(exact, query, key)
    return float(scale.max()) if scale.size else 0.0


def mha_grad_allowed(case: MHACase, size: float, *, tf32: bool = False) -> float:
    """Allowed error of a directional derivative Σ g·(∂output/∂inputs)·direction whose
    terms sum to ``size`` in absolute value (no emulation of the backward pass)."""
    tol, eps = _tolerance(case.dtype, tf32)
    return tol.grad_floor * eps * (1.0 + mha_logit_range(case, tf32=tf32)) * size + 16 * SUBNORMAL[case.dtype]
