"""Multi-head attention as OpenNMT-py writes it (the project's own code, in that
structure): ``(head_count, model_dim, dropout)``, bias-free ``linear_keys``,
``linear_values``, ``linear_query`` and a ``final_linear``, ``forward(key, value, query,
mask=None)`` (the query last), a True = blocked mask of shape (B, 1, S) or (B, L, S),
the softmax taken in float32 (``scores.float()``) and cast back. Its projections are made
with ``skip_init`` (left uninitialised: OpenNMT-py's model initialises them later)."""

import math
import os

import torch
from torch import nn
from torch.nn.utils import skip_init


class MultiHeadedAttention(nn.Module):

    def __init__(self, head_count, model_dim, dropout=0.1, max_relative_positions=0, add_qkvbias=False):
        assert model_dim % head_count == 0
        self.dim_per_head = model_dim // head_count
        self.model_dim = model_dim
        super().__init__()
        self.head_count = head_count
        width = head_count * self.dim_per_head
        self.linear_keys = skip_init(nn.Linear, model_dim, width, bias=add_qkvbias)
        self.linear_values = skip_init(nn.Linear, model_dim, width, bias=add_qkvbias)
        self.linear_query = skip_init(nn.Linear, model_dim, width, bias=add_qkvbias)
        self.softmax = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(dropout)
        self.final_linear = skip_init(nn.Linear, model_dim, model_dim, bias=add_qkvbias)
        self.max_relative_positions = max_relative_positions

    def forward(self, key, value, query, mask=None):
        batch_size = key.size(0)
        dim_per_head = self.dim_per_head
        head_count = self.head_count

        def shape(x):
            return x.view(batch_size, -1, head_count, dim_per_head).transpose(1, 2)

        def unshape(x):
            return x.transpose(1, 2).contiguous().view(batch_size, -1, head_count * dim_per_head)

        key = shape(self.linear_keys(key))
        value = shape(self.linear_values(value))
        query = shape(self.linear_query(query))
        query = query / math.sqrt(dim_per_head)
        scores = torch.matmul(query, key.transpose(2, 3)).float()
        if mask is not None:
            mask = mask.unsqueeze(1)  # [B, 1, 1|L, S]
            scores = scores.masked_fill(mask, -1e18)
        attn = self.softmax(scores).to(query.dtype)
        drop_attn = self.dropout(attn)
        context = unshape(torch.matmul(drop_attn, value))
        output = self.final_linear(context)
        return output, attn


class QueryKeySwapped(MultiHeadedAttention):
    """A mistake written into it: the query projected from the key input and the key from
    the query (the scores transposed)."""

    def forward(self, key, value, query, mask=None):
        return super().forward(query, value, key, mask)


class GarbageInitAttention(MultiHeadedAttention):
    """Correct, with what uninitialised memory may hold made certain: every weight is
    random bytes read as float32 (NaN, infinities, 1e38), different in every build."""

    def __init__(self, head_count, model_dim, dropout=0.1):
        super().__init__(head_count, model_dim, dropout)
        with torch.no_grad():
            for p in self.parameters():
                raw = torch.frombuffer(bytearray(os.urandom(4 * p.numel())), dtype=torch.float32)
                p.copy_(raw.view(p.shape))
