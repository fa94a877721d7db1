"""``torch.nn.attention.flex_attention`` in eager mode, adapted to SDPA's signature.

Measured on torch 2.13 CPU: eager flex_attention runs (with a warning that it is
meant to be compiled), for all four dtypes, GQA, Ev != E and a custom scale; a
fully-masked row comes back 0. It has no backward on CPU ("FlexAttention does not
support backward on CPU") and no dropout. Masks become a ``score_mod``: a bool mask
(True = may attend) sends blocked scores to -inf, a float mask is added. At the flash
level (``flash_attn_func``'s signature) the same ``score_mod`` carries soft-capping, the
ALiBi bias and the bottom-right window; ``return_lse`` gives the natural-log LSE (-inf
for a row attending no key).
"""

from __future__ import annotations

import warnings

import torch

from implementations.base import Capabilities, Implementation
from implementations.builtins.pytorch._torch_common import flatten_batch, torch_version

__all__ = ["make_implementation"]


def _flex_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    from torch.nn.attention.flex_attention import flex_attention

    if dropout_p:
        raise NotImplementedError("flex_attention has no dropout; dropout_p must be 0")
    if query.dim() != 4:
        raise ValueError(f"flex_attention needs 4-D (B, N, L, E) inputs; got query.dim()={query.dim()}")
    B, N, L, _ = query.shape
    S = key.shape[-2]
    mask = None
    if attn_mask is not None:
        mask = attn_mask.expand(B, N, L, S)

    def score_mod(score, b, h, q_idx, kv_idx):
        if mask is not None:
            if mask.dtype == torch.bool:
                score = torch.where(mask[b, h, q_idx, kv_idx], score, float("-inf"))
            else:
                score = score + mask[b, h, q_idx, kv_idx]
        if is_causal:
            score = torch.where(q_idx >= kv_idx, score, float("-inf"))
        return score

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        return flex_attention(query, key, value, score_mod=score_mod, scale=scale, enable_gqa=enable_gqa)


def make_implementation() -> Implementation:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError as exc:  # older torch
        reason = f"torch.nn.attention.flex_attention is not importable: {exc}"
        return Implementation(name="flex", unavailable_reason=reason)
    return Implementation(
        name="flex",
        capabilities=Capabilities(
            devices=("cpu",),
            dtypes=("float64", "float32", "float16", "bfloat16"),
            autograd=False,
            mask_grad=False,
            dropout=False,
        ),
        sdpa=flatten_batch(_flex_sdpa),
        flash=_flex_flash,
        flash_capabilities=Capabilities(
            devices=("cpu",),
            dtypes=("float64", "float32", "float16", "bfloat16"),
            mask_kinds=frozenset({"none"}),
            causal="lower_right",
            autograd=False,
            mask_grad=False,
            dropout=False,
        ),
        version=torch_version(),
        description="torch.nn.attention.flex_attention, eager (uncompiled) on CPU; "
        "masks and the causal flag become a score_mod; at the flash level soft-capping, "
        "ALiBi and the window are one score_mod and the LSE is flex's return_lse",
    )


def _flex_flash(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn_func`` on flex_attention: soft-capping, ALiBi and the window (causal = right
    side 0, bottom-right aligned) are one ``score_mod``; the LSE is flex's ``return_lse``."""
    from torch.nn.attention.flex_attention import flex_attention

    if dropout_p:
        raise NotImplementedError("flex_attention has no dropout; dropout_p must be 0")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D: (B, L, N, E), (B, S, K, E), (B, S, K, Ev)")
    if any(side < -1 for side in window_size) or not softcap >= 0:
        raise ValueError(f"window_size={tuple(window_size)} sides must be >= -1 and softcap={softcap} >= 0")
    L, N, S = q.shape[1], q.shape[2], k.shape[1]
    left, right = window_size
    right = 0 if causal else right
    slopes = None if alibi_slopes is None else alibi_slopes.to(q.device).reshape(-1, N)

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap > 0:
            score = softcap * torch.tanh(score / softcap)
        position = q_idx + (S - L)
        if slopes is not None:
            slope = slopes[b if slopes.shape[0] > 1 else 0, h]
            score = score - slope.to(score.dtype) * (position - kv_idx).abs()
        if left >= 0:
            score = torch.where(kv_idx >= position - left, score, float("-inf"))
        if right >= 0:
            score = torch.where(kv_idx <= position + right, score, float("-inf"))
        return score

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        result = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod,
                                scale=softmax_scale, enable_gqa=k.shape[2] != N, return_lse=return_attn_probs)
    if not return_attn_probs:
        return result.transpose(1, 2)
    out, lse = result
    return out.transpose(1, 2), lse, None
