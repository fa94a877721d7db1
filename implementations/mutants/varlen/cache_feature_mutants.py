"""Bugs of the KV cache's own options: rotary embeddings in the call, ``cache_batch_idx``,
``cache_leftpad`` and split-KV decoding (``num_splits``).

Each mutant is the ``varlen-reference`` built-in with one method of its
:class:`~implementations.builtins.references.varlen_reference.KVCacheAttention` overridden (as in
:mod:`.varlen_mutants`); the records use that module's kvcache vocabulary plus
``rotary_dim`` and ``rotary_interleaved`` (tables of random angles), ``cache_batch_idx``
(with ``B_cache`` cache rows), ``cache_leftpad``, ``num_splits`` and ``values: "huge"``
(q = 30 and keys ±30: logits beyond float64's exp range).
"""

from __future__ import annotations

import torch

from implementations.builtins.references.varlen_reference import KVCacheAttention
from implementations.mutants.varlen.varlen_mutants import ONE, _mutant

__all__ = ["CACHE_FEATURE_MUTANTS"]


class RotaryRelativePositions(KVCacheAttention):
    """Rotates q and the new keys at positions counted from the new tokens (0, 1, ...):
    cache_seqlens left out, so they no longer line up with the keys already cached."""

    def query_positions(self, length, L, per_row):
        return super().query_positions(0, L, per_row)

    def key_positions(self, length, new):
        return super().key_positions(0, new)


class RotaryQueriesPerRow(KVCacheAttention):
    """Rotates query i at cache_seqlens + i even when the call is neither causal nor
    local (the contract puts every query at cache_seqlens then)."""

    def query_positions(self, length, L, per_row):
        return super().query_positions(length, L, True)


class RotaryInterleaveSwapped(KVCacheAttention):
    """Reads rotary_interleaved the other way round: GPT-NeoX halves for True, GPT-J
    pairs for False."""

    def rotary_pairs(self, rotary_dim, interleaved):
        return super().rotary_pairs(rotary_dim, not interleaved)


class LeftpadCausalOffset(KVCacheAttention):
    """Drops the padded keys but aligns the diagonal (and window, ALiBi) as if they were
    still there: p_i - i = S_b - L counted from the first attended key."""

    def padded_offset(self, L, valid, start, length, new):
        return self.aligned_offset(L, valid, length, new)


class LeftpadIgnored(KVCacheAttention):
    """Attends the left padding: every sequence's keys start at cache index 0."""

    def first_key(self, pad):
        return 0


class BatchIdxIgnoredOnWrite(KVCacheAttention):
    """Writes sequence b's new keys into cache row b, not cache_batch_idx[b] (reads the right row)."""

    def write_row(self, rows, b):
        return b


class BatchIdxIgnoredOnRead(KVCacheAttention):
    """Reads cache row b for sequence b, not cache_batch_idx[b] (writes the right row)."""

    def read_row(self, rows, b):
        return b


class SplitMergeWithoutMax(KVCacheAttention):
    """Merges the split-KV partials with exp(lse_c) directly, without subtracting the
    largest partial LSE first: inf / inf = NaN once a logit passes exp's range."""

    def merge_splits(self, partials):
        outs = torch.stack([out for out, _ in partials])                 # (P, L, N, Ev)
        weights = torch.exp(torch.stack([lse for _, lse in partials]))   # (P, N, L)
        total = weights.sum(dim=0)
        lse = torch.where(total > 0, torch.log(total), torch.full_like(total, float("-inf")))
        share = weights / torch.where(total > 0, total, torch.ones_like(total))
        return (share.permute(0, 2, 1)[..., None] * outs).sum(dim=0), lse


class SplitMergeWithoutRescale(KVCacheAttention):
    """Adds the split-KV partial outputs without their weights exp(lse_c - lse) (the LSE
    itself is merged right)."""

    def merge_splits(self, partials):
        _, lse = super().merge_splits(partials)
        return torch.stack([out for out, _ in partials]).sum(dim=0), lse


ROTARY = {**ONE, "E": 2, "L": 1, "S_new": 1, "rotary_dim": 2, "rotary_interleaved": True}

CACHE_FEATURE_MUTANTS = [
    _mutant(
        "kvcache_rotary_relative_positions", kvcache=RotaryRelativePositions(),
        bug="rotary embeddings are applied at positions 0, 1, ... of the new tokens, not at cache_seqlens[b] + i",
        origin="hand-written pitfall: the rotary offset (cache_seqlens, FlashAttention's seqlen_offsets) "
               "forgotten, as in a prefill-only rotary applied to a decoding step",
        smallest_case={**ROTARY, "cache_seqlens": [1], "S_cache": 2},
        safe_case={**ROTARY, "cache_seqlens": [0], "S_cache": 2},
        expected_property="kvcache_rotary_agreement",
        expected_cause="kvcache_rotary_relative_positions",
    ),
    _mutant(
        "kvcache_rotary_queries_per_row", kvcache=RotaryQueriesPerRow(),
        bug="without causal or a window, query i is rotated at cache_seqlens + i instead of all queries at "
            "cache_seqlens",
        origin="hand-written pitfall: the causal rule for query positions applied to every call (FlashAttention "
               "rotates non-causal, non-local queries at cache_seqlens only)",
        smallest_case={**ROTARY, "L": 2, "cache_seqlens": [1], "S_cache": 3},
        safe_case={**ROTARY, "L": 1, "cache_seqlens": [1], "S_cache": 3},
        expected_property="kvcache_rotary_equivalence",
        expected_cause="kvcache_rotary_queries_per_row",
    ),
    _mutant(
        "kvcache_rotary_interleave_swapped", kvcache=RotaryInterleaveSwapped(),
        bug="rotary_interleaved=True rotates the halves (j, j + R/2) and False the pairs (2j, 2j + 1): the "
            "flag read the other way round",
        origin="hand-written pitfall: the GPT-J (interleaved pairs) and GPT-NeoX (rotate_half) rotary "
               "layouts confused when porting between the two conventions",
        smallest_case={**ROTARY, "E": 4, "rotary_dim": 4, "cache_seqlens": [1], "S_cache": 2},
        safe_case={**ROTARY, "E": 4, "rotary_dim": 2, "cache_seqlens": [1], "S_cache": 2},
        expected_property="kvcache_rotary_agreement",
        expected_cause="kvcache_rotary_interleave_swapped",
    ),
    _mutant(
        "kvcache_leftpad_causal_offset", kvcache=LeftpadCausalOffset(),
        bug="with cache_leftpad the padded keys are dropped but the causal diagonal is placed as if they "
            "were not: it moves right by the pad",
        origin="kernel bug: the key pointer advanced by leftpad while the causal offset still uses the "
               "unpadded cache length",
        smallest_case={**ONE, "L": 2, "cache_seqlens": [2], "S_new": 0, "S_cache": 2, "causal": True,
                       "cache_leftpad": [1]},
        safe_case={**ONE, "L": 2, "cache_seqlens": [2], "S_new": 0, "S_cache": 2, "causal": True,
                   "cache_leftpad": [0]},
        expected_property="kvcache_leftpad_agreement",
        expected_cause="kvcache_leftpad_causal_offset",
    ),
    _mutant(
        "kvcache_leftpad_ignored", kvcache=LeftpadIgnored(),
        bug="cache_leftpad is ignored: every sequence also attends its left padding",
        origin="hand-written pitfall: a left-padded batch decoded with cache_seqlens alone (the padding "
               "tokens' keys attended)",
        smallest_case={**ONE, "L": 1, "cache_seqlens": [2], "S_new": 0, "S_cache": 2, "cache_leftpad": [1]},
        safe_case={**ONE, "L": 1, "cache_seqlens": [2], "S_new": 0, "S_cache": 2, "cache_leftpad": [0]},
        expected_property="kvcache_leftpad_equivalence",
        expected_cause="kvcache_leftpad_ignored",
    ),
    _mutant(
        "kvcache_batch_idx_ignored_on_write", kvcache=BatchIdxIgnoredOnWrite(),
        bug="the new keys and values of sequence b are written into cache row b, not cache_batch_idx[b]",
        origin="kernel bug: the append path indexes the cache by the batch index while the attention path "
               "uses cache_batch_idx",
        smallest_case={**ONE, "L": 1, "cache_seqlens": [0], "S_new": 1, "S_cache": 1, "B_cache": 2,
                       "cache_batch_idx": [1]},
        safe_case={**ONE, "L": 1, "cache_seqlens": [0], "S_new": 1, "S_cache": 1, "B_cache": 2,
                   "cache_batch_idx": [0]},
        expected_property="kvcache_batch_idx_agreement",
        expected_cause="kvcache_batch_idx_ignored_on_write",
    ),
    _mutant(
        "kvcache_batch_idx_ignored_on_read", kvcache=BatchIdxIgnoredOnRead(),
        bug="sequence b attends cache row b, not cache_batch_idx[b] (the append goes to the right row)",
        origin="kernel bug: the attention path indexes the cache by the batch index, only the append "
               "uses cache_batch_idx",
        smallest_case={**ONE, "L": 1, "cache_seqlens": [1], "S_new": 0, "S_cache": 1, "B_cache": 2,
                       "cache_batch_idx": [1]},
        safe_case={**ONE, "L": 1, "cache_seqlens": [1], "S_new": 0, "S_cache": 1, "B_cache": 2,
                   "cache_batch_idx": [0]},
        expected_property="kvcache_batch_idx_agreement",
        expected_cause="kvcache_batch_idx_ignored_on_read",
    ),
    _mutant(
        "kvcache_split_merge_without_max", kvcache=SplitMergeWithoutMax(),
        bug="split-KV partials are merged with exp(lse_c) without subtracting the largest LSE: NaN once a "
            "logit passes exp's range",
        origin="hand-written pitfall: the textbook log-sum-exp merge without its max shift (FlashAttention's "
               "combine kernel subtracts the largest partial LSE first)",
        smallest_case={**ONE, "L": 1, "cache_seqlens": [2], "S_new": 0, "S_cache": 2, "num_splits": 2,
                       "values": "huge"},
        safe_case={**ONE, "L": 1, "cache_seqlens": [2], "S_new": 0, "S_cache": 2, "num_splits": 2},
        expected_property="kvcache_num_splits_equivalence",
        expected_cause="kvcache_split_merge_without_max",
    ),
    _mutant(
        "kvcache_split_merge_without_rescale", kvcache=SplitMergeWithoutRescale(),
        bug="split-KV partial outputs are added without their weights exp(lse_c - lse)",
        origin="hand-written pitfall: the partial outputs of the key chunks summed as if each were already "
               "normalised over all keys",
        smallest_case={**ONE, "L": 1, "cache_seqlens": [2], "S_new": 0, "S_cache": 2, "num_splits": 2},
        safe_case={**ONE, "L": 1, "cache_seqlens": [2], "S_new": 0, "S_cache": 2, "num_splits": 1},
        expected_property="kvcache_num_splits_equivalence",
        expected_cause="kvcache_split_merge_without_rescale",
    ),
]
