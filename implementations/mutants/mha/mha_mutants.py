"""MHA-level mutants: nn.MultiheadAttention drop-ins built on HandwrittenMHA.

Each class overrides one step of :class:`~implementations.mutants._base.HandwrittenMHA`.
Sizes in the records: B batch, N heads, L, S lengths, E head dim (D = N * E).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from implementations.mutants._base import MHA_CAPABILITIES, HandwrittenMHA, mha_implementation
from implementations.mutants.record import Mutant

__all__ = ["MHA_MUTANTS"]


def _case(**changes):
    case = {"B": 1, "N": 1, "L": 1, "S": 1, "E": 1, **changes}
    case.setdefault("K", case["N"])
    case.setdefault("Ev", case["E"])
    return case


class FloatMaskAsBool(HandwrittenMHA):
    """A float attn_mask is converted with .bool(): every nonzero bias blocks its key."""

    def attn_mask_to_additive(self, attn_mask, dtype):
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.bool()
        return super().attn_mask_to_additive(attn_mask, dtype)


class FloatPaddingIgnored(HandwrittenMHA):
    """A float key_padding_mask (0 / -inf) is silently dropped; only bool is honoured."""

    def padding_to_additive(self, key_padding_mask, dtype):
        if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
            return None
        return super().padding_to_additive(key_padding_mask, dtype)


class CausalHintDropped(HandwrittenMHA):
    """With is_causal=True the mask is dropped for the flag, but need_weights=True ignores the flag."""

    def resolve_causal(self, attn_mask, is_causal, padding, need_weights):
        if is_causal:
            super().resolve_causal(attn_mask, is_causal, padding, need_weights)  # same checks
            return None, not need_weights
        return attn_mask, False


class DropoutInEval(HandwrittenMHA):
    """The module's dropout p is passed to attention whether training or not."""

    def effective_dropout(self):
        return self.dropout


class WeightsSummed(HandwrittenMHA):
    """average_attn_weights=True sums the per-head weights instead of averaging them."""

    def average_heads(self, weights):
        return weights.sum(dim=1)


class MHAFullyMaskedNaN(HandwrittenMHA):
    """Plain softmax: a fully-padded query row is NaN (torch's own MHA behaviour)."""

    def softmax(self, scores):
        return torch.softmax(scores, dim=-1)


class ScaleSqrtEmbedDim(HandwrittenMHA):
    """Scores scaled by 1/sqrt(D) (embed dim) instead of 1/sqrt(E) (head dim)."""

    def scale(self):
        return 1.0 / math.sqrt(self.embed_dim)


class SplitHeadsView(HandwrittenMHA):
    """Splits heads with reshape(B, N, T, E) instead of reshape(B, T, N, E).transpose(1, 2)."""

    def split_heads(self, x):
        B, T, _ = x.shape
        return x.reshape(B, self.num_heads, T, self.head_dim)


class MergeWithoutTranspose(HandwrittenMHA):
    """Merges heads with reshape(B, L, D) straight from (B, N, L, E), without the transpose."""

    def merge_heads(self, x):
        B, N, L, E = x.shape
        return x.reshape(B, L, N * E)


class MissingContiguous(HandwrittenMHA):
    """Hands the transposed head views to the raw-memory kernel without .contiguous()."""

    def kernel_input(self, x):
        return x


class NoOutputProjection(HandwrittenMHA):
    """Returns the merged heads without applying out_proj."""

    def project_output(self, x):
        return x


class MaskEqualsZero(HandwrittenMHA):
    """`masked_fill(mask == 0, -inf)` (written for 1 = keep masks) on MHA's True = blocked mask."""

    def attn_mask_to_additive(self, attn_mask, dtype):
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            zeros = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device)
            return zeros.masked_fill(attn_mask == 0, float("-inf"))
        return super().attn_mask_to_additive(attn_mask, dtype)


class FunctionalDropoutDefault(HandwrittenMHA):
    """F.dropout(weights, self.dropout) without training=self.training: on in eval."""

    def dropout_weights(self, weights, dropout_p):
        return F.dropout(weights, p=self.dropout)


def _mutant(name, cls, *, bug, origin, smallest_case, expected_property, safe_case, expected_cause=None):
    def build():
        return mha_implementation(f"mutant:{name}", cls, MHA_CAPABILITIES, bug)

    return Mutant(
        name=name,
        bug=bug,
        origin=origin,
        smallest_case=smallest_case,
        expected_property=expected_property,
        build=build,
        level="mha",
        safe_case=safe_case,
        expected_cause=expected_cause,
    )


MHA_MUTANTS = [
    _mutant(
        "mha_float_mask_as_bool", FloatMaskAsBool,
        bug="a float attn_mask is turned into a bool one, so any nonzero bias blocks its key "
            "(a randn bias masks everything)",
        origin="docs/KNOWN_BUGS.md #2 (float mask treated as bool, pytorch#107084)",
        smallest_case=_case(attn_mask="float"),
        expected_property="mha_agreement",
        expected_cause="mha_float_mask_as_bool",
        safe_case=_case(S=2, attn_mask="bool_block_last"),
    ),
    _mutant(
        "mha_float_padding_ignored", FloatPaddingIgnored,
        bug="a float key_padding_mask (0 / -inf) is silently ignored",
        origin="docs/KNOWN_BUGS.md #3 (float key_padding_mask ignored, pytorch#92554)",
        smallest_case=_case(S=2, key_padding_mask="float_block_last"),
        expected_property="mha_mask_conventions",
        expected_cause="mha_float_padding_ignored",
        safe_case=_case(S=2, key_padding_mask="bool_block_last"),
    ),
    _mutant(
        "mha_causal_hint_dropped", CausalHintDropped,
        bug="is_causal=True drops the attn_mask in favour of the flag, but the need_weights=True "
            "path never applies the flag, so queries see future keys",
        origin="docs/KNOWN_BUGS.md #4 (is_causal dropped with need_weights=True, pytorch#99282)",
        smallest_case=_case(L=2, S=2, attn_mask="causal_bool", is_causal=True, need_weights=True),
        expected_property="mha_causal_flag_equivalence",
        expected_cause="mha_causal_hint_dropped",
        safe_case=_case(L=2, S=2, attn_mask="causal_bool", is_causal=True, need_weights=False),
    ),
    _mutant(
        "mha_dropout_in_eval", DropoutInEval,
        bug="the module passes its dropout p to attention in eval mode too",
        origin="docs/KNOWN_BUGS.md #7 (modules passed dropout_p in eval, pytorch#124464)",
        smallest_case=_case(dropout=0.5, training=False),
        expected_property="mha_eval_determinism",
        expected_cause="mha_dropout_in_eval",
        safe_case=_case(S=2, dropout=0.0),
    ),
    _mutant(
        "mha_weights_summed", WeightsSummed,
        bug="average_attn_weights=True sums the weights over heads instead of averaging them",
        origin="docs/KNOWN_BUGS.md #13 (per-head vs averaged weights confused, pytorch#70055)",
        smallest_case=_case(N=2, need_weights=True, average_attn_weights=True),
        expected_property="mha_averaged_weights",
        expected_cause="mha_weights_summed_over_heads",
        safe_case=_case(N=1, S=2, need_weights=True, average_attn_weights=True),
    ),
    _mutant(
        "mha_fully_masked_nan", MHAFullyMaskedNaN,
        bug="a query row with every key padded comes out NaN though fully_masked='zero' is declared",
        origin="docs/KNOWN_BUGS.md #1 (torch MHA NaN rows, pytorch#41508)",
        smallest_case=_case(key_padding_mask="bool_all"),
        expected_property="mha_fully_masked_rows",
        expected_cause="mha_fully_masked_nan",
        safe_case=_case(S=2, key_padding_mask="bool_block_last"),
    ),
    _mutant(
        "mha_scale_sqrt_embed_dim", ScaleSqrtEmbedDim,
        bug="scores are scaled by 1/sqrt(D) (embed dim) instead of 1/sqrt(E) (head dim)",
        origin="hand-written pitfall (sqrt(D) instead of sqrt(E)); docs/KNOWN_BUGS.md #12",
        smallest_case=_case(N=2, S=2),
        expected_property="mha_agreement",
        expected_cause="mha_scale_model_dim",
        safe_case=_case(N=1, E=2, S=2),
    ),
    _mutant(
        "mha_split_heads_view", SplitHeadsView,
        bug="heads are split with view(B, N, L, E) instead of view(B, L, N, E) + transpose, "
            "mixing positions and heads",
        origin="hand-written pitfall (head split with the wrong view)",
        smallest_case=_case(N=2, S=2),
        expected_property="mha_agreement",
        expected_cause="mha_heads_split_without_transpose",
        safe_case=_case(N=1, L=2, S=2),
    ),
    _mutant(
        "mha_merge_without_transpose", MergeWithoutTranspose,
        bug="heads are merged from (B, N, L, E) straight into (B, L, D) without the transpose",
        origin="hand-written pitfall (merge without transpose)",
        smallest_case=_case(N=2, L=2),
        expected_property="mha_agreement",
        expected_cause="mha_heads_merged_without_transpose",
        safe_case=_case(N=2, L=1, S=2),
    ),
    _mutant(
        "mha_missing_contiguous", MissingContiguous,
        bug="the transposed per-head views are handed to a kernel that reads raw memory without "
            ".contiguous(), which only works when the view happens to be dense",
        origin="hand-written pitfall (forgetting contiguous())",
        smallest_case=_case(N=2, S=2),
        expected_property="mha_agreement",
        expected_cause="mha_heads_split_without_transpose",
        safe_case=_case(N=1, L=2, S=2),
    ),
    _mutant(
        "mha_no_out_proj", NoOutputProjection,
        bug="the output projection out_proj is never applied",
        origin="hand-written pitfall (forgetting the output projection)",
        smallest_case=_case(),
        expected_property="mha_agreement",
        expected_cause="mha_no_out_proj",
        safe_case=None,
    ),
    _mutant(
        "mha_mask_eq_zero", MaskEqualsZero,
        bug="`masked_fill(mask == 0, -inf)` on MHA's bool attn_mask (True = blocked) blocks "
            "exactly the allowed keys",
        origin="hand-written pitfall (`mask == 0` against a bool mask)",
        smallest_case=_case(S=2, attn_mask="bool_block_last"),
        expected_property="mha_mask_conventions",
        expected_cause="mha_mask_inverted",
        safe_case=_case(S=2, attn_mask="float"),
    ),
    _mutant(
        "mha_dropout_functional_default", FunctionalDropoutDefault,
        bug="F.dropout(weights, p) is called without training=self.training, so dropout stays "
            "on in eval",
        origin="hand-written pitfall (dropout left on in eval)",
        smallest_case=_case(dropout=0.5, training=False),
        expected_property="mha_eval_determinism",
        expected_cause="mha_dropout_in_eval",
        safe_case=_case(S=2, dropout=0.0),
    ),
]
