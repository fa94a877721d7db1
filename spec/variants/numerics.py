"""SDPA variants about arithmetic: softmax precision and shift, overflow, accumulators, and
the key blocks of a tiled kernel. Each function computes (or tests the premise of) one
variant of :mod:`spec.variants.sdpa`'s table.

Dimension letters: B batch, N query heads, L query length, S key length, Ev value head dim.
"""

from __future__ import annotations

import numpy as np

from .._sdpa import prepare
from ..emulate import round_to
from . import _attention as A
from ._core import UNIT_ROUNDOFF, SDPAProblem, VariantResult

__all__ = ["KERNEL_BLOCK", "softmax_float32", "products_in_dtype", "float16_overflow", "no_max_subtraction",
           "no_max_subtraction_applies", "global_max", "global_max_applies", "low_precision_accumulation",
           "bfloat16_accumulator", "visited_keys", "online_softmax_no_rescale", "no_rescale_applies",
           "FINITE_FILLS", "input_round_trip", "input_round_trip_applies", "finite_fill_added",
           "finite_fill_applies", "fill_cancels", "fill_cancels_applies", "first_block_nan", "first_block_nan_applies", "causal_before_scale",
           "causal_before_scale_applies", "SOFTMAX_CLAMP", "softmax_clamped", "softmax_clamped_applies"]

#: Key block of the tiled-kernel variants (the bug zoo's tiled and Triton kernels use 16).
KERNEL_BLOCK = 16


def softmax_float32(p: SDPAProblem) -> VariantResult:
    """No slack: the variant is declared ``precision="float32"``, so ``rank`` compares
    with the allowed error scaled to float32 instead of trusting this rounding order."""
    _, scores, allowed, value = A.scores_of(p)
    weights = A.softmax(scores, allowed, A.declared_policy(p), dtype=np.float32)    # float32, then back
    return A.finish(weights, value)


def products_in_dtype(p: SDPAProblem) -> np.ndarray:
    """q·kᵀ rounded to the problem's dtype before any scaling (float16: ±inf beyond 65504).
    (B, N, L, S)"""
    prepared = prepare(p.query, p.key, p.value)
    return round_to(prepared.query @ np.swapaxes(prepared.key, -1, -2), p.dtype)


def float16_overflow(p: SDPAProblem) -> VariantResult:
    _, _, allowed, value = A.scores_of(p)
    with np.errstate(all="ignore"):
        # 1. logits = (q·kᵀ in the input dtype) · scale: inf · 0 is NaN
        logits = products_in_dtype(p) * p.resolved_scale
        scores = logits if p.additive_mask is None else logits + p.additive_mask
    # 2. the rest is right, so an inf logit makes its row NaN
    return A.finish(A.softmax(scores, allowed, A.declared_policy(p)), value)


def _exps_without_shift(p: SDPAProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(exp(s), allowed, value)`` with no max subtracted, in the compute dtype."""
    _, scores, allowed, value = A.scores_of(p)
    with np.errstate(all="ignore"):
        exps = np.exp(np.where(allowed, scores, -np.inf).astype(A.compute_dtype(p)))
    return exps, allowed, value


def no_max_subtraction(p: SDPAProblem) -> VariantResult:
    exps, allowed, value = _exps_without_shift(p)
    # exp(s) / Σ exp(s): an overflowed exp gives inf / inf = NaN; all-underflowed rows give 0
    total = exps.sum(axis=-1, keepdims=True)
    with np.errstate(all="ignore"):
        weights = (exps / np.where(total == 0, 1, total)).astype(np.float64)
    return A.finish(A.apply_policy(weights, ~allowed.any(axis=-1, keepdims=True), A.declared_policy(p)), value)


def no_max_subtraction_applies(p: SDPAProblem) -> bool:
    exps, allowed, _ = _exps_without_shift(p)
    valid = allowed.any(axis=-1, keepdims=True)
    overflow = np.isinf(exps) & allowed
    underflow = (exps.sum(axis=-1, keepdims=True) == 0) & valid
    return bool(overflow.any() or underflow.any())


def _exps_global_shift(p: SDPAProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(exp(s - global max), exp(s - row max), allowed, value)`` in the compute dtype."""
    _, scores, allowed, value = A.scores_of(p)
    masked = np.where(allowed, scores, -np.inf).astype(A.compute_dtype(p))
    attended = masked[np.isfinite(masked)]
    global_max = attended.max() if attended.size else 0.0                # over every row, head, item
    row_max = np.where(allowed.any(axis=-1, keepdims=True), masked.max(axis=-1, keepdims=True), 0)
    with np.errstate(all="ignore"):
        return np.exp(masked - global_max), np.exp(masked - row_max.astype(masked.dtype)), allowed, value


def global_max(p: SDPAProblem) -> VariantResult:
    exps, _, allowed, value = _exps_global_shift(p)
    total = exps.sum(axis=-1, keepdims=True)                             # 0: every exp underflowed
    with np.errstate(all="ignore"):
        weights = (exps / np.where(total == 0, 1, total)).astype(np.float64)
    return A.finish(A.apply_policy(weights, ~allowed.any(axis=-1, keepdims=True), A.declared_policy(p)), value)


def global_max_applies(p: SDPAProblem) -> bool:
    shifted, per_row, allowed, _ = _exps_global_shift(p)
    return bool((allowed & (shifted == 0) & (per_row > 0)).any())


#: The shifted score below which :func:`softmax_clamped` clamps: exp(-64) ~ 1.6e-28.
SOFTMAX_CLAMP = -64.0


def _clamped_exps(p: SDPAProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(exp(max(s - row max, -64)), s - row max, valid rows, value)``, blocked keys at -inf
    before the clamp, in the compute dtype."""
    _, scores, allowed, value = A.scores_of(p)
    valid = allowed.any(axis=-1, keepdims=True)
    with np.errstate(all="ignore"):
        masked = np.where(allowed, scores, -np.inf).astype(A.compute_dtype(p))
        shifted = masked - np.where(valid, masked.max(axis=-1, keepdims=True), 0).astype(masked.dtype)
        return np.exp(np.maximum(shifted, SOFTMAX_CLAMP)), shifted, valid, value


def softmax_clamped(p: SDPAProblem) -> VariantResult:
    exps, _, valid, value = _clamped_exps(p)
    with np.errstate(all="ignore"):
        weights = (exps / exps.sum(axis=-1, keepdims=True)).astype(np.float64)
    return A.finish(A.apply_policy(weights, ~valid, A.declared_policy(p)), value)


def softmax_clamped_applies(p: SDPAProblem) -> bool:
    _, shifted, valid, _ = _clamped_exps(p)
    return bool(((shifted < SOFTMAX_CLAMP) & valid).any())


def _rounded_matmul(a: np.ndarray, b: np.ndarray, dtype: str) -> np.ndarray:
    """``a @ b`` summed left to right, each product and partial sum rounded to ``dtype``."""
    total = round_to(a[..., :, :1] * b[..., :1, :], dtype)
    for r in range(1, a.shape[-1]):
        total = round_to(total + round_to(a[..., :, r:r + 1] * b[..., r:r + 1, :], dtype), dtype)
    return total


def low_precision_accumulation(p: SDPAProblem) -> VariantResult:
    dtype, prepared = p.dtype, prepare(p.query, p.key, p.value, attend_mask=p.attend_mask,
                                       additive_mask=p.additive_mask, causal=p.causal, scale=p.scale)
    q, k, v = (round_to(x, dtype) for x in (prepared.query, prepared.key, prepared.value))
    with np.errstate(all="ignore"):
        # 1. logits: q·kᵀ accumulated in dtype, then scaled             (B, N, L, S)
        logits = round_to(prepared.scale * _rounded_matmul(q, np.swapaxes(k, -1, -2), dtype), dtype)
        scores = logits if prepared.additive is None else round_to(logits + prepared.additive, dtype)
        # 2. softmax: exps and their sum in dtype
        empty = ~prepared.allowed.any(axis=-1, keepdims=True)
        masked = np.where(prepared.allowed, scores, -np.inf)
        row_max = np.where(empty, 0.0, masked.max(axis=-1, keepdims=True))
        exps = round_to(np.exp(round_to(masked - row_max, dtype)), dtype)
        total = _rounded_matmul(exps, np.ones((exps.shape[-1], 1)), dtype)  # (B, N, L, 1)
        weights = A.apply_policy(round_to(exps / np.where(empty, 1.0, total), dtype), empty, A.declared_policy(p))
        # 3. output: weights · v accumulated in dtype                    (B, N, L, Ev)
        output = _rounded_matmul(weights, v, dtype)
    return VariantResult(output, weights)


def bfloat16_accumulator(p: SDPAProblem) -> VariantResult:
    _, scores, allowed, value = A.scores_of(p)
    compute = A.compute_dtype(p)
    masked = np.where(allowed, scores, -np.inf).astype(compute)          # (B, N, L, S)
    row_max = np.full((*masked.shape[:-1], 1), -np.inf, dtype=compute)
    row_sum = np.zeros_like(row_max)
    acc = np.zeros((*masked.shape[:-1], value.shape[-1]), dtype=compute)  # (B, N, L, Ev)
    value = value.astype(compute)
    with np.errstate(all="ignore"):
        for start in range(0, masked.shape[-1], KERNEL_BLOCK):
            block = slice(start, start + KERNEL_BLOCK)
            # online softmax over one key block; sum and accumulator stored in bfloat16
            new_max = np.maximum(row_max, masked[..., block].max(axis=-1, keepdims=True))
            shift = np.where(np.isinf(new_max), 0, new_max).astype(compute)
            exps, alpha = np.exp(masked[..., block] - shift), np.exp(row_max - shift)
            row_sum = round_to(row_sum * alpha + exps.sum(axis=-1, keepdims=True), "bfloat16").astype(compute)
            acc = round_to(acc * alpha + exps @ value[..., block, :], "bfloat16").astype(compute)
            row_max = new_max
        output = (acc / np.where(row_sum == 0, 1, row_sum)).astype(np.float64)
    correct = A.reference(p)
    empty = ~allowed.any(axis=-1, keepdims=True)
    output = np.where(empty, correct.output, output)                     # empty rows: the policy
    # slack: only the float32/float64 parts may round differently elsewhere
    unit = UNIT_ROUNDOFF["float64" if compute == np.float64 else "float32"]
    return VariantResult(output, None, 4 * unit * A.magnitude(correct.weights, value))


# --------------------------------------------------------------------------- kernel blocks


def visited_keys(p: SDPAProblem) -> np.ndarray:
    """The bool mask plus: keys past the last full KERNEL_BLOCK block are never read."""
    S = p.key.shape[2]
    seen = np.arange(S) < (S // KERNEL_BLOCK) * KERNEL_BLOCK              # (S,)
    return seen if p.attend_mask is None else p.attend_mask & seen


def _running_max(p: SDPAProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(scores, allowed, value, running)``: running[..., j] = the row max over the key
    blocks up to and including key j's block. (B, N, L, S)"""
    _, scores, allowed, value = A.scores_of(p)
    masked = np.where(allowed, scores, -np.inf)
    S = masked.shape[-1]
    blocks = -(-S // KERNEL_BLOCK)
    padded = np.concatenate([masked, np.full((*masked.shape[:-1], blocks * KERNEL_BLOCK - S), -np.inf)], axis=-1)
    block_max = padded.reshape(*masked.shape[:-1], blocks, KERNEL_BLOCK).max(axis=-1)  # (B, N, L, blocks)
    running = np.repeat(np.maximum.accumulate(block_max, axis=-1), KERNEL_BLOCK, axis=-1)[..., :S]
    return masked, allowed, value, running


def online_softmax_no_rescale(p: SDPAProblem) -> VariantResult:
    masked, allowed, value, running = _running_max(p)
    empty = ~allowed.any(axis=-1, keepdims=True)
    final = np.where(empty, 0.0, running[..., -1:])
    with np.errstate(all="ignore"):
        # key j enters the accumulator as exp(s_j - running max at its block), never rescaled;
        # the normaliser is rescaled, so it is Σ exp(s - final max)
        numerator = np.exp(masked - np.where(np.isinf(running), 0.0, running))
        total = np.exp(masked - final).sum(axis=-1, keepdims=True)
        weights = numerator / np.where(empty, 1.0, total)
    return A.finish(A.apply_policy(weights, empty, A.declared_policy(p)), value)


def no_rescale_applies(p: SDPAProblem) -> bool:
    _, allowed, _, running = _running_max(p)
    return bool((allowed & (running < running[..., -1:])).any())


# --------------------------------------------------------------------------- inputs, fills, blocks, scale


#: Finite fills real code adds to the scores of blocked keys instead of -inf: BERT's
#: ``(1 - mask) * -10000.0``, the common ``-1e9``, and ``torch.finfo(dtype).min``.
FINITE_FILLS = {"1e4": -1e4, "1e9": -1e9, "finfo_min": None}


def _fill_value(name: str, dtype: str) -> float:
    """The fill ``name`` in ``dtype`` (``finfo_min``: the dtype's most negative finite value)."""
    value = FINITE_FILLS[name]
    if value is not None:
        return value
    return {"float16": -65504.0, "bfloat16": -3.3895313892515355e38, "float32": float(np.finfo(np.float32).min),
            "float64": float(np.finfo(np.float64).min)}[dtype]


def input_round_trip(p: SDPAProblem, to: str) -> VariantResult:
    """The oracle on q, k, v (and a float mask) rounded to ``to`` first: an
    implementation that casts its inputs to ``to`` and computes in the problem's
    precision (exact up to that precision's rounding, which the tolerance allows)."""
    rounded = {name: round_to(getattr(p, name), to) for name in ("query", "key", "value")}
    additive = None if p.additive_mask is None else round_to(p.additive_mask, to)
    return A.sdpa_of(p, query=rounded["query"], key=rounded["key"], value=rounded["value"],
                     additive_mask=additive)


def input_round_trip_applies(p: SDPAProblem, to: str) -> bool:
    """The inputs are finer than ``to`` and some of them change when rounded to it."""
    if UNIT_ROUNDOFF[p.dtype] >= UNIT_ROUNDOFF[to]:
        return False
    return any(bool((round_to(getattr(p, name), to) != getattr(p, name)).any())
               for name in ("query", "key", "value"))


def finite_fill_added(p: SDPAProblem, fill_name: str) -> VariantResult:
    """The bool mask and the causal rule applied by *adding* a finite fill to the
    blocked keys' scores (in the problem's precision, so in float16 ``s + fill`` rounds
    to a coarse grid or overflows to -inf), then a softmax over every key. A row with
    attendable keys comes out right (its blocked weights underflow); a fully blocked row
    is a softmax of the rounded filled scores instead of the declared policy."""
    _, scores, _, value = A.scores_of(p)
    blocked = ~A.allowed_keys(p, additive_mask=None)                      # bool and causal only
    fill = _fill_value(fill_name, p.dtype)
    rounding = p.dtype if p.dtype != "float64" else "float64"
    with np.errstate(all="ignore"):
        filled = np.where(blocked, round_to(round_to(scores, rounding) + fill, rounding), scores)
    # the additive mask's own -inf entries stay -inf: softmax over every key
    allowed = np.ones(filled.shape, dtype=bool)
    # (a row whose filled scores all overflowed to -inf is NaN, as exp(-inf - -inf) is;
    # a row the additive mask alone blocks keeps the declared policy)
    weights = A.softmax(filled, allowed, A.declared_policy(p), dtype=A.compute_dtype(p))
    additive_empty = ~A.allowed_keys(p, attend_mask=None, causal=None).any(axis=-1, keepdims=True)
    return A.finish(A.apply_policy(weights, additive_empty, A.declared_policy(p)), value)


def fill_cancels(p: SDPAProblem) -> VariantResult:
    """The bool mask and the causal rule applied by adding a large finite value (any:
    -0.7 * finfo.max, -1e9...) in a precision where the scores keep their differences
    (float32 or float64 arithmetic): the same fill on every key of a fully blocked row
    cancels out in the softmax, so that row attends all its keys as if unmasked instead
    of getting the declared policy; a row with an attendable key is right (its blocked
    keys' weights underflow). The additive mask's own -inf entries stay -inf."""
    _, scores, allowed, value = A.scores_of(p)
    blocked_rows = ~A.allowed_keys(p, additive_mask=None).any(axis=-1, keepdims=True)
    everything = np.broadcast_to(blocked_rows, allowed.shape)
    weights = A.softmax(scores, allowed | everything, A.declared_policy(p))
    return A.finish(weights, value)


def fill_cancels_applies(p: SDPAProblem) -> bool:
    """Some row is fully blocked by the bool mask or the causal rule."""
    return bool((~A.allowed_keys(p, additive_mask=None).any(axis=-1)).any())


def finite_fill_applies(p: SDPAProblem, fill_name: str) -> bool:
    """Some key blocked by the bool mask or the causal rule gets a nonzero (or NaN)
    weight under the fill: in a fully blocked row always, elsewhere only when the
    attended scores lie far below the fill (where they do not, the output is right)."""
    blocked = ~A.allowed_keys(p, additive_mask=None)
    if not blocked.any():
        return False
    weights = finite_fill_added(p, fill_name).weights
    return bool((blocked & ((weights != 0) | np.isnan(weights))).any())


def first_block_nan(p: SDPAProblem) -> VariantResult:
    """An online softmax that computes ``exp(s - m)`` with the running max ``m`` still
    -inf: a row whose first key block (KERNEL_BLOCK keys) is fully blocked is NaN
    (``exp(-inf - -inf)``), whatever comes later; other rows are right."""
    correct = A.reference(p)
    allowed = A.allowed_keys(p)
    first = allowed[..., :KERNEL_BLOCK]
    nan_rows = ~first.any(axis=-1, keepdims=True)                         # (B, N, L, 1)
    output = np.where(nan_rows, np.nan, correct.output)
    weights = np.where(nan_rows, np.nan, correct.weights)
    return VariantResult(output, weights)


def first_block_nan_applies(p: SDPAProblem) -> bool:
    allowed = A.allowed_keys(p)
    nan_rows = ~allowed[..., :KERNEL_BLOCK].any(axis=-1)
    if not nan_rows.any():
        return False
    if p.fully_masked in ("nan", "unspecified"):
        # rows empty anyway are NaN (or free) already: only rows with later keys differ
        return bool((nan_rows & allowed.any(axis=-1)).any())
    return True


def causal_before_scale(p: SDPAProblem) -> VariantResult:
    """The causal rule's -inf is put into q·kᵀ before the scale multiplies it: with
    scale 0 a blocked score is -inf·0 = NaN, with a negative scale +inf, so every row
    with a causally blocked key is NaN; with a positive scale nothing changes."""
    correct = A.reference(p)
    if p.causal is None or p.resolved_scale > 0:
        return correct
    causal_blocked = ~A.allowed_keys(p, attend_mask=None, additive_mask=None)
    nan_rows = causal_blocked.any(axis=-1, keepdims=True)
    return VariantResult(np.where(nan_rows, np.nan, correct.output), np.where(nan_rows, np.nan, correct.weights))


def causal_before_scale_applies(p: SDPAProblem) -> bool:
    if p.causal is None or p.resolved_scale > 0:
        return False
    return bool((~A.allowed_keys(p, attend_mask=None, additive_mask=None)).any())
