"""Mutants that prove each property can fail on its own.

Every property of the suite is the ``expected_property`` of at least one mutant;
the mutants here cover the thirteen that no other mutant names. Each is a
plausible bug that the named property, run alone (``-k``), kills under ``ci``;
broader properties (often ``forward_agreement``) may catch it too. Each class
overrides one step of a correct base in :mod:`._base`; the records are at the
bottom.
"""

from __future__ import annotations

import math

import torch

from implementations.mutants._base import (
    MHA_CAPABILITIES,
    SDPA_CAPABILITIES,
    HandwrittenMHA,
    NaiveSDPA,
    mha_implementation,
    safe_softmax,
    sdpa_implementation,
)
from implementations.mutants.record import Mutant

__all__ = ["PROPERTY_MUTANTS"]

ONE = {"B": 1, "N": 1, "K": 1, "L": 1, "S": 1, "E": 1, "Ev": 1}
#: Logit soft-capping constant of Gemma-2's attention (attn_logit_softcapping).
SOFTCAP = 50.0


def _case(**changes):
    return {**ONE, **changes}


# --------------------------------------------------------------------------- SDPA


class MaskRowOffByOne(NaiveSDPA):
    """Query row i reads mask row i + 1 (the last row reads its own): a row offset off by one."""

    def prepare_mask(self, attn_mask, q, k, compute):
        mask = super().prepare_mask(attn_mask, q, k, compute)
        if mask is None or mask.dim() < 2 or mask.shape[-2] == 1:
            return mask
        L = mask.shape[-2]
        rows = torch.clamp(torch.arange(L, device=mask.device) + 1, max=L - 1)
        return mask.index_select(-2, rows)


class MaskColumnShifted(NaiveSDPA):
    """Key j reads mask column j - 1 and key 0 is never masked: the mask is padded on
    the left for a key that is not there, then cut back to S columns."""

    def prepare_mask(self, attn_mask, q, k, compute):
        mask = super().prepare_mask(attn_mask, q, k, compute)
        if mask is None:
            return mask
        S = k.shape[-2]
        mask = mask.expand(*mask.shape[:-1], S)
        attended = torch.ones_like(mask[..., :1]) if mask.dtype == torch.bool else torch.zeros_like(mask[..., :1])
        return torch.cat([attended, mask[..., :-1]], dim=-1)


class LogitSoftcapLeftOn(NaiveSDPA):
    """Logits are soft-capped, 50·tanh(s / 50) (Gemma-2's attention soft-capping),
    in an implementation that declares plain softmax attention."""

    def scores(self, q, k, scale, in_dtype):
        return SOFTCAP * torch.tanh(super().scores(q, k, scale, in_dtype) / SOFTCAP)


class ValuesInt8(NaiveSDPA):
    """V is quantised to int8 with one absmax scale per (batch, kv head), an int8
    KV-cache path left on for every dtype."""

    def attend(self, q, k, v, mask, is_causal, scale, dropout_p, in_dtype):
        amax = v.detach().abs().amax(dim=(-2, -1), keepdim=True)              # (B, K, 1, 1)
        step = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        v = torch.round(v / step).clamp(-127, 127) * step
        return super().attend(q, k, v, mask, is_causal, scale, dropout_p, in_dtype)


class SoftmaxPlusOne(NaiveSDPA):
    """softmax₁: exp(s) / (1 + Σ exp(s)) (the "quiet" softmax that lets a head attend
    to nothing), so every row's weights sum to less than 1."""

    def softmax(self, scores):
        row_max = scores.detach().amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        exps = torch.exp(scores - row_max)
        return exps / (torch.exp(-row_max) + exps.sum(dim=-1, keepdim=True))


class SoftmaxAcrossHeads(NaiveSDPA):
    """Softmax over heads and keys together: scores laid out (..., L, N·S) by a
    transpose/reshape mix-up, so one query's weights over all heads sum to 1."""

    def softmax(self, scores):
        *batch, N, L, S = scores.shape
        by_row = scores.transpose(-3, -2).reshape(*batch, L, N * S)           # (..., L, N*S)
        weights = safe_softmax(by_row).reshape(*batch, L, N, S)
        return weights.transpose(-3, -2)                                       # (..., N, L, S)


class ScaleAppliedTwice(NaiveSDPA):
    """q is pre-scaled by 1/sqrt(E) and the scores are scaled again (by the default
    or the explicit scale): the default becomes 1/E, an explicit s becomes s/sqrt(E)."""

    def scores(self, q, k, scale, in_dtype):
        return super().scores(q / math.sqrt(q.shape[-1]), k, scale, in_dtype)


class MaskMultiplied(NaiveSDPA):
    """A bool mask is multiplied into the scores (scores * mask): blocked keys get
    logit 0 instead of -inf and keep a share of the weight."""

    def attention_weights(self, scores, mask, is_causal, dropout_p):
        if mask is not None and mask.dtype == torch.bool:
            scores, mask = scores * mask, None
        return super().attention_weights(scores, mask, is_causal, dropout_p)


class QueryScaledInPlace(NaiveSDPA):
    """q is scaled in place (q.mul_(scale)); for float32/float64 inputs the cast to
    the compute dtype returns the caller's tensor, so the caller's query changes."""

    def attend(self, q, k, v, mask, is_causal, scale, dropout_p, in_dtype):
        q.mul_(scale)
        return super().attend(q, k, v, mask, is_causal, 1.0, dropout_p, in_dtype)


# --------------------------------------------------------------------------- MHA


class FusedPathDropsPadding(HandwrittenMHA):
    """need_weights=False takes a fused path that never receives key_padding_mask."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        if not need_weights:
            key_padding_mask = None
        return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                               average_attn_weights, is_causal)


class QueryProjectionDetached(HandwrittenMHA):
    """The query projection is detached (a stop-gradient left in from a cached-projection
    path): no gradient reaches the query input or the query rows of in_proj_weight."""

    def project_inputs(self, query, key, value):
        q, k, v = super().project_inputs(query, key, value)
        return q.detach(), k, v


class ModuleDropoutNoRescale(HandwrittenMHA):
    """The module's own dropout multiplies the weights by a keep-mask and forgets the
    1 / (1 - p) rescale, shrinking the train-mode expectation by (1 - p)."""

    def dropout_weights(self, weights, dropout_p):
        if dropout_p == 0:
            return weights
        return weights * (torch.rand_like(weights) >= dropout_p)


class UnbatchedWeightsKeepBatchDim(HandwrittenMHA):
    """For unbatched (L, D) input the weights keep the batch dim: (1, L, S) instead of (L, S)."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        out, weights = super().forward(query, key, value, key_padding_mask, need_weights,
                                       attn_mask, average_attn_weights, is_causal)
        if query.dim() == 2 and weights is not None:
            weights = weights.unsqueeze(0)
        return out, weights


# --------------------------------------------------------------------------- records


def _sdpa(name, cls, *, bug, origin, smallest_case, expected_property, safe_case,
          capabilities=SDPA_CAPABILITIES):
    def build():
        return sdpa_implementation(f"mutant:{name}", cls(), capabilities, bug)

    return Mutant(name=name, bug=bug, origin=origin, smallest_case=smallest_case,
                  expected_property=expected_property, build=build, level="sdpa",
                  safe_case=safe_case)


def _mha_case(**changes):
    case = {"B": 1, "N": 1, "L": 1, "S": 1, "E": 1, **changes}
    case.setdefault("K", case["N"])
    case.setdefault("Ev", case["E"])
    return case


def _mha(name, cls, *, bug, origin, smallest_case, expected_property, safe_case):
    def build():
        return mha_implementation(f"mutant:{name}", cls, MHA_CAPABILITIES, bug)

    return Mutant(name=name, bug=bug, origin=origin, smallest_case=smallest_case,
                  expected_property=expected_property, build=build, level="mha",
                  safe_case=safe_case)


PROPERTY_MUTANTS = [
    _sdpa(
        "mask_row_off_by_one", MaskRowOffByOne,
        bug="query row i is masked with mask row i + 1 (the last row with its own): the mask's "
            "row offset is off by one",
        origin="kernel bug (off-by-one row offset into the mask)",
        smallest_case=_case(L=2, S=2, mask="causal"),
        expected_property="query_permutation",
        safe_case=_case(L=2, S=2, mask="block_last"),
    ),
    _sdpa(
        "mask_column_shifted", MaskColumnShifted,
        bug="key j is masked with mask column j - 1 and key 0 never: the mask is padded on the "
            "left for a key that is not there",
        origin="hand-written pitfall (mask padded on the wrong side, off by one column)",
        smallest_case=_case(S=2, mask="block_last"),
        expected_property="key_permutation",
        safe_case=_case(S=2),
    ),
    _sdpa(
        "logit_softcap_left_on", LogitSoftcapLeftOn,
        bug="logits are soft-capped to 50·tanh(s/50) in an implementation that declares plain "
            "softmax attention",
        origin="hand-written pitfall (Gemma-2 style attention soft-capping left on by default)",
        smallest_case=_case(S=2),
        expected_property="shift_invariance",
        safe_case=_case(S=1),
    ),
    _sdpa(
        "values_int8", ValuesInt8,
        bug="V is quantised to int8 with one absmax scale per (batch, kv head) for every dtype, "
            "so the output is not linear in V",
        origin="hand-written pitfall (an int8 KV-cache path left on)",
        smallest_case=_case(S=2),
        expected_property="value_linearity",
        safe_case=_case(S=1),
    ),
    _sdpa(
        "softmax_plus_one", SoftmaxPlusOne,
        bug="weights are exp(s) / (1 + Σ exp(s)) (softmax₁), so every row sums to less than 1 "
            "and outputs shrink toward 0",
        origin="hand-written pitfall (the 'quiet softmax' / softmax₁ variant used by mistake)",
        smallest_case=_case(),
        expected_property="convex_hull",
        safe_case=_case(mask="all_blocked"),
    ),
    _sdpa(
        "softmax_across_heads", SoftmaxAcrossHeads,
        bug="softmax runs over heads and keys together, so each query's weights over all heads "
            "sum to 1 and heads change each other",
        origin="hand-written pitfall (softmax over a flattened heads × keys axis after a "
               "reshape mix-up)",
        smallest_case=_case(N=2, K=2),
        expected_property="head_independence",
        safe_case=_case(S=2),
    ),
    _sdpa(
        "scale_applied_twice", ScaleAppliedTwice,
        bug="q is pre-scaled by 1/sqrt(E) and the scores scaled again: the default scale is 1/E",
        origin="hand-written pitfall (query pre-scaled before a kernel that scales again)",
        smallest_case=_case(S=2, E=2, Ev=2),
        expected_property="scaling_variance",
        safe_case=_case(S=2),
    ),
    _sdpa(
        "mask_multiplied", MaskMultiplied,
        bug="the bool mask is multiplied into the scores, so blocked keys get logit 0 instead "
            "of -inf and keep some weight",
        origin="classic hand-written mistake (scores * mask instead of masked_fill(-inf))",
        smallest_case=_case(S=2, mask="block_last"),
        expected_property="masked_keys_ignored",
        safe_case=_case(S=2, mask="additive"),
    ),
    _sdpa(
        "query_scaled_in_place", QueryScaledInPlace,
        bug="q is scaled in place, so a float32/float64 caller's query tensor is changed and "
            "a second identical call gives another result",
        origin="hand-written pitfall (in-place q.mul_(scale) on the caller's tensor)",
        smallest_case=_case(S=2, E=2, Ev=2, repeat=True),
        expected_property="output_contract",
        safe_case=_case(S=2, E=2, Ev=2),
    ),
    _mha(
        "mha_fused_path_drops_padding", FusedPathDropsPadding,
        bug="with need_weights=False the module takes a fused path that ignores key_padding_mask",
        origin="hand-written pitfall (a fast path that drops one of the masks)",
        smallest_case=_mha_case(S=2, key_padding_mask="bool_block_last", need_weights=False),
        expected_property="mha_need_weights_equivalence",
        safe_case=_mha_case(S=2, key_padding_mask="bool_block_last", need_weights=True),
    ),
    _mha(
        "mha_query_projection_detached", QueryProjectionDetached,
        bug="the query projection is detached, so no gradient reaches the query input or the "
            "query rows of in_proj_weight",
        origin="hand-written pitfall (a stop-gradient left on the query projection)",
        smallest_case=_mha_case(S=2, grad=True),
        expected_property="mha_gradients",
        safe_case=_mha_case(S=2),
    ),
    _mha(
        "mha_dropout_no_rescale", ModuleDropoutNoRescale,
        bug="the module's dropout zeroes weights without dividing the kept ones by (1 - p), "
            "shrinking the train-mode output",
        origin="classic hand-written mistake (module-level dropout without the 1/(1 - p) rescale)",
        smallest_case=_mha_case(dropout=0.5, training=True),
        expected_property="mha_dropout_expectation",
        safe_case=_mha_case(dropout=0.5, training=False),
    ),
    _mha(
        "mha_unbatched_weights_batch_dim", UnbatchedWeightsKeepBatchDim,
        bug="for unbatched (L, D) inputs the weights come back (1, L, S) instead of (L, S)",
        origin="hand-written pitfall (the batch dim added for 2-D inputs is not removed from "
               "the weights)",
        smallest_case=_mha_case(unbatched=True, need_weights=True),
        expected_property="mha_output_contract",
        safe_case=_mha_case(unbatched=False, need_weights=True),
    ),
]
