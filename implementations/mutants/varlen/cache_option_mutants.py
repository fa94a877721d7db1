"""Bugs of FlashAttention's options at the varlen and kvcache levels (window, softcap, LSE).

Each mutant is the ``varlen-reference`` built-in with one method overridden (as in
:mod:`.varlen_mutants`); the records use that module's vocabulary plus ``window``
[left, right], ``softcap``, ``alibi`` (slopes per head) and ``lse`` (compare the LSE:
``return_attn_probs`` / ``return_softmax_lse``).
"""

from __future__ import annotations

import torch

from implementations.builtins.references.varlen_reference import (
    KVCacheAttention,
    VarlenAttention,
    _compute_dtype,
    attend,
    logits,
    softmax_rows,
    window_allowed,
)
from implementations.mutants.varlen.varlen_mutants import ONE, _mutant

__all__ = ["CACHE_OPTION_MUTANTS"]


class SoftcapAfterMask(VarlenAttention):
    """Soft-caps the scores after the window/causal mask: a blocked key's -inf becomes -c
    (c·tanh(-inf / c)), so blocked keys get weight."""

    def attend(self, q, k, v, *, scale, causal, window=(-1, -1), softcap=0.0, slopes=None, offset=None, lse=False,
               dropout=None):
        L, N, _ = q.shape
        S, K, Ev = v.shape
        if not softcap or L == 0 or S == 0:
            return attend(q, k, v, scale=scale, causal=causal, window=window, softcap=softcap, slopes=slopes,
                          offset=offset, lse=lse, dropout=dropout)
        work, offset = _compute_dtype(q.dtype), S - L if offset is None else offset
        qh = q.to(work).transpose(0, 1)
        kh = k.to(work).repeat_interleave(N // K, dim=1).transpose(0, 1)
        vh = v.to(work).repeat_interleave(N // K, dim=1).transpose(0, 1)
        scores = logits(qh, kh, scale=scale, softcap=0.0, slopes=slopes, offset=offset)
        allowed = window_allowed(L, S, window, causal, offset, q.device)
        scores = softcap * torch.tanh(scores.masked_fill(~allowed, float("-inf")) / softcap)  # the bug
        weights, row_lse = softmax_rows(scores, torch.ones_like(allowed))
        if dropout is not None:
            weights = dropout(weights)
        out = (weights @ vh).transpose(0, 1).to(q.dtype)
        return (out, row_lse) if lse else out


class LsePacked(VarlenAttention):
    """Returns the LSE of each query over the whole packed key tensor (every sequence's
    keys, no mask) instead of over its own sequence's keys."""

    def packed_lse(self, lse, q, k, starts_q, starts_k, scale):
        if k.shape[0] == 0:
            return lse
        whole = lse.clone()
        for b in range(len(starts_q) - 1):
            rows = slice(starts_q[b], starts_q[b + 1])
            whole[:, rows] = attend(q[rows], k, k, scale=scale, causal=False, lse=True)[1]
        return whole


class WindowIgnoresCache(KVCacheAttention):
    """Aligns the window (and causal, ALiBi) with the appended keys only: p_i = i + S_new - L,
    as if the cache held no keys before them (cache_seqlens left out of the offset)."""

    def aligned_offset(self, L, valid, length, new):
        return new - L


class LseWholeCache(KVCacheAttention):
    """Returns the LSE over every row of the cache's capacity (stale rows past cache_seqlens
    included) instead of over the valid keys."""

    def returned_lse(self, lse, q, k_cache, block_table, scale, capacity):
        whole = lse.clone()
        for b in range(q.shape[0]):
            keys = self.rows(k_cache, block_table, b, capacity)
            whole[b] = attend(q[b], keys, keys, scale=scale, causal=False, lse=True)[1]
        return whole


CACHE_OPTION_MUTANTS = [
    _mutant(
        "varlen_softcap_after_mask", varlen=SoftcapAfterMask(),
        bug="soft-capping is applied after the mask: blocked keys' -inf becomes -softcap and they get weight",
        origin="hand-written pitfall: c·tanh(s/c) applied to the masked scores (FlashAttention caps before "
               "masking)",
        smallest_case={**ONE, "lengths": [(1, 2)], "window": [0, 0], "softcap": 0.5},
        safe_case={**ONE, "lengths": [(1, 2)], "softcap": 0.5},
        expected_property="varlen_feature_agreement",
        expected_cause="varlen_softcap_after_mask",
    ),
    _mutant(
        "varlen_lse_packed", varlen=LsePacked(),
        bug="the returned LSE of each query is over the whole packed key tensor, not its own sequence's keys",
        origin="hand-written pitfall: the LSE taken over the packed keys (cu_seqlens ignored for the LSE only)",
        smallest_case={**ONE, "lengths": [(1, 1), (0, 1)], "lse": True},
        safe_case={**ONE, "lengths": [(1, 1)], "lse": True},
        expected_property="varlen_lse_agreement",
        expected_cause="varlen_lse_packed",
    ),
    _mutant(
        "kvcache_window_ignores_cache", kvcache=WindowIgnoresCache(),
        bug="the window's aligned position counts only the appended keys (p_i = i + S_new - L), not cache_seqlens",
        origin="kernel bug: the sliding-window offset computed from the new tokens, without the cache length",
        smallest_case={**ONE, "L": 1, "cache_seqlens": [1], "S_new": 1, "S_cache": 2, "window": [0, 0]},
        safe_case={**ONE, "L": 1, "cache_seqlens": [0], "S_new": 1, "S_cache": 2, "window": [0, 0]},
        expected_property="kvcache_feature_agreement",
        expected_cause="kvcache_window_ignores_cache",
    ),
    _mutant(
        "kvcache_lse_whole_cache", kvcache=LseWholeCache(),
        bug="the returned LSE is over the cache's whole capacity (stale rows included), not the valid keys",
        origin="hand-written pitfall: the split-KV LSE reduced over the allocated cache, not cache_seqlens",
        smallest_case={**ONE, "L": 1, "cache_seqlens": [1], "S_new": 0, "S_cache": 2, "lse": True},
        safe_case={**ONE, "L": 1, "cache_seqlens": [2], "S_new": 0, "S_cache": 2, "lse": True},
        expected_property="kvcache_lse_agreement",
        expected_cause="kvcache_lse_whole_cache",
    ),
]
