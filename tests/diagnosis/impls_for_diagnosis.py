"""Small implementations the diagnosis tests certify (plugged in as file.py:attr)."""

import math

import torch

from implementations.base import Capabilities, Implementation


def softmax_in_float32(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False):
    """Right in every convention, but the softmax of float64 inputs runs in float32
    (transformers' eager attention: ``softmax(scores, dtype=torch.float32)``)."""
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    if key.shape[-3] != query.shape[-3] and (not enable_gqa or query.shape[-3] % key.shape[-3]):
        raise ValueError(f"{query.shape[-3]} query heads with {key.shape[-3]} kv heads")
    if key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(group, dim=-3), value.repeat_interleave(group, dim=-3)
    scores = scale * (query @ key.transpose(-2, -1))                      # (B, N, L, S), float64
    if is_causal:
        L, S = scores.shape[-2:]
        causal = torch.ones(L, S, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask
    blocked = torch.isneginf(scores).all(dim=-1, keepdim=True)            # fully-masked rows
    weights = torch.softmax(scores.float(), dim=-1).to(query.dtype)       # the bug: float32
    weights = torch.where(blocked, torch.zeros_like(weights), weights)
    return weights @ value


#: float64 only, no autograd (the bug is in the forward; this keeps the test short).
softmax_float32_impl = Implementation(
    name="softmax-float32",
    capabilities=Capabilities(dtypes=("float64",), autograd=False, mask_grad=False),
    sdpa=softmax_in_float32,
)


def my_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """A plain wrapper of PyTorch's SDPA, as a user writes one: it inherits the built-in
    ``sdpa``'s known deviations (implementations/xfail/sdpa.toml) without its file."""
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa)
