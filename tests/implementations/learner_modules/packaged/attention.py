"""Self-attention inside a package: ``from .heads import ...``."""

import torch
from torch import nn

from .heads import merge_heads, split_heads


class PackagedAttention(nn.Module):

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.to_q, self.to_k = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.to_v, self.to_out = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        q, k, v = (split_heads(f(x), self.n_heads) for f in (self.to_q, self.to_k, self.to_v))
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.to_out(merge_heads(torch.softmax(scores, dim=-1) @ v))
