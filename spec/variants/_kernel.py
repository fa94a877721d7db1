"""One sequence of FlashAttention's attention with each step a switch (pure NumPy, float64):
the oracle of ``spec.flash_attention`` when every switch is off, a wrong convention when
one is on. The flash, varlen and kvcache variants are made of it.

Layout per sequence, FlashAttention's: q (L, N, E), k (S, K, E), v (S, K, Ev); the output
(L, N, Ev) and the LSE (N, L). Dimension letters as in ``spec.flash``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Steps", "Attended", "attend", "merge", "plain_lse", "compute_dtype"]

#: The conventions a sink can be handled by (``Steps.sink``); "right" is the spec's.
SINK_MODES = ("right", "with_value", "after_shift", "per_row", "weight_kept", "scaled")


@dataclass(frozen=True)
class Steps:
    """Which step of one sequence's attention is done the wrong way (all off: the spec).

    ``causal_upper_left``: a right side of 0 (causal, or window right 0) keeps key j <= i
    instead of j <= p_i. ``window_left_strict``: the left edge keeps j > p_i - left.
    ``window_ignored``: window_size dropped (causal kept). ``softcap_before_scale``:
    scale · c·tanh(q·k / c). ``softcap_after_mask``: c·tanh applied to the masked, biased
    scores, so a blocked key's -inf becomes -c. ``alibi_upper_left``: the ALiBi distance
    |i - j|. ``sink``: one of :data:`SINK_MODES`. ``lse``: "natural" (the spec's),
    "log2" (the LSE in base-2 units) or "uncapped" (of the scores before soft-capping).
    """

    causal_upper_left: bool = False
    window_left_strict: bool = False
    window_ignored: bool = False
    softcap_before_scale: bool = False
    softcap_after_mask: bool = False
    alibi_upper_left: bool = False
    sink: str = "right"
    lse: str = "natural"


class Attended(NamedTuple):
    """One sequence's result: ``output`` (L, N, Ev), ``lse`` (N, L), ``magnitude`` (L, N, Ev)
    (weights · |V|), ``score_size`` (N, L) (the largest |score| a row attends), ``live``
    (L,) rows that attend a key."""

    output: np.ndarray
    lse: np.ndarray
    magnitude: np.ndarray
    score_size: np.ndarray
    live: np.ndarray


def compute_dtype(dtype: str) -> Any:
    """What an implementation of ``dtype`` computes its softmax in: float64 or float32."""
    return np.float64 if dtype == "float64" else np.float32


def _empty(L: int, N: int, Ev: int, policy: str) -> Attended:
    fill = np.nan if policy == "nan" else 0.0
    return Attended(np.full((L, N, Ev), fill), np.full((N, L), -np.inf), np.zeros((L, N, Ev)),
                    np.zeros((N, L)), np.zeros(L, dtype=bool))


def _allowed(L: int, S: int, window: tuple[int, int], causal: bool, offset: int, steps: Steps) -> np.ndarray:
    """(L, S) True = may attend: p_i - left <= j <= p_i + right, p_i = i + offset."""
    left, right = window
    if steps.window_ignored:
        left, right = -1, -1
    if causal:
        right = 0
    rows = np.arange(L)[:, None]
    position, keys = rows + offset, np.arange(S)[None, :]
    allowed = np.ones((L, S), dtype=bool)
    if left >= 0:
        allowed &= (keys > position - left) if steps.window_left_strict else (keys >= position - left)
    if right >= 0:
        allowed &= (keys <= rows) if (steps.causal_upper_left and right == 0) else (keys <= position + right)
    return allowed


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: float, causal: bool = False,
           window: tuple[int, int] = (-1, -1), softcap: float = 0.0, slopes: np.ndarray | None = None,
           sinks: np.ndarray | None = None, offset: int | None = None, policy: str = "zero",
           dtype: str = "float64", steps: Steps | None = None) -> Attended:
    """One sequence, q (L, N, E), k (S, K, E), v (S, K, Ev), under ``steps``.

    ``offset`` is p_i - i (None: S - L, the bottom-right alignment); ``slopes`` (N,);
    ``sinks`` (N,). A row with no attendable key follows ``policy`` ("zero", "nan",
    "uniform": the mean of the S values; "unspecified" reads as zero); with sinks it is 0.
    ``dtype`` is the precision the implementation computed in (a sink's exp overflows
    in it)."""
    steps = steps or Steps()
    L, N, _ = q.shape
    S, K, Ev = v.shape
    if L == 0 or S == 0:
        return _empty(L, N, Ev, "zero" if sinks is not None else policy)
    offset = S - L if offset is None else offset
    group = N // K
    qh = q.transpose(1, 0, 2)                                            # (N, L, E)
    kh = np.repeat(k.transpose(1, 0, 2), group, axis=0)                  # (N, S, E)
    vh = np.repeat(v.transpose(1, 0, 2), group, axis=0)                  # (N, S, Ev)
    with np.errstate(all="ignore"):
        raw = qh @ np.swapaxes(kh, -1, -2)                               # (N, L, S)
        logits = scale * raw
        capped = logits
        if softcap and steps.softcap_before_scale:
            capped = scale * (softcap * np.tanh(raw / softcap))
        elif softcap and not steps.softcap_after_mask:
            capped = softcap * np.tanh(logits / softcap)
        bias = 0.0
        if slopes is not None:
            position = np.arange(L)[:, None] + (0 if steps.alibi_upper_left else offset)
            bias = -np.asarray(slopes)[:, None, None] * np.abs(position - np.arange(S)[None, :])
        allowed = np.broadcast_to(_allowed(L, S, window, causal, offset, steps), (N, L, S))
        scores = np.where(allowed, capped + bias, -np.inf)
        if softcap and steps.softcap_after_mask:
            scores = softcap * np.tanh(scores / softcap)                 # -inf becomes -c: every key attends
            allowed = np.ones((N, L, S), dtype=bool)
        empty = ~allowed.any(axis=-1, keepdims=True)                     # (N, L, 1)
        key_max = np.where(empty, -np.inf, scores.max(axis=-1, keepdims=True))
        shift = np.where(empty, 0.0, key_max)
        sink_weight = None
        if sinks is None:
            e = np.exp(scores - shift)
            total = e.sum(axis=-1, keepdims=True)
            weights = e / np.where(total == 0, 1.0, total)
        else:
            weights, sink_weight = _with_sinks(scores, key_max, shift, np.asarray(sinks, dtype=np.float64),
                                               scale, L, dtype, steps)
        output = weights @ vh                                            # (N, L, Ev)
        magnitude = weights @ np.abs(vh)
        if sink_weight is not None and steps.sink == "with_value":
            output, magnitude = output + sink_weight * vh[:, :1], magnitude + sink_weight * np.abs(vh[:, :1])
        if sink_weight is not None and steps.sink == "weight_kept":
            output, magnitude = output + sink_weight, magnitude + sink_weight
        if sinks is None and policy == "nan":
            output = np.where(empty, np.nan, output)
        elif sinks is None and policy == "uniform":
            output = np.where(empty, vh.mean(axis=-2, keepdims=True), output)
            magnitude = np.where(empty, np.abs(vh).mean(axis=-2, keepdims=True), magnitude)
        lse_scores = scores
        if steps.lse == "uncapped" and softcap:
            lse_scores = np.where(allowed, logits + bias, -np.inf)
        lse = _lse(lse_scores, empty)
        if steps.lse == "log2":
            lse = lse / math.log(2.0)
        size = np.abs(scale) * (np.abs(qh) @ np.swapaxes(np.abs(kh), -1, -2))
        if softcap:
            size = np.minimum(size, softcap)
        size = size + np.abs(bias)
        attended = allowed & (weights > 0)
        score_size = np.where(attended, size, 0.0).max(axis=-1)           # (N, L)
    live = ~empty[0, :, 0]
    return Attended(output.transpose(1, 0, 2), lse, magnitude.transpose(1, 0, 2), score_size, live)


def _with_sinks(scores: np.ndarray, key_max: np.ndarray, shift: np.ndarray, sinks: np.ndarray, scale: float,
                L: int, dtype: str, steps: Steps) -> tuple[np.ndarray, np.ndarray]:
    """(key weights (N, L, S), the sink's weight (N, L, 1)) of a softmax whose denominator
    holds one sink logit per head (``spec.flash``), or the wrong handling of ``steps.sink``."""
    N = scores.shape[0]
    sink = sinks[:, None, None]                                          # (N, 1, 1)
    if steps.sink == "per_row":                                          # row i uses sinks[i % N]
        sink = np.broadcast_to(sinks[np.arange(L) % N][None, :, None], (N, L, 1))
    elif steps.sink == "scaled":
        sink = sink * scale
    if steps.sink == "after_shift":                                      # exp(sink) unshifted
        e = np.exp(scores - shift)
        es = np.exp(sink.astype(compute_dtype(dtype))).astype(np.float64)   # overflows in the dtype
        es = np.broadcast_to(es, (N, L, 1))
        total = e.sum(axis=-1, keepdims=True) + es
        return e / total, es / total
    top = np.maximum(key_max, sink)
    e = np.exp(scores - top)
    es = np.broadcast_to(np.exp(sink - top), (N, L, 1))
    total = e.sum(axis=-1, keepdims=True) + es
    return e / total, es / total


def _lse(scores: np.ndarray, empty: np.ndarray) -> np.ndarray:
    """(N, L): log Σ exp over the attendable scores (-inf elsewhere), -inf for empty rows."""
    with np.errstate(all="ignore"):
        top = np.where(empty, 0.0, scores.max(axis=-1, keepdims=True))
        total = np.exp(scores - top).sum(axis=-1, keepdims=True)
        lse = np.where(empty, -np.inf, top + np.log(np.where(empty, 1.0, total)))
    return lse[..., 0]


def plain_lse(q: np.ndarray, k: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """(LSE (N, L), score size (N, L)) of q (L, N, E) over every key of k (S, K, E): scaled
    logits, no mask, cap or bias (-inf with no key)."""
    L, N, _ = q.shape
    S, K, _ = k.shape
    if S == 0 or L == 0:
        return np.full((N, L), -np.inf), np.zeros((N, L))
    qh = q.transpose(1, 0, 2)
    kh = np.repeat(k.transpose(1, 0, 2), N // K, axis=0)
    scores = scale * (qh @ np.swapaxes(kh, -1, -2))
    size = (np.abs(scale) * (np.abs(qh) @ np.swapaxes(np.abs(kh), -1, -2))).max(axis=-1)
    return _lse(scores, np.zeros((N, L, 1), dtype=bool)), size


def merge(parts: list[Attended], *, mode: str = "max", dtype: str = "float64") -> tuple[np.ndarray, ...]:
    """(output (L, N, Ev), LSE (N, L), magnitude) of the partial results of disjoint key
    chunks (split-KV decoding): ``mode`` "max" (the spec's: shifted by the largest partial
    LSE), "no_max" (e^lse_c unshifted, in the dtype's compute precision: inf / inf = NaN
    once an LSE passes exp's range, 0 where every chunk underflows) or "no_rescale" (the
    partial outputs added without their weights; the LSE merged right)."""
    outs = np.stack([p.output for p in parts])                           # (P, L, N, Ev)
    mags = np.stack([p.magnitude for p in parts])
    lses = np.stack([p.lse for p in parts])                              # (P, N, L)
    with np.errstate(all="ignore"):
        top = lses.max(axis=0)
        top = np.where(np.isfinite(top), top, 0.0)
        weights = np.exp(lses - top)
        total = weights.sum(axis=0)
        lse = np.where(total > 0, top + np.log(np.where(total > 0, total, 1.0)), -np.inf)
        share = weights / np.where(total > 0, total, 1.0)                # (P, N, L)
        if mode == "no_max":
            work = compute_dtype(dtype)
            weights = np.exp(lses.astype(work))
            total = weights.sum(axis=0)
            lse = np.where(total > 0, np.log(np.where(total > 0, total, 1)), -np.inf).astype(np.float64)
            lse = np.where(np.isposinf(lse), -np.inf, lse)   # read as FlashAttention-2's +inf: no key
            share = (weights / np.where(total > 0, total, work(1))).astype(np.float64)
        rows = np.swapaxes(share, -1, -2)[..., None]                     # (P, L, N, 1)
        if mode == "no_rescale":
            return outs.sum(axis=0), lse, mags.sum(axis=0)
        return (rows * outs).sum(axis=0), lse, (rows * mags).sum(axis=0)
