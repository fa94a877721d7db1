"""A naive SDPA computed in low-precision arithmetic: the error yardstick for tolerances.

The conformance runner allows an implementation ``k ×`` the error that this naive
same-precision computation makes against the float64 oracle (FlashAttention's rule).
So the emulation is deliberately plain: each operation's result is rounded to ``dtype``;
reductions (the two matmuls and the softmax sum) accumulate in float32 for the 16-bit
dtypes, as fused kernels and PyTorch's CPU/GPU ops do, and in ``dtype`` itself for
float32/float64. Overflow is not guarded against: a float16 score beyond 65504 becomes
inf exactly as in a naive float16 implementation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from . import _checks
from ._sdpa import Problem, prepare

__all__ = ["EMULATED_DTYPES", "emulate_sdpa", "round_arrays_to", "round_to"]

#: dtype name -> (storage dtype, accumulation dtype); bfloat16 has no NumPy dtype: its
#: values are float32 ones rounded by :func:`_to_bfloat16`.
EMULATED_DTYPES: dict[str, tuple[Any, Any]] = {
    "float64": (np.float64, np.float64),
    "float32": (np.float32, np.float32),
    "float16": (np.float16, np.float32),
    "bfloat16": (None, np.float32),
}


def _to_bfloat16(values: Any) -> np.ndarray:
    """``values`` rounded to bfloat16 (round-to-nearest-even, from float64 in one
    rounding, as ml_dtypes converts), as a float32 array: NaN stays NaN, a value past the
    largest finite bfloat16 becomes ±inf, subnormals keep 2⁻¹³³ steps. NumPy bit
    operations, so nothing is imported for it."""
    x = np.asarray(values, dtype=np.float64)
    bits = x.view(np.uint64)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        # normal range: keep the top 7 of float64's 52 mantissa bits, ties to even
        kept = (bits + np.uint64((1 << 44) - 1) + ((bits >> np.uint64(45)) & np.uint64(1))) \
            & np.uint64(~((1 << 45) - 1) & 0xFFFFFFFFFFFFFFFF)
        out = kept.view(np.float64)
        out = np.where(np.abs(x) < _BF16_MIN_NORMAL, np.round(x * 2.0**133) * 2.0**-133, out)
        out = np.where(np.abs(out) > _BF16_MAX, np.copysign(np.inf, x), out)
        out = np.where(np.isnan(x), x, out)
        return out.astype(np.float32)


_BF16_MIN_NORMAL = 2.0**-126
_BF16_MAX = (2 - 2.0**-7) * 2.0**127


def _store(values: Any, dtype: str) -> np.ndarray:
    """``values`` rounded to ``dtype``, in ``dtype`` (float32 holding bfloat16 values)."""
    if dtype == "bfloat16":
        return _to_bfloat16(values)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return np.asarray(values).astype(EMULATED_DTYPES[dtype][0])


def round_to(values: Any, dtype: str) -> np.ndarray:
    """Round float values to ``dtype`` (round-to-nearest-even) and return them as float64."""
    _checks.check_choice("dtype", dtype, tuple(EMULATED_DTYPES))
    return _store(np.asarray(values, dtype=np.float64), dtype).astype(np.float64)


def round_arrays_to(record: Any, dtype: str) -> Any:
    """``record`` (a dataclass such as ``MHAParams``) with every array field rounded to
    ``dtype`` by :func:`round_to`; other fields (None, flags) as they are."""
    changes = {f.name: round_to(getattr(record, f.name), dtype) for f in dataclasses.fields(record)
               if isinstance(getattr(record, f.name), np.ndarray)}
    return dataclasses.replace(record, **changes)


def _rounder(dtype: str) -> tuple[Callable[[np.ndarray], np.ndarray], Any]:
    """``store(x)``: round x to dtype, hand it back in the accumulation dtype."""
    accumulate = EMULATED_DTYPES[dtype][1]

    def store(x: np.ndarray) -> np.ndarray:
        return _store(x, dtype).astype(accumulate)

    return store, accumulate


def emulate_sdpa(query: Any, key: Any, value: Any, *, dtype: str, attend_mask: Any = None,
                 additive_mask: Any = None, causal: str | None = None,
                 scale: float | None = None, fully_masked: str = "zero", sinks: Any = None) -> np.ndarray:
    """Output (..., N, L, Ev) of a naive SDPA run in ``dtype`` arithmetic, as float64 values.

    Same arguments and mask polarity as :func:`spec.sdpa` (``attend_mask`` True = may
    attend, ``additive_mask`` added to the scaled scores). ``dtype`` is one of "float64",
    "float32", "float16", "bfloat16". Inputs are first rounded to ``dtype`` (values already
    stored in that dtype are unchanged). With "float64" the result equals the oracle.
    """
    _checks.check_choice("dtype", dtype, tuple(EMULATED_DTYPES))
    _checks.check_policy(fully_masked)
    p = prepare(query, key, value, attend_mask=attend_mask, additive_mask=additive_mask,
                causal=causal, scale=scale, sinks=sinks)
    output, _ = attend(p, dtype, fully_masked)
    return output.astype(np.float64)


def attend(p: Problem, dtype: str, fully_masked: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps 1-5 of the naive computation on a prepared problem: ``(output, weights)``,
    (..., N, L, Ev) and (..., N, L, S), values of ``dtype`` held in its accumulation dtype."""
    store, accumulate = _rounder(dtype)
    q, k, v = store(p.query), store(p.key), store(p.value)        # rounded to dtype
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        # 1. logits = scale · (q kᵀ): a rounded matmul, then a rounded multiply  (..., N, L, S)
        logits = store(accumulate(p.scale) * store(q @ np.swapaxes(k, -1, -2)))
        # 2. scores = logits + additive mask; blocked keys -> -inf
        scores = logits if p.additive is None else store(logits + store(p.additive))
        scores = np.where(p.allowed, scores, accumulate(-np.inf))
        # 3-4. softmax in the accumulation dtype, weights rounded once to dtype
        empty_row = ~p.allowed.any(axis=-1, keepdims=True)                   # (..., N, L, 1)
        row_max = np.where(empty_row, accumulate(0), scores.max(axis=-1, keepdims=True))
        if p.sinks is not None:  # the sink (read in the accumulation dtype) joins max and sum
            sink = accumulate(p.sinks)
            row_max = np.where(empty_row, sink, np.maximum(row_max, sink))
        unnormalised = np.exp(scores - row_max)
        total = unnormalised.sum(axis=-1, keepdims=True)
        if p.sinks is not None:
            total = total + np.exp(sink - row_max)
            empty_row = np.zeros_like(empty_row)             # the sink holds an empty row's weight
        weights = store(unnormalised / np.where(empty_row, accumulate(1), total))
        if fully_masked == "nan":
            weights = np.where(empty_row, accumulate(np.nan), weights)
        elif fully_masked == "uniform":
            weights = np.where(empty_row, store(accumulate(1.0 / weights.shape[-1])), weights)
        # 5. output = weights · v, rounded to dtype                          (..., N, L, Ev)
        output = store(weights @ v)
    return output, weights
