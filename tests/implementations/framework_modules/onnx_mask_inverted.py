"""A torch SDPA function that reads a bool mask as True = blocked (nn.MultiheadAttention's
polarity, not SDPA's): exported to ONNX (``--impl=onnx:...``) its graph must fail
``masked_keys_ignored``."""

import torch
import torch.nn.functional as F


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = ~attn_mask
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
