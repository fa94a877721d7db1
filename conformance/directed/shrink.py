"""Shrinking a failing directed case: a smaller failing case of the same property and
target, searched for on a budget counted in examples.

A directed example (``conformance.directed.examples``) is the smallest case of its bug
class as written for every implementation, not for the one that fails: ``gqa_tile`` fails
the grouped-query example (``B=1 N=4 K=2 L=2 S=3 E=4``, values near 1e-31) as surely with
``L = S = E = 1`` and values of a quarter. After a directed case fails, the runner
(``conformance.harness.runner``) hands it here: :func:`passes` propose smaller cases,
simplest change first (each size towards 1, smallest first, then the values set to the
normal regime and rounded to halves or quarters, exact in every dtype and printed in a
few digits), and :func:`shrink` keeps each pass's first proposal that still fails the same
way, sweeping the passes again while one of them found a smaller case (a shorter key
axis can let the queries shrink), until a sweep finds none or :data:`BUDGET` examples
were checked.

A proposal is checked only when the property's own strategy could have drawn it
(``directed.admission.admitted``, with the arguments the property built its directed
cases with: :func:`remember_arguments`), so a shrunk case is never one the implementation
does not claim. SDPA, flash, varlen and MHA cases are shrunk (an MHA case in its batch,
heads and head dim, its module's weights cut with them, its lengths, a self-attention one
with L = S, and its inputs' values; a flash case in its sizes and q, k, v values, its features as written: causal, window,
softcap, ALiBi and sink values cut to the heads kept, FP8 descales to the batch and kv heads
kept; a varlen case in its sequences (each alone, then each left out), heads, each
sequence's query and key lengths, head dims and values, per-sequence slopes and descales
cut alike, FP8 values as written; a kvcache case in its sequences (every per-sequence
array cut alike: cache_seqlens, cache_batch_idx, cache_leftpad, new keys, slopes, descales,
block table), heads, query length, new keys, each sequence's valid cache length, the
cache's room (whole pages when paged), head dims, page size, spare cache rows and pages,
and values, FP8 values as written); a sharded case in its sequence, world size (where a
group of another size starts cheaply: ranks forked on the CPU; else as written), window
sides, batch, heads, head dims and values (layout, causal flag and scale as written).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from conformance.calls.flash_cases import FlashCase
from conformance.calls.kvcache import KVCacheCase
from conformance.calls.varlen import VarlenCase
from conformance.core.cases import MHACase, SDPACase
from conformance.sharded import forkserver
from conformance.sharded.cases import ShardedCase
from spec import sharding

__all__ = ["BUDGET", "remember_arguments", "arguments_of", "passes", "shrink"]

#: Most examples checked while shrinking one failing directed case (the proposals the
#: property's strategy could not draw are not checked, and not counted).
BUDGET = 24

#: The property's ``sdpa_cases`` arguments each directed case was built with.
_ARGUMENTS: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def remember_arguments(cases: list[Any], arguments: dict[str, Any]) -> list[Any]:
    """Note ``arguments`` (a property's strategy arguments) on each of ``cases``."""
    for case in cases:
        try:
            _ARGUMENTS[case] = dict(arguments)
        except TypeError:  # not weakly referenceable: shrunk without the property's arguments
            pass
    return cases


def arguments_of(case: Any) -> dict[str, Any] | None:
    """The strategy arguments ``case`` was built with (None: unknown)."""
    try:
        return _ARGUMENTS.get(case)
    except TypeError:
        return None


def _smaller(value: int, low: int = 1) -> list[int]:
    """Smaller sizes to try for ``value``, smallest first."""
    return sorted({v for v in (low, value // 2, value - 1) if low <= v < value})


def _cut(mask: np.ndarray | None, shape: tuple[int, int, int, int]) -> np.ndarray | None:
    """``mask`` (broadcastable to (B, N, L, S)) cut to a smaller ``shape``."""
    if mask is None:
        return None
    index = tuple(slice(None) if size == 1 else slice(0, shape[axis - mask.ndim + 4])
                  for axis, size in enumerate(mask.shape))
    return np.ascontiguousarray(mask[index])


def _resized(case: SDPACase, **sizes: int) -> SDPACase:
    s = {**case.sizes(), **sizes}
    B, N, K, L, S, E, Ev = (s[d] for d in ("B", "N", "K", "L", "S", "E", "Ev"))
    shared = case.value is case.key
    key = np.ascontiguousarray(case.key[:B, :K, :S, :E])
    return case.replace(
        query=np.ascontiguousarray(case.query[:B, :N, :L, :E]),
        key=key,
        value=key if shared else np.ascontiguousarray(case.value[:B, :K, :S, :Ev]),
        attend_mask=_cut(case.attend_mask, (B, N, L, S)),
        additive_mask=_cut(case.additive_mask, (B, N, L, S)),
        sinks=None if case.sinks is None else np.ascontiguousarray(case.sinks[:N]),
    )


def _heads(case: SDPACase) -> Iterator[dict[str, int]]:
    s = case.sizes()
    group = s["N"] // s["K"]
    pairs = {(g * k, k) for k in [*_smaller(s["K"]), s["K"]] for g in [*_smaller(group), group]}
    for n, k in sorted(pairs - {(s["N"], s["K"])}):
        yield {"N": n, "K": k}


def _dim(name: str) -> Callable[[SDPACase], Iterator[dict[str, int]]]:
    def changes(case: SDPACase) -> Iterator[dict[str, int]]:
        for v in _smaller(case.sizes()[name]):
            yield {name: v}
    return changes


def _head_dims(case: SDPACase) -> Iterator[dict[str, int]]:
    """E (with Ev where they are equal or the value is the key)."""
    s = case.sizes()
    together = case.value is case.key or s["E"] == s["Ev"]
    for v in _smaller(s["E"]):
        yield {"E": v, "Ev": v} if together else {"E": v}


def _value_dims(case: SDPACase) -> Iterator[dict[str, int]]:
    """Ev, where it differs from E (a pass of its own: E shrinking first must not stop it)."""
    s = case.sizes()
    if case.value is not case.key and s["E"] != s["Ev"]:
        for v in _smaller(s["Ev"]):
            yield {"Ev": v}


#: The passes over the sizes, in order: each tries its smaller sizes, smallest first.
_SIZE_PASSES: tuple[Callable[[SDPACase], Iterator[dict[str, int]]], ...] = (
    _dim("B"), _heads, _dim("L"), _dim("S"), _head_dims, _value_dims)


def _quarters(a: np.ndarray, steps: int) -> np.ndarray:
    """``a`` scaled to at most 2 in magnitude and rounded to multiples of 1/``steps``
    (exact in every dtype the suite draws, float8 included)."""
    a = np.asarray(a, dtype=np.float64)
    finite = np.isfinite(a)
    top = float(np.abs(a[finite]).max()) if finite.any() else 0.0
    if top == 0.0:
        return a.copy()
    out = a.copy()
    out[finite] = np.round(a[finite] / top * 2 * steps) / steps
    return out + 0.0  # no negative zeros in the reproducer


def _value_changes(case: SDPACase) -> Iterator[SDPACase]:
    for steps in (1, 2, 4):
        key = _quarters(case.key, steps)
        yield case.replace(query=_quarters(case.query, steps), key=key,
                           value=key if case.value is case.key else _quarters(case.value, steps),
                           regime="normal")


def _flash_resized(case: FlashCase, **sizes: int) -> FlashCase:
    """``case`` cut to smaller sizes, its options cut alike (ALiBi slopes and sinks to the
    heads kept, per-head FP8 descales to the batch and kv heads kept)."""
    s = {**case.sizes(), **sizes}
    B, N, K, L, S, E, Ev = (s[d] for d in ("B", "N", "K", "L", "S", "E", "Ev"))
    shared = case.value is case.key
    key = np.ascontiguousarray(case.key[:B, :S, :K, :E])
    changes: dict[str, Any] = {
        "query": np.ascontiguousarray(case.query[:B, :L, :N, :E]), "key": key,
        "value": key if shared else np.ascontiguousarray(case.value[:B, :S, :K, :Ev])}
    if case.alibi_slopes is not None:
        slopes = case.alibi_slopes
        changes["alibi_slopes"] = np.ascontiguousarray(slopes[:N] if slopes.ndim == 1 else slopes[:B, :N])
    if case.sinks is not None:
        changes["sinks"] = np.ascontiguousarray(case.sinks[:N])
    for name in ("q_descale", "k_descale", "v_descale"):
        d = getattr(case, name)
        if d is not None and d.shape != (1,):
            changes[name] = np.ascontiguousarray(d[:B, :K])
    return case.replace(**changes)


def _mha_resized(case: MHACase, B: int, L: int, S: int) -> MHACase:
    """``case`` cut to batch ``B`` and lengths ``L``, ``S`` (a self-attention case stays one;
    masks cut alike: key padding (B, S), attn_mask (L, S) or (B*N, L, S) batch-major)."""
    self_attention = case.self_attention

    def cut(x: np.ndarray, length: int) -> np.ndarray:
        if case.unbatched:
            return np.ascontiguousarray(x[:length])
        return np.ascontiguousarray(x[:B, :length] if case.batch_first else x[:length, :B])

    query = cut(case.query, L)
    key = query if self_attention else cut(case.key, S)
    value = query if self_attention else key if case.value is case.key else cut(case.value, S)
    padding = case.key_padding_mask
    if padding is not None:
        padding = np.ascontiguousarray(padding[..., :S] if padding.ndim == 1 else padding[:B, :S])
    attn = case.attn_mask
    if attn is not None:
        attn = np.ascontiguousarray(attn[:L, :S] if attn.ndim == 2 else attn[:B * case.N, :L, :S])
    return case.replace(query=query, key=key, value=value, key_padding_mask=padding, attn_mask=attn)


def _mha_heads(case: MHACase, N: int, E: int) -> MHACase | None:
    """``case`` with ``N`` heads of head dim ``E`` (embed_dim N·E): the module's weights cut
    to the first N heads' first E rows of each projection and the first N·E input and
    output features, inputs of embed_dim wide cut alike (kdim/vdim kept), a per-head
    attn_mask to the heads kept. None where a kdim/vdim module would become a packed one."""
    p, D, E0 = case.params, case.D, case.D // case.N
    D1 = N * E
    rows = np.array([h * E0 + e for h in range(N) for e in range(E)], dtype=int)
    packed = p.packed
    kdim, vdim = (D1, D1) if packed else (p.kdim, p.vdim)
    if not packed and kdim == D1 and vdim == D1:
        return None

    def cut(a: np.ndarray | None, index: Any) -> np.ndarray | None:
        return None if a is None else np.ascontiguousarray(a[index])

    three = np.concatenate([rows, D + rows, 2 * D + rows])
    params = dataclasses.replace(
        p, embed_dim=D1, num_heads=N, kdim=kdim, vdim=vdim,
        out_proj_weight=cut(p.out_proj_weight, np.ix_(np.arange(D1), rows)),
        out_proj_bias=cut(p.out_proj_bias, np.arange(D1)),
        in_proj_weight=cut(p.in_proj_weight, np.ix_(three, np.arange(D1))) if packed else None,
        in_proj_bias=cut(p.in_proj_bias, three),
        q_proj_weight=None if packed else cut(p.q_proj_weight, np.ix_(rows, np.arange(D1))),
        k_proj_weight=None if packed else cut(p.k_proj_weight, rows),
        v_proj_weight=None if packed else cut(p.v_proj_weight, rows),
        bias_k=cut(p.bias_k, (..., rows)), bias_v=cut(p.bias_v, (..., rows)))
    query = np.ascontiguousarray(case.query[..., :D1])
    if case.self_attention:
        key = value = query
    else:
        key = np.ascontiguousarray(case.key[..., :D1]) if packed else case.key
        value = key if case.value is case.key else (np.ascontiguousarray(case.value[..., :D1]) if packed
                                                    else case.value)
    attn = case.attn_mask
    if attn is not None and attn.ndim == 3:  # (B*N, L, S), batch-major
        attn = np.ascontiguousarray(attn[[b * case.N + h for b in range(case.B) for h in range(N)]])
    return case.replace(params=params, query=query, key=key, value=value, attn_mask=attn)


def _mha_sizes(case: MHACase) -> Iterator[Callable[[MHACase], Iterator[MHACase]]]:
    """The size passes of an MHA case: the batch, the heads, the head dim, then the
    lengths (together for self-attention, whose keys are its queries)."""
    self_attention = case.self_attention
    if not case.unbatched:
        yield lambda c: (_mha_resized(c, b, c.L, c.S) for b in _smaller(c.B))
    yield lambda c: (x for n in _smaller(c.N) if (x := _mha_heads(c, n, c.D // c.N)) is not None)
    yield lambda c: (x for e in _smaller(c.D // c.N) if (x := _mha_heads(c, c.N, e)) is not None)
    if self_attention:
        yield lambda c: (_mha_resized(c, c.B, n, n) for n in _smaller(c.L))
    else:
        yield lambda c: (_mha_resized(c, c.B, n, c.S) for n in _smaller(c.L))
        yield lambda c: (_mha_resized(c, c.B, c.L, n) for n in _smaller(c.S))


def _mha_values(case: MHACase) -> Iterator[MHACase]:
    if _simple(case):
        return
    self_attention = case.self_attention
    for steps in (1, 2, 4):
        query = _quarters(case.query, steps)
        key = query if self_attention else _quarters(case.key, steps)
        yield case.replace(query=query, key=key, value=query if self_attention else key if case.value is case.key
                           else _quarters(case.value, steps))


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


class _VarlenSized:
    """A varlen case seen through ``sizes()`` (for the head passes shared with SDPA)."""

    def __init__(self, case: VarlenCase) -> None:
        self.case, self.value, self.key = case, case.value, case.key

    def sizes(self) -> dict[str, int]:
        return {"N": self.case.N, "K": self.case.K, "E": self.case.E, "Ev": self.case.Ev}


def _varlen_values(case: VarlenCase) -> Iterator[VarlenCase]:
    if case.fp8 is not None or _simple(case):  # FP8 values are the format's own
        return
    for steps in (1, 2, 4):
        yield case.replace(query=_quarters(case.query, steps), key=_quarters(case.key, steps),
                           value=_quarters(case.value, steps))


def _varlen_passes() -> list[Callable[[VarlenCase], Iterator[VarlenCase]]]:
    def heads(c: VarlenCase) -> Iterator[VarlenCase]:
        return (_varlen_resized(c, **change) for change in _heads(_VarlenSized(c)))

    def dims(c: VarlenCase) -> Iterator[VarlenCase]:
        return (_varlen_resized(c, **change) for change in _head_dims(_VarlenSized(c)))

    def value_dims(c: VarlenCase) -> Iterator[VarlenCase]:
        return (_varlen_resized(c, **change) for change in _value_dims(_VarlenSized(c)))

    return [_varlen_sequences, heads, _varlen_lengths(0), _varlen_lengths(1), dims, value_dims, _varlen_values]


class _KVCacheSized:
    """A kvcache case seen through ``sizes()`` (for the head passes shared with SDPA)."""

    def __init__(self, case: KVCacheCase) -> None:
        self.case, self.value, self.key = case, case.v_cache, case.k_cache

    def sizes(self) -> dict[str, int]:
        return {"N": self.case.N, "K": self.case.K, "E": self.case.E, "Ev": self.case.Ev}


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


def _kvcache_passes() -> list[Callable[[KVCacheCase], Iterator[KVCacheCase | None]]]:
    def heads(c: KVCacheCase) -> Iterator[KVCacheCase | None]:
        return (_kvcache_resized(c, **change) for change in _heads(_KVCacheSized(c)))

    def dims(c: KVCacheCase) -> Iterator[KVCacheCase | None]:
        return (_kvcache_resized(c, **change) for change in _head_dims(_KVCacheSized(c)))

    def value_dims(c: KVCacheCase) -> Iterator[KVCacheCase | None]:
        # Ev alone, equal to E or not (a rotary bug holds E where the values need not)
        return (_kvcache_resized(c, Ev=v) for v in _smaller(c.Ev))

    return [_kvcache_sequences, heads, _kvcache_size("L"), _kvcache_size("S_new", low=0), _kvcache_seqlens,
            _kvcache_capacity, dims, value_dims, _kvcache_page_size, _kvcache_spare, _kvcache_values]


#: The lengths a sharded case may have at a world size and layout: 1..3 units of the
#: layout's divisor (``sharding.divisor``), the strategy's draw (fewer with padding).
_SHARD_UNITS = 3


def _sharded_resized(case: ShardedCase, **sizes: int) -> ShardedCase:
    """``case`` with a smaller world size, sequence (its first ``L`` positions), batch,
    heads or head dims; a window side longer than the sequence cut to its length (the
    same window: a side of L - 1 or more reaches every key)."""
    s = {"world_size": case.world_size, "B": case.B, "N": case.N, "K": case.K, "L": case.L, "E": case.E,
         "Ev": case.Ev, **sizes}
    B, N, K, L, E, Ev = (s[d] for d in ("B", "N", "K", "L", "E", "Ev"))
    window = tuple(side if side <= L else L for side in case.window)
    return case.replace(query=np.ascontiguousarray(case.query[:B, :N, :L, :E]),
                        key=np.ascontiguousarray(case.key[:B, :K, :L, :E]),
                        value=np.ascontiguousarray(case.value[:B, :K, :L, :Ev]),
                        world_size=s["world_size"], window=window)


def _sharded_world(case: ShardedCase) -> Iterator[ShardedCase]:
    """Fewer ranks, fewest first, the sequence cut to the most positions the strategy
    draws at that world size (and to a multiple of its divisor, for a target without
    padding). Only where a group of another world size starts cheaply: on the CPU its
    ranks are forked from the run's fork server (``conformance.sharded.forkserver``); a
    CUDA group spawns a process per rank and initialises NCCL, so there the world size is
    kept as written."""
    if not forkserver.available(case.device):
        return
    for W in _smaller(case.world_size):
        d = sharding.divisor(case.layout, W)
        L = min(case.L, _SHARD_UNITS * d)
        yield _sharded_resized(case, world_size=W, L=L)
        if L % d and L > d:
            yield _sharded_resized(case, world_size=W, L=L - L % d)


def _sharded_window(case: ShardedCase) -> Iterator[ShardedCase]:
    """A narrower window: each bounded side shorter, towards 0 (still a window: the
    directed case's feature; an unbounded side stays so)."""
    for i, side in enumerate(case.window):
        for v in _smaller(side, low=0) if side > 0 else ():
            window = list(case.window)
            window[i] = v
            yield case.replace(window=tuple(window))


class _ShardedSized:
    """A sharded case seen through ``sizes()`` (for the head passes shared with SDPA)."""

    def __init__(self, case: ShardedCase) -> None:
        self.case, self.value, self.key = case, case.value, case.key

    def sizes(self) -> dict[str, int]:
        return {"N": self.case.N, "K": self.case.K, "E": self.case.E, "Ev": self.case.Ev}


def _sharded_values(case: ShardedCase) -> Iterator[ShardedCase]:
    if _simple_arrays([case.query, case.key, case.value]):
        return
    for steps in (1, 2, 4):
        yield case.replace(query=_quarters(case.query, steps), key=_quarters(case.key, steps),
                           value=_quarters(case.value, steps), regime="normal")


def _sharded_passes() -> list[Callable[[ShardedCase], Iterator[ShardedCase]]]:
    def size(name: str) -> Callable[[ShardedCase], Iterator[ShardedCase]]:
        return lambda c: (_sharded_resized(c, **{name: v}) for v in _smaller(getattr(c, name)))

    def heads(c: ShardedCase) -> Iterator[ShardedCase]:
        return (_sharded_resized(c, **change) for change in _heads(_ShardedSized(c)))

    def dims(c: ShardedCase) -> Iterator[ShardedCase]:
        return (_sharded_resized(c, **change) for change in _head_dims(_ShardedSized(c)))

    def value_dims(c: ShardedCase) -> Iterator[ShardedCase]:
        return (_sharded_resized(c, **change) for change in _value_dims(_ShardedSized(c)))

    return [size("L"), _sharded_world, _sharded_window, size("B"), heads, dims, value_dims, _sharded_values]


def passes(case: Any) -> list[Callable[[Any], Iterator[Any]]]:
    """The shrinking passes of ``case``, simplest change first, each a function of the
    current smallest case giving its proposals (none for a case of a level other than SDPA,
    MHA, flash, varlen, kvcache and sharded)."""
    if isinstance(case, MHACase):
        return [*_mha_sizes(case), _mha_values]
    if isinstance(case, VarlenCase):
        return _varlen_passes()
    if isinstance(case, KVCacheCase):
        return _kvcache_passes()
    if isinstance(case, ShardedCase):
        return _sharded_passes()
    if not isinstance(case, (SDPACase, FlashCase)):
        return []
    resized = _flash_resized if isinstance(case, FlashCase) else _resized
    sizes = [lambda c, p=p: (resized(c, **change) for change in p(c)) for p in _SIZE_PASSES]
    return [*sizes, lambda c: _value_changes(c) if c.regime != "normal" or not _simple(c) else iter(())]


def _simple(case: SDPACase | MHACase) -> bool:
    """Whether every value is already a multiple of a quarter within [-2, 2]."""
    return _simple_arrays([case.query, case.key, case.value])


def _simple_arrays(arrays: list[np.ndarray]) -> bool:
    """Whether every value of ``arrays`` is a multiple of a quarter within [-2, 2]."""
    arrays = [np.asarray(a, dtype=np.float64) for a in arrays]
    return all(np.all(np.abs(a) <= 2) and np.all(a * 4 == np.round(a * 4)) for a in arrays)


def shrink(case: Any, fails: Callable[[Any], bool], *, admit: Callable[[Any], bool] | None = None,
           budget: int = BUDGET) -> tuple[Any, int]:
    """The smallest case found from ``case`` on which ``fails(candidate)`` holds, and the
    number of examples checked (at most ``budget``); ``admit(candidate)``: whether a
    proposal may be checked at all. Sweeps of :func:`passes`: each keeps its first
    (smallest) failing proposal; a pass that found nothing is not tried again until
    another pass finds a smaller case; the sweeps end when one finds none."""
    best, checked = case, 0
    tried: set[int] = set()  # passes that found nothing smaller since the last change
    while True:
        changed = False
        for i, proposals in enumerate(passes(case)):
            if i in tried:
                continue
            for candidate in proposals(best):
                if checked >= budget:
                    return best, checked
                if candidate is None:  # a change no case of the level can make
                    continue
                if admit is not None and not admit(candidate):
                    continue
                checked += 1
                if fails(candidate):
                    best, changed = candidate, True
                    tried.clear()
                    break
            else:
                tried.add(i)
        if not changed:
            return best, checked
