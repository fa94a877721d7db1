"""A drop-in for torch.nn.MultiheadAttention: same constructor, parameter names and forward.

    pytest conformance --impl=examples/mha_dropin.py:SimpleMultiheadAttention

The registry recognises the class by its constructor and forward signatures, loads the
oracle's weights by parameter name (in_proj_weight, in_proj_bias, out_proj.weight,
out_proj.bias) and probes which constructor options and forward arguments work; this
one supports the common subset (no kdim/vdim, bias_kv, zero_attn or dropout), and the
probe records that. Masks use MHA's convention: bool True = blocked, float added.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F


class SimpleMultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None):
        super().__init__()
        unsupported = {"dropout": dropout != 0.0, "add_bias_kv": add_bias_kv, "add_zero_attn": add_zero_attn,
                       "kdim": kdim not in (None, embed_dim), "vdim": vdim not in (None, embed_dim)}
        if any(unsupported.values()):
            raise NotImplementedError(f"not supported: {[k for k, v in unsupported.items() if v]}")
        self.embed_dim, self.num_heads, self.batch_first = embed_dim, num_heads, batch_first
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, device=device, dtype=dtype))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim, device=device, dtype=dtype)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        nn.init.xavier_uniform_(self.in_proj_weight)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if is_causal and attn_mask is None:
            raise ValueError("is_causal is a hint: pass the causal attn_mask too")
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        B, L, D = query.shape
        S, N, E = key.shape[1], self.num_heads, D // self.num_heads
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None,) * 3
        q = F.linear(query, w_q, b_q).view(B, L, N, E).transpose(1, 2)  # (B, N, L, E)
        k = F.linear(key, w_k, b_k).view(B, S, N, E).transpose(1, 2)  # (B, N, S, E)
        v = F.linear(value, w_v, b_v).view(B, S, N, E).transpose(1, 2)  # (B, N, S, E)
        scores = q @ k.transpose(-2, -1) / math.sqrt(E)  # (B, N, L, S)
        for mask, shape in ((attn_mask, None), (key_padding_mask, (B, 1, 1, S))):
            if mask is None:
                continue
            if mask.dim() == 3:
                shape = (B, N, L, S)
            mask = mask if shape is None else mask.reshape(shape)
            scores = scores.masked_fill(mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        empty = torch.isneginf(scores).all(dim=-1, keepdim=True)  # rows that may attend nothing
        weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
        out = self.out_proj((weights @ v).transpose(1, 2).reshape(B, L, D))  # (B, L, D)
        if unbatched:
            out, weights = out[0], weights[0]
        elif not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        return out, weights.mean(dim=-3) if average_attn_weights else weights
