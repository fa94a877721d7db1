"""Hand-written multi-head attention modules with the classic tutorial mistakes, written
the way a learner writes them (no subclassing of a correct module): a ``-1e9`` mask fill,
so a row with every key blocked is uniform, and ``forward(query, key, value, mask)``.

Each must fail ``mha_agreement`` with its mistake named as the probable cause
(``tests/implementations/test_learner_level.py``), whatever case the runner shrinks to,
including the directed ones whose rows are fully masked.
"""

import math

from torch import nn


class _Projections(nn.Module):
    def __init__(self, d_model, num_heads):
        super().__init__()
        self.d_model, self.h = d_model, num_heads
        self.w_q, self.w_k = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.w_v, self.w_o = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)


class ScaledByModelDim(_Projections):
    """1/sqrt(d_model) where 1/sqrt(d_model / h) belongs."""

    def forward(self, query, key, value, mask=None):
        B, L, D = query.shape
        S = key.shape[1]
        q = self.w_q(query).view(B, L, self.h, -1).transpose(1, 2)
        k = self.w_k(key).view(B, S, self.h, -1).transpose(1, 2)
        v = self.w_v(value).view(B, S, self.h, -1).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_model)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        return self.w_o((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, D))


class ViewWithoutTranspose(_Projections):
    """Heads split with view(B, h, L, d_k) straight from (B, L, D)."""

    def forward(self, query, key, value, mask=None):
        B, L, D = query.shape
        S = key.shape[1]
        q = self.w_q(query).view(B, self.h, L, -1)
        k = self.w_k(key).view(B, self.h, S, -1)
        v = self.w_v(value).view(B, self.h, S, -1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.h)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        return self.w_o((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, D))
