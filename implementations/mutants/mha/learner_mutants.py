"""Learner-level mutants: hand-written attention modules certified with no adapter.

Each mutant is a tutorial-style module (not an nn.MultiheadAttention drop-in) with one
classic mistake, resolved through the learner level
(:func:`implementations.registry.learner.recognise_learner`), so its capabilities are
probed exactly as a learner's module would be: the probes must choose the module's
conventions without absorbing the mistake. The correct modules they are built from are
controls in several shapes (``LEARNER_CONTROLS``); each must certify with no failure.

Sizes in the records: B batch, N heads, L = S (self-attention, ``self_attention``), E head
dim (D = N * E).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from implementations.base import Implementation
from implementations.mutants.record import Mutant

__all__ = ["LEARNER_CONTROLS", "LEARNER_MUTANTS", "control_of", "learner_implementation",
           # the copied modules' controls, loaded as learner_mutants:NAME
           "HeadListAttention", "KeyValueQueryAttention", "MemoryAttention"]


# --------------------------------------------------------------------------- correct controls


class KeepMaskSelfAttention(nn.Module):
    """w_q/w_k/w_v/w_o, forward(x, mask) with mask 1 = keep, of shape (B, 1, L, S) or
    (B, 1, 1, S) (broadcast against the (B, H, L, S) scores); rows with no key give 0."""

    def __init__(self, d_model, n_heads, dropout=0.0):
        super().__init__()
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_model // n_heads
        self.w_q, self.w_k = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.w_v, self.w_o = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.p = dropout

    def split(self, t):  # (B, L, D) -> (B, H, L, dh)
        B, L, _ = t.shape
        return t.view(B, L, self.n_heads, self.d_head).transpose(1, 2)

    def scale(self):
        return 1.0 / math.sqrt(self.d_head)

    def apply_mask(self, scores, mask):
        return scores.masked_fill(mask == 0, float("-inf"))

    def softmax(self, scores):
        empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
        return torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)

    def dropout(self, attn):
        return F.dropout(attn, p=self.p, training=self.training)

    def forward(self, x, mask=None):
        B, L, _ = x.shape
        q, k, v = self.split(self.w_q(x)), self.split(self.w_k(x)), self.split(self.w_v(x))
        scores = q @ k.transpose(-2, -1) * self.scale()
        if mask is not None:
            scores = self.apply_mask(scores, mask)
        attn = self.dropout(self.softmax(scores))
        return self.w_o((attn @ v).transpose(1, 2).contiguous().view(B, L, self.d_model))


class AnnotatedAttention(nn.Module):
    """The Annotated Transformer's shape: (h, d_model), a ModuleList ``linears`` of four,
    forward(query, key, value, mask) with an additive mask (0 / -inf); NaN rows where
    every key is blocked (declared by the probe)."""

    def __init__(self, h, d_model, dropout=0.0):
        super().__init__()
        self.d_k, self.h = d_model // h, h
        self.linears = nn.ModuleList([nn.Linear(d_model, d_model) for _ in range(4)])
        self.drop = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        n = query.size(0)
        query, key, value = [lin(x).view(n, -1, self.h, self.d_k).transpose(1, 2)
                             for lin, x in zip(self.linears, (query, key, value), strict=False)]
        scores = query @ key.transpose(-2, -1) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores + mask
        x = self.drop(scores.softmax(dim=-1)) @ value
        return self.linears[-1](x.transpose(1, 2).contiguous().view(n, -1, self.h * self.d_k))


class FusedQKVAttention(nn.Module):
    """One fused ``qkv`` Linear (3·D) and ``proj``; forward(x, padding_mask) with True =
    blocked of shape (B, S); returns (output, weights per head)."""

    def __init__(self, dim, num_heads, attn_drop=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(attn_drop)

    def cut(self, qkv):  # (B, L, 3D) -> q, k, v (B, H, L, dh)
        B, L, three_d = qkv.shape
        return qkv.reshape(B, L, 3, self.num_heads, three_d // (3 * self.num_heads)).permute(2, 0, 3, 1, 4).unbind(0)

    def forward(self, x, padding_mask=None):
        B, L, D = x.shape
        q, k, v = self.cut(self.qkv(x))
        attn = (q @ k.transpose(-2, -1)) * (D // self.num_heads) ** -0.5
        if padding_mask is not None:
            attn = attn.masked_fill(padding_mask[:, None, None, :], float("-inf"))
        attn = torch.nan_to_num(attn.softmax(dim=-1))
        out = (self.attn_drop(attn) @ v).transpose(1, 2).reshape(B, L, D)
        return self.proj(out), attn


class CrossAttentionModule(nn.Module):
    """q_proj/k_proj/v_proj/out_proj, forward(query, key, value, mask) with a bool keep mask
    (B, 1, S) or (B, L, S) filled with -1e9 (uniform rows where every key is blocked)."""

    def __init__(self, embed_dim, n_heads, dropout=0.0):
        super().__init__()
        self.n_heads, self.head_dim, self.p = n_heads, embed_dim // n_heads, dropout
        self.q_proj, self.k_proj = nn.Linear(embed_dim, embed_dim), nn.Linear(embed_dim, embed_dim)
        self.v_proj, self.out_proj = nn.Linear(embed_dim, embed_dim), nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key, value, mask=None):
        B, L, D = query.shape
        q = self.q_proj(query).view(B, L, self.n_heads, -1).transpose(1, 2)
        k = self.k_proj(key).view(B, key.shape[1], self.n_heads, -1).transpose(1, 2)
        v = self.v_proj(value).view(B, value.shape[1], self.n_heads, -1).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores.masked_fill(mask.unsqueeze(1) == 0, -1e9)
        attn = F.dropout(scores.softmax(dim=-1), self.p, training=self.training)
        return self.out_proj((attn @ v).transpose(1, 2).reshape(B, L, D))


# --------------------------------------------------------------------------- the mistakes


class ScaleByModelDim(KeepMaskSelfAttention):
    """Scores scaled by 1/sqrt(d_model) instead of 1/sqrt(d_head)."""

    def scale(self):
        return 1.0 / math.sqrt(self.d_model)


class SplitWithoutTranspose(KeepMaskSelfAttention):
    """Heads split with view(B, H, L, dh) straight from (B, L, D), no transpose."""

    def split(self, t):
        B, L, _ = t.shape
        return t.view(B, self.n_heads, L, self.d_head)


class SoftmaxOverQueries(KeepMaskSelfAttention):
    """softmax(dim=-2): each key's column sums to 1 over the queries."""

    def softmax(self, scores):
        empty = torch.isneginf(scores).all(dim=-2, keepdim=True)
        return torch.softmax(scores.masked_fill(empty, 0.0), dim=-2).masked_fill(empty, 0.0)


class PaddingMaskInverted(KeepMaskSelfAttention):
    """Documented 1 = keep, but a padding-shaped mask (B, 1, 1, S) is read as 1 = blocked
    (the mask == 1 of a tutorial that used True = padding for key padding)."""

    def apply_mask(self, scores, mask):
        if mask.dim() == 4 and mask.shape[2] == 1:
            return scores.masked_fill(mask == 1, float("-inf"))
        return super().apply_mask(scores, mask)


class FusedCutWrongForLastHead(FusedQKVAttention):
    """The fused projection cut right for every head but the last, whose q and k are swapped."""

    def cut(self, qkv):
        q, k, v = super().cut(qkv)
        q, k = q.clone(), k.clone()
        q[:, -1], k[:, -1] = k[:, -1].clone(), q[:, -1].clone()
        return q, k, v


class DropoutInEval(KeepMaskSelfAttention):
    """F.dropout(attn, p) without training=self.training: dropout stays on in eval."""

    def dropout(self, attn):
        return F.dropout(attn, p=self.p)


# --------------------------------------------------------------------------- records


def learner_implementation(name: str, cls: type) -> Implementation:
    """``cls`` through the learner level (probed as a user's module is), named ``name``."""
    from implementations.registry.learner import recognise_learner

    impl = recognise_learner(cls, name=name, origin=f"{__name__}:{cls.__name__}", timeout=60.0)
    return dataclasses.replace(impl, listed=False)


#: The correct modules, by name: ``--impl=implementations.mutants.mha.learner_mutants:NAME``
#: (the class) certifies each through the learner level.
LEARNER_CONTROLS = {cls.__name__: cls for cls in (KeepMaskSelfAttention, AnnotatedAttention, FusedQKVAttention,
                                                  CrossAttentionModule)}


def _case(**changes):
    case = {"B": 1, "N": 1, "L": 1, "S": 1, "E": 1, "self_attention": True, "need_weights": False, **changes}
    case["S"] = case["L"]
    case.setdefault("K", case["N"])
    case.setdefault("Ev", case["E"])
    return case


_MUTANT_CLASSES: dict[str, type] = {}


def control_of(name: str) -> Implementation:
    """The correct module learner mutant ``name`` is built from, through the learner level
    (its capabilities are the mutant's, probe notes aside: the mistake changes no probe)."""
    control = next(base for base in _MUTANT_CLASSES[name].__mro__ if base in LEARNER_CONTROLS.values())
    return learner_implementation(f"control:{control.__name__}", control)


def _mutant(name, cls, *, bug, origin, smallest_case, expected_property, safe_case, expected_cause=None):
    _MUTANT_CLASSES[name] = cls
    return Mutant(name=name, bug=bug, origin=origin, smallest_case=smallest_case,
                  expected_property=expected_property,
                  build=lambda: learner_implementation(f"mutant:{name}", cls), level="mha",
                  safe_case=safe_case, expected_cause=expected_cause)


LEARNER_MUTANTS = [
    _mutant(
        "learner_scale_d_model", ScaleByModelDim,
        bug="a learner's module scales the scores by 1/sqrt(d_model) instead of 1/sqrt(d_head)",
        origin="hand-written pitfall (classic tutorial mistake: the model dim for the head dim)",
        smallest_case=_case(N=2, L=2), expected_property="mha_agreement",
        expected_cause="mha_scale_model_dim", safe_case=_case(N=1, E=2, L=2),
    ),
    _mutant(
        "learner_view_without_transpose", SplitWithoutTranspose,
        bug="a learner's module splits heads with view(B, H, L, dh) and no transpose, mixing positions and heads",
        origin="hand-written pitfall (classic tutorial mistake: view without transpose)",
        smallest_case=_case(N=2, L=2), expected_property="mha_agreement",
        expected_cause="mha_heads_split_without_transpose", safe_case=_case(N=1, L=2),
    ),
    _mutant(
        "learner_softmax_over_queries", SoftmaxOverQueries,
        bug="a learner's module takes the softmax over the query axis (dim=-2) instead of the keys",
        origin="hand-written pitfall (classic tutorial mistake: softmax over the wrong axis)",
        smallest_case=_case(L=2), expected_property="mha_agreement",
        expected_cause="mha_softmax_over_queries", safe_case=_case(N=2, L=1),
    ),
    _mutant(
        "learner_padding_mask_inverted", PaddingMaskInverted,
        bug="a learner's 1 = keep module reads a padding-shaped (B, 1, 1, S) mask as 1 = blocked",
        origin="hand-written pitfall (classic tutorial mistake: mask polarity inverted for one mask shape)",
        smallest_case=_case(L=2, key_padding_mask="bool_block_last"), expected_property="mha_agreement",
        expected_cause="mha_padding_mask_inverted", safe_case=_case(N=2, L=2),
    ),
    _mutant(
        "learner_fused_cut_last_head", FusedCutWrongForLastHead,
        bug="a learner's fused qkv projection is cut right for every head but the last, whose q and k are swapped",
        origin="hand-written pitfall (classic tutorial mistake: a fused projection cut wrong)",
        smallest_case=_case(L=2), expected_property="mha_agreement",
        expected_cause=None, safe_case=_case(L=1, N=2),
    ),
    _mutant(
        "learner_dropout_in_eval", DropoutInEval,
        bug="a learner's module calls F.dropout(attn, p) without training=self.training, so dropout is on in eval",
        origin="hand-written pitfall (classic tutorial mistake: functional dropout left on in eval)",
        smallest_case=_case(dropout=0.5, training=False, L=2), expected_property="mha_eval_determinism",
        expected_cause="mha_dropout_in_eval", safe_case=_case(L=2, dropout=0.0),
    ),
]


# --------------------------------------------------------------------------- copied modules' conventions

from implementations.mutants.mha.copied_mutants import (  # noqa: E402 - after the helpers it is built with
    COPIED_CONTROLS,
    HeadListAttention,
    KeyValueQueryAttention,
    MemoryAttention,
    copied_mutants,
)

LEARNER_CONTROLS.update(COPIED_CONTROLS)
LEARNER_MUTANTS += copied_mutants(_mutant, _case)
# Every control is an attribute of this module: the suite loads it as learner_mutants:NAME.
assert all(globals().get(name) is cls for name, cls in LEARNER_CONTROLS.items())
