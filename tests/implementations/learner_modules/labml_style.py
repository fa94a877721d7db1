"""Multi-head attention as labml-nn writes it (the project's own code, in that
structure): ``(heads, d_model, dropout_prob, bias)``, a ``PrepareForMultiHeadAttention``
sub-module per input (its own ``linear``), keyword-only ``forward(*, query, key, value,
mask=None)`` on sequence-first ``(L, B, D)`` inputs."""

import math

import torch
from torch import nn


class PrepareForMultiHeadAttention(nn.Module):

    def __init__(self, d_model, heads, d_k, bias):
        super().__init__()
        self.linear = nn.Linear(d_model, heads * d_k, bias=bias)
        self.heads = heads
        self.d_k = d_k

    def forward(self, x):
        head_shape = x.shape[:-1]
        x = self.linear(x)
        return x.view(*head_shape, self.heads, self.d_k)


class MultiHeadAttention(nn.Module):

    def __init__(self, heads, d_model, dropout_prob=0.1, bias=True):
        super().__init__()
        self.d_k = d_model // heads
        self.heads = heads
        self.query = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=bias)
        self.key = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=bias)
        self.value = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=True)
        self.softmax = nn.Softmax(dim=1)
        self.output = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout_prob)
        self.scale = 1 / math.sqrt(self.d_k)
        self.attn = None

    def get_scores(self, query, key):
        return torch.einsum("ibhd,jbhd->ijbh", query, key)

    def forward(self, *, query, key, value, mask=None):
        seq_len, batch_size, _ = query.shape
        if mask is not None:  # [L, S, B] -> [L, S, B, 1]
            mask = mask.unsqueeze(-1)
        query = self.query(query)
        key = self.key(key)
        value = self.value(value)
        scores = self.get_scores(query, key) * self.scale
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        attn = self.softmax(scores)
        attn = self.dropout(attn)
        x = torch.einsum("ijbh,jbhd->ibhd", attn, value)
        self.attn = attn.detach()
        x = x.reshape(seq_len, batch_size, -1)
        return self.output(x)
