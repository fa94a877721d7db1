"""``flash_attn_with_kvcache`` written step by step in PyTorch, from ``spec/kvcache.py``.

One decoding step: q (B, L, N, E) against a cache (B, S_cache, K, E|Ev), or pages
(num_pages, page_size, K, E|Ev) with ``block_table``; the new keys are written into the
cache in place, rotated first with the rotary tables; each sequence then attends its valid
keys (``cache_seqlens[b] + S_new``, from ``cache_leftpad[b]``), in ``num_splits`` chunks
merged by their LSEs when asked. The module docstring of
``implementations.builtins.references.varlen_reference`` gives the whole convention.
"""

from __future__ import annotations

from typing import Any

import torch

from implementations.builtins.references.sequence_steps import (
    _FP8_TYPES,
    _check_options,
    _compute_dtype,
    _descale_rows,
    _scale,
    _slopes_of,
    attend,
)

__all__ = ["KVCacheAttention"]


class KVCacheAttention:
    """``flash_attn_with_kvcache``: each step is a method (the bug zoo overrides one)."""

    def __call__(self, q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                 cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                 softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                 rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                 return_softmax_lse=False, q_descale=None, k_descale=None, v_descale=None):
        """Decoding attention against a KV cache (see the module docstring); returns (B, L, N, Ev),
        or with ``return_softmax_lse`` (out, lse (B, N, L)). FP8 q, caches, k, v (FlashAttention-3):
        sequence b's query and every key it attends dequantised with descale row b (None, (1,)
        or (B, K)), the new keys stored as given, the output bfloat16."""
        _check_options(window_size, softcap)
        if (k is None) != (v is None):
            raise ValueError("k and v must be given together")
        B = q.shape[0]
        capacity = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
        if cache_seqlens is None:
            if k is not None:
                raise ValueError("new keys k/v need cache_seqlens (where would they go?)")
            lengths = [capacity] * B
        elif isinstance(cache_seqlens, int):
            lengths = [cache_seqlens] * B
        else:
            lengths = [int(x) for x in cache_seqlens]
        new = 0 if k is None else k.shape[1]
        if any(n < 0 or n + new > capacity for n in lengths):
            raise ValueError(f"cache_seqlens {lengths} plus S_new={new} must lie in [0, {capacity}]")
        rows = _cache_rows(cache_batch_idx, B, k_cache.shape[0], block_table, appending=k is not None)
        pads = _leftpads(cache_leftpad, lengths, block_table)
        if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
            raise ValueError(f"num_splits={num_splits!r} must be an int >= 0 (0: heuristic, 1: no split)")
        scale = _scale(softmax_scale, q.shape[-1])
        fp8 = q.dtype in _FP8_TYPES
        if not fp8 and any(d is not None for d in (q_descale, k_descale, v_descale)):
            raise ValueError("q_descale/k_descale/v_descale apply only to FP8 q, k_cache, v_cache")
        if fp8 and (rotary_cos is not None or rotary_sin is not None):
            raise ValueError("rotary_cos/rotary_sin cannot be combined with FP8 inputs (a rotated FP8 key is "
                             "no FP8 value); rotate before quantising")
        descales = [_descale_rows(d, name, B, k_cache.shape[2])
                    for d, name in ((q_descale, "q_descale"), (k_descale, "k_descale"), (v_descale, "v_descale"))]
        # 1. rotate q and the new keys at their positions in the cache
        if rotary_cos is not None or rotary_sin is not None:
            q, k = self.rotate_inputs(q, k, rotary_cos, rotary_sin, lengths, rotary_interleaved,
                                      per_row=bool(causal) or tuple(window_size) != (-1, -1))
        # 2. append the new keys and values at each sequence's length (in place, like FlashAttention)
        if k is not None:
            for b in range(B):
                self.write(k_cache, block_table, self.write_row(rows, b), self.append_at(lengths[b]), k[b])
                self.write(v_cache, block_table, self.write_row(rows, b), self.append_at(lengths[b]), v[b])
        # 3. sequence b attends its keys cache_leftpad[b] .. cache_seqlens[b] + S_new - 1
        L, N = q.shape[1], q.shape[2]
        out = torch.zeros(*q.shape[:3], v_cache.shape[-1], dtype=torch.bfloat16 if fp8 else q.dtype,
                          device=q.device)                                # (B, L, N, Ev)
        lse = torch.zeros(B, N, L, dtype=_compute_dtype(q.dtype), device=q.device)
        for b in range(B):
            valid = self.valid_keys(lengths[b], new, capacity)
            start = self.first_key(pads[b])
            keys = self.rows(k_cache, block_table, self.read_row(rows, b), valid)[start:]     # (S_b - pad, K, E)
            values = self.rows(v_cache, block_table, self.read_row(rows, b), valid)[start:]   # (S_b - pad, K, Ev)
            qb = q[b]
            if fp8:  # the rows from lengths[b] - start on are the appended ones
                qb, keys, values = self.dequantize(qb, keys, values, descales, b, lengths[b] - start)
            out[b], lse[b] = self.split_attend(qb, keys, values, num_splits, scale=scale, causal=causal,
                                               window=tuple(window_size), softcap=float(softcap),
                                               slopes=_slopes_of(alibi_slopes, b, N),
                                               offset=self.padded_offset(L, valid, start, lengths[b], new))
        if return_softmax_lse:
            return out, self.returned_lse(lse, q, k_cache, block_table, scale, capacity)
        return out

    def aligned_offset(self, L: int, valid: int, length: int, new: int) -> int:
        """p_i - i for the window, causal and ALiBi: the valid keys minus the queries."""
        return valid - L

    def padded_offset(self, L: int, valid: int, start: int, length: int, new: int) -> int:
        """The aligned offset counted from the first attended key ``start`` (the left pad):
        the diagonal stays where it is in cache indices."""
        return self.aligned_offset(L, valid - start, length - start, new)

    def first_key(self, pad: int) -> int:
        """The first cache index a sequence attends: its left pad."""
        return pad

    def read_row(self, rows: list[int], b: int) -> int:
        """The cache row sequence b reads (``cache_batch_idx[b]``)."""
        return rows[b]

    def write_row(self, rows: list[int], b: int) -> int:
        """The cache row sequence b's new keys are written to (``cache_batch_idx[b]``)."""
        return rows[b]

    def returned_lse(self, lse, q, k_cache, block_table, scale, capacity):
        """The LSE (B, N, L) as returned: each sequence's over its valid keys."""
        return lse

    def append_at(self, length: int) -> int:
        """Where a sequence's new keys go: right after its ``length`` valid ones."""
        return length

    def valid_keys(self, length: int, new: int, capacity: int) -> int:
        """How many keys a sequence attends: its valid cache plus the appended ones."""
        return length + new

    def attend(self, q, keys, values, *, scale: float, causal: bool, **options):
        return attend(q, keys, values, scale=scale, causal=causal, **options)

    def dequantize(self, q, keys, values, descales, b: int, appended_from: int):
        """Sequence b's FP8 query (L, N, E) and attended keys (S, K, E) / values as float32
        ``stored · descale``, row b of each (B, K) descale (query head h: kv head h // (N // K));
        the keys from ``appended_from`` on are the appended ones (dequantised alike)."""
        qd, kd, vd = (d[b].to(q.device) for d in descales)              # (K,) each
        group = q.shape[1] // keys.shape[1]
        return (q.to(torch.float32) * qd.repeat_interleave(group)[None, :, None],
                keys.to(torch.float32) * kd[None, :, None], values.to(torch.float32) * vd[None, :, None])

    # -- rotary embeddings ------------------------------------------------------------

    def rotate_inputs(self, q, k, cos, sin, lengths, interleaved, *, per_row: bool):
        """q (B, L, N, E) and the new keys k (B, S_new, K, E) rotated at their positions."""
        if cos is None or sin is None:
            raise ValueError("rotary_cos and rotary_sin must be given together")
        if k is None:
            raise ValueError("rotary_cos/rotary_sin apply only with new keys k and v")
        if cos.dim() != 2 or sin.shape != cos.shape or not 1 <= cos.shape[1] <= q.shape[-1] // 2:
            raise ValueError(f"rotary_cos/rotary_sin of shape {tuple(cos.shape)}/{tuple(sin.shape)} must be "
                             f"(seqlen_ro, rotary_dim / 2) with 2 <= rotary_dim <= headdim={q.shape[-1]}")
        L, new = q.shape[1], k.shape[1]
        q_out, k_out = q.clone(), k.clone()
        for b, length in enumerate(lengths):
            q_pos, k_pos = self.query_positions(length, L, per_row), self.key_positions(length, new)
            if max(q_pos + k_pos, default=0) >= cos.shape[0]:
                raise ValueError(f"rotary tables of {cos.shape[0]} rows, but position {max(q_pos + k_pos)} is used")
            q_out[b] = self.rotate(q[b], cos, sin, q_pos, bool(interleaved))
            k_out[b] = self.rotate(k[b], cos, sin, k_pos, bool(interleaved))
        return q_out, k_out

    def query_positions(self, length: int, L: int, per_row: bool) -> list[int]:
        """Cache positions of a sequence's queries: ``length + i`` when causal or local, else all ``length``."""
        return [length + i if per_row else length for i in range(L)]

    def key_positions(self, length: int, new: int) -> list[int]:
        """Cache positions of a sequence's new keys: ``length + i``."""
        return [length + i for i in range(new)]

    def rotary_pairs(self, rotary_dim: int, interleaved: bool) -> tuple[list[int], list[int]]:
        """The dims of each rotated pair j: (2j, 2j + 1) interleaved, (j, j + R/2) not."""
        half = rotary_dim // 2
        if interleaved:
            return [2 * j for j in range(half)], [2 * j + 1 for j in range(half)]
        return list(range(half)), list(range(half, rotary_dim))

    def rotate(self, x, cos, sin, positions: list[int], interleaved: bool):
        """x (T, H, E) rotated at ``positions``, in the compute dtype (the caller stores it in x's)."""
        work = _compute_dtype(x.dtype)
        index = torch.tensor(positions, dtype=torch.long, device=x.device)
        c = cos.to(device=x.device, dtype=work)[index][:, None, :]        # (T, 1, R/2)
        s = sin.to(device=x.device, dtype=work)[index][:, None, :]
        first, second = self.rotary_pairs(2 * cos.shape[1], interleaved)
        x = x.to(work)
        out = x.clone()
        out[..., first] = x[..., first] * c - x[..., second] * s
        out[..., second] = x[..., second] * c + x[..., first] * s
        return out

    # -- split-KV ---------------------------------------------------------------------

    def split_attend(self, q, keys, values, num_splits: int, *, offset: int, **options):
        """One sequence's (output (L, N, Ev), LSE (N, L)): with ``num_splits`` > 1 the keys in
        that many contiguous chunks, each attended alone (positions kept), merged by
        :meth:`merge_splits`; 0 (the heuristic) and 1 do not split."""
        S = keys.shape[0]
        if num_splits <= 1 or S == 0:
            return self.attend(q, keys, values, offset=offset, lse=True, **options)
        size = -(-S // num_splits)
        work = _compute_dtype(q.dtype)
        partials = [self.attend(q.to(work), keys[lo:lo + size], values[lo:lo + size], offset=offset - lo, lse=True,
                                **options) for lo in range(0, size * num_splits, size)]
        out, lse = self.merge_splits(partials)
        return out.to(q.dtype), lse

    def merge_splits(self, partials):
        """Partials [(output (L, N, Ev), LSE (N, L))] of disjoint key chunks -> the whole:
        ``lse = m + log Σ_c exp(lse_c − m)`` with m the largest partial LSE, each output
        weighted by ``exp(lse_c − lse)``; a chunk with no key (LSE -inf) weighs 0."""
        outs = torch.stack([out for out, _ in partials])                 # (P, L, N, Ev)
        lses = torch.stack([lse for _, lse in partials])                 # (P, N, L)
        top = lses.amax(dim=0)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        weights = torch.exp(lses - top)                                  # exp(-inf) = 0
        total = weights.sum(dim=0)
        lse = torch.where(total > 0, top + torch.log(torch.where(total > 0, total, torch.ones_like(total))),
                          torch.full_like(total, float("-inf")))
        share = weights / torch.where(total > 0, total, torch.ones_like(total))      # (P, N, L)
        return (share.permute(0, 2, 1)[..., None] * outs).sum(dim=0), lse

    # -- the cache ----------------------------------------------------------------------

    def page_of(self, block_table, b: int, t, page_size: int):
        """The page holding logical row(s) ``t`` of sequence b."""
        return block_table[b].long()[t // page_size]

    def rows(self, cache, block_table, b: int, length: int):
        """Cache row b's first ``length`` logical rows (S_b, K, X): a view of a contiguous
        cache, or a gather from pages ``block_table[b, t // page_size]``, slot ``t % page_size``."""
        if block_table is None:
            return cache[b, :length]
        page_size = cache.shape[1]
        t = torch.arange(length, device=cache.device)
        return cache[self.page_of(block_table, b, t, page_size), t % page_size]

    def write(self, cache, block_table, b: int, start: int, new) -> None:
        """Write ``new`` (S_new, K, X) at logical rows start .. start + S_new - 1 of cache row b, in place."""
        if block_table is None:
            cache[b, start:start + new.shape[0]] = new
            return
        page_size = cache.shape[1]
        t = torch.arange(start, start + new.shape[0], device=cache.device)
        cache[self.page_of(block_table, b, t, page_size), t % page_size] = new


def _cache_rows(cache_batch_idx: Any, B: int, cache_rows: int, block_table: Any, *, appending: bool) -> list[int]:
    """The cache row of each sequence: ``cache_batch_idx`` (checked) or 0 .. B - 1."""
    if cache_batch_idx is None:
        return list(range(B))
    if block_table is not None:
        raise ValueError("cache_batch_idx cannot be combined with block_table (a paged cache)")
    rows = [int(x) for x in cache_batch_idx]
    if len(rows) != B or any(not 0 <= r < cache_rows for r in rows):
        raise ValueError(f"cache_batch_idx={rows} must hold one row in [0, {cache_rows}) per sequence (B={B})")
    if appending and len(set(rows)) != len(rows):
        raise ValueError(f"cache_batch_idx={rows} must be distinct when new keys are appended")
    return rows


def _leftpads(cache_leftpad: Any, lengths: list[int], block_table: Any) -> list[int]:
    """Each sequence's first valid cache index: ``cache_leftpad`` (checked) or 0."""
    if cache_leftpad is None:
        return [0] * len(lengths)
    if block_table is not None:
        raise ValueError("cache_leftpad cannot be combined with block_table (a paged cache)")
    pads = [int(x) for x in cache_leftpad]
    if len(pads) != len(lengths) or any(not 0 <= p <= n for p, n in zip(pads, lengths, strict=True)):
        raise ValueError(f"cache_leftpad={pads} must hold one pad in [0, cache_seqlens[b]] per sequence")
    return pads


#: The two entry points, FlashAttention's names and signatures.
