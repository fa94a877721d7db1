"""Implementations whose failures test the report's form (``tests/runner/test_failure_report.py``),
each with scaled_dot_product_attention's signature, right where they claim
(``partial_support_impls._attend``) but for:

* :func:`wrong_for_three_batches`: right except with a batch of three (no directed case
  has one), so only the random search finds it;
* :func:`bridge_breaks`: calls a helper whose code is the suite's (compiled under the
  framework bridge's file name), which raises ``AttributeError`` on cases with L = 1,
  S = 2 (none of the probe's calls), as the bridge does on a layer whose sublayers it
  cannot find;
* :func:`kvcache_without_rotary`: ``flash_attn_with_kvcache``'s signature, which claims
  rotary through ``rotary_cos``/``rotary_sin``, raising ``NotImplementedError`` on it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from implementations.builtins.references.varlen_reference import KVCacheAttention
from tests.runner.partial_support_impls import _attend

_BRIDGE = Path(__file__).resolve().parents[2] / "implementations" / "bridge" / "sdpa.py"
_namespace: dict = {}
exec(compile("def read_sublayer(layer):\n    return layer.query_dense\n", str(_BRIDGE), "exec"), _namespace)


def wrong_for_three_batches(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False):
    out = _attend(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    if query.shape[0] == 3:
        return out * 2
    return out


def bridge_breaks(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
    if query.shape[-2] == 1 and key.shape[-2] == 2:  # none of the probe's calls
        _namespace["read_sublayer"](object())
    return _attend(query, key, value, attn_mask, is_causal, scale, enable_gqa)


_kvcache = KVCacheAttention()


def kvcache_without_rotary(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                           cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                           return_softmax_lse=False):
    """``flash_attn_with_kvcache``'s signature (so rotary is claimed by it), but no rotary."""
    if rotary_cos is not None:
        raise NotImplementedError("rotary embeddings are not supported")
    return _kvcache(q, k_cache, v_cache, k, v, None, None, cache_seqlens, cache_batch_idx, cache_leftpad,
                    block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                    alibi_slopes, num_splits, return_softmax_lse)


def mask_subtracted(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """Subtracts its float mask instead of adding it (a bool mask is right)."""
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = -attn_mask
    return _attend(query, key, value, attn_mask, is_causal, scale, enable_gqa)
