"""A wrong NumPy attention: the scale argument is ignored (1/sqrt(E) always). The
suite must fail it through the framework bridge (the bridge must not hide the bug)."""

import numpy as np


def attention(query, key, value, attn_mask=None, is_causal=False, scale=None):
    work = np.promote_types(query.dtype, np.float32)
    q, k, v = (x.astype(work) for x in (query, key, value))
    logits = np.einsum("...le,...se->...ls", q, k) / np.sqrt(q.shape[-1])  # the bug: scale unused
    if is_causal:
        logits = np.where(np.tril(np.ones(logits.shape[-2:], bool)), logits, -np.inf)
    if attn_mask is not None:
        logits = np.where(attn_mask, logits, -np.inf) if attn_mask.dtype == bool else logits + attn_mask
    peak = logits.max(-1, keepdims=True)
    weights = np.exp(logits - np.where(np.isfinite(peak), peak, 0))
    total = weights.sum(-1, keepdims=True)
    weights = np.divide(weights, total, out=np.zeros_like(weights), where=total > 0)
    return np.einsum("...ls,...se->...le", weights, v).astype(query.dtype)
