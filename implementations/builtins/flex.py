"""``torch.nn.attention.flex_attention`` in eager mode, adapted to SDPA's signature.

Measured on torch 2.13 CPU: eager flex_attention runs (with a warning that it is
meant to be compiled), for all four dtypes, GQA, Ev != E and a custom scale; a
fully-masked row comes back 0. It has no backward on CPU ("FlexAttention does not
support backward on CPU") and no dropout. Masks become a ``score_mod``: a bool mask
(True = may attend) sends blocked scores to -inf, a float mask is added.
"""

from __future__ import annotations

import warnings

import torch

from implementations.base import Capabilities, Implementation
from implementations.builtins._torch_common import flatten_batch, torch_version

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
        version=torch_version(),
        description="torch.nn.attention.flex_attention, eager (uncompiled) on CPU; "
        "masks and the causal flag become a score_mod",
    )
