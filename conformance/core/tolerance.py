"""The tolerance rule, in one table, and every other error bound of the suite.

Per example, not per suite (docs/DESIGN.md#tolerance): an implementation's error
against the float64 oracle may be at most

    allowed = k × (error of a naive same-precision computation of this case)
              + floor × eps(dtype) × magnitude

elementwise, where the naive error is measured with ``spec.emulate_sdpa`` on the
very same stored inputs (its largest absolute error over the case), and
``magnitude`` is the size of what the output element sums: ``weights @ |V|``
from the oracle (an attention output is a convex combination of value rows, so
its rounding error scales with the attended values, not with the output, which
may cancel to ~0). NaN or inf where the oracle is finite always fails.

The measured ratio ``error / allowed`` (its maximum over the case) is the
headroom shown on the certificate: 0.1 means ten times inside the bound.

Gradients have no emulation in ``spec``: their bound is the rounding floor at the
gradient's magnitude (computed by running the VJP on absolute values), times
``1 + max|scaled logit|`` because a logit error of δ moves the weights by δ.
MHA modules have no emulation either: their bound is the rounding floor at the
module output's magnitude, likewise times ``1 + max|scaled logit|``.

The statistical properties' bounds live here too: Hoeffding's inequality for
the dropout means, and the accepted range of the ``scaling_variance`` statistic.

The call modules (``conformance.calls.sdpa``, ``conformance.calls.mha``) compute the
inputs (magnitudes, naive errors, logit ranges) and call these functions; the
properties add the bounds of the calls they compare.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spec import fp8 as spec_fp8

__all__ = [
    "TOLERANCES",
    "Tolerance",
    "EPS",
    "SUBNORMAL",
    "tolerance_for",
    "sdpa_allowed",
    "grad_allowed",
    "lse_allowed",
    "ROTATION_ULPS",
    "rotation_allowed",
    "spread_over_head",
    "MHA_TOLERANCES",
    "MHATolerance",
    "WEIGHTS_FACTOR",
    "mha_bound",
    "mha_derivative_allowed",
    "logit_shift_allowed",
    "constant_column_allowed",
    "DROPOUT_FALSE_ALARM",
    "hoeffding_halfwidth",
    "sdpa_dropout_allowed",
    "mha_dropout_allowed",
    "SCALING_VARIANCE_FACTOR",
    "scaling_variance_accepted",
    "scaling_variance_ratio",
    "FP8_ACCUMULATION_EPS",
    "fp8_score_error",
    "fp8_allowed",
    "fp8_lse_allowed",
    "flash_dropout_allowed",
]

#: Unit roundoff (half the machine epsilon) of each dtype, and of TF32.
EPS = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "tf32": 2.0**-11,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
}


@dataclass(frozen=True)
class Tolerance:
    """k: multiple of the naive same-precision error; floor: ulps at the magnitude;
    grad_floor: ulps at the gradient magnitude (times 1 + max|logit|).
    Module-level calls have their own table, :data:`MHA_TOLERANCES`."""

    k: float
    floor: float
    grad_floor: float


#: The one table of tolerances. Measured headroom of the built-in correct
#: implementations under the ``thorough`` profile is reported by
#: ``benchmarks/runner_speed.py``; keep every entry at least 4× above it.
TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(k=8.0, floor=256.0, grad_floor=256.0),
    "float32": Tolerance(k=8.0, floor=256.0, grad_floor=256.0),
    "tf32": Tolerance(k=8.0, floor=64.0, grad_floor=64.0),
    "float16": Tolerance(k=8.0, floor=16.0, grad_floor=256.0),
    "bfloat16": Tolerance(k=8.0, floor=16.0, grad_floor=256.0),
}


def tolerance_for(dtype: str, *, tf32: bool = False) -> tuple[Tolerance, float]:
    """The table row and unit roundoff for ``dtype`` (TF32 when declared on float32)."""
    key = "tf32" if (tf32 and dtype == "float32") else dtype
    return TOLERANCES[key], EPS[key]


def sdpa_allowed(
    dtype: str,
    naive_error: float,
    magnitude: np.ndarray,
    *,
    tf32: bool = False,
    logit_scale: np.ndarray | float = 0.0,
) -> np.ndarray:
    """Elementwise allowed absolute error of an SDPA output (see module docstring).

    ``logit_scale`` (per row): the largest |scaled logit| a row attends. exp(s)
    carries a relative error of about eps·|s| in any implementation, so the
    floor grows with it (it matters in float64, where the naive error is 0).
    """
    tol, eps = tolerance_for(dtype, tf32=tf32)
    magnitude = magnitude * (1.0 + logit_scale)
    # The smallest positive normal of the dtype keeps subnormal-only rows from
    # demanding exactness below what the dtype can represent.
    tiny = {"float64": 2.2e-308, "float32": 1.2e-38, "float16": 6.1e-5, "bfloat16": 1.2e-38}[dtype]
    return tol.k * naive_error + tol.floor * eps * np.maximum(magnitude, tiny)


def lse_allowed(dtype: str, naive_error: float, score_size: np.ndarray, *, tf32: bool = False) -> np.ndarray:
    """Elementwise allowed error of a log-sum-exp (FlashAttention's ``softmax_lse``):
    k × the naive same-precision LSE error plus the rounding floor at the row's largest
    |score| (``score_size``, per row), the size a score's own rounding error scales with."""
    tol, eps = tolerance_for(dtype, tf32=tf32)
    return tol.k * naive_error + tol.floor * eps * (1.0 + score_size)


#: Rotated keys written into a KV cache (``flash_attn_with_kvcache`` with ``rotary_cos``):
#: ``x_a·c − x_b·s`` computed in any order and precision at least the dtype's, then
#: stored in the dtype, may land one unit in the last place from the correctly rounded
#: float64 value, plus the computation's own rounding: a few ulps of the terms' size.
ROTATION_ULPS = 8.0


def rotation_allowed(dtype: str, size: np.ndarray) -> np.ndarray:
    """Elementwise allowed error of a rotated and stored key, ``size`` = |x_a·c| + |x_b·s|
    (what the two products' rounding scales with); the dtype's smallest normal as a floor."""
    tiny = {"float64": 2.2e-308, "float32": 1.2e-38, "float16": 6.1e-5, "bfloat16": 1.2e-38}[dtype]
    return ROTATION_ULPS * EPS[dtype] * np.maximum(size, tiny)


#: Smallest positive subnormal of each dtype: gradients below a few of these
#: are lost to underflow in any same-precision backward.
SUBNORMAL = {"float64": 5e-324, "float32": 1.4e-45, "float16": 6.0e-8, "bfloat16": 9.2e-41}


def grad_allowed(dtype: str, magnitude: np.ndarray, logit_range: float, *, tf32: bool = False) -> np.ndarray:
    """Elementwise allowed error of an SDPA gradient of ``magnitude`` (the VJP run
    on absolute values, spread with :func:`spread_over_head`); ``logit_range``:
    the largest |scaled logit| (+ |additive mask|) of the case."""
    tol, eps = tolerance_for(dtype, tf32=tf32)
    return tol.grad_floor * eps * (1.0 + logit_range) * magnitude + 16 * SUBNORMAL[dtype]


#: A logit's rounding error moves weight between keys, so every entry of a
#: head's gradient can be off by this share of that head's largest entry.
GRAD_HEAD_SHARE = 2.0**-10


def spread_over_head(magnitude: np.ndarray) -> np.ndarray:
    """``magnitude`` (..., H, X, Y) raised to at least GRAD_HEAD_SHARE of its head's maximum."""
    return np.maximum(magnitude, magnitude.max(axis=(-2, -1), keepdims=True) * GRAD_HEAD_SHARE)


@dataclass(frozen=True)
class MHATolerance:
    """The rule for a whole module call (``mha_bounds`` computes its inputs).

    k: multiple of the naive module call's error; floor: ulps at the per-element
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
#: 0.25 of the bound while a module 5 % off fails in every dtype (bfloat16: in 95 % of
#: cases; a correct bfloat16 module is itself off by up to ~1.4 %). bfloat16's floor has
#: no logit growth: every bfloat16 logit is rounded, so the naive error already measures
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


def mha_tolerance_for(dtype: str, *, tf32: bool = False) -> tuple[MHATolerance, float]:
    """The module-level table row and unit roundoff for ``dtype`` (TF32 when declared)."""
    key = "tf32" if (tf32 and dtype == "float32") else dtype
    return MHA_TOLERANCES[key], EPS[key]


def mha_bound(dtype: str, naive_error: float, magnitude: np.ndarray, expected: np.ndarray, *,
              tf32: bool = False) -> np.ndarray:
    """Elementwise allowed error of a module output (or weights):
    ``k·naive + eps·(floor·magnitude + value_floor·|expected|)``."""
    tol, eps = mha_tolerance_for(dtype, tf32=tf32)
    tiny = {"float64": 2.2e-308, "float32": 1.2e-38, "float16": 6.1e-5, "bfloat16": 1.2e-38}[dtype]
    return tol.k * naive_error + eps * (tol.floor * np.maximum(magnitude, tiny)
                                        + tol.value_floor * np.nan_to_num(np.abs(expected)))


def mha_derivative_allowed(dtype: str, *, analytic_size: float, numeric: float, logit_range: float,
                           cancellation: float, step: float, tf32: bool = False) -> float:
    """Allowed |analytic - numeric| of a directional derivative of Σ g·output
    (``mha_gradients``): the implementation's rounding at the derivative's size
    plus the noise of float64 central differences with step ``step``.

    ``analytic_size``: Σ|grad|·|direction| of the implementation's gradients;
    ``numeric``: the central difference; ``cancellation``: Σ|g·f(x + step·d)|,
    what the difference of two oracle outputs cancels.

    Central differences: truncation O(step²) plus float64 cancellation
    ~ eps·Σ|g·f| / step. The rounding term is ``grad_floor`` ulps of the module
    table's row (TF32's row and eps when the target declares TF32).
    """
    fd_noise = 64 * 2.0**-52 * cancellation / step + 1e-6 * analytic_size
    tol, eps = mha_tolerance_for(dtype, tf32=tf32)
    return (tol.grad_floor * eps * (1 + logit_range) * (analytic_size + abs(numeric)) + fd_noise
            + 16 * SUBNORMAL[dtype])


def logit_shift_allowed(delta_logit: np.ndarray, value_max: float) -> np.ndarray:
    """Output change (B, N, L, 1) when the logits of a row move by ``delta_logit``
    (B, N, L, S): softmax moves the weights by at most 2·max|delta| in L1, times
    ``value_max`` = max |V|. Non-finite deltas (blocked keys) do not count."""
    worst = np.where(np.isfinite(delta_logit), np.abs(delta_logit), 0.0).max(-1, keepdims=True)
    return 2 * worst * value_max


def constant_column_allowed(dtype: str, value: float, keys: int, *, tf32: bool = False) -> float:
    """Allowed error of an output element whose value column is ``value`` for each of
    ``keys`` keys (``small_sizes_sweep``): the exact output is ``value`` (a convex
    combination of copies of it). A same-precision computation rounds each weight
    (relative error <= u), so the weights sum to 1 ± u, plus the accumulation's
    error (keys + 4)·u_acc (u_acc: float32's, float64's for float64); before its
    final rounding the output is within that of ``value``, which for ``value`` in the
    middle of its binade (1.5, say) rounds to ``value`` or a neighbour. So: one ulp
    of ``value`` plus the accumulation term. Tighter than :func:`sdpa_allowed`, whose
    floor (16 ulps of the magnitude) lets a bfloat16 output be 6% off: an output
    scaled by 1.01 is two bfloat16 ulps away at 1.5."""
    _, eps = tolerance_for(dtype, tf32=tf32)
    accumulation = EPS["float64"] if dtype == "float64" else EPS["float32"]
    value = abs(value)
    return float(2 * eps * 2.0 ** np.floor(np.log2(value)) + (keys + 4) * accumulation * value)


# -- statistical bounds ---------------------------------------------------------

#: False-alarm probability per example of the dropout properties, shared
#: among the elements compared (a union bound).
DROPOUT_FALSE_ALARM = 1e-7
#: Relative slack on a mean of dropout samples (the rounding of the mean itself).
DROPOUT_SLACK = 1e-6


def hoeffding_halfwidth(width: np.ndarray, samples: int, elements: int) -> np.ndarray:
    """Hoeffding: the mean of ``samples`` independent draws from an interval of
    ``width`` lies within width·sqrt(ln(2/δ) / 2M) of the expectation with
    probability 1 - δ, δ = DROPOUT_FALSE_ALARM / ``elements``."""
    delta = DROPOUT_FALSE_ALARM / max(1, elements)
    return width * np.sqrt(np.log(2 / delta) / (2 * samples))


def sdpa_dropout_allowed(c: np.ndarray, samples: int, elements: int) -> np.ndarray:
    """``dropout_expectation``: each sample of an output element lies in [0, c]
    (V positive, c = Σ w|v| / (1 - p))."""
    return hoeffding_halfwidth(c, samples, elements) + DROPOUT_SLACK * c


def mha_dropout_allowed(c: np.ndarray, samples: int, elements: int, rounding: np.ndarray) -> np.ndarray:
    """``mha_dropout_expectation``: each sample lies in an interval of width 2c
    around the output bias; ``rounding`` is the module's own bound (``mha_bounds.allowed_error``)."""
    return hoeffding_halfwidth(2 * c, samples, elements) + DROPOUT_SLACK * c + rounding


def dropout_spread_allowed(width: np.ndarray, samples: int, elements: int) -> np.ndarray:
    """Maurer and Pontil (2009, theorem 10): the sample standard deviation (ddof=1) of
    ``samples`` independent draws from an interval of ``width`` lies within
    width·sqrt(2 ln(2/δ) / (M - 1)) of the true one with probability 1 - δ,
    δ = DROPOUT_FALSE_ALARM / ``elements``. About 0.21·width at M = 1024: it tells a
    dropout that drops each weight independently from none at all, from one mask shared
    by every sample, or from one applied to the output instead of the weights."""
    delta = DROPOUT_FALSE_ALARM / max(1, elements)
    return width * np.sqrt(2 * np.log(2 / delta) / (samples - 1)) + DROPOUT_SLACK * width


#: ``scaling_variance`` accepts its statistic (≈ 1 under the default scale)
#: within a factor of this of 1.
SCALING_VARIANCE_FACTOR = 2.0


def scaling_variance_accepted(statistic: float) -> bool:
    return 1 / SCALING_VARIANCE_FACTOR <= statistic <= SCALING_VARIANCE_FACTOR


def scaling_variance_ratio(statistic: float) -> float:
    """Headroom of the statistic: |log statistic| / log FACTOR (1 at the edge)."""
    return abs(np.log(statistic)) / np.log(SCALING_VARIANCE_FACTOR)


def flash_dropout_allowed(c: np.ndarray, samples: int, elements: int, rounding: np.ndarray) -> np.ndarray:
    """``flash_dropout_expectation``: each sample of an output element lies in [0, c] (V
    positive, c = Σ w|v| / (1 - p)), so Hoeffding bounds the mean as for SDPA; a 16-bit
    kernel's samples carry a rounding error each, at most ``rounding`` (the no-dropout
    bound at magnitude c, ``flash_bounds.allowed_output`` / (1 - p)), which can shift the
    mean by as much: it is added, as at the MHA level."""
    return hoeffding_halfwidth(c, samples, elements) + DROPOUT_SLACK * c + rounding


# -- FP8 inputs (flash level, spec.fp8) -----------------------------------------
#
# An FP8 call's inputs are exact: the oracle runs on stored · descale, which float64 holds
# exactly (spec.fp8). So the whole error is the kernel's own rounding, and the bound below
# is derived from the formats' unit roundoffs for a kernel computing as FlashAttention-3's
# FP8 forward does (per query row i, heads first; w the oracle's weights, n_i the number of
# keys row i attends):
#
# 1. Scores s_ij = (scale · qd · kd) · Σ_e q8_e k8_e. A product of two FP8 values has at most
#    8 significant bits: exact in float32. The sum of E products in an accumulator of unit
#    roundoff u_a is within γ_E · Σ_e |q8_e k8_e| (γ_n = n u_a / (1 - n u_a)), and the three
#    factors add three roundings: |δs_ij| <= δ_i = γ_{E+3} · Z_i, Z_i the row's largest
#    scale · |qd kd| · Σ_e |q8_e k8_e| (``flash_bounds._score_sizes`` of the dequantised
#    problem). u_a is FP8_ACCUMULATION_EPS, not float32's: Hopper's FP8 tensor cores keep
#    about 14 bits of the accumulation (DeepSeek-V3 technical report, §3.3.2); a float32
#    accumulator (2^-24) is well inside. Soft-capping (1-Lipschitz) and the ALiBi bias
#    (float32) add nothing beyond it.
# 2. Scores moved by at most δ_i move each weight by a factor within e^(±2 δ_i), so the
#    output by at most (e^(2 δ_i) - 1) · Σ_j w_ij |v_j - O_i| <= 2 (e^(2 δ_i) - 1) · M_i,
#    M_i = Σ_j w_ij |v_j| (``magnitude``; |O_i| <= M_i); and never by more than 2 A_i (both
#    outputs are convex combinations of the attended values), which caps it at huge δ_i.
# 3. P_ij = exp(s_ij - m_i) ∈ (0, 1] (m_i the row max: the largest term is 1, so the row sum
#    ℓ_i >= 1) is rounded to the FP8 format for the PV product: r(P) = P + d with
#    |d| <= u_p · P + σ/2 (u_p the format's unit roundoff, σ its smallest subnormal; an offset
#    such as FlashAttention-3's 2^8 only makes σ/2 smaller). With the row sum taken over the
#    float32 P (FlashAttention-3) O'_i - O_i = Σ_j d_ij v_j / ℓ_i; over the rounded P it is
#    Σ_j d_ij (v_j - O_i) / (ℓ_i + Σ_j d_ij). Both are within
#        R_i = (2 u_p M_i + σ/2 · (A_i + n_i M_i)) / (1 - u_p - n_i σ/2),
#    A_i = Σ_j |v_j| over the attended keys (``key_values``).
# 4. v_descale multiplies the float32 accumulator (one float32 rounding) and the output is
#    rounded to its dtype: u_out · |O_i| (+ half its smallest subnormal).
# 5. What the model leaves to float32 (the exp, the scale's product, v_descale) is covered by
#    the SDPA rule's float32 floor, 256 u_32 · M_i · (1 + Z_i).
#
# No multiple k: every term is a worst case under the model, and the certificate's ratio
# shows how far inside a kernel is (the zoo's FlashBase, which rounds P to FP8 as
# FlashAttention-3 does, must pass: tests/implementations/test_flash_fp8.py).

#: Unit roundoff of the scores' accumulation in an FP8 kernel (step 1 above).
FP8_ACCUMULATION_EPS = 2.0**-14


def fp8_score_error(head_dim: int, score_size: np.ndarray) -> np.ndarray:
    """δ_i of step 1: the largest error of a computed score of a row whose largest
    scale·|qd kd|·Σ_e|q8 k8| is ``score_size``."""
    n = head_dim + 3
    gamma = n * FP8_ACCUMULATION_EPS / (1 - n * FP8_ACCUMULATION_EPS)
    return gamma * score_size


def fp8_allowed(fmt: str, out_dtype: str, *, magnitude: np.ndarray, key_values: np.ndarray,
                keys: np.ndarray, score_size: np.ndarray, head_dim: int, expected: np.ndarray) -> np.ndarray:
    """Elementwise allowed error of an FP8 call's output (steps 1-5 above): ``fmt`` the
    inputs' format, ``out_dtype`` the dtype the output came back in; ``magnitude`` M,
    ``key_values`` A (elementwise, as the output), ``keys`` n and ``score_size`` Z (per row,
    broadcastable), ``expected`` the oracle's output."""
    f = spec_fp8.format_of(fmt)
    u, half_sub = f.unit_roundoff, f.smallest_subnormal / 2
    delta = fp8_score_error(head_dim, score_size)
    rounding = (2 * u * magnitude + half_sub * (key_values + keys * magnitude)) / (1 - u - keys * half_sub)
    with np.errstate(over="ignore", invalid="ignore"):
        scores = np.minimum(2 * np.expm1(np.minimum(2 * delta, 700.0)) * magnitude, 2 * key_values)
    output = EPS[out_dtype] * np.abs(expected) + SUBNORMAL[out_dtype]
    floor = TOLERANCES["float32"].floor * EPS["float32"] * magnitude * (1 + score_size)
    return rounding + scores + output + floor


def fp8_lse_allowed(fmt: str, stored: str, *, keys: np.ndarray, score_size: np.ndarray, head_dim: int,
                    expected: np.ndarray) -> np.ndarray:
    """Allowed error of an FP8 call's LSE (per row): the scores' δ_i (step 1), plus
    -log(1 - u_p - n_i σ/2) for a row sum over the FP8-rounded P (step 3; FlashAttention-3
    sums the float32 P and needs none of it), plus float32's floor at 1 + Z_i and the
    rounding of the dtype the LSE is returned in."""
    f = spec_fp8.format_of(fmt)
    u, half_sub = f.unit_roundoff, f.smallest_subnormal / 2
    sum_rounding = -np.log1p(-(u + keys * half_sub))
    floor = TOLERANCES["float32"].floor * EPS["float32"] * (1 + score_size)
    size = np.where(np.isfinite(expected), np.abs(expected), 0.0)
    return fp8_score_error(head_dim, score_size) + sum_rounding + floor + EPS[stored] * size
