"""Small realistic implementations that each need one declaration to be certified
(``tests/runner/test_declarations.py``): right under their own convention, wrong or
raising under torch's. Each has scaled_dot_product_attention's signature, so
``--impl=tests/runner/impls_for_declarations.py:NAME`` certifies it as a plain function.

Dimension letters: B batch, N query heads, K kv heads, L query length, S key length,
E head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _expand_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool):
    """K kv heads repeated to the N query heads (query head h reads kv head h // (N/K))."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(group, dim=-3), value.repeat_interleave(group, dim=-3)
    return key, value


def _masked_scores(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    """The scaled scores (B, N, L, S) with the upper-left causal flag and a bool (True = may
    attend) or additive mask applied (blocked: -inf), and the values GQA-expanded."""
    key, value = _expand_kv(query, key, value, enable_gqa)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale  # (B, N, L, S)
    if is_causal:
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask
    return scores, value


def _attend(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    """Attention written out: upper-left causal flag, bool (True = may attend) or additive
    mask, a row with every key blocked giving 0."""
    scores, value = _masked_scores(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    weights = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)  # all blocked: 0
    return weights @ value


def self_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
    """A fused self-attention kernel's reference: one sequence length T for queries and
    keys (its causal mask is built once as (T, T)). Needs ``self_attention_lengths``."""
    T = query.shape[-2]
    if key.shape[-2] != T:
        raise ValueError(f"self-attention only: {T} queries but {key.shape[-2]} keys")
    return _attend(query, key, value, attn_mask, is_causal, scale, enable_gqa)


def memory_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
    """Cross-attention of a ``forward(x, memory)`` layer: the one memory tensor is both
    keys and values (``value`` has no place in that layer, so it is not read). Needs
    ``shared_kv``."""
    memory = key
    return _attend(query, memory, memory, attn_mask, is_causal, scale, enable_gqa)


def jax_style_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False):
    """A port of JAX's dot_product_attention core: a bool mask (and the causal flag) sets
    blocked logits to a large finite negative, so a row with every key blocked comes out
    uniform; a float mask is added as given, so a row of -inf is NaN. Needs
    ``fully_masked=bool:uniform,additive:nan`` (causal: uniform)."""
    key, value = _expand_kv(query, key, value, enable_gqa)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale  # (B, N, L, S)
    large_negative = -0.7 * torch.finfo(scores.dtype).max
    L, S = scores.shape[-2:]
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        scores = scores + attn_mask
    if is_causal:
        causal = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        attn_mask = causal if attn_mask is None or attn_mask.dtype != torch.bool else attn_mask & causal
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = torch.where(attn_mask, scores, torch.full_like(scores, large_negative))
    return torch.softmax(scores, dim=-1) @ value


def per_head_kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """A kernel launched per (batch item, head) on exactly (B, N, L, E) inputs: it reads
    the mask of item b, head h as ``attn_mask[b, h]`` (broadcast dims of size 1), so a
    mask of fewer dims, (L, S) or (N, L, S), is misread. Needs ``batch_dims=1``."""
    B, N, L, _ = query.shape  # exactly 4-D
    group = N // key.shape[1]
    out = query.new_empty(B, N, L, value.shape[-1])
    for b in range(B):
        for h in range(N):
            mask = None
            if attn_mask is not None:
                mask = attn_mask[b % attn_mask.shape[0], h % attn_mask.shape[1]]
            out[b, h] = _attend(query[b, h], key[b, h // group], value[b, h // group], mask,
                                is_causal, scale, False)
    return out


def float32_softmax(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """torch's SDPA with the softmax always in float32 (as JAX does): float64 outputs
    carry float32 rounding. A known deviation, for ``--xfail-file``."""
    dtype = query.dtype
    if dtype == torch.float64:
        query, key, value = query.float(), key.float(), value.float()
        attn_mask = attn_mask.float() if attn_mask is not None and attn_mask.is_floating_point() else attn_mask
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                         is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return out.to(dtype)


def _check_tiles(name: str, *dims: int) -> None:
    if min(dims) < 16:
        raise ValueError(f"{name}: head dims {dims} below the 16-wide tensor-core tile")


def tile_kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
    """A tensor-core kernel's SDPA: right for head dims of at least 16 (its tile width),
    raising below. Needs ``min_head_dim=16``; its derived flash level too. Rows with
    every key blocked give 0, with finite gradients."""
    _check_tiles("tile_kernel", query.shape[-1], value.shape[-1])
    N, K = query.shape[-3], key.shape[-3]
    if K != N and not (enable_gqa and N % K == 0):
        raise ValueError(f"tile_kernel: {N} query heads and {K} kv heads (enable_gqa={enable_gqa})")
    if key.shape[-1] != query.shape[-1] or key.shape[-2] != value.shape[-2]:
        raise ValueError(f"tile_kernel: shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    scores, value = _masked_scores(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    live = torch.isfinite(scores).any(dim=-1, keepdim=True)  # rows attending a key
    scores = torch.where(live, scores, torch.zeros_like(scores))
    return (torch.softmax(scores, dim=-1) * live) @ value


def tile_flash(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
               softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """The same kernel at the flash level (``flash_attn_func``'s signature): right for
    head dims of at least 16, raising below. Needs ``min_head_dim=16``."""
    from implementations.builtins.references.flash_reference import flash_attn_func

    _check_tiles("tile_flash", q.shape[-1], v.shape[-1])
    return flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                           window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                           deterministic=deterministic, return_attn_probs=return_attn_probs)


def tile_kernel_impl():
    """``tile_kernel`` declared as it is: ``min_head_dim=16`` (no probing: a plain call
    with small head dims would raise). Its flash level is derived from the SDPA."""
    from implementations.base import Capabilities, Implementation

    return Implementation(name="tile-kernel", sdpa=tile_kernel,
                          capabilities=Capabilities(min_head_dim=16, causal="upper_left"))


def tile_flash_impl():
    """``tile_flash`` declared as it is: a flash level with ``min_head_dim=16``."""
    from implementations.base import DEFAULT_FLASH_FEATURES, Capabilities, Implementation

    return Implementation(name="tile-flash", flash=tile_flash,
                          capabilities=Capabilities(min_head_dim=16, causal="lower_right",
                                                    flash_features=DEFAULT_FLASH_FEATURES))
