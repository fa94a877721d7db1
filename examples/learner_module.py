"""The self-attention module a learner writes from a tutorial, certified with no adapter.

The module has its own conventions: ``forward(x, mask=None)`` (self-attention only) on
batch-first (B, L, D) inputs, ``mask`` with **1 = keep / 0 = blocked** of shape (B, 1, L, S)
or (B, 1, 1, S) (anything that broadcasts against the (B, H, L, S) scores), and four Linear
layers ``w_q, w_k, w_v, w_o``. It is not an nn.MultiheadAttention drop-in; the suite's
learner level reads it (constructor, Linear names, forward) and probes its conventions
(mask polarity and shapes, output form), then certifies it through nn.MultiheadAttention's
interface. The certificate's probe notes say what was read and what was assumed:

    pytest conformance --impl=examples/learner_module.py:SelfAttention
"""

import math

import torch
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        assert d_model % n_heads == 0
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_model // n_heads
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        B, L, _ = x.shape  # x (B, L, D)
        # split heads: (B, L, D) -> (B, L, H, dh) -> (B, H, L, dh)
        q = self.w_q(x).view(B, L, self.n_heads, self.d_head).transpose(1, 2)
        k = self.w_k(x).view(B, L, self.n_heads, self.d_head).transpose(1, 2)
        v = self.w_v(x).view(B, L, self.n_heads, self.d_head).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)  # (B, H, L, L)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        empty = torch.isneginf(scores).all(dim=-1, keepdim=True)  # a row that may attend nothing
        attn = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
        out = (attn @ v).transpose(1, 2).contiguous().view(B, L, self.d_model)  # (B, L, D)
        return self.w_o(out)
