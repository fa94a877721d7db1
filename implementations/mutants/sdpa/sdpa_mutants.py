"""SDPA-level mutants of the straight-line base (and of its manual-backward variant).

Each class overrides one step of :class:`~implementations.mutants._base.NaiveSDPA`;
its docstring states the bug. The records (``MUTANTS`` entries) are at the bottom.
"""

from __future__ import annotations

import math

import torch

from implementations.mutants._base import (
    SDPA_CAPABILITIES,
    ManualBackwardSDPA,
    NaiveSDPA,
    sdpa_implementation,
)
from implementations.mutants.record import Mutant

__all__ = ["SDPA_MUTANTS"]

ONE = {"B": 1, "N": 1, "K": 1, "L": 1, "S": 1, "E": 1, "Ev": 1}


def _case(**changes):
    return {**ONE, **changes}


class FullyMaskedNaN(NaiveSDPA):
    """Plain softmax: a row whose keys are all blocked is softmax(-inf...) = NaN."""

    def softmax(self, scores):
        return torch.softmax(scores, dim=-1)


class FullyMaskedNaNGrad(NaiveSDPA):
    """Zeroes fully-masked rows *after* softmax with torch.where: forward 0, backward NaN."""

    def softmax(self, scores):
        fully_masked = torch.isneginf(scores).all(dim=-1, keepdim=True)
        return torch.where(fully_masked, torch.zeros_like(scores), torch.softmax(scores, dim=-1))


class BoolMaskInverted(NaiveSDPA):
    """Reads SDPA's bool mask in MHA's polarity (True = blocked)."""

    def bool_blocked(self, mask):
        return mask


class CausalLowerRight(NaiveSDPA):
    """is_causal builds FlashAttention's lower-right mask while declaring upper-left."""

    def causal_attend(self, L, S, device):
        return torch.ones(L, S, dtype=torch.bool, device=device).tril(diagonal=S - L)


class LogitsInInputDtype(NaiveSDPA):
    """q·kᵀ computed in the input dtype: float16 logits overflow to inf (then NaN)."""

    def scores(self, q, k, scale, in_dtype):
        raw = q.to(in_dtype) @ k.to(in_dtype).transpose(-2, -1)
        return raw.to(q.dtype) * scale


class GradAssumesOutputStrides(ManualBackwardSDPA):
    """Backward reads the upstream gradient with the output's strides (empty_like(out))."""

    def grad_layout(self, grad_out, out_shape, out_stride):
        return torch.as_strided(grad_out, out_shape, out_stride, grad_out.storage_offset())


class GQATile(NaiveSDPA):
    """GQA expands kv heads with repeat (tile) instead of repeat_interleave."""

    def expand_kv_heads(self, k, v, num_heads):
        group = num_heads // k.shape[-3]
        if group == 1:
            return k, v
        reps = [1] * k.dim()
        reps[-3] = group
        return k.repeat(*reps), v.repeat(*reps)


class GQAIndivisibleAccepted(NaiveSDPA):
    """Maps query head h to kv head h*K//N without checking N % K == 0."""

    def check_heads(self, N, K, enable_gqa):
        if N != K and not enable_gqa:
            super().check_heads(N, K, enable_gqa)

    def expand_kv_heads(self, k, v, num_heads):
        K = k.shape[-3]
        index = torch.arange(num_heads, device=k.device) * K // num_heads
        return k.index_select(-3, index), v.index_select(-3, index)


class MaskShapeSliced(NaiveSDPA):
    """A mask built for longer sequences is silently cut to (L, S) instead of raising."""

    def prepare_mask(self, attn_mask, q, k, compute):
        if attn_mask is not None:
            attn_mask = attn_mask[..., : q.shape[-2], : k.shape[-2]]
        return super().prepare_mask(attn_mask, q, k, compute)


class ScaleIgnored(NaiveSDPA):
    """scale= is ignored; always 1/sqrt(E)."""

    def resolve_scale(self, scale, E, Ev):
        return 1.0 / math.sqrt(E)


class ScaleSqrtEv(NaiveSDPA):
    """Default scale 1/sqrt(Ev) (value head dim) instead of 1/sqrt(E)."""

    def resolve_scale(self, scale, E, Ev):
        return 1.0 / math.sqrt(Ev) if scale is None else scale


class ScaleZeroFalsy(NaiveSDPA):
    """`scale or 1/sqrt(E)`: an explicit scale=0.0 is replaced by the default."""

    def resolve_scale(self, scale, E, Ev):
        return scale or 1.0 / math.sqrt(E)


class NoMaxSubtraction(NaiveSDPA):
    """Softmax as exp(s) / sum(exp(s)) with no max shift: exp overflows at large logits."""

    def softmax(self, scores):
        exps = torch.exp(scores)
        denom = exps.sum(dim=-1, keepdim=True)
        return exps / torch.where(denom == 0, torch.ones_like(denom), denom)


class MaskAfterSoftmax(NaiveSDPA):
    """Bool/causal mask zeroes weights after softmax; rows are not renormalised."""

    def attention_weights(self, scores, mask, is_causal, dropout_p):
        if mask is not None and mask.dtype != torch.bool:
            scores = scores + mask
        weights = self.softmax(scores)
        blocked = self.blocked_positions(mask, is_causal, scores.shape[-2], scores.shape[-1], scores.device)
        if blocked is not None:
            weights = weights.masked_fill(blocked, 0.0)
        return self.dropout(weights, dropout_p)


class DropoutOnMaskedLogits(NaiveSDPA):
    """Dropout applied to the masked logits: a dropped -inf is -inf·0 = NaN."""

    def attention_weights(self, scores, mask, is_causal, dropout_p):
        if mask is not None and mask.dtype != torch.bool:
            scores = scores + mask
        blocked = self.blocked_positions(mask, is_causal, scores.shape[-2], scores.shape[-1], scores.device)
        if blocked is not None:
            scores = scores.masked_fill(blocked, float("-inf"))
        return self.softmax(self.dropout(scores, dropout_p))


class DropoutNoRescale(NaiveSDPA):
    """Dropout zeroes weights but does not divide the kept ones by (1 - p)."""

    def dropout(self, weights, dropout_p):
        if dropout_p == 0.0:
            return weights
        keep = torch.rand_like(weights) >= dropout_p
        return weights * keep


def _mutant(name, cls, *, bug, origin, smallest_case, expected_property, safe_case, expected_cause=None, capabilities=SDPA_CAPABILITIES):
    def build():
        return sdpa_implementation(f"mutant:{name}", cls(), capabilities, bug)

    return Mutant(
        name=name,
        bug=bug,
        origin=origin,
        smallest_case=smallest_case,
        expected_property=expected_property,
        build=build,
        level="sdpa",
        safe_case=safe_case,
        expected_cause=expected_cause,
    )


SDPA_MUTANTS = [
    _mutant(
        "fully_masked_nan", FullyMaskedNaN,
        bug="a query row whose keys are all blocked comes out NaN, though fully_masked='zero' is declared",
        origin="docs/KNOWN_BUGS.md #1 (softmax of all -inf, pytorch#41508)",
        smallest_case=_case(mask="all_blocked"),
        expected_property="fully_masked_rows",
        expected_cause="fully_masked_nan",
        safe_case=_case(S=2, mask="block_last"),
    ),
    _mutant(
        "fully_masked_nan_grad", FullyMaskedNaNGrad,
        bug="fully-masked rows are zeroed with torch.where after softmax: the forward is 0 but "
            "the gradients of q, k, v are NaN",
        origin="docs/KNOWN_BUGS.md #1 (NaN gradients poisoning shared weights, pytorch#41508)",
        smallest_case=_case(mask="additive_all_blocked", grad=True),
        expected_property="fully_masked_rows",
        safe_case=_case(mask="additive_all_blocked"),
    ),
    _mutant(
        "bool_mask_inverted", BoolMaskInverted,
        bug="the bool attn_mask is read as True = blocked (MHA's polarity) instead of True = may attend",
        origin="docs/KNOWN_BUGS.md #5 (bool mask polarity, pytorch#170400)",
        smallest_case=_case(S=2, mask="block_last"),
        expected_property="bool_additive_equivalence",
        expected_cause="mask_inverted",
        safe_case=_case(S=2, mask="additive"),
    ),
    _mutant(
        "causal_lower_right", CausalLowerRight,
        bug="is_causal applies the lower-right (FlashAttention) triangle while the implementation "
            "declares upper-left",
        origin="docs/KNOWN_BUGS.md #6 (causal alignment for L != S, pytorch#108108)",
        smallest_case=_case(L=1, S=2, causal=True),
        expected_property="causal_flag_equivalence",
        expected_cause="causal_lower_right",
        safe_case=_case(L=2, S=2, causal=True),
    ),
    _mutant(
        "logits_in_input_dtype", LogitsInInputDtype,
        bug="q·kᵀ is computed in the input dtype, so float16 logits beyond 65504 become inf and the "
            "row NaN",
        origin="docs/KNOWN_BUGS.md #8 (fp16 overflow in the math path, pytorch#119131)",
        smallest_case=_case(dtype="float16", values="huge"),
        expected_property="large_logits",
        expected_cause="float16_overflow",
        safe_case=_case(S=2, dtype="float16"),
    ),
    _mutant(
        "grad_assumes_output_strides", GradAssumesOutputStrides,
        bug="the backward reinterprets the upstream gradient with the output's (B, L, N, Ev) strides, "
            "so a contiguous upstream gradient is read transposed",
        origin="docs/KNOWN_BUGS.md #10 (empty_like(out) gradient strides, pytorch#133671)",
        smallest_case=_case(N=2, K=2, L=2, grad=True),
        expected_property="gradient_agreement",
        safe_case=_case(N=1, L=2, S=2, grad=True),
        capabilities=SDPA_CAPABILITIES.replace(dropout=False),
    ),
    _mutant(
        "gqa_tile", GQATile,
        bug="GQA repeats the kv heads with tile (head h uses kv head h % K) instead of "
            "repeat_interleave (h // (N/K))",
        origin="docs/KNOWN_BUGS.md #11 (GQA grouping)",
        smallest_case=_case(N=4, K=2),
        expected_property="gqa_equivalence",
        expected_cause="gqa_tiled",
        safe_case=_case(N=2, K=1, S=2),
    ),
    _mutant(
        "gqa_indivisible_accepted", GQAIndivisibleAccepted,
        bug="N % K != 0 is accepted silently (query head h uses kv head h*K//N) instead of raising",
        origin="docs/KNOWN_BUGS.md #11 (heads that don't divide accepted silently)",
        smallest_case=_case(N=3, K=2, expect="raise"),
        expected_property="invalid_inputs_raise",
        safe_case=_case(N=4, K=2, S=2),
    ),
    _mutant(
        "mask_shape_sliced", MaskShapeSliced,
        bug="an attn_mask larger than (L, S) is silently sliced to fit instead of raising",
        origin="docs/KNOWN_BUGS.md #14 (mask built for S=20 used with shorter K/V, xformers#1122)",
        smallest_case=_case(mask="oversized", expect="raise"),
        expected_property="invalid_inputs_raise",
        safe_case=_case(S=2, mask="block_last"),
    ),
    _mutant(
        "scale_ignored", ScaleIgnored,
        bug="an explicit scale= is ignored and 1/sqrt(E) used",
        origin="docs/KNOWN_BUGS.md #12 (custom scale ignored)",
        smallest_case=_case(S=2, scale=0.5),
        expected_property="temperature",
        expected_cause="scale_arg_ignored",
        safe_case=_case(S=2),
    ),
    _mutant(
        "scale_sqrt_ev", ScaleSqrtEv,
        bug="the default scale is 1/sqrt(Ev) (value head dim) instead of 1/sqrt(E)",
        origin="docs/KNOWN_BUGS.md #12 (default 1/sqrt(Ev))",
        smallest_case=_case(S=2, Ev=2),
        expected_property="forward_agreement",
        expected_cause="scale_value_dim",
        safe_case=_case(S=2, E=2, Ev=2),
    ),
    _mutant(
        "scale_zero_falsy", ScaleZeroFalsy,
        bug="`scale or 1/sqrt(E)` replaces an explicit scale=0.0 by the default",
        origin="docs/KNOWN_BUGS.md #12 (explicit tiny scales) / classic hand-written mistake (falsy 0.0)",
        smallest_case=_case(S=2, scale=0.0),
        expected_property="temperature",
        expected_cause="scale_zero_falsy",
        safe_case=_case(S=2, scale=0.5),
    ),
    _mutant(
        "no_max_subtraction", NoMaxSubtraction,
        bug="softmax without subtracting the row max: exp overflows for logits above ~88 in "
            "float32 and the row is NaN",
        origin="docs/KNOWN_BUGS.md #15 (numerical range) / classic hand-written mistake",
        smallest_case=_case(dtype="float32", values="large"),
        expected_property="large_logits",
        expected_cause="no_max_subtraction",
        safe_case=_case(S=2, dtype="float32"),
    ),
    _mutant(
        "mask_after_softmax", MaskAfterSoftmax,
        bug="bool/causal masks zero the weights after softmax, so rows no longer sum to 1",
        origin="hand-written pitfall (masking after softmax)",
        smallest_case=_case(S=2, mask="block_last"),
        expected_property="weights_are_distributions",
        expected_cause="mask_after_softmax",
        safe_case=_case(S=2, mask="additive"),
    ),
    _mutant(
        "dropout_on_masked_logits", DropoutOnMaskedLogits,
        bug="dropout is applied to the -inf-masked logits before softmax, and a dropped -inf is "
            "-inf*0 = NaN",
        origin="hand-written pitfall (-inf then dropout giving NaN)",
        smallest_case=_case(S=2, mask="block_last", dropout_p=0.5),
        expected_property="dropout_expectation",
        safe_case=_case(S=2, mask="block_last"),
    ),
    _mutant(
        "dropout_no_rescale", DropoutNoRescale,
        bug="dropout drops weights but never divides the kept ones by (1 - p), shrinking the "
            "expected output by (1 - p)",
        origin="classic hand-written mistake (inverted dropout without rescale)",
        smallest_case=_case(dropout_p=0.5),
        expected_property="dropout_expectation",
        expected_cause="dropout_no_rescale",
        safe_case=_case(S=2),
    ),
]
