"""A torch SDPA function that drops its ``scale`` argument (always 1/sqrt(E)): exported to
ONNX (``--impl=onnx:...``) its graph must fail ``temperature`` and ``forward_agreement``."""

import torch.nn.functional as F


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, enable_gqa=enable_gqa)
