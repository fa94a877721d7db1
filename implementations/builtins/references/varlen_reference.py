"""FlashAttention's packed and decoding entry points, written step by step in PyTorch.

Two functions with FlashAttention-2's signatures, written from ``spec/varlen.py`` and
``spec/kvcache.py`` (not from FlashAttention's code):

* :func:`flash_attn_varlen_func` — q (T_q, N, E), k (T_k, K, E), v (T_k, K, Ev) hold B
  packed sequences; sequence b owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and
  key rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` and attends nothing else.
* :func:`flash_attn_with_kvcache` — q (B, L, N, E) against a cache (B, S_cache, K, E|Ev),
  or pages (num_pages, page_size, K, E|Ev) with ``block_table`` (B, max_pages); new keys
  k/v (B, S_new, K, E|Ev) are written into the cache **in place** at
  ``cache_seqlens[b]``, then sequence b attends its first ``cache_seqlens[b] + S_new`` keys.

``causal`` is FlashAttention's bottom-right triangle: query i of a sequence with L
queries and S keys may attend key j when ``j <= i + S - L``; a query row with no key
(S = 0, or causal with L > S) gives 0. GQA: query head h uses kv head h // (N / K).
FlashAttention's options per sequence, as ``spec.flash`` defines them: ``window_size``
(left, right) around the aligned position ``p_i = i + S - L``, ``softcap`` (c·tanh(s/c)
before bias and masks), ``alibi_slopes`` (N,) or (B, N) (bias ``-slope·|p_i - j|``), and
the LSE (``return_attn_probs=True``: (out, lse (N, T_q), None); ``return_softmax_lse=True``:
(out, lse (B, N, L))), -inf in a row attending no key. The packed call's ``dropout_p``
drops each weight of a sequence after the softmax with probability p and rescales the
kept ones by 1/(1 - p), each sequence with a pattern of its own (its own offset in the
call's random stream); the LSE stays the dropout-free one. With ``return_attn_probs=True``
and ``dropout_p > 0`` the third element is FlashAttention-2's S_dmask (B, N, max_seqlen_q,
max_seqlen_k), in the input dtype: sequence b's weights at ``[b, :, :L_b, :S_b]``, negated
where dropped, 0 in the padding (FlashAttention-2 rounds the last two sizes up to multiples
of 128; the unrounded crop is returned here). FP8 q, k, v (FlashAttention-3's
``q_descale``, ``k_descale``, ``v_descale``: None, (1,) or (B, K), row b for packed
sequence b) are dequantised to float32 sequence by sequence; the output is bfloat16. The
decoding call takes them too: row b dequantises sequence b's query and every key it attends
(cached and appended; the new keys are stored in the cache as given), without rotary tables.
The decoding call's own options, as ``spec.kvcache`` defines them: ``rotary_cos``/``rotary_sin``
(seqlen_ro, R/2) with ``rotary_interleaved`` rotate q and the new keys at their cache
positions before the append (keys at ``cache_seqlens[b] + i``; queries likewise when causal
or local, else all at ``cache_seqlens[b]``); ``cache_batch_idx`` picks the cache row each
sequence reads and writes; ``cache_leftpad`` starts a sequence's keys later (the diagonal,
window, ALiBi and rotary positions stay in cache indices); ``num_splits`` > 1 attends the
keys in that many chunks and merges the partials by their LSEs (split-KV decoding).
16-bit inputs are computed in float32 and rounded once at the end; float64 stays float64.
Dimension letters: B batch, N query heads, K kv heads, L query length, S key length,
E q/k head dim, Ev value head dim, T packed total length.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from implementations.base import Capabilities, Implementation

__all__ = [
    "VARLEN_CAPABILITIES",
    "KVCacheAttention",
    "VarlenAttention",
    "attend",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "make_implementation",
]


def _refuse(**given: Any) -> None:
    """Options of FlashAttention this reference does not implement must keep their default."""
    for name, (value, default) in given.items():
        if value != default:
            raise NotImplementedError(f"{name}={value!r} is not supported (only {default!r})")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def window_allowed(L: int, S: int, window: tuple[int, int], causal: bool, offset: int,
                   device: Any) -> torch.Tensor:
    """(L, S) bool: query i attends key j iff p_i - left <= j <= p_i + right, p_i = i + offset
    (``offset`` = S - L: bottom-right); causal sets right = 0; a side of -1 is unbounded."""
    left, right = (int(x) for x in window)
    if causal:
        right = 0
    position = torch.arange(L, device=device)[:, None] + offset          # (L, 1)
    keys = torch.arange(S, device=device)[None, :]                       # (1, S)
    allowed = torch.ones(L, S, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= keys >= position - left
    if right >= 0:
        allowed &= keys <= position + right
    return allowed


def logits(q: torch.Tensor, k: torch.Tensor, *, scale: float, softcap: float, slopes: Any,
           offset: int) -> torch.Tensor:
    """Heads first q (N, L, E), k (N, S, E) -> scores (N, L, S): scale·q·k, soft-capped, plus
    the ALiBi bias -slope_h·|p_i - j| (p_i = i + offset)."""
    scores = scale * (q @ k.transpose(-1, -2))
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if slopes is not None:
        L, S = q.shape[1], k.shape[1]
        position = torch.arange(L, device=q.device)[:, None] + offset
        distance = (position - torch.arange(S, device=q.device)[None, :]).abs().to(scores.dtype)
        scores = scores - slopes.to(device=q.device, dtype=scores.dtype).reshape(-1, 1, 1) * distance
    return scores


def softmax_rows(scores: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (N, L, S), lse (N, L)) from the row max over the allowed keys; a row with no
    allowed key has weight 0 everywhere and LSE -inf."""
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)                                # exp(-inf) = 0 on blocked keys
    total = weights.sum(dim=-1, keepdim=True)
    lse = torch.where(total > 0, row_max + torch.log(torch.where(total > 0, total, torch.ones_like(total))),
                      torch.full_like(total, float("-inf")))
    return weights / torch.where(total > 0, total, torch.ones_like(total)), lse[..., 0]  # empty rows stay 0


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
           window: tuple[int, int] = (-1, -1), softcap: float = 0.0, slopes: Any = None,
           offset: int | None = None, lse: bool = False, dropout: Any = None) -> Any:
    """One sequence: q (L, N, E), k (S, K, E), v (S, K, Ev) -> (L, N, Ev), in q's dtype (with
    ``lse``: also the LSE (N, L) in the compute dtype). ``offset``: the aligned position's
    shift p_i - i (None: S - L, FlashAttention's bottom-right). ``dropout``: applied to the
    weights (N, L, S) after the softmax (the LSE stays the dropout-free one)."""
    L, N, _ = q.shape
    S, K, Ev = v.shape
    if N % K:
        raise ValueError(f"query heads N={N} must be a multiple of kv heads K={K}")
    out_dtype, work = q.dtype, _compute_dtype(q.dtype)
    if L == 0 or S == 0:
        out = torch.zeros(L, N, Ev, dtype=out_dtype, device=q.device)
        return (out, torch.full((N, L), float("-inf"), dtype=work, device=q.device)) if lse else out
    offset = S - L if offset is None else offset
    group = N // K
    q = q.to(work).transpose(0, 1)                                      # (N, L, E)
    k = k.to(work).repeat_interleave(group, dim=1).transpose(0, 1)      # (N, S, E)
    v = v.to(work).repeat_interleave(group, dim=1).transpose(0, 1)      # (N, S, Ev)
    scores = logits(q, k, scale=scale, softcap=softcap, slopes=slopes, offset=offset)
    weights, row_lse = softmax_rows(scores, window_allowed(L, S, window, causal, offset, q.device))
    if dropout is not None:
        weights = dropout(weights)
    out = (weights @ v).transpose(0, 1).to(out_dtype)                    # (L, N, Ev)
    return (out, row_lse) if lse else out


#: The 8-bit float types q, k, v may come in (FlashAttention-3, with descales).
_FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _descale_rows(descale: Any, name: str, B: int, K: int) -> torch.Tensor:
    """A descale as float32 (B, K): None -> ones, (1,) -> filled, (B, K) as given."""
    if descale is None:
        return torch.ones(B, K)
    d = descale.detach().to("cpu", torch.float32)
    if tuple(d.shape) in ((), (1,)):
        return d.reshape(1, 1).expand(B, K)
    if tuple(d.shape) != (B, K):
        raise ValueError(f"{name} has shape {tuple(d.shape)}, but should be (1,) or (num_sequences, K) = ({B}, {K})")
    return d


def _check_options(window_size: Any, softcap: float) -> None:
    if any(int(side) < -1 for side in window_size):
        raise ValueError(f"window_size={tuple(window_size)}: each side must be >= 0, or -1 for unbounded")
    if not (softcap >= 0 and math.isfinite(softcap)):
        raise ValueError(f"softcap={softcap} must be a finite number >= 0 (0 = off)")


def _slopes_of(alibi_slopes: Any, b: int, N: int) -> Any:
    """Sequence b's slopes (N,) from (N,) or (B, N); None stays None."""
    if alibi_slopes is None:
        return None
    return alibi_slopes.reshape(-1, N)[b % alibi_slopes.reshape(-1, N).shape[0]]


def _scale(softmax_scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


class VarlenAttention:
    """``flash_attn_varlen_func``: each step is a method (the bug zoo overrides one)."""

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                 softcap=0.0, alibi_slopes=None, deterministic=False,
                 return_attn_probs=False, block_table=None, q_descale=None, k_descale=None, v_descale=None):
        """Packed variable-length attention (see the module docstring); returns (T_q, N, Ev),
        or with ``return_attn_probs`` (out, lse (N, T_q), S_dmask (B, N, max_seqlen_q, max_seqlen_k)
        with dropout, else None). FP8 q, k, v (FlashAttention-3):
        each sequence dequantised with its descale row (None, (1,) or (B, K)), the output bfloat16."""
        _refuse(block_table=(block_table, None))
        _check_options(window_size, softcap)
        if not 0 <= dropout_p < 1:
            raise ValueError(f"dropout_p={dropout_p} must be in [0, 1)")
        seed = int(torch.randint(0, 2 ** 62, ())) if dropout_p else 0   # one per call, from torch's generator
        starts_q, starts_k = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]
        if len(starts_q) != len(starts_k):
            raise ValueError(f"cu_seqlens_q has {len(starts_q)} entries but cu_seqlens_k {len(starts_k)}")
        if starts_q[-1] != q.shape[0] or starts_k[-1] != k.shape[0]:
            raise ValueError("cu_seqlens must end at the packed lengths total_q and total_k")
        scale = self.scale(softmax_scale, q.shape[-1])
        N = q.shape[1]
        fp8 = q.dtype in _FP8_TYPES
        if not fp8 and any(d is not None for d in (q_descale, k_descale, v_descale)):
            raise ValueError("q_descale/k_descale/v_descale apply only to FP8 q, k, v")
        descales = [_descale_rows(d, name, len(starts_q) - 1, k.shape[1])
                    for d, name in ((q_descale, "q_descale"), (k_descale, "k_descale"), (v_descale, "v_descale"))]
        out = torch.zeros(q.shape[0], N, v.shape[-1], dtype=torch.bfloat16 if fp8 else q.dtype, device=q.device)
        lse = torch.zeros(N, q.shape[0], dtype=_compute_dtype(q.dtype), device=q.device)
        B = len(starts_q) - 1
        lengths = [(starts_q[b + 1] - starts_q[b], starts_k[b + 1] - starts_k[b]) for b in range(B)]
        s_dmask = None
        if return_attn_probs and dropout_p:
            rows_max = max([int(max_seqlen_q)] + [L for L, _ in lengths])
            keys_max = max([int(max_seqlen_k)] + [S for _, S in lengths])
            s_dmask = torch.zeros(B, N, rows_max, keys_max, dtype=out.dtype, device=q.device)
        for b in range(B):
            rows, keys = self.sequence(starts_q, starts_k, b)
            dropout = self.dropout(float(dropout_p), seed, b, q.device)
            qs, ks, vs = q[rows], k[keys], v[keys]
            if fp8:
                qs, ks, vs = self.dequantize(qs, ks, vs, descales, b)
            out[rows], lse[:, rows] = self.attend(qs, ks, vs, scale=scale, causal=causal,
                                                  window=tuple(window_size), softcap=float(softcap),
                                                  slopes=_slopes_of(alibi_slopes, b, N), lse=True,
                                                  **({} if dropout is None else {"dropout": dropout}))
            if s_dmask is not None and dropout.pattern is not None:
                L, S = lengths[b]
                s_dmask[self.pattern_row(b), :, :L, :S] = dropout.pattern.to(s_dmask.dtype)
        if not return_attn_probs:
            return out
        return out, self.packed_lse(lse, q, k, starts_q, starts_k, scale), s_dmask

    def attend(self, q, k, v, **options):
        """One sequence (``attend``'s arguments)."""
        return attend(q, k, v, **options)

    def dequantize(self, q, k, v, descales, b: int):
        """Sequence b's FP8 q, k, v as float32 values ``stored · descale``: row
        :meth:`descale_row` of each (B, K) descale (query head h: kv head h // (N // K))."""
        qd, kd, vd = (d[self.descale_row(b)].to(q.device) for d in descales)   # (K,) each
        group = q.shape[1] // k.shape[1]
        return (q.to(torch.float32) * qd.repeat_interleave(group)[None, :, None],
                k.to(torch.float32) * kd[None, :, None], v.to(torch.float32) * vd[None, :, None])

    def descale_row(self, b: int) -> int:
        """The descale row of packed sequence b: its own (FlashAttention-3's varlen batch is
        the sequence)."""
        return b

    def dropout(self, p: float, seed: int, b: int, device: Any) -> Any:
        """Sequence b's dropout (None when p = 0): each weight kept with probability 1 - p
        and the kept ones rescaled by 1/(1 - p), the pattern drawn from the call's seed at
        the sequence's own offset (:meth:`rng_offset`), so no two sequences share one. The
        closure keeps the pattern it applied as ``pattern`` (N, L, S): the weights, negated
        where dropped (FlashAttention-2's S_dmask; None until it runs)."""
        if not p:
            return None
        generator = torch.Generator(device=device)
        generator.manual_seed((seed + self.rng_offset(b)) % 2 ** 63)

        def drop(weights):
            keep = torch.rand(weights.shape, generator=generator, device=device, dtype=weights.dtype) >= p
            drop.pattern = torch.where(keep, weights, -weights).detach()
            return self.rescale(weights * keep, p)

        drop.pattern = None
        return drop

    def pattern_row(self, b: int) -> int:
        """The row of S_dmask that holds packed sequence b's dropout pattern: its own."""
        return b

    def rng_offset(self, b: int) -> int:
        """Where sequence b's dropout pattern starts in the call's random stream: its index."""
        return b

    def rescale(self, kept, p: float):
        """The kept weights scaled by 1/(1 - p): the expectation stays the weights."""
        return kept / (1.0 - p)

    def packed_lse(self, lse, q, k, starts_q, starts_k, scale):
        """The LSE (N, T_q) as returned: each sequence's own."""
        return lse

    def scale(self, softmax_scale: float | None, head_dim: int) -> float:
        return _scale(softmax_scale, head_dim)

    def sequence(self, starts_q: list[int], starts_k: list[int], b: int) -> tuple[slice, slice]:
        """Sequence b's query rows and key rows in the packed tensors."""
        return slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])


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
flash_attn_varlen_func = VarlenAttention()
flash_attn_with_kvcache = KVCacheAttention()


VARLEN_CAPABILITIES = Capabilities(
    dtypes=("float64", "float32", "float16", "bfloat16"),
    causal="lower_right",
    fully_masked="zero",
    autograd=False,
    mask_grad=False,
    mask_kinds=frozenset({"none"}),
    varlen_features=frozenset({"window", "softcap", "alibi", "lse", "dropout", "fp8", "dropout_pattern"}),
    fp8_dtypes=("float8_e4m3fn", "float8_e5m2"),
    kvcache_features=frozenset({"window", "softcap", "alibi", "lse", "rotary", "cache_batch_idx",
                                "cache_leftpad", "num_splits", "fp8"}),
)


def make_implementation(*, name: str = "varlen-reference", varlen: Any = None, kvcache: Any = None,
                        description: str = "") -> Implementation:
    """The built-in (or, with ``varlen``/``kvcache`` given, one of the bug zoo's variants)."""
    devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    return Implementation(
        name=name,
        capabilities=VARLEN_CAPABILITIES.replace(devices=devices),
        varlen=varlen or flash_attn_varlen_func,
        kvcache=kvcache or flash_attn_with_kvcache,
        version=torch.__version__,
        listed=not name.startswith("mutant:"),
        description=description or "flash_attn_varlen_func and flash_attn_with_kvcache in plain PyTorch, "
        "written from spec/varlen.py and spec/kvcache.py (implementations/builtins/references/varlen_reference.py)",
    )
