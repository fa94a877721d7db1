"""The kvcache-level variants: ``flash_attn_with_kvcache`` with one step done the way real
code gets it wrong (the valid length off by one, the append misplaced or not written,
causal top-left, the block table ignored, the window aligned without the cache, the LSE
over the whole cache, rotary at the wrong positions or layout, the left pad mishandled,
``cache_batch_idx`` ignored, the split-KV merge without its max or rescale), each computed
in float64 on the call's own inputs: the output, the LSE and the caches after the call.

A call's steps, as ``spec.kvcache`` orders them: rotate q and the new keys, write the new
keys and values into the caches (in place), then each sequence attends its valid keys
(in num_splits chunks merged by their LSEs). The caches after the call are returned in
the logical layout the runner reads them back in: contiguous as given, paged gathered
through the call's block table.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..rotary import rotary_pairs
from ._core import Variant, VariantResult
from ._family import KVCacheProblem
from ._kernel import Attended, attend, merge, plain_lse

__all__ = ["KVCACHE_VARIANTS", "KVSteps", "reference", "compute", "live_rows", "compared_cache_rows"]


@dataclass(frozen=True)
class KVSteps:
    """Which step of a decoding call is done the wrong way (all off: the spec)."""

    extra_key: bool = False                 # one stale key past cache_seqlens + S_new
    append_at_start: bool = False           # the new keys written at row 0
    append_not_written: bool = False        # attended, but the caches are returned untouched
    causal_upper_left: bool = False         # causal: p_i = i from the first attended key
    block_table_ignored: bool = False       # page b·max_pages + j instead of block_table[b, j]
    window_ignores_cache: bool = False      # p_i - i = S_new - L
    lse_whole_cache: bool = False           # the LSE over every row of the capacity
    rotary_relative: bool = False           # rotary positions counted from the new tokens
    rotary_per_row: bool = False            # query i at cache_seqlens + i whatever the call
    rotary_swapped: bool = False            # rotary_interleaved read the other way round
    leftpad_causal_offset: bool = False     # the pad dropped, the diagonal placed without it
    leftpad_ignored: bool = False           # keys from cache index 0
    write_row_b: bool = False               # new keys into cache row b, not cache_batch_idx[b]
    read_row_b: bool = False                # sequence b attends cache row b
    merge: str = "max"                      # split-KV merge: "max", "no_max", "no_rescale"


def _slopes(p: KVCacheProblem, b: int) -> np.ndarray | None:
    if p.alibi_slopes is None:
        return None
    rows = np.asarray(p.alibi_slopes).reshape(-1, p.query.shape[2])
    return rows[b % rows.shape[0]]


def _rotate(p: KVCacheProblem, s: KVSteps) -> tuple[np.ndarray, np.ndarray | None]:
    """q and the new keys rotated at their cache positions (float64)."""
    q, k = p.query, p.k_new
    if p.rotary_cos is None or k is None:
        return q, k
    cos, sin = p.rotary_cos, p.rotary_sin
    first, second = rotary_pairs(2 * cos.shape[1], bool(p.rotary_interleaved) != s.rotary_swapped)
    per_row = bool(p.causal) or tuple(p.window) != (-1, -1) or s.rotary_per_row

    def rotated(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        c, si = cos[positions][:, None, :], sin[positions][:, None, :]   # (T, 1, R/2)
        out = x.copy()
        out[..., first] = x[..., first] * c - x[..., second] * si
        out[..., second] = x[..., second] * c + x[..., first] * si
        return out

    q_out, k_out = q.copy(), k.copy()
    L, new = q.shape[1], k.shape[1]
    for b, length in enumerate(p.cache_seqlens):
        base = 0 if s.rotary_relative else length
        q_out[b] = rotated(q[b], base + (np.arange(L) if per_row else np.zeros(L, dtype=np.int64)))
        k_out[b] = rotated(k[b], base + np.arange(new))
    return q_out, k_out


def _page(p: KVCacheProblem, s: KVSteps, b: int, t: np.ndarray) -> np.ndarray:
    """The physical page of logical rows ``t`` of sequence b."""
    max_pages = p.block_table.shape[1]
    if s.block_table_ignored:
        return b * max_pages + t // p.page_size
    return p.block_table[b][t // p.page_size]


def _write(p: KVCacheProblem, s: KVSteps, cache: np.ndarray, row: int, start: int, new: np.ndarray) -> None:
    if p.block_table is None:
        cache[row, start:start + new.shape[0]] = new
        return
    t = np.arange(start, start + new.shape[0])
    cache[_page(p, s, row, t), t % p.page_size] = new


def _read(p: KVCacheProblem, s: KVSteps, cache: np.ndarray, row: int, length: int) -> np.ndarray:
    if p.block_table is None:
        return cache[row, :length]
    t = np.arange(length)
    return cache[_page(p, s, row, t), t % p.page_size]


def _logical(p: KVCacheProblem, cache: np.ndarray) -> np.ndarray:
    """The caches as the runner reads them back: contiguous as they are, pages gathered
    through the call's own block table (B, max_pages · page_size, K, X)."""
    if p.block_table is None:
        return cache
    table = p.block_table
    return cache[table].reshape(table.shape[0], table.shape[1] * cache.shape[1], *cache.shape[2:])


def _split_attend(p: KVCacheProblem, s: KVSteps, q: np.ndarray, keys: np.ndarray, values: np.ndarray, *,
                  offset: int, policy: str, slopes: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """One sequence's (output, LSE, magnitude, score size, live): whole, or in num_splits chunks."""
    options = dict(scale=p.resolved_scale, causal=bool(p.causal), window=p.window, softcap=float(p.softcap),
                   slopes=slopes, dtype=p.dtype)
    upper_left = s.causal_upper_left and bool(p.causal)
    S, splits = keys.shape[0], p.num_splits or 0
    whole = attend(q, keys, values, offset=0 if upper_left else offset, policy=policy, **options)
    if splits <= 1 or S == 0:
        return whole
    size = -(-S // splits)
    parts: list[Attended] = [attend(q, keys[lo:lo + size], values[lo:lo + size],
                                    offset=0 if upper_left else offset - lo, **options)
                             for lo in range(0, size * splits, size)]
    output, lse, magnitude = merge(parts, mode=s.merge, dtype=p.dtype)
    live = np.any([a.live for a in parts], axis=0)
    if policy != "zero":                          # rows no chunk attends follow the declared policy
        output = np.where(live[:, None, None], output, whole.output)
    score = np.max([a.score_size for a in parts], axis=0)
    return Attended(output, lse, magnitude, score, live)


def compute(p: KVCacheProblem, s: KVSteps | None = None) -> VariantResult:
    """What ``flash_attn_with_kvcache`` under ``s`` returns on ``p``: the output (B, L, N, Ev),
    the LSE (B, N, L), the caches after the call (logical layout) and the sizes (``s`` None:
    the spec's steps)."""
    s = s or KVSteps()
    B, L, N, _ = p.query.shape
    Ev = p.v_cache.shape[-1]
    policy = "zero" if p.fully_masked == "unspecified" else p.fully_masked
    rows, new, capacity = p.rows(), p.S_new, p.capacity
    pads = p.cache_leftpad or (0,) * B
    q, k = _rotate(p, s)
    k_cache, v_cache = p.k_cache.copy(), p.v_cache.copy()
    if k is not None:
        for b in range(B):
            row, at = (b if s.write_row_b else rows[b]), (0 if s.append_at_start else p.cache_seqlens[b])
            _write(p, s, k_cache, row, at, k[b])
            _write(p, s, v_cache, row, at, p.v_new[b])
    output, magnitude = np.zeros((B, L, N, Ev)), np.zeros((B, L, N, Ev))
    lse, size = np.zeros((B, N, L)), np.zeros((B, N, L))
    for b in range(B):
        length = p.cache_seqlens[b]
        valid = min(length + new + 1, capacity) if s.extra_key else length + new
        start = 0 if s.leftpad_ignored else pads[b]
        row = b if s.read_row_b else rows[b]
        keys = _read(p, s, k_cache, row, valid)[start:]
        values = _read(p, s, v_cache, row, valid)[start:]
        # p_i - i counted from the first attended key: the valid keys minus the queries
        offset = (new - L) if s.window_ignores_cache else (valid - start - L)
        if s.leftpad_causal_offset:
            offset = valid - L
        part = _split_attend(p, s, q[b], keys, values, offset=offset, policy=policy, slopes=_slopes(p, b))
        output[b], lse[b], magnitude[b], size[b] = part.output, part.lse, part.magnitude, part.score_size
    if s.lse_whole_cache:
        for b in range(B):
            whole = _read(p, s, k_cache, b, capacity)
            lse[b], packed = plain_lse(q[b], whole, p.resolved_scale)
            size[b] = np.maximum(size[b], packed)
    if s.append_not_written:
        k_cache, v_cache = p.k_cache, p.v_cache
    return VariantResult(output, lse=lse, k_cache=_logical(p, k_cache), v_cache=_logical(p, v_cache),
                         magnitude=magnitude, score_size=size)


def reference(p: KVCacheProblem) -> VariantResult:
    """The correct convention: :func:`spec.kvcache_attention` (output, LSE, caches after)."""
    return compute(p)


def live_rows(p: KVCacheProblem) -> np.ndarray:
    """Bool (B, L, 1, 1): rows that attend a key under the correct convention."""
    B, L = p.query.shape[:2]
    live = np.zeros((B, L), dtype=bool)
    pads = p.cache_leftpad or (0,) * B
    for b in range(B):
        S = p.cache_seqlens[b] + p.S_new - pads[b]
        dummy = np.zeros((S, 1, 1))
        live[b] = attend(np.zeros((L, 1, 1)), dummy, dummy, scale=1.0, causal=bool(p.causal), window=p.window).live
    return live[:, :, None, None]


def compared_cache_rows(p: KVCacheProblem) -> np.ndarray:
    """Bool (rows, S, 1, 1) of the caches' logical layout: what a call must leave there, the
    rows the runner checks: each sequence's first cache_seqlens + S_new rows, and the whole
    of every cache row no sequence names (it must stay untouched)."""
    rows = p.rows()
    count = p.k_cache.shape[0] if p.block_table is None else p.B
    checked = np.zeros((count, p.capacity), dtype=bool)
    for r in range(count):
        if r not in rows:
            checked[r] = True
    for b, row in enumerate(rows):
        checked[row, :p.cache_seqlens[b] + p.S_new] = True
    return checked[:, :, None, None]


def _with(**changes: object):
    steps = replace(KVSteps(), **changes)
    return lambda p: compute(p, steps)


def _room(p: KVCacheProblem) -> bool:
    """Some sequence has a cache row past its valid keys."""
    return any(n + p.S_new < p.capacity for n in p.cache_seqlens)


def _rotary(p: KVCacheProblem) -> bool:
    return p.rotary_cos is not None and p.k_new is not None


def _split(p: KVCacheProblem) -> bool:
    return (p.num_splits or 0) > 1


def _batch_idx_moves(p: KVCacheProblem) -> bool:
    return p.cache_batch_idx is not None and list(p.cache_batch_idx) != list(range(p.B))


def _variant(id: str, summary: str, models: str, applies, **steps: object) -> Variant:
    return Variant(id=id, level="kvcache", summary=summary, models=models, applies=applies, compute=_with(**steps))


KVCACHE_VARIANTS = (
    _variant("kvcache_seqlens_off_by_one",
             "attends cache_seqlens[b] + S_new + 1 cache rows: one stale row past the valid keys (where the cache "
             "has room)",
             "the valid length taken as an inclusive last index, <= instead of < "
             "(bug zoo: kvcache_seqlens_off_by_one)",
             _room, extra_key=True),
    _variant("kvcache_append_at_start",
             "writes the new keys and values at row 0 of the cache instead of row cache_seqlens[b], and attends "
             "the cache as written",
             "the append offset (cache_seqlens) forgotten in the cache write (bug zoo: kvcache_append_at_start)",
             lambda p: p.k_new is not None and any(n > 0 for n in p.cache_seqlens), append_at_start=True),
    _variant("kvcache_append_not_written",
             "attends the new keys and values but leaves the caches as they were (the next step misses them)",
             "torch.cat of the cache and the new keys instead of an in-place write "
             "(bug zoo: kvcache_append_not_written)",
             lambda p: p.k_new is not None, append_not_written=True),
    _variant("kvcache_causal_upper_left",
             "aligns causal decoding top-left: query i sees keys 0..i from the first attended key (the window "
             "and ALiBi with it) instead of 0..i + S_b - L",
             "PyTorch's is_causal (top-left) used for a decoding step, whose queries are the last L of S_b "
             "positions (bug zoo: kvcache_causal_top_left)",
             lambda p: bool(p.causal), causal_upper_left=True),
    _variant("kvcache_block_table_ignored",
             "reads and writes the pages as if block_table were the identity (page b · max_pages + j)",
             "a paged kernel indexing the page pool by logical page, skipping the table lookup "
             "(bug zoo: paged_block_table_ignored)",
             lambda p: p.block_table is not None, block_table_ignored=True),
    _variant("kvcache_window_ignores_cache",
             "aligns the window, causal and ALiBi with the appended keys only: p_i = i + S_new - L, as if the "
             "cache held nothing before them",
             "the sliding-window offset computed from the new tokens without cache_seqlens "
             "(bug zoo: kvcache_window_ignores_cache)",
             lambda p: (bool(p.causal) or tuple(p.window) != (-1, -1) or p.alibi_slopes is not None),
             window_ignores_cache=True),
    _variant("kvcache_lse_whole_cache",
             "returns the LSE over every row of the cache's capacity (stale rows included, no mask, cap or "
             "bias) instead of over the valid keys; the output is right",
             "the split-KV LSE reduced over the allocated cache, not cache_seqlens "
             "(bug zoo: kvcache_lse_whole_cache)",
             lambda p: True, lse_whole_cache=True),
    _variant("kvcache_rotary_relative_positions",
             "rotates q and the new keys at positions counted from the new tokens (0, 1, ...) instead of at "
             "cache_seqlens[b] + i",
             "the rotary offset (cache_seqlens) forgotten, as in a prefill-only rotary applied to a decoding "
             "step (bug zoo: kvcache_rotary_relative_positions)",
             lambda p: _rotary(p) and any(n > 0 for n in p.cache_seqlens), rotary_relative=True),
    _variant("kvcache_rotary_queries_per_row",
             "rotates query i at cache_seqlens + i even when the call is neither causal nor local (every query "
             "belongs at cache_seqlens then)",
             "the causal rule for query positions applied to every call "
             "(bug zoo: kvcache_rotary_queries_per_row)",
             lambda p: _rotary(p) and p.query.shape[1] > 1 and not p.causal and tuple(p.window) == (-1, -1),
             rotary_per_row=True),
    _variant("kvcache_rotary_interleave_swapped",
             "reads rotary_interleaved the other way round: GPT-NeoX halves (j, j + R/2) for True, GPT-J pairs "
             "(2j, 2j + 1) for False",
             "the GPT-J and GPT-NeoX rotary layouts confused (bug zoo: kvcache_rotary_interleave_swapped)",
             lambda p: _rotary(p) and p.rotary_cos.shape[1] > 1, rotary_swapped=True),
    _variant("kvcache_leftpad_causal_offset",
             "drops the left padding but places the diagonal (window, ALiBi) as if it were still there: it moves "
             "right by the pad",
             "the key pointer advanced by cache_leftpad while the causal offset uses the unpadded length "
             "(bug zoo: kvcache_leftpad_causal_offset)",
             lambda p: p.cache_leftpad is not None and any(p.cache_leftpad)
             and (bool(p.causal) or tuple(p.window) != (-1, -1) or p.alibi_slopes is not None),
             leftpad_causal_offset=True),
    _variant("kvcache_leftpad_ignored",
             "ignores cache_leftpad: every sequence also attends its left padding",
             "a left-padded batch decoded with cache_seqlens alone (bug zoo: kvcache_leftpad_ignored)",
             lambda p: p.cache_leftpad is not None and any(p.cache_leftpad), leftpad_ignored=True),
    _variant("kvcache_batch_idx_ignored_on_write",
             "writes sequence b's new keys and values into cache row b, not cache_batch_idx[b] (and reads the "
             "named row, without them)",
             "the append path indexing the cache by the batch index while the attention uses cache_batch_idx "
             "(bug zoo: kvcache_batch_idx_ignored_on_write)",
             lambda p: _batch_idx_moves(p) and p.k_new is not None, write_row_b=True),
    _variant("kvcache_batch_idx_ignored_on_read",
             "attends cache row b for sequence b, not cache_batch_idx[b] (the append goes to the named row)",
             "the attention path indexing the cache by the batch index, only the append using cache_batch_idx "
             "(bug zoo: kvcache_batch_idx_ignored_on_read)",
             _batch_idx_moves, read_row_b=True),
    _variant("kvcache_split_merge_without_max",
             "merges the split-KV partials with e^lse_c unshifted, in the computing precision: NaN once a "
             "partial LSE passes exp's range (88 in float32, 709 in float64), 0 where every chunk underflows",
             "the textbook log-sum-exp merge without its max shift; FlashAttention's combine kernel subtracts "
             "the largest partial LSE first (bug zoo: kvcache_split_merge_without_max)",
             _split, merge="no_max"),
    _variant("kvcache_split_merge_without_rescale",
             "adds the split-KV partial outputs without their weights e^(lse_c - lse) (the LSE is merged right)",
             "the partial outputs of the key chunks summed as if each were already normalised over all keys "
             "(bug zoo: kvcache_split_merge_without_rescale)",
             _split, merge="no_rescale"),
)
