"""Bugs of packed variable-length and KV-cache attention (the varlen and kvcache levels).

Each mutant is the ``varlen-reference`` built-in (``implementations/builtins/
varlen_reference.py``) with one method of :class:`VarlenAttention` or
:class:`KVCacheAttention` overridden; its capabilities are the built-in's.
``smallest_case`` here uses this level's vocabulary: ``lengths`` (varlen: one (L_b, S_b)
per sequence), or ``L``, ``cache_seqlens``, ``S_new``, ``S_cache``, ``page_size`` and
``block_table`` (kvcache), plus ``N``, ``K``, ``E``, ``Ev``, ``causal`` (and, for
FlashAttention's options, ``window``, ``softcap``, ``alibi``, ``lse``; ``dropout_p``, with
``dropout_pattern`` the S_dmask read back)
(``tests/mutants/test_varlen_mutant_records.py`` turns it into a call).
"""

from __future__ import annotations

from implementations.builtins.references.varlen_reference import (
    KVCacheAttention,
    VarlenAttention,
    attend,
    make_implementation,
)
from implementations.mutants.record import Mutant

__all__ = ["VARLEN_MUTANTS"]


class NeighbourKey(VarlenAttention):
    """Each sequence's key slice runs one row into the next sequence."""

    def sequence(self, starts_q, starts_k, b):
        rows, keys = super().sequence(starts_q, starts_k, b)
        return rows, slice(keys.start, min(keys.stop + 1, starts_k[-1]))


class ScaleOverE(VarlenAttention):
    """softmax_scale=None read as 1/E instead of 1/sqrt(E)."""

    def scale(self, softmax_scale, head_dim):
        return 1.0 / head_dim if softmax_scale is None else float(softmax_scale)


class SeqlensOffByOne(KVCacheAttention):
    """Attends one key past the valid ones (cache_seqlens[b] + S_new + 1, where the cache has room)."""

    def valid_keys(self, length, new, capacity):
        return min(length + new + 1, capacity)


class AppendAtStart(KVCacheAttention):
    """Writes the new keys and values at the start of the cache, not after its valid rows."""

    def append_at(self, length):
        return 0


class AppendNotWritten(KVCacheAttention):
    """Attends the new keys and values but never writes them into the caches."""

    def __call__(self, q, k_cache, v_cache, k=None, v=None, *args, **kwargs):
        if k is None:
            return super().__call__(q, k_cache, v_cache, k, v, *args, **kwargs)
        return super().__call__(q, k_cache.clone(), v_cache.clone(), k, v, *args, **kwargs)


class CausalTopLeft(KVCacheAttention):
    """Causal in the cache aligned top-left (query i sees keys 0..i), not bottom-right."""

    def attend(self, q, keys, values, *, scale, causal, **options):
        if not causal:
            return attend(q, keys, values, scale=scale, causal=causal, **options)
        # p_i = i: tril(ones(L, S)), the square triangle over the first L keys (rows past S see all)
        return attend(q, keys, values, scale=scale, causal=True, **{**options, "offset": 0})


class BlockTableIgnored(KVCacheAttention):
    """Reads and writes pages as if block_table were the identity (b * max_pages + j)."""

    def page_of(self, block_table, b, t, page_size):
        return b * block_table.shape[1] + t // page_size


def _mutant(name: str, *, varlen=None, kvcache=None, bug: str, origin: str, smallest_case: dict,
            expected_property: str, safe_case: dict | None = None, expected_cause: str | None = None) -> Mutant:
    def build():
        return make_implementation(name=f"mutant:{name}", varlen=varlen, kvcache=kvcache, description=bug)

    return Mutant(name=name, bug=bug, origin=origin, smallest_case=smallest_case,
                  expected_property=expected_property, build=build,
                  level="varlen" if varlen is not None else "kvcache", safe_case=safe_case,
                  expected_cause=expected_cause)


ONE = {"N": 1, "K": 1, "E": 1, "Ev": 1}

VARLEN_MUTANTS = [
    _mutant(
        "varlen_neighbour_key", varlen=NeighbourKey(),
        bug="each packed sequence also attends the first key of the next sequence",
        origin="kernel bug: a key-block loop bounded by the next sequence's end plus one "
               "(cu_seqlens_k[b + 1] read inclusively)",
        smallest_case={**ONE, "lengths": [(1, 1), (0, 1)]},
        safe_case={**ONE, "lengths": [(1, 1)]},
        expected_property="varlen_equivalence",
        expected_cause="varlen_neighbour_key",
    ),
    _mutant(
        "varlen_scale_over_e", varlen=ScaleOverE(),
        bug="softmax_scale=None gives 1/E instead of 1/sqrt(E) in the packed kernel",
        origin="hand-written pitfall: the default scale written as 1 / head_dim",
        smallest_case={**ONE, "E": 2, "Ev": 1, "lengths": [(1, 2)]},
        safe_case={**ONE, "lengths": [(1, 2)]},
        expected_property="varlen_agreement",
        expected_cause="varlen_scale_over_e",
    ),
    _mutant(
        "kvcache_seqlens_off_by_one", kvcache=SeqlensOffByOne(),
        bug="each sequence attends cache_seqlens[b] + S_new + 1 cache rows: one stale row past the valid ones",
        origin="kernel bug: the valid length taken as an inclusive last index (<= instead of <)",
        smallest_case={**ONE, "L": 1, "cache_seqlens": [0], "S_new": 0, "S_cache": 1},
        safe_case={**ONE, "L": 1, "cache_seqlens": [1], "S_new": 0, "S_cache": 1},
        expected_property="kvcache_equivalence",
        expected_cause="kvcache_seqlens_off_by_one",
    ),
    _mutant(
        "kvcache_append_at_start", kvcache=AppendAtStart(),
        bug="new keys and values are written at row 0 of the cache instead of row cache_seqlens[b]",
        origin="hand-written pitfall: the append offset (cache_seqlens) forgotten in the cache write",
        smallest_case={**ONE, "L": 1, "cache_seqlens": [1], "S_new": 1, "S_cache": 2},
        safe_case={**ONE, "L": 1, "cache_seqlens": [0], "S_new": 1, "S_cache": 2},
        expected_property="kvcache_equivalence",
        expected_cause="kvcache_append_at_start",
    ),
    _mutant(
        "kvcache_append_not_written", kvcache=AppendNotWritten(),
        bug="the new keys and values are attended but not written into the caches (the next step misses them)",
        origin="hand-written pitfall: torch.cat of the cache and the new keys instead of an in-place "
               "write (FlashAttention's flash_attn_with_kvcache updates k_cache and v_cache in place)",
        smallest_case={**ONE, "L": 1, "cache_seqlens": [0], "S_new": 1, "S_cache": 1},
        safe_case={**ONE, "L": 1, "cache_seqlens": [1], "S_new": 0, "S_cache": 1},
        expected_property="kvcache_equivalence",
        expected_cause="kvcache_append_not_written",
    ),
    _mutant(
        "kvcache_causal_top_left", kvcache=CausalTopLeft(),
        bug="causal decoding lets query i see keys 0..i (top-left) instead of 0..i + S_b - L (bottom-right)",
        origin="real code: PyTorch's is_causal (top-left) used for a decoding step, where the "
               "new queries are the last L of S_b positions (FlashAttention's bottom-right)",
        smallest_case={**ONE, "L": 1, "cache_seqlens": [2], "S_new": 0, "S_cache": 2, "causal": True},
        safe_case={**ONE, "L": 1, "cache_seqlens": [2], "S_new": 0, "S_cache": 2, "causal": False},
        expected_property="kvcache_agreement",
        expected_cause="kvcache_causal_upper_left",
    ),
    _mutant(
        "paged_block_table_ignored", kvcache=BlockTableIgnored(),
        bug="pages are read and written as if block_table were the identity (page b * max_pages + j)",
        origin="kernel bug: the paged kernel indexes the page pool by logical page, skipping the table lookup",
        smallest_case={**ONE, "L": 1, "cache_seqlens": [1], "S_new": 0, "S_cache": 1, "page_size": 1,
                       "block_table": [[1]], "num_pages": 2},
        safe_case={**ONE, "L": 1, "cache_seqlens": [1], "S_new": 0, "S_cache": 1, "page_size": 1,
                   "block_table": [[0]], "num_pages": 1},
        expected_property="paged_equivalence",
        expected_cause="kvcache_block_table_ignored",
    ),
]


# -- dropout (varlen_dropout_expectation) ---------------------------------------------------


class DropoutNoRescale(VarlenAttention):
    """Drops each sequence's weights after the softmax but keeps the survivors as they are
    (no 1/(1 - p)): the expectation shrinks by 1 - p."""

    def rescale(self, kept, p):
        return kept


class DropoutOffsetNotAdvanced(VarlenAttention):
    """Every packed sequence draws its dropout pattern at the same offset of the call's random
    stream: sequences of one shape drop the same weights."""

    def rng_offset(self, b):
        return 0


VARLEN_MUTANTS += [
    _mutant(
        "varlen_dropout_no_rescale", varlen=DropoutNoRescale(),
        bug="varlen dropout keeps the surviving weights unscaled (no 1/(1 - p)): the mean output shrinks by 1 - p",
        origin="hand-written pitfall: the mask multiplied into the weights and the inverted-dropout "
               "rescale forgotten (it lives in a separate step in non-fused code)",
        smallest_case={**ONE, "lengths": [(1, 1)], "dropout_p": 0.5},
        safe_case={**ONE, "lengths": [(1, 1)]},
        expected_property="varlen_dropout_expectation",
    ),
    _mutant(
        "varlen_dropout_offset_not_advanced", varlen=DropoutOffsetNotAdvanced(),
        bug="every packed sequence draws its dropout pattern at the same Philox offset: equal-shaped "
            "sequences drop the same weights",
        origin="kernel bug: the random stream's offset (FlashAttention-2's batch index in the Philox "
               "subsequence) taken from the head only, not advanced per packed sequence",
        smallest_case={**ONE, "lengths": [(1, 1), (1, 1)], "dropout_p": 0.5},
        safe_case={**ONE, "lengths": [(1, 1), (1, 1)]},
        expected_property="varlen_dropout_expectation",
    ),
]


# -- the dropout pattern (varlen_dropout_pattern_agreement) ------------------------------------


class PatternAtBatchRow(VarlenAttention):
    """Writes every packed sequence's dropout pattern into S_dmask's row 0 (the packed
    tensor taken as one batch element): the output drops what each sequence drew, the
    returned pattern shows the last sequence's over the first's, and zeros (all kept) below."""

    def pattern_row(self, b):
        return 0


VARLEN_MUTANTS += [
    _mutant(
        "varlen_dropout_pattern_batch_row", varlen=PatternAtBatchRow(),
        bug="varlen dropout: every packed sequence's S_dmask pattern is written at row 0, not at the "
            "sequence's own row (the output uses the right patterns)",
        origin="kernel bug: the S_dmask pointer advanced by the padded batch index (0 for one packed "
               "batch) instead of the sequence index (FlashAttention-2's varlen S_dmask is (num_sequences, "
               "N, seqlen_q_rounded, seqlen_k_rounded))",
        smallest_case={**ONE, "lengths": [(2, 4), (2, 4)], "dropout_p": 0.5, "dropout_pattern": True},
        safe_case={**ONE, "lengths": [(2, 4)], "dropout_p": 0.5, "dropout_pattern": True},
        expected_property="varlen_dropout_pattern_agreement",
    ),
]


# -- FP8 with descales (varlen_fp8_agreement) ---------------------------------------------------


class DescaleByBatch(VarlenAttention):
    """Reads every packed sequence's descales from row 0: the packed tensor taken as one
    batch element (the flash kernel's batch index, 0 for a varlen call), not the sequence."""

    def descale_row(self, b):
        return 0


VARLEN_MUTANTS += [
    _mutant(
        "varlen_fp8_descale_by_batch", varlen=DescaleByBatch(),
        bug="FP8 varlen: every packed sequence is dequantised with descale row 0 instead of its own row",
        origin="kernel bug: the descale pointer advanced by the batch index (0 for one packed batch) instead "
               "of the sequence index (FlashAttention-3's varlen descales are (num_sequences, K))",
        smallest_case={**ONE, "lengths": [(1, 1), (1, 1)], "fp8": "float8_e4m3fn"},
        safe_case={**ONE, "lengths": [(1, 1)], "fp8": "float8_e4m3fn"},
        expected_property="varlen_fp8_agreement",
    ),
]


# -- FP8 KV cache with descales (kvcache_fp8_agreement) ------------------------------------------


class NewKeysUndescaled(KVCacheAttention):
    """Dequantises the cached keys and values with k_descale/v_descale but attends the
    appended ones (read straight from k and v) as stored, without their descales."""

    def dequantize(self, q, keys, values, descales, b, appended_from):
        q_f, keys_f, values_f = super().dequantize(q, keys, values, descales, b, appended_from)
        keys_f[appended_from:] = keys[appended_from:].to(keys_f.dtype)
        values_f[appended_from:] = values[appended_from:].to(values_f.dtype)
        return q_f, keys_f, values_f


VARLEN_MUTANTS += [
    _mutant(
        "kvcache_fp8_new_keys_undescaled", kvcache=NewKeysUndescaled(),
        bug="FP8 kvcache: the appended keys and values are attended as stored, without k_descale/v_descale "
            "(the cached ones are dequantised)",
        origin="kernel bug: the append path reads k/v from the new-key tensors and skips the descale the "
               "cache-load path applies (two load paths, one dequantisation)",
        smallest_case={**ONE, "L": 1, "cache_seqlens": [0], "S_new": 1, "S_cache": 1, "fp8": "float8_e4m3fn"},
        safe_case={**ONE, "L": 1, "cache_seqlens": [1], "S_new": 0, "S_cache": 1, "fp8": "float8_e4m3fn"},
        expected_property="kvcache_fp8_agreement",
    ),
]
