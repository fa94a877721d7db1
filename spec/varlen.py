"""Packed variable-length batches (FlashAttention's ``flash_attn_varlen_func``).

B sequences are packed along one axis: query (T_q, N, E), key (T_k, K, E), value
(T_k, K, Ev). Sequence b owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key
rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``; its L_b and S_b are those slice lengths, so
aligned positions, windows, causal and ALiBi are per sequence (p_i = i + S_b - L_b with
i counted from the sequence's first row). No query attends another sequence's keys.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _checks
from . import _flash_checks as checks
from .errors import fail
from .flash import FlashResult, flash_attention, window_mask

__all__ = ["varlen_attention", "document_mask"]


def _sequences(cu_seqlens_q: Any, cu_seqlens_k: Any, total_q: int,
               total_k: int) -> list[tuple[slice, slice]]:
    """(query rows, key rows) of each sequence, after validating both cumulative arrays."""
    cu_q = checks.cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, "total_q")
    cu_k = checks.cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, "total_k")
    if cu_q.size != cu_k.size:
        fail("cu_seqlens_k", cu_k.tolist() if cu_k.size <= 12 else cu_k,
             f"must have as many entries as cu_seqlens_q ({cu_q.size}, i.e. B={cu_q.size - 1})",
             "pass one query and one key sequence per batch element (an empty one is allowed)")
    return [(slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1])))
            for b in range(cu_q.size - 1)]


def document_mask(cu_seqlens_q: Any, cu_seqlens_k: Any, *, causal: bool = False,
                  window: tuple[int, int] = (-1, -1), alignment: str = "lower_right") -> np.ndarray:
    """The packed problem's attend mask, bool (T_q, T_k), **True = may attend**.

    Block-diagonal: sequence b's block is ``window_mask(L_b, S_b, window, causal=causal,
    alignment=alignment)``; entries between sequences are False.
    """
    cu_q = checks.int_vector("cu_seqlens_q", cu_seqlens_q)
    cu_k = checks.int_vector("cu_seqlens_k", cu_seqlens_k)
    total_q, total_k = int(cu_q[-1]) if cu_q.size else 0, int(cu_k[-1]) if cu_k.size else 0
    allowed = np.zeros((total_q, total_k), dtype=bool)
    for rows, keys in _sequences(cu_q, cu_k, total_q, total_k):
        allowed[rows, keys] = window_mask(rows.stop - rows.start, keys.stop - keys.start, window,
                                          causal=causal, alignment=alignment)
    return allowed


def varlen_attention(query: Any, key: Any, value: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, *,
                     causal: bool = False, window: tuple[int, int] = (-1, -1),
                     softcap: float = 0.0, alibi_slopes: Any = None, scale: float | None = None,
                     return_lse: bool = False, fully_masked: str = "zero",
                     alignment: str = "lower_right") -> np.ndarray | FlashResult:
    """Attention over packed sequences: each one exactly :func:`spec.flash_attention` on its slices.

    query (T_q, N, E), key (T_k, K, E), value (T_k, K, Ev); ``cu_seqlens_q`` and
    ``cu_seqlens_k`` int (B + 1,), starting at 0, non-decreasing, ending at T_q / T_k.
    Empty sequences are allowed (a query sequence with no keys is fully masked).
    ``alibi_slopes`` (N,) or (B, N); ``scale=None`` -> 1/sqrt(E) for every sequence.
    Returns the output (T_q, N, Ev), or ``FlashResult(output, lse)`` with lse (N, T_q)
    (FlashAttention-2's varlen LSE layout).
    """
    _checks.check_policy(fully_masked)
    q = _checks.as_float64("query", query)
    k = _checks.as_float64("key", key)
    v = _checks.as_float64("value", value)
    checks.head_layout(q, k, v, 1, ("(T_q, N, E)", "(T_k, K, E)", "(T_k, K, Ev)"))
    (T, N, E), Ev = q.shape, v.shape[-1]
    sequences = _sequences(cu_seqlens_q, cu_seqlens_k, T, k.shape[0])
    slopes = checks.slopes_array(alibi_slopes, len(sequences), N)        # (1 or B, N)
    scale = _checks.resolve_scale(scale, E)                              # one scale for every sequence
    output = np.zeros((T, N, Ev))
    lse = np.zeros((N, T))
    for b, (rows, keys) in enumerate(sequences):
        result = flash_attention(
            q[None, rows], k[None, keys], v[None, keys],                 # (1, L_b, N, E), (1, S_b, K, E|Ev)
            causal=causal, window=window, softcap=softcap,
            alibi_slopes=None if slopes is None else slopes[b % slopes.shape[0]],
            scale=scale, return_lse=True,
            fully_masked=fully_masked, alignment=alignment)
        output[rows] = result.output[0]                                  # (L_b, N, Ev)
        lse[:, rows] = result.lse[0]                                     # (N, L_b)
    return FlashResult(output, lse) if return_lse else output
