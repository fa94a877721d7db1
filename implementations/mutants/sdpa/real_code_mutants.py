"""Mutants modelled on bugs found in real attention code.

Each record's ``origin`` names the library and what its code did; the class
reproduces that one mistake on a correct base from :mod:`._base` (the
lower-right ones on :class:`~implementations.mutants._base.LowerRightSDPA`,
which declares FlashAttention's alignment as those libraries do).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from implementations.mutants._base import (
    LOWER_RIGHT_CAPABILITIES,
    MHA_CAPABILITIES,
    SDPA_CAPABILITIES,
    HandwrittenMHA,
    LowerRightSDPA,
    NaiveSDPA,
    mha_implementation,
    safe_softmax,
    sdpa_implementation,
)
from implementations.mutants.record import Mutant

__all__ = ["REAL_CODE_MUTANTS"]

ONE = {"B": 1, "N": 1, "K": 1, "L": 1, "S": 1, "E": 1, "Ev": 1}
#: Window that local attention pads the key length up to a multiple of.
LOCAL_WINDOW = 4


def _case(**changes):
    return {**ONE, **changes}


class CausalIgnoredOnFastPath(NaiveSDPA):
    """The fast path (taken when E == Ev) never passes is_causal on; the other path honours it."""

    def attend(self, q, k, v, mask, is_causal, scale, dropout_p, in_dtype):
        if q.shape[-1] == v.shape[-1]:
            is_causal = False
        return super().attend(q, k, v, mask, is_causal, scale, dropout_p, in_dtype)


class CausalUpperLeftWhenLonger(LowerRightSDPA):
    """Declares lower-right, builds it only when L <= S; for L > S the flag goes to a
    kernel whose is_causal is upper-left."""

    def causal_attend(self, L, S, device):
        if L > S:
            return torch.ones(L, S, dtype=torch.bool, device=device).tril()
        return super().causal_attend(L, S, device)


class ZeroPaddingKeysAttended(NaiveSDPA):
    """Keys/values are zero-padded up to a multiple of the window; the padding is
    blocked only when a mask or the causal flag builds one, so without them the
    zero keys are attended."""

    def attend(self, q, k, v, mask, is_causal, scale, dropout_p, in_dtype):
        L, S = q.shape[-2], k.shape[-2]
        pad = (-S) % LOCAL_WINDOW
        if pad == 0:
            return super().attend(q, k, v, mask, is_causal, scale, dropout_p, in_dtype)
        if is_causal:
            mask, is_causal = self.causal_attend(L, S, q.device), False
        if mask is not None:
            mask = mask.expand(*mask.shape[:-1], S)
            blocked = False if mask.dtype == torch.bool else float("-inf")
            mask = F.pad(mask, (0, pad), value=blocked)
        k, v = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        return super().attend(q, k, v, mask, is_causal, scale, dropout_p, in_dtype)


class Float64MaskValue(NaiveSDPA):
    """Blocked logits get -finfo(float64).max, which is -inf once cast to the float32
    compute dtype; fully-masked rows are zeroed after the matmul. The forward is
    right, but softmax of an all -inf row is NaN and the backward spreads it."""

    def attend(self, q, k, v, mask, is_causal, scale, dropout_p, in_dtype):
        scores = self.scores(q, k, scale, in_dtype)
        if mask is not None and mask.dtype != torch.bool:
            scores = scores + mask
        dead = torch.isneginf(scores)
        blocked = self.blocked_positions(mask, is_causal, scores.shape[-2], scores.shape[-1], scores.device)
        if blocked is not None:
            mask_value = torch.tensor(-torch.finfo(torch.float64).max, dtype=torch.float64)
            scores = scores.masked_fill(blocked, mask_value.to(scores.dtype))
            dead = dead | blocked
        weights = self.dropout(torch.softmax(scores, dim=-1), dropout_p)
        out = weights @ v
        return out.masked_fill(dead.all(dim=-1, keepdim=True), 0.0)


class SoftmaxInFloat32(NaiveSDPA):
    """Softmax always runs in float32, also for float64 inputs."""

    def softmax(self, scores):
        return safe_softmax(scores.float()).to(scores.dtype)


class GQARepeatOuter(NaiveSDPA):
    """GQA expands kv heads as (r kvh): query head h reads kv head h % K (an einops
    ``repeat(k, 'b kvh n d -> b (r kvh) n d')``) instead of h // (N / K)."""

    def expand_kv_heads(self, k, v, num_heads):
        K = k.shape[-3]
        if K == num_heads:
            return k, v
        r = num_heads // K

        def repeat(x):
            *batch, _, S, D = x.shape
            return x.unsqueeze(-4).expand(*batch, r, K, S, D).reshape(*batch, r * K, S, D)

        return repeat(k), repeat(v)


class CausalDroppedForOneQuery(NaiveSDPA):
    """is_causal is dropped when L == 1 (a single query is taken for a decode step),
    though the declared upper-left triangle lets that query see key 0 only."""

    def attend(self, q, k, v, mask, is_causal, scale, dropout_p, in_dtype):
        if q.shape[-2] == 1:
            is_causal = False
        return super().attend(q, k, v, mask, is_causal, scale, dropout_p, in_dtype)


class FlagEmptiedRowsUniform(LowerRightSDPA):
    """The causal flag blocks with finfo.min instead of -inf, so a row that the flag
    alone empties (lower-right, L > S) gets uniform weights, mean(V); the same rows
    emptied by an explicit mask give 0."""

    def attention_weights(self, scores, mask, is_causal, dropout_p):
        if is_causal:
            allowed = self.causal_attend(scores.shape[-2], scores.shape[-1], scores.device)
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
            is_causal = False
        return super().attention_weights(scores, mask, is_causal, dropout_p)


class AttentionOutputHalved(HandwrittenMHA):
    """The merged attention output is multiplied by 0.5 before out_proj."""

    def project_output(self, x):
        return super().project_output(0.5 * x)


def _sdpa(name, cls, *, bug, origin, smallest_case, expected_property, safe_case,
          capabilities=SDPA_CAPABILITIES):
    def build():
        return sdpa_implementation(f"mutant:{name}", cls(), capabilities, bug)

    return Mutant(name=name, bug=bug, origin=origin, smallest_case=smallest_case,
                  expected_property=expected_property, build=build, level="sdpa",
                  safe_case=safe_case)


def _mha(name, cls, *, bug, origin, smallest_case, expected_property, safe_case):
    def build():
        return mha_implementation(f"mutant:{name}", cls, MHA_CAPABILITIES, bug)

    return Mutant(name=name, bug=bug, origin=origin, smallest_case=smallest_case,
                  expected_property=expected_property, build=build, level="mha",
                  safe_case=safe_case)


REAL_CODE_MUTANTS = [
    _sdpa(
        "causal_ignored_on_fast_path", CausalIgnoredOnFastPath,
        bug="is_causal is ignored on the fast path taken when E == Ev, and honoured on the other",
        origin="real code: x-transformers `Attend` with flash=True passed no causal flag to the "
               "fused kernel while its plain path applied the causal mask",
        smallest_case=_case(S=2, causal=True),
        expected_property="causal_flag_equivalence",
        safe_case=_case(S=2, E=1, Ev=2, causal=True),
    ),
    _sdpa(
        "causal_upper_left_when_longer", CausalUpperLeftWhenLonger,
        bug="declares lower-right causal, but for L > S the flag gives the upper-left triangle",
        origin="real code: x-transformers `Attend` flash path built the lower-right mask only "
               "when S > L and otherwise handed is_causal to torch SDPA (upper-left)",
        smallest_case=_case(L=2, S=1, causal="lower_right"),
        expected_property="causal_flag_equivalence",
        safe_case=_case(L=2, S=3, causal="lower_right"),
        capabilities=LOWER_RIGHT_CAPABILITIES,
    ),
    _sdpa(
        "zero_padding_keys_attended", ZeroPaddingKeysAttended,
        bug=f"keys are zero-padded to a multiple of {LOCAL_WINDOW} and, with no mask or causal "
            "flag, the zero keys are attended",
        origin="real code: local-attention with autopad=True pads the sequence to a window "
               "multiple with zeros and, without a mask, attends the padding",
        smallest_case=_case(),
        expected_property="convex_hull",
        safe_case=_case(S=LOCAL_WINDOW),
    ),
    _sdpa(
        "float64_mask_value_nan_grad", Float64MaskValue,
        bug="blocked logits get -finfo(float64).max, -inf in the float32 softmax: a fully-masked "
            "row's weights are NaN and its backward makes the whole dV NaN",
        origin="real code: x-transformers masked with -finfo(float64).max and ran softmax in "
               "float32, zeroing fully-masked rows only after the matmul",
        smallest_case=_case(mask="all_blocked", dtype="float32", grad=True),
        expected_property="fully_masked_rows",
        safe_case=_case(mask="all_blocked", grad=True),
    ),
    _sdpa(
        "softmax_in_float32", SoftmaxInFloat32,
        bug="softmax is computed in float32 for float64 inputs",
        origin="real code: transformers eager attention (softmax(..., dtype=torch.float32)) and "
               "JAX dot_product_attention upcast to float32 whatever the input dtype",
        smallest_case=_case(S=2),
        expected_property="forward_agreement",
        safe_case=_case(S=1),
    ),
    _sdpa(
        "gqa_repeat_outer", GQARepeatOuter,
        bug="GQA expands kv heads as (r kvh), so query head h uses kv head h % K instead of "
            "h // (N/K)",
        origin="real code: x-transformers expanded kv heads with einops repeat "
               "'b kvh n d -> b (r kvh) n d'",
        smallest_case=_case(N=4, K=2),
        expected_property="gqa_equivalence",
        safe_case=_case(N=2, K=1, S=2),
    ),
    _sdpa(
        "causal_dropped_for_one_query", CausalDroppedForOneQuery,
        bug="is_causal is dropped when L == 1, though upper-left causal lets that query see "
            "key 0 only",
        origin="real code: transformers' SDPA integration passes is_causal only when "
               "query length > 1 (a single query is taken for a decode step)",
        smallest_case=_case(S=2, causal=True),
        expected_property="causal_flag_equivalence",
        safe_case=_case(L=2, S=2, causal=True),
    ),
    _sdpa(
        "flag_emptied_rows_uniform", FlagEmptiedRowsUniform,
        bug="rows emptied by the lower-right causal flag alone (L > S) give mean(V); the same "
            "rows emptied by an explicit mask give 0",
        origin="hand-written: the causal flag blocks with finfo.min instead of -inf, so rows it "
               "empties on its own get uniform weights",
        smallest_case=_case(L=2, S=1, causal="lower_right"),
        expected_property="fully_masked_rows",
        safe_case=_case(L=2, S=2, causal="lower_right"),
        capabilities=LOWER_RIGHT_CAPABILITIES,
    ),
    _mha(
        "mha_attention_output_halved", AttentionOutputHalved,
        bug="the merged attention output is scaled by 0.5 before the output projection",
        origin="hand-written: a factor 0.5 left on the attention output (as when the outputs "
               "of two attention branches were averaged)",
        smallest_case={"B": 1, "N": 1, "K": 1, "L": 1, "S": 1, "E": 1, "Ev": 1},
        expected_property="mha_agreement",
        safe_case=None,
    ),
]
