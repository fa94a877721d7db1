"""SDPA functions for the probe audit (``test_probe_audit.py``): ``correct`` is
``F.scaled_dot_product_attention``; each other one differs from it in the one thing a
probe decides, and is otherwise correct, so the probe's own call must tell the two apart."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _refuse_if(condition: bool, error: Exception) -> None:
    """Raise ``error`` where ``condition`` holds: what the one unsupported input does."""
    if condition:
        raise error


def correct(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def equal_lengths_only(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False):
    _refuse_if(query.shape[-2] != key.shape[-2],
               ValueError("self-attention kernel: the query and key lengths must match"))
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def four_dims_only(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
    _refuse_if(query.dim() != 4, ValueError(f"expected (B, N, L, E) inputs, got {query.dim()} dims"))
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def no_float16(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    _refuse_if(query.dtype == torch.float16, TypeError("float16 is not supported"))
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def bool_masks_only(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    _refuse_if(attn_mask is not None and attn_mask.dtype != torch.bool,
               TypeError("only bool masks are supported"))
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def one_kv_head_broadcast(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                          enable_gqa=False):
    """Broadcasts a single key/value head over the query heads (multi-query attention) and
    nothing else: K = 1 would pass a GQA probe, K = 2 of N = 4 does not."""
    _refuse_if(key.shape[-3] not in (1, query.shape[-3]),
               ValueError("key/value heads must be 1 or the query's heads"))
    if key.shape[-3] == 1:
        key = key.expand(*query.shape[:-2], *key.shape[-2:])
        value = value.expand(*query.shape[:-2], *value.shape[-2:])
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale)


def same_head_dims(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
    _refuse_if(value.shape[-1] != query.shape[-1], ValueError("value's head dim must equal the query's"))
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def forward_only(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
    with torch.no_grad():
        return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def detached_mask(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
    mask = attn_mask.detach() if attn_mask is not None and attn_mask.dtype != torch.bool else attn_mask
    return correct(query, key, value, mask, dropout_p, is_causal, scale, enable_gqa)


def no_dropout(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    _refuse_if(dropout_p, NotImplementedError("dropout is not supported"))
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def default_scale_only(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False):
    _refuse_if(scale is not None, NotImplementedError("only the default 1/sqrt(E) scale"))
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def contiguous_only(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    _refuse_if(not (query.is_contiguous() and key.is_contiguous() and value.is_contiguous()),
               ValueError("inputs must be contiguous"))
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
