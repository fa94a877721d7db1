"""Scaled dot-product attention on NumPy arrays (B, N, L, E), with no torch in it:
``pytest conformance --impl=examples/frameworks/numpy_attention.py:attention``
(the framework bridge recognises NumPy from the function's body; no gradients)."""

import numpy as np


def attention(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """softmax(query key^T * scale + mask) value; a bool mask is True where a query may
    attend, a float one is added to the logits; ``is_causal``: upper-left."""
    dtype = query.dtype
    work = np.promote_types(dtype, np.float32)  # float16 products overflow: compute in float32
    query, key, value = (x.astype(work) for x in (query, key, value))
    scale = 1 / np.sqrt(query.shape[-1]) if scale is None else scale
    logits = np.einsum("...le,...se->...ls", query, key) * scale
    length, keys = logits.shape[-2:]
    if is_causal:
        logits = np.where(np.tril(np.ones((length, keys), bool)), logits, -np.inf)
    if attn_mask is not None:
        logits = np.where(attn_mask, logits, -np.inf) if attn_mask.dtype == bool else logits + attn_mask
    peak = logits.max(-1, keepdims=True)
    weights = np.exp(logits - np.where(np.isfinite(peak), peak, 0))
    total = weights.sum(-1, keepdims=True)
    weights = np.divide(weights, total, out=np.zeros_like(weights), where=total > 0)  # a fully masked row: 0
    return np.einsum("...ls,...se->...le", weights, value).astype(dtype)
