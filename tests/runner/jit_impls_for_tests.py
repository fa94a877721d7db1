"""Implementations declared ``jit`` that the compile-budget tests certify (file.py:attr):
a correct one that records each call's configuration, and two wrong ones."""

import json
import os

import torch
import torch.nn.functional as F

from implementations.base import Capabilities, Implementation

_caps = Capabilities(dtypes=("float64", "float32"), jit=True)


def _sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def _mask_key(attn_mask):
    if attn_mask is None:
        return None
    return "bool" if attn_mask.dtype == torch.bool else "additive"  # not its broadcast form


def recording(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Correct (the math backend); appends each call's configuration (what a compiler
    would key on: shapes, mask kind, causal flag, scale; the budget leaves the mask's
    broadcast form free) as a JSON line to the
    file $CONFORMANCE_TEST_CONFIGS names (if set)."""
    path = os.environ.get("CONFORMANCE_TEST_CONFIGS")
    if path:
        config = [list(query.shape), list(key.shape), list(value.shape), _mask_key(attn_mask),
                  bool(is_causal), scale]
        with open(path, "a") as out:
            out.write(json.dumps(config) + "\n")
    return _sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def negative_scale_dropped(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                           enable_gqa=False):
    """Bug: a negative scale is taken as its magnitude."""
    scale = abs(scale) if scale is not None else None
    return _sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def bias_ignored(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
    """Bug: an additive mask's finite entries are dropped (only its -inf blocks)."""
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = torch.where(torch.isinf(attn_mask), attn_mask, torch.zeros_like(attn_mask))
    return _sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


recording_jit_impl = Implementation(name="recording-jit", capabilities=_caps, sdpa=recording)
negative_scale_jit_impl = Implementation(name="negative-scale-jit", capabilities=_caps,
                                         sdpa=negative_scale_dropped)
bias_ignored_jit_impl = Implementation(name="bias-ignored-jit", capabilities=_caps, sdpa=bias_ignored)
