"""A plain MLX attention function as a user writes it (``mlx.core`` only): right in
every convention; MLX computes it in the dtype it is given. The query is scaled before
the product: ``(q @ kᵀ) * scale`` overflows float16 where q·kᵀ passes 65504 while the
scaled logits do not (``large_logits`` fails it, as it should)."""

import mlx.core as mx


def attention(query, key, value, attn_mask=None, is_causal=False, scale=None):
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    logits = (query * scale) @ mx.swapaxes(key, -1, -2)
    if is_causal:
        L, S = logits.shape[-2:]
        logits = mx.where(mx.tril(mx.ones((L, S), dtype=mx.bool_)), logits, -mx.inf)
    if attn_mask is not None:
        logits = mx.where(attn_mask, logits, -mx.inf) if attn_mask.dtype == mx.bool_ else logits + attn_mask
    peak = mx.max(logits, axis=-1, keepdims=True)
    weights = mx.exp(logits - mx.where(mx.isinf(peak), mx.zeros_like(peak), peak))
    total = mx.sum(weights, axis=-1, keepdims=True)
    weights = mx.where(total > 0, weights / mx.where(total > 0, total, mx.ones_like(total)), mx.zeros_like(weights))
    return weights @ value
