"""KV-cache decoding (FlashAttention's ``flash_attn_with_kvcache``), contiguous or paged.

Sequence b's cache holds ``cache_seqlens[b]`` valid keys. The new keys k (B, S_new, K, E)
and values v (B, S_new, K, Ev), when given, are written at positions
``cache_seqlens[b] ... cache_seqlens[b] + S_new - 1``; the query (B, L, N, E) then attends
the first ``S_b = cache_seqlens[b] + S_new`` keys. Keys past S_b are **absent** (not
masked: they do not count for ``fully_masked="uniform"`` either). Positions align to the
valid length: ``p_i = i + S_b - L`` (bottom-right), for causal, window and ALiBi alike.

Cache options (FlashAttention's, each checked):

* ``cache_batch_idx`` (B,) ints: sequence b reads and writes cache row
  ``cache_batch_idx[b]`` (the cache may hold more rows than B; rows no sequence names are
  returned untouched); distinct when new keys are appended (FlashAttention leaves which
  write wins open); contiguous caches only. ``cache_seqlens``, ``cache_leftpad``, the
  ALiBi rows and the positions stay indexed by b.
* ``cache_leftpad`` (B,) ints, ``0 <= cache_leftpad[b] <= cache_seqlens[b]``: sequence b's
  keys start at that cache index; the keys before it are **absent** like those past S_b.
  Nothing else moves: positions are cache indices, so the bottom-right diagonal
  (``p_i = i + S_b - L`` in cache indices, ``i + (S_b - leftpad) - L`` counted from the
  first valid key), the window, ALiBi's ``|p_i - j|`` and the rotary positions are those
  of the same call without padding. Contiguous caches only.
* ``rotary_cos``/``rotary_sin`` (seqlen_ro, R/2) and ``rotary_interleaved`` (default True,
  as in FlashAttention): only with new keys; q and the new keys are rotated first
  (``spec.rotary``: keys at ``cache_seqlens[b] + i``, queries at ``cache_seqlens[b] + i``
  when causal or local, else all at ``cache_seqlens[b]``); the cache stores the rotated
  keys; values are never rotated.
* ``num_splits`` (int >= 0; 0 = FlashAttention's heuristic): a speed setting. The result
  does not depend on it: splitting the valid keys into chunks and combining the partial
  results with :func:`spec.merge_partials` is exact.

FP8 inputs (FlashAttention-3's ``q_descale``, ``k_descale``, ``v_descale``, :mod:`spec.fp8`):
q, the caches and the new keys and values hold 8-bit float values; each descale is None,
per tensor (a scalar or (1,)) or (B, K), one row per **sequence** b (the query's batch
index, also with ``cache_batch_idx``: FlashAttention-3 checks the descales against q's
batch size). Sequence b's keys, cached and appended alike, stand for ``stored ·
k_descale[b, g]`` (kv head g), its values likewise with ``v_descale``, its query head h
for ``stored · q_descale[b, h // (N // K)]``; the product is exact in float64, and
attention runs on those values (:func:`spec.fp8.dequantize` of the keys each sequence
attends). The caches after the call hold the **stored** values: the append copies the
new keys and values as given (no rounding, no descale). Rotary tables are not defined
with FP8 inputs (a rotated FP8 key is no longer an FP8 value the cache could store):
the call raises.

Cache layouts:

* contiguous: k_cache (B, S_cache, K, E), v_cache (B, S_cache, K, Ev); capacity S_cache;
* paged: k_cache (num_pages, page_size, K, E), v_cache (num_pages, page_size, K, Ev) and
  ``block_table`` int (B, max_pages): logical key t of sequence b lives in page
  ``block_table[b, t // page_size]``, slot ``t % page_size``; capacity max_pages·page_size.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import _checks
from . import _flash_checks as checks
from . import fp8
from .errors import fail
from .flash import flash_attention
from .rotary import apply_rotary, rotary_positions, rotary_table

__all__ = ["KVCacheResult", "gather_pages", "kvcache_attention"]

CACHE_FIX = "pass k_cache (B, S_cache, K, E), or pages (num_pages, page_size, K, E) with block_table"


class KVCacheResult(NamedTuple):
    """``output`` (B, L, N, Ev), ``lse`` (B, N, L), and the updated ``k_cache``/``v_cache``.

    The caches are float64 copies in the input's layout with the new keys and values
    written in (FlashAttention updates its caches in place; the spec never mutates input).
    """

    output: np.ndarray
    lse: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray


def _block_table(block_table: Any, num_pages: int) -> np.ndarray:
    table = np.asarray(block_table)
    if table.ndim != 2 or not np.issubdtype(table.dtype, np.integer):
        fail("block_table", table, "must be a 2-D int array (B, max_pages)",
             "pass one row of page indices per sequence")
    if table.size and (table.min() < 0 or table.max() >= num_pages):
        fail("block_table", table, f"every entry must name a page in [0, num_pages={num_pages})",
             "pad unused entries with any valid page index (e.g. 0), not -1")
    return table.astype(np.int64)


def gather_pages(cache: Any, block_table: Any) -> np.ndarray:
    """Paged cache (num_pages, page_size, K, X) -> contiguous (B, max_pages·page_size, K, X).

    Row t of sequence b is ``cache[block_table[b, t // page_size], t % page_size]``; the
    dtype is kept (pure re-indexing).
    """
    cache = np.asarray(cache)
    if cache.ndim != 4:
        fail("cache", cache, "must have rank 4: (num_pages, page_size, K, X)", CACHE_FIX)
    table = _block_table(block_table, cache.shape[0])
    B, max_pages = table.shape
    pages = cache[table]                                                 # (B, max_pages, page_size, K, X)
    return pages.reshape(B, max_pages * cache.shape[1], *cache.shape[2:])  # (B, max_pages·page_size, K, X)


def _seqlens(cache_seqlens: Any, batch: int, capacity: int, new: int) -> np.ndarray:
    if cache_seqlens is None:
        if new:
            fail("cache_seqlens", None, "must be given with new keys k/v (where would they go?)",
                 "pass cache_seqlens=int or one int per sequence")
        return np.full(batch, capacity)
    if checks.is_int(cache_seqlens):
        cache_seqlens = np.full(batch, int(cache_seqlens))
    lengths = checks.int_vector("cache_seqlens", cache_seqlens)
    if lengths.shape != (batch,):
        fail("cache_seqlens", lengths, f"must have one length per sequence, shape ({batch},)",
             "pass an int or a (B,) int array")
    if (lengths < 0).any() or (lengths + new > capacity).any():
        fail("cache_seqlens", lengths.tolist(), f"each length plus S_new={new} must lie in "
             f"[0, capacity={capacity}]", "allocate a larger cache (or more pages per sequence)")
    return lengths


def _check_new(k: Any, v: Any, batch: int, heads: int, dims: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    if (k is None) != (v is None):
        fail("k" if k is None else "v", None, "k and v must be given together",
             "pass both new keys and new values, or neither")
    if k is None:
        return np.zeros((batch, 0, heads, dims[0])), np.zeros((batch, 0, heads, dims[1]))
    k, v = _checks.as_float64("k", k), _checks.as_float64("v", v)
    if k.ndim != 4 or v.ndim != 4 or k.shape[:2] != v.shape[:2] or k.shape[0] != batch \
            or (k.shape[2], k.shape[3], v.shape[2], v.shape[3]) != (heads, dims[0], heads, dims[1]):
        fail("k", k, f"k and v must be (B, S_new, K, E) = ({batch}, S_new, {heads}, {dims[0]}) and "
             f"(B, S_new, K, Ev) = ({batch}, S_new, {heads}, {dims[1]}), got v {v.shape}",
             "give the new keys and values the cache's kv heads and head dims")
    return k, v


def _check_pages_disjoint(table: np.ndarray, page_size: int, lengths: np.ndarray, new: int) -> None:
    """No slot is written by two sequences, nor written by one while another reads it."""
    writer: dict[tuple[int, int], int] = {}
    for b in range(table.shape[0]):
        for t in range(lengths[b], lengths[b] + new):
            slot = (int(table[b, t // page_size]), t % page_size)
            if writer.setdefault(slot, b) != b:
                fail("block_table", table, f"sequences {writer[slot]} and {b} both write page "
                     f"{slot[0]} slot {slot[1]}", "give every sequence its own pages for new keys")
    for b in range(table.shape[0]):
        for t in range(lengths[b] + new):
            owner = writer.get((int(table[b, t // page_size]), t % page_size), b)
            if owner != b:
                fail("block_table", table, f"sequence {b} reads page {table[b, t // page_size]} "
                     f"slot {t % page_size} that sequence {owner} writes", "share only read-only pages")


def _batch_idx(cache_batch_idx: Any, batch: int, rows: int, appending: bool, paged: bool) -> np.ndarray | None:
    """The cache row of each sequence, checked; None: row b for sequence b."""
    if cache_batch_idx is None:
        return None
    if paged:
        fail("cache_batch_idx", cache_batch_idx, "cannot be combined with block_table (a paged cache)",
             "index the pages through block_table instead")
    idx = checks.int_vector("cache_batch_idx", cache_batch_idx)
    if idx.shape != (batch,):
        fail("cache_batch_idx", idx.tolist(), f"must have one cache row per sequence, shape ({batch},)",
             "pass a (B,) int array")
    if idx.size and (idx.min() < 0 or idx.max() >= rows):
        fail("cache_batch_idx", idx.tolist(), f"every entry must name a cache row in [0, {rows})",
             "allocate the cache with enough rows, or pass valid row indices")
    if appending and np.unique(idx).size != idx.size:
        fail("cache_batch_idx", idx.tolist(), "must be distinct when new keys k/v are appended (which "
             "sequence's write would win is left open)", "give every sequence its own cache row")
    return idx


def _leftpad(cache_leftpad: Any, lengths: np.ndarray, paged: bool) -> np.ndarray:
    """Each sequence's first valid cache index, checked (zeros when None)."""
    if cache_leftpad is None:
        return np.zeros_like(lengths)
    if paged:
        fail("cache_leftpad", cache_leftpad, "cannot be combined with block_table (a paged cache)",
             "leave the padding out of the pages, or use a contiguous cache")
    pad = checks.int_vector("cache_leftpad", cache_leftpad)
    if pad.shape != lengths.shape:
        fail("cache_leftpad", pad.tolist(), f"must have one entry per sequence, shape {lengths.shape}",
             "pass a (B,) int array")
    if (pad < 0).any() or (pad > lengths).any():
        fail("cache_leftpad", pad.tolist(), f"each entry must lie in [0, cache_seqlens[b]] = "
             f"[0, {lengths.tolist()}]", "pad at most the cache's valid keys")
    return pad


def _rotated(q: np.ndarray, k: np.ndarray, lengths: np.ndarray, rotary_cos: Any, rotary_sin: Any,
             interleaved: Any, causal: bool, window: Any) -> tuple[np.ndarray, np.ndarray]:
    """q (B, L, N, E) and the new keys k (B, S_new, K, E) rotated at their positions."""
    if (rotary_cos is None) != (rotary_sin is None):
        fail("rotary_sin" if rotary_sin is None else "rotary_cos", None,
             "rotary_cos and rotary_sin must be given together", "pass both tables, or neither")
    if rotary_cos is None:
        return q, k
    if k.shape[1] == 0:
        fail("rotary_cos", rotary_cos, "applies only with new keys k/v (FlashAttention rotates q and the "
             "appended keys)", "pass k and v, or rotate q and the cache yourself and leave rotary_cos=None")
    rotary_table(rotary_cos, rotary_sin, q.shape[-1])
    q_pos, k_pos = rotary_positions(lengths, q.shape[1], k.shape[1], causal=causal, window=window)
    return (apply_rotary(q, rotary_cos, rotary_sin, q_pos, interleaved=interleaved),
            apply_rotary(k, rotary_cos, rotary_sin, k_pos, interleaved=interleaved))


def _dequantized(q: np.ndarray, keys: np.ndarray, values: np.ndarray, q_descale: Any, k_descale: Any,
                 v_descale: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q (B, L, N, E) and each sequence's keys (B, S_cache, K, E) / values after the append,
    as the attention reads them: unchanged without descales, else ``stored · descale`` with
    row b for sequence b (:func:`spec.fp8.dequantize`, exact)."""
    if q_descale is None and k_descale is None and v_descale is None:
        return q, keys, values
    return fp8.dequantize(q, keys, values, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)


def kvcache_attention(query: Any, k_cache: Any, v_cache: Any, *, cache_seqlens: Any = None,
                      k: Any = None, v: Any = None, block_table: Any = None,
                      rotary_cos: Any = None, rotary_sin: Any = None, rotary_interleaved: bool = True,
                      cache_batch_idx: Any = None, cache_leftpad: Any = None, num_splits: int = 0,
                      causal: bool = False, window: tuple[int, int] = (-1, -1),
                      softcap: float = 0.0, alibi_slopes: Any = None, scale: float | None = None,
                      fully_masked: str = "zero", alignment: str = "lower_right", q_descale: Any = None,
                      k_descale: Any = None, v_descale: Any = None) -> KVCacheResult:
    """Decoding attention against a KV cache: per sequence, :func:`spec.flash_attention` on its valid keys.

    ``cache_seqlens``: int or (B,) ints, the valid keys before the append; None = the
    whole cache (only without k/v). ``k``/``v``: new keys/values appended first (both or
    neither). ``block_table``: paged layout (see the module docstring); every entry must
    name a page. ``rotary_cos``/``rotary_sin``/``rotary_interleaved``, ``cache_batch_idx``,
    ``cache_leftpad`` and ``num_splits``: the cache options of the module docstring.
    ``q_descale``/``k_descale``/``v_descale`` (None, per tensor or (B, K), row b for sequence
    b): FP8 inputs standing for ``stored · descale`` (module docstring); the caches returned
    hold the stored values. The other options are :func:`spec.flash_attention`'s. Returns :class:`KVCacheResult`
    ``(output (B, L, N, Ev), lse (B, N, L), k_cache, v_cache)``.
    """
    _checks.check_policy(fully_masked)
    checks.size("num_splits", num_splits)
    q = _checks.as_float64("query", query)
    k_cache, v_cache = _checks.as_float64("k_cache", k_cache), _checks.as_float64("v_cache", v_cache)
    for name, array in (("query", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if array.ndim != 4:
            fail(name, array, f"must have rank 4, got rank {array.ndim}", CACHE_FIX + ", and query (B, L, N, E)")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        fail("v_cache", v_cache, f"must share k_cache's first three dims {k_cache.shape[:3]}", CACHE_FIX)
    B = q.shape[0]
    paged = block_table is not None
    rows = _batch_idx(cache_batch_idx, B, k_cache.shape[0], k is not None, paged)
    if not paged:
        keys, values = k_cache, v_cache                                  # (B | B_cache, S_cache, K, E|Ev)
    else:
        keys, values = gather_pages(k_cache, block_table), gather_pages(v_cache, block_table)
    if rows is not None:
        keys, values = keys[rows], values[rows]                          # (B, S_cache, K, E|Ev)
    if keys.shape[0] != B:
        fail("block_table" if paged else "k_cache", keys,
             f"must hold B={B} sequences like query", "pass one cache row (or block-table row) per query "
             "sequence, or cache_batch_idx naming one row each")
    checks.head_layout(q, keys, values, 2, ("(B, L, N, E)", "(B, S_cache, K, E)", "(B, S_cache, K, Ev)"))
    K, E, Ev = keys.shape[2], keys.shape[3], values.shape[3]
    k, v = _check_new(k, v, B, K, (E, Ev))
    new = k.shape[1]
    lengths = _seqlens(cache_seqlens, B, keys.shape[1], new)
    starts = _leftpad(cache_leftpad, lengths, paged)
    slopes = checks.slopes_array(alibi_slopes, B, q.shape[2])            # (1 or B, N)
    if paged:
        _check_pages_disjoint(_block_table(block_table, k_cache.shape[0]), k_cache.shape[1], lengths, new)
    if rotary_cos is not None and not (q_descale is None and k_descale is None and v_descale is None):
        fail("rotary_cos", rotary_cos, "cannot be combined with FP8 descales (a rotated FP8 key is no FP8 "
             "value the cache could store)", "rotate q and the keys before quantising them, and pass "
             "rotary_cos=None")
    # 1. rotate q and the new keys at their positions (cache indices)
    q, k = _rotated(q, k, lengths, rotary_cos, rotary_sin, rotary_interleaved, checks.causal_flag(causal), window)
    # 2. append the new keys and values at each sequence's length
    keys, values = keys.copy(), values.copy()
    for b in range(B):
        keys[b, lengths[b]:lengths[b] + new] = k[b]                      # (S_new, K, E)
        values[b, lengths[b]:lengths[b] + new] = v[b]                    # (S_new, K, Ev)
    # 3. each sequence attends its keys cache_leftpad[b] .. cache_seqlens[b] + S_new - 1
    #    (FP8: the stored values times sequence b's descale rows, exact)
    q_att, keys_att, values_att = _dequantized(q, keys, values, q_descale, k_descale, v_descale)
    output, lse = np.zeros((*q.shape[:3], Ev)), np.zeros((B, q.shape[2], q.shape[1]))
    for b in range(B):
        valid = slice(starts[b], lengths[b] + new)
        result = flash_attention(
            q_att[b:b + 1], keys_att[b:b + 1, valid],                   # (1, L, N, E), (1, S_b - pad, K, E)
            values_att[b:b + 1, valid],                                   # (1, S_b - pad, K, Ev)
            causal=causal, window=window, softcap=softcap,
            alibi_slopes=None if slopes is None else slopes[b % slopes.shape[0]],
            scale=scale, return_lse=True, fully_masked=fully_masked, alignment=alignment)
        output[b], lse[b] = result.output[0], result.lse[0]
    # 4. the updated caches in the input's layout
    if not paged:
        if rows is None:
            return KVCacheResult(output, lse, keys, values)
        k_rows, v_rows = k_cache.copy(), v_cache.copy()
        k_rows[rows], v_rows[rows] = keys, values                        # rows no sequence names: untouched
        return KVCacheResult(output, lse, k_rows, v_rows)
    table, page_size = _block_table(block_table, k_cache.shape[0]), k_cache.shape[1]
    k_pages, v_pages = k_cache.copy(), v_cache.copy()
    for b in range(B):
        for t in range(lengths[b], lengths[b] + new):
            page, slot = table[b, t // page_size], t % page_size
            k_pages[page, slot], v_pages[page, slot] = keys[b, t], values[b, t]
    return KVCacheResult(output, lse, k_pages, v_pages)
