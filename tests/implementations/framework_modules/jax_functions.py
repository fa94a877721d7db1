"""Plain JAX attention functions as users write them (the bridge compiles them unless
``jit=false`` is declared): one that traces, and one whose Python branch on a value
does not (it runs eagerly through the bridge's fallback)."""

import jax
import jax.numpy as jnp


def attention(query, key, value, attn_mask=None, is_causal=False, scale=None):
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    logits = jnp.einsum("...le,...se->...ls", query, key) * scale
    if is_causal:
        logits = jnp.where(jnp.tril(jnp.ones(logits.shape[-2:], bool)), logits, -jnp.inf)
    if attn_mask is not None:
        logits = jnp.where(attn_mask, logits, -jnp.inf) if attn_mask.dtype == bool else logits + attn_mask
    peak = jnp.max(logits, -1, keepdims=True)
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(peak), peak, 0))
    total = jnp.sum(weights, -1, keepdims=True)
    return jnp.einsum("...ls,...se->...le", jnp.where(total > 0, weights / jnp.where(total > 0, total, 1), 0),
                      value)


def attention_with_a_value_branch(query, key, value, attn_mask=None, is_causal=False, scale=None):
    if float(jnp.max(jnp.abs(query))) == 0.0:  # a Python branch on a value: does not trace
        return jnp.zeros(query.shape[:-1] + value.shape[-1:], query.dtype)
    return attention(query, key, value, attn_mask, is_causal, scale)


__all__ = ["attention", "attention_with_a_value_branch", "jax"]
