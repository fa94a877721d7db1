"""The tolerance rule sequence by sequence, for a packed batch and for a cache alike.

Each sequence is one SDPA problem of its own (B = 1, the sequence's own L and S,
FlashAttention's bottom-right causal, bounded by ``calls.sdpa.allowed_for``); with a window,
soft-capping or ALiBi it is the flash level's rule (``conformance.calls.flash_bounds``) on
the sequence as a flash case, which also bounds the LSE. A level hands over its sequences
as ``(b, at, q, k, v)``: sequence b's queries (L, N, E), keys (S, K, E) and values (S, K,
Ev), and ``at``, where its rows go in the level's arrays.

Dimension letters: N query heads, K kv heads, L query length, S key length, E q/k head
dim, Ev value head dim.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from conformance.calls import sdpa as calls
from conformance.calls.cache_options import (
    flash_options,
    sequence_flash_case,
    sequence_lse_bounds,
    slopes_row,
)
from conformance.calls.flash_bounds import allowed_output
from conformance.calls.flash_bounds import oracle as flash_oracle
from conformance.core.cases import SDPACase
from conformance.core.compare import compare_values
from conformance.core.target import Target

__all__ = ["compare_with_oracle", "compared_rows", "sequence_bounds", "sequences_bounds", "sequences_lse_bounds"]

#: One sequence of a case: (b, where its rows go, q (L, N, E), k (S, K, E), v (S, K, Ev)).
Sequence = tuple[int, Any, np.ndarray, np.ndarray, np.ndarray]


def sequence_bounds(target: Target, q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool,
                    scale: float | None, dtype: str, device: str,
                    options: dict[str, Any] | None = None) -> tuple[np.ndarray, ...]:
    """One sequence, q (L, N, E), k (S, K, E), v (S, K, Ev): (expected (L, N, Ev), allowed
    (L, N, Ev), live (L, N, 1): rows that attend at least one key), by ``calls.sdpa.allowed_for``
    on the sequence as an SDPA case (B = 1, bottom-right causal, fully-masked rows -> 0);
    with ``options`` (window, softcap, alibi_slopes (N,)), by the flash level's rule."""
    L, N, _ = q.shape
    S, _, Ev = v.shape
    if L == 0 or S == 0:
        zeros = np.zeros((L, N, Ev))
        return zeros, zeros, np.zeros((L, N, 1), dtype=bool)
    if options:
        flash_case = sequence_flash_case(q, k, v, causal=causal, scale=scale, dtype=dtype, device=device,
                                         options=options)
        ref = flash_oracle(flash_case)
        live = np.broadcast_to(~flash_case.empty_rows()[:, None, None], (L, N, 1))
        return ref.output[0], allowed_output(target, flash_case, ref)[0], live
    case = SDPACase(np.transpose(q, (1, 0, 2))[None], np.transpose(k, (1, 0, 2))[None],
                    np.transpose(v, (1, 0, 2))[None], causal="lower_right" if causal else None,
                    scale=scale, dtype=dtype, device=device)     # (1, N, L, E), (1, K, S, E|Ev)
    allowed, ref = calls.allowed_for(target, case)                  # (1, N, L, Ev)
    live = calls.valid_rows(case)                                   # (1, N, L, 1)

    def back(x: np.ndarray) -> np.ndarray:                          # (1, N, L, X) -> (L, N, X)
        return np.transpose(x[0], (1, 0, 2))

    return back(ref.output), back(allowed), back(live)


def _options(case: Any, b: int, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with sequence b's row of the ALiBi slopes, when the case has slopes."""
    if options.get("alibi_slopes") is not None:
        options["alibi_slopes"] = slopes_row(case.alibi_slopes, b)
    return options


def sequences_bounds(target: Target, case: Any, sequences: Iterable[Sequence],
                     shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(expected, allowed, live rows) of the whole case, arrays of ``shape`` (live: its last
    axis 1), filled sequence by sequence by :func:`sequence_bounds`."""
    expected, allowed = np.zeros(shape), np.zeros(shape)
    live = np.zeros((*shape[:-1], 1), dtype=bool)
    options = flash_options(case)
    for b, at, q, k, v in sequences:
        expected[at], allowed[at], live[at] = sequence_bounds(
            target, q, k, v, causal=case.causal, scale=case.scale, dtype=case.dtype, device=case.device,
            options=_options(case, b, options))
    return expected, allowed, live


def sequences_lse_bounds(target: Target, case: Any, sequences: Iterable[Sequence], shape: tuple[int, ...],
                         stored: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(expected LSE, allowed error), arrays of ``shape``, sequence by sequence
    (``cache_options.sequence_lse_bounds``; ``stored``: the dtype the LSE came back in)."""
    expected, allowed = np.zeros(shape), np.zeros(shape)
    options = flash_options(case)
    for b, at, q, k, v in sequences:
        expected[at], allowed[at] = sequence_lse_bounds(
            target, q, k, v, causal=case.causal, scale=case.scale, dtype=case.dtype, device=case.device,
            options=_options(case, b, options), stored=stored)
    return expected, allowed


def compared_rows(target: Target, live: np.ndarray) -> np.ndarray | None:
    """Rows to compare: all of them under the ``zero`` policy (FlashAttention's: a row
    with no key gives 0), only the live ones otherwise (``fully_masked`` declares the rest)."""
    return None if target.caps.fully_masked == "zero" else live


def compare_with_oracle(target: Target, what: str, output: np.ndarray,
                        bounds: tuple[np.ndarray, np.ndarray, np.ndarray]) -> float:
    """``output`` against (expected, allowed, live) of :func:`sequences_bounds`: the worst
    error/allowed ratio."""
    __tracebackhide__ = True
    expected, allowed, live = bounds
    return compare_values(what, output, expected, allowed, where=compared_rows(target, live)).ratio
