"""Small wrong implementations, one per property the bug zoo has no mutant for yet
(plugged in as file.py:attr by tests/runner/test_replay.py). Each overrides one step
of a correct base of the bug zoo, so that exactly its property's check fails."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from implementations.base import ExpectedFailure
from implementations.mutants._base import (
    MHA_CAPABILITIES,
    SDPA_CAPABILITIES,
    HandwrittenMHA,
    NaiveSDPA,
    mha_implementation,
    sdpa_implementation,
)


class WritesIntoQuery(NaiveSDPA):
    """output_contract: the output is right, but the query is doubled in place."""

    def __call__(self, query, key, value, *args, **kwargs):
        out = super().__call__(query, key, value, *args, **kwargs)
        with torch.no_grad():
            query.mul_(2)
        return out


class LeakyMask(NaiveSDPA):
    """masked_keys_ignored: blocked keys get a score of -10 instead of -inf."""

    def attention_weights(self, scores, mask, is_causal, dropout_p):
        if mask is not None and mask.dtype != torch.bool:
            scores = scores + torch.where(torch.isinf(mask), torch.full_like(mask, -10.0), mask)
        blocked = self.blocked_positions(mask, is_causal, scores.shape[-2], scores.shape[-1], scores.device)
        if blocked is not None:
            scores = scores.masked_fill(blocked, -10.0)
        return self.dropout(self.softmax(scores), dropout_p)


class RowScaled(NaiveSDPA):
    """query_permutation: output row l is scaled by 1 + 0.01·l (depends on the position)."""

    def attend(self, q, k, v, mask, is_causal, scale, dropout_p, in_dtype):
        out = super().attend(q, k, v, mask, is_causal, scale, dropout_p, in_dtype)
        rows = torch.arange(out.shape[-2], dtype=out.dtype, device=out.device)
        return out * (1 + 0.01 * rows)[:, None]


class KeyPositionBias(NaiveSDPA):
    """key_permutation: key s gets a score bias of -0.5·s (depends on the position)."""

    def scores(self, q, k, scale, in_dtype):
        positions = torch.arange(k.shape[-2], dtype=q.dtype, device=q.device)
        return super().scores(q, k, scale, in_dtype) - 0.5 * positions


class KeyNormBias(NaiveSDPA):
    """shift_invariance: each key's score gets + 0.5·|k|² (not a per-row constant)."""

    def scores(self, q, k, scale, in_dtype):
        return super().scores(q, k, scale, in_dtype) + 0.5 * (k * k).sum(-1)[..., None, :]


class SquaredTerm(NaiveSDPA):
    """value_linearity: out + 0.1·out² is not linear in V."""

    def attend(self, q, k, v, mask, is_causal, scale, dropout_p, in_dtype):
        out = super().attend(q, k, v, mask, is_causal, scale, dropout_p, in_dtype)
        return out + 0.1 * out * out


class Overshoot(NaiveSDPA):
    """convex_hull: the output is scaled by 1.5, out of the attended values' range."""

    def attend(self, q, k, v, mask, is_causal, scale, dropout_p, in_dtype):
        return 1.5 * super().attend(q, k, v, mask, is_causal, scale, dropout_p, in_dtype)


class LastKvHead(NaiveSDPA):
    """head_independence: every head reads the last kv head (right for one head alone)."""

    def expand_kv_heads(self, k, v, num_heads):
        k, v = super().expand_kv_heads(k, v, num_heads)
        return k[..., -1:, :, :].expand(k.shape), v[..., -1:, :, :].expand(v.shape)


class UnitDefaultScale(NaiveSDPA):
    """scaling_variance: the default scale is 1 instead of 1/sqrt(E)."""

    def resolve_scale(self, scale, E, Ev):
        return 1.0 if scale is None else scale


class QueryDetached(HandwrittenMHA):
    """mha_gradients: the query projection reads a detached query (no gradient through it)."""

    def project_inputs(self, query, key, value):
        q, _, _ = super().project_inputs(query.detach(), key, value)
        _, k, v = super().project_inputs(query, key, value)
        return q, k, v


class NoWeightsPathScaled(HandwrittenMHA):
    """mha_need_weights_equivalence: need_weights=False scales the output by 1.01."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return (out, weights) if kwargs.get("need_weights", True) else (out * 1.01, weights)


class DropoutNotRescaled(HandwrittenMHA):
    """mha_dropout_expectation: dropped weights are not rescaled by 1/(1 - p)."""

    def dropout_weights(self, weights, dropout_p):
        return F.dropout(weights, p=dropout_p, training=True) * (1 - dropout_p) if dropout_p > 0 else weights


class Float64Output(HandwrittenMHA):
    """mha_output_contract: the output comes back in float64 whatever the input dtype."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out.double(), weights


def _sdpa(name, cls):
    return sdpa_implementation(f"replay-{name}", cls(), SDPA_CAPABILITIES, cls.__doc__)


def _mha(name, cls):
    return mha_implementation(f"replay-{name}", cls, MHA_CAPABILITIES, cls.__doc__)


#: property id -> an implementation that property (alone, under ci) kills.
output_contract = _sdpa("output_contract", WritesIntoQuery)
masked_keys_ignored = _sdpa("masked_keys_ignored", LeakyMask)
query_permutation = _sdpa("query_permutation", RowScaled)
key_permutation = _sdpa("key_permutation", KeyPositionBias)
shift_invariance = _sdpa("shift_invariance", KeyNormBias)
value_linearity = _sdpa("value_linearity", SquaredTerm)
convex_hull = _sdpa("convex_hull", Overshoot)
head_independence = _sdpa("head_independence", LastKvHead)
scaling_variance = _sdpa("scaling_variance", UnitDefaultScale)
mha_gradients = _mha("mha_gradients", QueryDetached)
mha_need_weights_equivalence = _mha("mha_need_weights_equivalence", NoWeightsPathScaled)
mha_dropout_expectation = _mha("mha_dropout_expectation", DropoutNotRescaled)
mha_output_contract = _mha("mha_output_contract", Float64Output)


#: Correct, with expected-failure entries that have typos: the session must refuse them.
typo_property = dataclasses.replace(
    sdpa_implementation("typo-property", NaiveSDPA(), SDPA_CAPABILITIES, "correct"),
    expected_failures=(ExpectedFailure("forward_agreemnt", "a typo in the property id"),))
typo_match = dataclasses.replace(
    typo_property, name="typo-match",
    expected_failures=(ExpectedFailure("forward_agreement", "a typo in a match key", {"scal_sign": "zero"}),))
#: Correct, with an entry whose cases this run may call but never fail: never applied.
never_applies = dataclasses.replace(
    typo_property, name="never-applies",
    expected_failures=(ExpectedFailure("forward_agreement", "never fails", {"scale_sign": "negative"}),))
