"""A plain function with scaled_dot_product_attention's signature: no adapter needed.

    pytest conformance --impl=examples/sdpa_function.py:attention

The registry recognises the signature, probes what it supports (masks, GQA, Ev != E,
dtypes, gradients ...) and certifies it against the spec. Shapes: query (..., N, L, E),
key (..., K, S, E), value (..., K, S, Ev); a bool mask is True = may attend, a float
mask is added to the scores; is_causal is upper-left (query i sees keys 0..i).
"""

import math

import torch


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    out_dtype = query.dtype
    if out_dtype in (torch.float16, torch.bfloat16):  # q·kᵀ can overflow float16: compute in float32
        query, key, value = query.float(), key.float(), value.float()
        attn_mask = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.float()
    N, K = query.shape[-3], key.shape[-3]
    if N != K:
        if not enable_gqa or N % K:
            raise ValueError(f"N={N} query heads vs K={K} kv heads needs enable_gqa=True and N % K == 0")
        key = key.repeat_interleave(N // K, dim=-3)  # (..., N, S, E)
        value = value.repeat_interleave(N // K, dim=-3)  # (..., N, S, Ev)
    L, S = query.shape[-2], key.shape[-2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale  # (..., N, L, S)
    if is_causal:
        causal = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    blocked_row = torch.isneginf(scores).all(dim=-1, keepdim=True)  # (..., N, L, 1)
    weights = torch.softmax(scores.masked_fill(blocked_row, 0.0), dim=-1).masked_fill(blocked_row, 0.0)
    if dropout_p > 0.0:
        weights = torch.nn.functional.dropout(weights, p=dropout_p)
    return (weights @ value).to(out_dtype)  # (..., N, L, Ev)
