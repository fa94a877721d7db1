"""Wrong conventions of scaled dot-product attention, each computed in float64.

Every variant takes an :class:`SDPAProblem` and changes exactly one step of the oracle
(:func:`spec.sdpa`): the causal triangle, the GQA head map, the scale, a mask's
reading, the softmax's precision or shift, the key blocks a kernel visits. Rows with
no attendable key keep the problem's declared policy unless the variant is about them.

Dimension letters: B batch, N query heads, K kv heads, L query length, S key length,
E q/k head dim, Ev value head dim.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from . import numerics
from . import _attention as A
from ._core import SDPAProblem, Variant, VariantResult
from .numerics import KERNEL_BLOCK

__all__ = ["SDPA_VARIANTS", "KERNEL_BLOCK"]

# --------------------------------------------------------------------------- causal


def _flag_read_as_changes(p: SDPAProblem, alignment: str | None) -> bool:
    """Whether reading the causal flag as ``alignment`` (None: ignoring it) changes the keys seen."""
    return p.causal is not None and p.causal != alignment and A.blocks_differ(p, causal=alignment)


def _causal_as(alignment: str | None) -> dict[str, Callable]:
    def compute(p: SDPAProblem) -> VariantResult:
        return A.oracle_with(p, causal=None if p.causal is None else alignment)  # no flag, nothing to misread

    return dict(applies=lambda p: _flag_read_as_changes(p, alignment), compute=compute)


def _causal_dropped_when_decoding(p: SDPAProblem) -> VariantResult:
    return A.oracle_with(p, causal=None if p.query.shape[2] == 1 else p.causal)


def _strict_causal(p: SDPAProblem) -> np.ndarray | None:
    """The causal attend mask without its diagonal, merged into the bool mask."""
    if p.causal is None:
        return p.attend_mask
    L, S = p.query.shape[2], p.key.shape[2]
    offset = 0 if p.causal == "upper_left" else S - L
    strict = np.tri(L, S, offset - 1, dtype=bool)                        # (L, S), j < i + offset
    return strict if p.attend_mask is None else p.attend_mask & strict


# --------------------------------------------------------------------------- heads and batch


def _gqa_tiled(p: SDPAProblem) -> VariantResult:
    group = p.query.shape[1] // p.key.shape[1]
    key = np.tile(p.key, (1, group, 1, 1))                               # (B, K, S, E) -> (B, N, S, E)
    value = np.tile(p.value, (1, group, 1, 1))                           # head h uses kv head h % K
    return A.oracle_with(p, key=key, value=value)


def _kv_batch_offset(p: SDPAProblem) -> VariantResult:
    key = np.broadcast_to(p.key[:1], p.key.shape)                        # every item reads item 0
    value = np.broadcast_to(p.value[:1], p.value.shape)
    return A.oracle_with(p, key=key, value=value)


# --------------------------------------------------------------------------- masks


def _inverted(p: SDPAProblem) -> np.ndarray | None:
    return None if p.attend_mask is None else ~p.attend_mask


def _nonzero_blocks(p: SDPAProblem) -> np.ndarray | None:
    """A float mask read as bool: entries != 0 block their key, entries == 0 attend."""
    if p.additive_mask is None:
        return p.attend_mask
    attend = p.additive_mask == 0
    return attend if p.attend_mask is None else p.attend_mask & attend


def _has_finite_bias(p: SDPAProblem) -> bool:
    mask = p.additive_mask
    return mask is not None and bool((np.isfinite(mask) & (mask != 0)).any())


def _additive_subtracted(p: SDPAProblem) -> VariantResult:
    if p.additive_mask is None:
        return A.reference(p)
    logits, _, _, value = A.scores_of(p)
    # 1. scores = logits - mask: a -inf entry becomes +inf, and its row NaN
    with np.errstate(all="ignore"):
        scores = logits - p.additive_mask
    # 2. softmax over the keys the bool mask and the causal rule allow
    return A.finish(A.softmax(scores, A.allowed_keys(p, additive_mask=None), A.declared_policy(p)), value)


def _mask_after_softmax(p: SDPAProblem) -> VariantResult:
    _, scores, _, value = A.scores_of(p)
    # 1. softmax over every key the additive mask allows (bool and causal not applied yet)
    weights = A.softmax(scores, A.allowed_keys(p, attend_mask=None, causal=None), A.declared_policy(p))
    # 2. zero the weights the bool mask and causal rule block; no renormalisation
    return A.finish(np.where(A.allowed_keys(p, additive_mask=None), weights, 0.0), value)


def _mask_after_softmax_applies(p: SDPAProblem) -> bool:
    """Some key the additive mask lets through is blocked by the bool mask or the causal rule."""
    through_softmax = A.allowed_keys(p, attend_mask=None, causal=None)
    return bool((through_softmax & ~A.allowed_keys(p, additive_mask=None)).any())


# --------------------------------------------------------------------------- fully-masked rows


def _fully_masked_as(policy: str) -> dict[str, Callable]:
    def applies(p: SDPAProblem) -> bool:
        return p.fully_masked not in (policy, "unspecified") and not A.valid_rows(p).all()

    return dict(applies=applies, compute=lambda p: A.oracle_with(p, fully_masked=policy), row_policy=policy)


# --------------------------------------------------------------------------- numerics (computed in numerics.py)


def _softmax_float32_applies(p: SDPAProblem) -> bool:
    return p.dtype == "float64" and bool((A.allowed_keys(p).sum(axis=-1) >= 2).any())


def _product_overflows(p: SDPAProblem) -> bool:
    return p.dtype == "float16" and bool((np.isinf(numerics.products_in_dtype(p)) & A.allowed_keys(p)).any())


def _accumulates(p: SDPAProblem) -> bool:
    return p.dtype in ("float16", "bfloat16") and max(p.query.shape[-1], p.key.shape[2]) > 1


# --------------------------------------------------------------------------- dropout


def _dropout_no_rescale(p: SDPAProblem) -> VariantResult:
    correct = A.reference(p)
    keep = 1.0 - p.dropout_p
    return VariantResult(correct.output * keep, correct.weights * keep)


# --------------------------------------------------------------------------- fills and round trips


def _finite_fill_rows() -> list[dict[str, Any]]:
    texts = {"1e4": ("-1e4", "BERT-style (1 - mask) * -10000.0 added to the scores"),
             "1e9": ("-1e9", "a bool mask turned into an additive one with -1e9"),
             "finfo_min": ("finfo(dtype).min", "a bool mask turned into an additive one with "
                           "torch.finfo(dtype).min (transformers' eager attention)")}
    rows = []
    for name, (fill, models) in texts.items():
        rows.append(dict(
            id=f"mask_fill_{name}",
            summary=f"the bool mask and the causal rule are applied by adding {fill} to the blocked scores "
                    "instead of -inf, so a fully blocked row is a softmax of the filled scores (rounded in "
                    "the input precision: uniform, the unmasked row, or NaN where the sum overflows) and "
                    "blocked keys keep weight where the scores lie far below the fill",
            models=models,
            applies=lambda p, name=name: numerics.finite_fill_applies(p, name),
            compute=lambda p, name=name: numerics.finite_fill_added(p, name)))
    return rows


def _round_trip_rows() -> list[dict[str, Any]]:
    rows = []
    for to in ("float16", "bfloat16"):
        rows.append(dict(
            id=f"inputs_rounded_to_{to}",
            summary=f"q, k, v (and a float mask) are rounded to {to} and the attention computed in the "
                    "input precision: an input round trip, not a low-precision accumulator",
            models=f"a kernel that casts its inputs to {to} (a half-precision-only kernel behind a float32 "
                   "entry point, autocast left on)",
            applies=lambda p, to=to: numerics.input_round_trip_applies(p, to),
            compute=lambda p, to=to: numerics.input_round_trip(p, to)))
    return rows


# --------------------------------------------------------------------------- the table


def _scale_variant(scale_of: Callable[[SDPAProblem], float | None], applies: Callable[[SDPAProblem], bool],
                   **text: str) -> dict[str, Any]:
    return dict(applies=applies, compute=lambda p: A.oracle_with(p, scale=scale_of(p)), **text)


def _table() -> list[Variant]:
    rows = [
        dict(id="causal_ignored_when_L1",
             summary="the causal flag is dropped when there is a single query (L = 1): it attends every key",
             models="transformers' SDPA integration passes is_causal only when L > 1 (a decode-step "
                    "assumption), wrong for a one-query chunk of a longer prompt",
             applies=lambda p: p.query.shape[2] == 1 and _flag_read_as_changes(p, None),
             compute=_causal_dropped_when_decoding,
             undeclarable="a causal flag that has no effect on a one-query call is a bug, not a convention: "
                          "no declaration makes it conform"),
        dict(id="causal_ignored", summary="the causal flag is ignored: every key is attended",
             models="x-transformers' Attend(flash=True) dropped the per-call causal argument; any "
                    "wrapper that forgets to pass is_causal on",
             undeclarable="a causal flag that has no effect is a bug, not a convention: no declaration "
                          "makes it conform",
             **_causal_as(None)),
        dict(id="causal_upper_left",
             summary="the causal flag applies the upper-left triangle (query i sees keys j <= i) where "
                     "lower-right was declared",
             models="PyTorch's is_causal alignment in code declaring FlashAttention's (pytorch#108108, "
                    "#103082); x-transformers' flash path used it whenever L > S",
             declaration="--impl-option causal=upper_left",
             **_causal_as("upper_left")),
        dict(id="causal_lower_right",
             summary="the causal flag applies the lower-right triangle (query i sees keys j <= i + S - L) "
                     "where upper-left was declared",
             models="FlashAttention >= 2.1, xformers and cuDNN align the last query with the last key; "
                    "code declaring PyTorch's alignment that calls them (pytorch#108108, #103082)",
             declaration="--impl-option causal=lower_right",
             **_causal_as("lower_right")),
        dict(id="causal_excludes_diagonal",
             summary="the causal mask also blocks the diagonal: query i sees only keys strictly before it",
             models="an off-by-one in a hand-built triangle (triu(ones, 0) instead of triu(ones, 1) as "
                    "the blocked set)",
             applies=lambda p: p.causal is not None
             and A.blocks_differ(p, attend_mask=_strict_causal(p), causal=None),
             compute=lambda p: A.oracle_with(p, attend_mask=_strict_causal(p), causal=None)),
        dict(id="gqa_tiled",
             summary="GQA expands the kv heads by tiling: query head h uses kv head h % K, not h // (N/K)",
             models="k.repeat(...) where repeat_interleave is meant (bug zoo: gqa_tile)",
             applies=lambda p: 1 < p.key.shape[1] < p.query.shape[1], compute=_gqa_tiled),
        dict(id="kv_batch_offset",
             summary="every batch item attends batch item 0's keys and values",
             models="a kernel's K/V pointer missing the batch offset (bug zoo: tiled_kv_batch_offset)",
             applies=lambda p: p.query.shape[0] > 1, compute=_kv_batch_offset),
        _scale_variant(lambda p: 1.0 / math.sqrt(p.value.shape[-1]) if p.scale is None else p.scale,
                       lambda p: p.scale is None and p.value.shape[-1] != p.query.shape[-1],
                       id="scale_value_dim", summary="the default scale is 1/sqrt(Ev), the value head dim",
                       models="the head dim read from V instead of Q (bug zoo: scale_sqrt_ev)"),
        _scale_variant(lambda p: None if p.scale == 0 else p.scale, lambda p: p.scale is not None and p.scale == 0,
                       id="scale_zero_falsy",
                       summary="an explicit scale=0.0 is replaced by the default 1/sqrt(E)",
                       models="`scale or 1/sqrt(E)`: 0.0 is falsy (bug zoo: scale_zero_falsy)"),
        _scale_variant(lambda p: None,
                       lambda p: p.scale is not None and p.scale != 1.0 / math.sqrt(p.query.shape[-1]),
                       id="scale_arg_ignored", summary="an explicit scale is ignored and 1/sqrt(E) used",
                       models="a custom scale= accepted but never passed down (bug zoo: scale_ignored)"),
        _scale_variant(lambda p: 1.0, lambda p: p.resolved_scale != 1.0,
                       id="unscaled", summary="the scores are not scaled at all (scale 1)",
                       models="a hand-written q @ k.T with the 1/sqrt(E) forgotten"),
        _scale_variant(lambda p: p.resolved_scale ** 2, lambda p: p.resolved_scale not in (0.0, 1.0),
                       id="scale_squared", summary="the scale is applied twice (scale²)",
                       models="q pre-scaled by the caller and the scores scaled again, or q and k each "
                              "multiplied by the scale instead of its square root"),
        dict(id="mask_inverted",
             summary="the bool mask is read as True = blocked (nn.MultiheadAttention's polarity)",
             models="SDPA and nn.MultiheadAttention bool masks have opposite polarity; PyTorch's own "
                    "documented reference had it wrong in 2.0/2.1 (pytorch#170400)",
             applies=lambda p: p.attend_mask is not None and A.blocks_differ(p, attend_mask=_inverted(p)),
             compute=lambda p: A.oracle_with(p, attend_mask=_inverted(p)),
             undeclarable="an SDPA-level bool mask read as True = blocked has no declaration: the SDPA "
                          "contract is True = may attend, so invert the mask inside the implementation"),
        dict(id="float_mask_as_bool",
             summary="the float mask is read as a bool one: every nonzero entry blocks its key and the "
                     "biases are dropped",
             models="a float mask turned into a bool one with .bool() and read as True = blocked, so "
                    "0/-inf masks still work but a bias masks its keys (pytorch#107084)",
             applies=_has_finite_bias,
             compute=lambda p: A.oracle_with(p, attend_mask=_nonzero_blocks(p), additive_mask=None)),
        dict(id="additive_mask_subtracted",
             summary="the float mask is subtracted from the scores: biases flip sign and a -inf entry "
                     "becomes +inf, making its row NaN",
             models="a mask applied as scores - mask, written for masks that hold positive penalties",
             applies=lambda p: p.additive_mask is not None and bool((p.additive_mask != 0).any()),
             compute=_additive_subtracted),
        dict(id="mask_after_softmax",
             summary="the bool and causal masks zero the weights after the softmax, without "
                     "renormalising, so rows sum to less than 1",
             models="masking the attention weights instead of the scores (bug zoo: mask_after_softmax)",
             applies=_mask_after_softmax_applies, compute=_mask_after_softmax),
        dict(id="fully_masked_nan",
             summary="a row with no attendable key is NaN (softmax of all -inf)",
             models="plain softmax on fully-masked rows; nn.MultiheadAttention with need_weights=True "
                    "and its fast path (pytorch#41508, #160064)",
             declaration="--impl-option fully_masked={kind}:nan",
             **_fully_masked_as("nan")),
        dict(id="fully_masked_uniform",
             summary="a row with no attendable key gets uniform weights, so its output is the mean of V",
             models="masked_fill with a finite value (-1e9, finfo.min) instead of -inf: a fully-masked "
                    "row's scores are all equal",
             declaration="--impl-option fully_masked={kind}:uniform",
             **_fully_masked_as("uniform")),
        dict(id="fully_masked_zero",
             summary="a row with no attendable key outputs zeros (weights 0) where another policy was "
                     "declared",
             models="PyTorch SDPA's policy since 2.5 (and FlashAttention's) in code declaring NaN or "
                    "uniform rows",
             declaration="--impl-option fully_masked={kind}:zero",
             **_fully_masked_as("zero")),
        *_finite_fill_rows(),
        dict(id="mask_fill_cancels",
             summary="the bool mask and the causal rule are applied by adding a large finite value in a "
                     "precision that keeps the scores apart, so in a fully blocked row the fill, the same "
                     "on every key, cancels out: the row attends all its keys as if unmasked instead of "
                     "the declared policy (rows with an attendable key are right)",
             models="Keras' dot_product_attention (blocked keys get -0.7 * the dtype's largest value, "
                    "which SDPA then adds in float32), masked_fill(-1e9) or finfo.min followed by a "
                    "float32 softmax",
             applies=numerics.fill_cancels_applies, compute=numerics.fill_cancels),
        dict(id="softmax_float32",
             summary="float64 inputs go through a float32 softmax, so the output has float32 precision",
             models="transformers' eager attention (softmax(..., dtype=float32)) and JAX's default "
                    "float32, on float64 inputs",
             applies=_softmax_float32_applies, compute=numerics.softmax_float32, precision="float32"),
        dict(id="float16_overflow",
             summary="q·kᵀ is computed in float16 before scaling, so products beyond 65504 become inf "
                     "and their rows NaN",
             models="the math path and eager attention of transformers (Llama, GPT-2) and x-transformers "
                    "multiplying fp16 q and k before scaling (pytorch#119131, #60939)",
             applies=_product_overflows, compute=numerics.float16_overflow),
        dict(id="no_max_subtraction",
             summary="the softmax does not subtract the row max: exp overflows (NaN rows) or "
                     "underflows (zero rows) at large logits",
             models="exp(s) / sum(exp(s)) in a hand-written softmax (bug zoo: no_max_subtraction)",
             applies=numerics.no_max_subtraction_applies, compute=numerics.no_max_subtraction),
        dict(id="softmax_clamped",
             summary="the softmax clamps each shifted score s - max at -64 before exp, so blocked keys and "
                     "keys more than 64 below the row max keep weight exp(-64) ~ 1.6e-28 instead of 0 (seen "
                     "where their values are large)",
             models="PaddlePaddle 3.3's CPU softmax (paddle.nn.functional.softmax, and its "
                    "scaled_dot_product_attention's math path)",
             applies=numerics.softmax_clamped_applies, compute=numerics.softmax_clamped),
        dict(id="global_max",
             summary="the softmax shift is the max over all rows (and heads and batch items), so a row "
                     "far below it underflows to 0",
             models="a kernel reducing the max over the whole tile instead of per row (bug zoo: "
                    "tiled_global_max)",
             applies=numerics.global_max_applies, compute=numerics.global_max),
        dict(id="low_precision_accumulation",
             summary="the matmuls and the softmax sum accumulate in the 16-bit input dtype instead of "
                     "float32 (modelled as left-to-right sums)",
             models="16-bit accumulators in hand-written kernels and naive half-precision loops",
             applies=_accumulates, compute=numerics.low_precision_accumulation),
        dict(id="bfloat16_accumulator",
             summary="the output accumulator and the row sum are kept in bfloat16 whatever the input dtype",
             models="a kernel's accumulator declared in the storage type of a bf16 build (bug zoo: "
                    "tiled_bf16_accumulator)",
             applies=lambda p: p.dtype != "bfloat16", compute=numerics.bfloat16_accumulator),
        dict(id="ragged_tail_dropped",
             summary=f"keys after the last full block of {KERNEL_BLOCK} are never read (S < {KERNEL_BLOCK}: "
                     "nothing is)",
             models="a kernel grid of S // BLOCK_N instead of cdiv(S, BLOCK_N) (bug zoo: "
                    "tiled_ragged_tail_dropped, triton_drop_ragged_block)",
             applies=lambda p: A.blocks_differ(p, attend_mask=numerics.visited_keys(p)),
             compute=lambda p: A.oracle_with(p, attend_mask=numerics.visited_keys(p))),
        dict(id="online_softmax_no_rescale",
             summary=f"an online softmax over key blocks of {KERNEL_BLOCK} does not rescale its "
                     "accumulator when the running max grows",
             models="FlashAttention-style kernels missing acc *= exp(m_old - m_new) (bug zoo: "
                    "tiled_no_rescale, triton_no_rescale)",
             applies=numerics.no_rescale_applies, compute=numerics.online_softmax_no_rescale),
        dict(id="first_block_nan",
             summary=f"an online softmax over key blocks of {KERNEL_BLOCK} computes exp(s - m) while the "
                     "running max m is still -inf, so a row whose first key block is fully blocked is NaN "
                     "(exp(-inf - -inf)) even when later keys attend",
             models="a FlashAttention-style kernel without the guard for a fully masked block (m_new = "
                    "-inf), seen in hand-written Triton kernels",
             applies=numerics.first_block_nan_applies, compute=numerics.first_block_nan),
        dict(id="causal_before_scale",
             summary="the causal -inf is put into q·kᵀ before the scale multiplies it, so with scale 0 "
                     "(-inf·0) or a negative scale (+inf) every row with a causally blocked key is NaN",
             models="a kernel applying the causal mask to the unscaled scores; PyTorch's CPU flash "
                    "kernel with is_causal=True and scale <= 0 (implementations/xfail/sdpa.toml)",
             applies=numerics.causal_before_scale_applies, compute=numerics.causal_before_scale),
        dict(id="value_is_key",
             summary="the keys are used as the values (the value argument is ignored)",
             models="a kernel for shared-kv attention (MLA-style, or k = v models) handed separate "
                    "values; a wrapper passing key twice",
             applies=lambda p: p.key.shape == p.value.shape and not np.array_equal(p.key, p.value),
             compute=lambda p: A.oracle_with(p, value=p.key) if p.key.shape == p.value.shape else A.reference(p),
             declaration="--impl-option shared_kv=true"),
        *_round_trip_rows(),
        dict(id="dropout_no_rescale",
             summary="dropout does not divide the kept weights by 1 - p, so the expected output shrinks "
                     "by 1 - p",
             models="hand-written dropout without the inverted-dropout rescale (bug zoo: dropout_no_rescale)",
             applies=lambda p: p.dropout_p > 0, compute=_dropout_no_rescale),
    ]
    return [Variant(level="sdpa", **row) for row in rows]


#: The SDPA variants in their tie-breaking order (narrower conventions first).
SDPA_VARIANTS: tuple[Variant, ...] = tuple(_table())
