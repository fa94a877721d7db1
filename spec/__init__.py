"""The attention spec: a float64 NumPy oracle for scaled dot-product and multi-head attention.

Pure NumPy; never imports torch. Dimension letters used everywhere: B batch, N query
heads, K key/value heads, L query length, S key length, E q/k head dim, Ev value head
dim, D model dim.

Mask polarity: ``attend_mask`` is bool with **True = may attend**; ``additive_mask`` is
float and **added** to the scaled scores. ``mha_forward`` takes nn.MultiheadAttention's
masks in its own convention (bool **True = blocked**). :mod:`spec.masks` converts.

Public API::

    sdpa(query, key, value, *, attend_mask, additive_mask, causal, scale, fully_masked, sinks) -> SDPAResult
    sdpa_vjp(query, key, value, grad_output, *, attend_mask, additive_mask, causal, scale, sinks) -> SDPAGrads
    emulate_sdpa(query, key, value, *, dtype, attend_mask, additive_mask, causal, scale, fully_masked)
    MHAParams, mha_forward(params, query, key, value, *, key_padding_mask, attn_mask, ...)
    emulate_mha(params, query, key, value, *, dtype, <mha_forward's options>) -> (output, weights)
    emulate_mha_steps(...) -> MHASteps (projections, weights, attended, output)
    masks (module), SpecError

FlashAttention's features, in its layout q (B, L, N, E), k/v (B, S, K, E|Ev)::

    flash_attention(q, k, v, *, causal, window, softcap, alibi_slopes, scale, return_lse,
                    fully_masked, alignment, sinks, q_descale, k_descale, v_descale,
                    dropout_p, dropout_mask) -> output | FlashResult(output, lse)
    flash_attention_vjp(q, k, v, grad_output, *, causal, window, softcap, alibi_slopes,
                        scale, alignment, sinks, dropout_p, dropout_mask)
        -> FlashGrads(dquery, dkey, dvalue)
    fp8 (module): FORMATS, quantize, representable, descale_array, dequantize
    window_mask(L, S, window, *, causal, alignment), alibi_bias(L, S, slopes, *, alignment)
    merge_partials(out1, lse1, out2, lse2) -> FlashResult
    varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, **options), document_mask(...)
    kvcache_attention(q, k_cache, v_cache, *, cache_seqlens, k, v, block_table, rotary_cos,
                      rotary_sin, rotary_interleaved, cache_batch_idx, cache_leftpad, num_splits,
                      **options) -> KVCacheResult(output, lse, k_cache, v_cache)
    gather_pages(cache, block_table)
    apply_rotary(x, cos, sin, positions, *, interleaved), rotary_positions(cache_seqlens, L,
                 S_new, *, causal, window) -> (query positions, new-key positions)
    variants (module): wrong conventions as data, VARIANTS, rank(observed, problem, ...)
"""

from __future__ import annotations

from . import fp8, masks, variants
from ._sdpa import SDPAGrads, SDPAResult, sdpa, sdpa_vjp
from .emulate import emulate_sdpa
from .emulate_mha import MHASteps, emulate_mha, emulate_mha_steps
from .errors import SpecError
from .flash import (FlashGrads, FlashResult, alibi_bias, flash_attention, flash_attention_vjp,
                    merge_partials, window_mask)
from .kvcache import KVCacheResult, gather_pages, kvcache_attention
from .mha import MHAParams, mha_forward
from .rotary import apply_rotary, rotary_positions
from .varlen import document_mask, varlen_attention
from .variants import VARIANTS

__all__ = [
    "SpecError",
    "sdpa",
    "SDPAResult",
    "sdpa_vjp",
    "SDPAGrads",
    "emulate_sdpa",
    "emulate_mha",
    "emulate_mha_steps",
    "MHASteps",
    "MHAParams",
    "mha_forward",
    "masks",
    "fp8",
    "flash_attention",
    "FlashResult",
    "flash_attention_vjp",
    "FlashGrads",
    "window_mask",
    "alibi_bias",
    "merge_partials",
    "varlen_attention",
    "document_mask",
    "kvcache_attention",
    "KVCacheResult",
    "gather_pages",
    "apply_rotary",
    "rotary_positions",
    "variants",
    "VARIANTS",
]
