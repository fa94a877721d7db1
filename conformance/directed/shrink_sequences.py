"""The smaller cases a failing varlen or kvcache case is shrunk through
(``conformance.directed.shrink``): a varlen case in its sequences (each alone, then each
left out), heads, each sequence's query and key lengths, head dims and values; a kvcache
case in its sequences (every per-sequence array cut alike), heads, query length, new
keys, each sequence's valid cache length, the cache's room, head dims, page size, spare
cache rows and pages, and values. FP8 values stay as written."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from conformance.calls.kvcache import KVCacheCase
from conformance.calls.varlen import VarlenCase
from conformance.directed.shrink_sizes import (
    _head_dims,
    _heads,
    _quarters,
    _simple,
    _simple_arrays,
    _smaller,
    _through,
    _value_dims,
)

def _varlen_packed(case: VarlenCase, lengths: list[tuple[int, int]], keep: list[int]) -> VarlenCase:
    """``case`` with the sequences ``keep`` only, sequence b cut to its first ``lengths[b]``
    queries and keys (per-sequence ALiBi slopes and FP8 descales cut alike)."""
    rows, keys = case.sequences(), lengths
    q_rows = [np.arange(rows[b][0].start, rows[b][0].start + keys[b][0]) for b in keep]
    k_rows = [np.arange(rows[b][1].start, rows[b][1].start + keys[b][1]) for b in keep]
    q_index = np.concatenate(q_rows) if q_rows else np.zeros(0, dtype=int)
    k_index = np.concatenate(k_rows) if k_rows else np.zeros(0, dtype=int)
    changes: dict[str, Any] = {
        "query": np.ascontiguousarray(case.query[q_index]), "key": np.ascontiguousarray(case.key[k_index]),
        "value": np.ascontiguousarray(case.value[k_index]),
        "cu_seqlens_q": tuple(int(x) for x in np.cumsum([0] + [keys[b][0] for b in keep])),
        "cu_seqlens_k": tuple(int(x) for x in np.cumsum([0] + [keys[b][1] for b in keep]))}
    if case.alibi_slopes is not None and np.ndim(case.alibi_slopes) == 2:
        changes["alibi_slopes"] = np.ascontiguousarray(case.alibi_slopes[keep])
    for name in ("q_descale", "k_descale", "v_descale"):
        d = getattr(case, name)
        if d is not None and np.ndim(d) == 2 and d.shape[0] == case.B:
            changes[name] = np.ascontiguousarray(d[keep])
    return case.replace(**changes)


def _varlen_sequences(case: VarlenCase) -> Iterator[VarlenCase]:
    """Fewer sequences: each one alone, then each left out (fewest first)."""
    lengths, B = case.lengths(), case.B
    if B == 1:
        return
    for b in range(B):
        yield _varlen_packed(case, lengths, [b])
    if B > 2:
        for b in range(B):
            yield _varlen_packed(case, lengths, [i for i in range(B) if i != b])


def _varlen_lengths(axis: int) -> Callable[[VarlenCase], Iterator[VarlenCase]]:
    """Shorter sequences: each sequence's queries (axis 0) or keys (axis 1) cut, smallest
    first (0 included: the strategy draws empty sequences)."""
    def changes(case: VarlenCase) -> Iterator[VarlenCase]:
        lengths = case.lengths()
        for b, pair in enumerate(lengths):
            for n in _smaller(pair[axis], low=0 if pair[axis] else 1):
                cut = list(lengths)
                cut[b] = (n, pair[1]) if axis == 0 else (pair[0], n)
                yield _varlen_packed(case, cut, list(range(case.B)))
    return changes


def _varlen_resized(case: VarlenCase, **sizes: int) -> VarlenCase:
    """``case`` with fewer heads or smaller head dims (slopes and descales cut alike)."""
    N, K = sizes.get("N", case.N), sizes.get("K", case.K)
    E, Ev = sizes.get("E", case.E), sizes.get("Ev", case.Ev)
    changes: dict[str, Any] = {"query": np.ascontiguousarray(case.query[:, :N, :E]),
                               "key": np.ascontiguousarray(case.key[:, :K, :E]),
                               "value": np.ascontiguousarray(case.value[:, :K, :Ev])}
    slopes = case.alibi_slopes
    if slopes is not None:
        changes["alibi_slopes"] = np.ascontiguousarray(slopes[:N] if np.ndim(slopes) == 1 else slopes[:, :N])
    for name in ("q_descale", "k_descale", "v_descale"):
        d = getattr(case, name)
        if d is not None and np.ndim(d) == 2:
            changes[name] = np.ascontiguousarray(d[:, :K])
    return case.replace(**changes)


def _varlen_values(case: VarlenCase) -> Iterator[VarlenCase]:
    if case.fp8 is not None or _simple(case):  # FP8 values are the format's own
        return
    for steps in (1, 2, 4):
        yield case.replace(query=_quarters(case.query, steps), key=_quarters(case.key, steps),
                           value=_quarters(case.value, steps))


def varlen_passes() -> list[Callable[[VarlenCase], Iterator[VarlenCase]]]:
    def by(changes: Callable[[Any], Iterator[dict[str, int]]]) -> Callable[[VarlenCase], Iterator[VarlenCase]]:
        return _through(_varlen_resized, changes, lambda c: (c.key, c.value))

    return [_varlen_sequences, by(_heads), _varlen_lengths(0), _varlen_lengths(1), by(_head_dims), by(_value_dims),
            _varlen_values]


def _kvcache_pages(case: KVCacheCase) -> tuple[list[list[int]], list[int]]:
    """Each sequence's physical pages, in logical order, and the spare pages (those no
    sequence's block table names), as ``page_order`` lists them."""
    pages = case.S_cache // case.page_size
    order = [int(p) for p in case.page_order]
    return [order[b * pages:(b + 1) * pages] for b in range(case.B)], order[case.B * pages:]


def _kvcache_order(used: list[list[int]], spare: list[int]) -> tuple[int, ...]:
    """The page order of ``used`` (each sequence's pages) then ``spare``, the pages
    renumbered 0, 1, ... in their old order (a reversed or shuffled table stays so)."""
    pages = [p for row in used for p in row] + spare
    rank = {p: i for i, p in enumerate(sorted(pages))}
    return tuple(rank[p] for p in pages)


def _kvcache_resized(case: KVCacheCase, keep: list[int] | None = None, *, rows: list[int] | None = None,
                     spare_pages: list[int] | None = None, **sizes: Any) -> KVCacheCase | None:
    """``case`` with the sequences ``keep`` only (row b of every per-sequence array:
    cache_seqlens, cache_batch_idx, cache_leftpad, the new keys, (B, N) slopes, (B, K)
    descales, the block table) and smaller sizes: N, K, L, S_new, E, Ev, the cache
    capacity and the kept sequences' ``seqlens``. The capacity keeps the strategy's room
    (the valid rows plus at most 3, whole pages); with ``cache_batch_idx`` the cache keeps
    the rows ``rows`` (default: the kept sequences' rows and at most two others), the
    indices renumbered; paged, the kept sequences' first pages and the spare pages
    ``spare_pages`` (default: as written), renumbered in their order; rotary tables keep
    the rotary dim where E does (else the widest even one) and the rows the positions
    need, plus one. None where no such case exists."""
    keep = list(range(case.B)) if keep is None else keep
    N, K = sizes.get("N", case.N), sizes.get("K", case.K)
    E, Ev = sizes.get("E", case.E), sizes.get("Ev", case.Ev)
    L, new = sizes.get("L", case.L), sizes.get("S_new", case.S_new)
    seqlens = tuple(sizes.get("seqlens", [case.cache_seqlens[b] for b in keep]))
    need = max(seqlens) + new
    capacity = sizes.get("capacity", case.S_cache)
    if case.paged:
        size = case.page_size
        capacity = min(capacity, max(1, -(-(need + 3) // size)) * size)
        if capacity < max(need, size) or capacity % size:
            return None
    else:
        capacity = min(capacity, need + 3)
        if capacity < need:
            return None
    changes: dict[str, Any] = {"query": np.ascontiguousarray(case.query[keep, :L, :N, :E]),
                               "cache_seqlens": tuple(int(n) for n in seqlens)}
    if case.cache_batch_idx is None:
        cache_rows = keep
    else:
        named = [int(case.cache_batch_idx[b]) for b in keep]
        if rows is None:
            rows = sorted(named + [r for r in range(case.k_cache.shape[0]) if r not in named][:2])
        cache_rows = sorted(rows)
        changes["cache_batch_idx"] = tuple(cache_rows.index(r) for r in named)
    changes["k_cache"] = np.ascontiguousarray(case.k_cache[cache_rows, :capacity, :K, :E])
    changes["v_cache"] = np.ascontiguousarray(case.v_cache[cache_rows, :capacity, :K, :Ev])
    if case.paged:
        used, spare = _kvcache_pages(case)
        pages = capacity // case.page_size
        changes["page_order"] = _kvcache_order([used[b][:pages] for b in keep],
                                               spare if spare_pages is None else spare_pages)
    for name, dim in (("k_new", E), ("v_new", Ev)):
        changes[name] = None if not new else np.ascontiguousarray(getattr(case, name)[keep, :new, :K, :dim])
    if case.cache_leftpad is not None:
        changes["cache_leftpad"] = tuple(int(case.cache_leftpad[b]) for b in keep)
    slopes = case.alibi_slopes
    if slopes is not None:
        changes["alibi_slopes"] = np.ascontiguousarray(slopes[:N] if np.ndim(slopes) == 1 else slopes[keep, :N])
    for name in ("q_descale", "k_descale", "v_descale"):
        d = getattr(case, name)
        if d is not None and np.ndim(d) == 2:
            changes[name] = np.ascontiguousarray(d[keep, :K])
    if case.rotary_cos is not None:
        R = 2 * int(np.shape(case.rotary_cos)[1])
        R = R if R <= E else E - E % 2
        if not R:
            return None
        positions = max(capacity, max(seqlens) + max(L, new)) + 1
        changes["rotary_cos"] = np.ascontiguousarray(case.rotary_cos[:positions, :R // 2])
        changes["rotary_sin"] = np.ascontiguousarray(case.rotary_sin[:positions, :R // 2])
    return case.replace(**changes)


def _kvcache_sequences(case: KVCacheCase) -> Iterator[KVCacheCase | None]:
    """Fewer sequences: each one alone, then each left out (fewest first)."""
    B = case.B
    if B == 1:
        return
    for b in range(B):
        yield _kvcache_resized(case, [b])
    if B > 2:
        for b in range(B):
            yield _kvcache_resized(case, [i for i in range(B) if i != b])


def _kvcache_size(name: str, low: int = 1) -> Callable[[KVCacheCase], Iterator[KVCacheCase | None]]:
    """A smaller ``name`` (L, or S_new down to no new keys), smallest first."""
    def changes(case: KVCacheCase) -> Iterator[KVCacheCase | None]:
        for v in _smaller(getattr(case, name), low=low):
            yield _kvcache_resized(case, **{name: v})
    return changes


def _kvcache_seqlens(case: KVCacheCase) -> Iterator[KVCacheCase | None]:
    """Shorter valid caches: each sequence's cache_seqlens cut, smallest first (to 0, or
    to its left pad: a pad never passes the valid rows)."""
    seqlens = list(case.cache_seqlens)
    for b, n in enumerate(seqlens):
        low = 0 if case.cache_leftpad is None else int(case.cache_leftpad[b])
        for v in _smaller(n, low=low):
            yield _kvcache_resized(case, seqlens=[*seqlens[:b], v, *seqlens[b + 1:]])


def _kvcache_capacity(case: KVCacheCase) -> Iterator[KVCacheCase | None]:
    """A smaller cache: less room past the valid rows (whole pages when paged)."""
    need = max(case.cache_seqlens) + case.S_new
    if not case.paged:
        for v in _smaller(case.S_cache, low=need):
            yield _kvcache_resized(case, capacity=v)
        return
    size = case.page_size
    for pages in _smaller(case.S_cache // size, low=max(1, -(-need // size))):
        yield _kvcache_resized(case, capacity=pages * size)


def _kvcache_page_size(case: KVCacheCase) -> Iterator[KVCacheCase | None]:
    """Smaller pages dividing the page size: each page split in order, a spare page's
    first part kept as the spare."""
    if not case.paged:
        return
    used, spare = _kvcache_pages(case)
    for size in _smaller(case.page_size):
        if case.page_size % size:
            continue
        parts = case.page_size // size
        split = [[p * parts + i for p in row for i in range(parts)] for row in used]
        yield _kvcache_resized(case.replace(page_size=size,
                                            page_order=_kvcache_order(split, [p * parts for p in spare])))


def _kvcache_spare(case: KVCacheCase) -> Iterator[KVCacheCase | None]:
    """Fewer spare cache rows (rows no sequence's cache_batch_idx names) or spare pages."""
    if case.cache_batch_idx is not None:
        named = [int(r) for r in case.cache_batch_idx]
        rows = range(case.k_cache.shape[0])
        for r in (r for r in rows if r not in named):
            yield _kvcache_resized(case, rows=[x for x in rows if x != r])
    if case.paged:
        _, spare = _kvcache_pages(case)
        for p in spare:
            yield _kvcache_resized(case, spare_pages=[x for x in spare if x != p])


def _kvcache_values(case: KVCacheCase) -> Iterator[KVCacheCase]:
    names = ("query", "k_cache", "v_cache", "k_new", "v_new")
    if case.fp8 is not None or _simple_arrays([getattr(case, n) for n in names if getattr(case, n) is not None]):
        return  # FP8 values are the format's own
    for steps in (1, 2, 4):
        yield case.replace(**{n: None if getattr(case, n) is None else _quarters(getattr(case, n), steps)
                              for n in names})


def kvcache_passes() -> list[Callable[[KVCacheCase], Iterator[KVCacheCase | None]]]:
    def by(changes: Callable[[Any], Iterator[dict[str, int]]]) -> Callable[[KVCacheCase], Iterator[KVCacheCase | None]]:
        return _through(_kvcache_resized, changes, lambda c: (c.k_cache, c.v_cache))

    heads, dims = by(_heads), by(_head_dims)

    def value_dims(c: KVCacheCase) -> Iterator[KVCacheCase | None]:
        # Ev alone, equal to E or not (a rotary bug holds E where the values need not)
        return (_kvcache_resized(c, Ev=v) for v in _smaller(c.Ev))

    return [_kvcache_sequences, heads, _kvcache_size("L"), _kvcache_size("S_new", low=0), _kvcache_seqlens,
            _kvcache_capacity, dims, value_dims, _kvcache_page_size, _kvcache_spare, _kvcache_values]
