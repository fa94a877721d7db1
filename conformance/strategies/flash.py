"""Hypothesis strategies for flash-level cases (``conformance.calls.flash.FlashCase``).

Sizes and values are the SDPA strategies' (``sizes.draw_sizes``, ``values.sdpa_values``),
drawn heads first and handed over in FlashAttention's layout; head dims mostly up to 16,
or from a declared ``min_head_dim`` up to twice it (within ``max_head_dim``: 64..128 for a
kernel declaring 64 and 128). The features are drawn
where they matter:

* ``window`` sides at and around their edges: -1 (unbounded), 0, 1, a random width,
  S - 1, S, S + 1 and L + S (wider than every row reaches), each side on its own;
* ``softcap`` relative to the case's largest |scaled logit| m: far below it (m / 20:
  every logit saturates), near it (m / 2, m), above it (2 m) and far above (20 m: the
  cap changes almost nothing), and Gemma-2's 50;
* ALiBi slopes per head: the standard geometric ``2^(-8 (h + 1) / N)``, random reals of
  either sign, one zero slope, per head (N,) or per batch item and head (B, N); exact in
  float32, the dtype FlashAttention reads them in;
* learned ``sinks`` (N,) relative to the case's largest |score| m: zero, random around
  the scores, far above every score (the sink takes nearly all the mass), far below (it
  changes almost nothing), 1000 above (exp(sink - max over the keys) overflows unless the
  sink joins the max), one per head differing; exact in bfloat16, float16 and float32;
* FP8 inputs (``fp8=True``, the formats of ``caps.fp8_dtypes``): each of q, k, v with no
  descale, one per tensor, or one per batch element and kv head (FlashAttention-3's),
  each factor as a quantisation makes it (amax / the format's largest, times a jitter in
  [1, 2)), a power of two, or a random float32; the values quantised as ``stored =
  round(value / descale)`` (saturating at the format's largest), so ``stored · descale``
  is about the drawn value and exact in float64 (``spec.fp8``).

Simplest first everywhere, so a failing case shrinks toward no feature and small sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from hypothesis import strategies as st

from conformance.calls.flash import FlashCase
from conformance.calls.flash_bounds import _forward
from conformance.strategies._drawing import draw_seed, named_strategy, weighted
from conformance.strategies.shape_budget import check_shape_budget, shape_pool
from conformance.strategies.sizes import draw_sizes, size_bounds
from conformance.strategies.values import _draw_scale, _scale_kind_choices, sdpa_values
from implementations.base import Capabilities
from spec import fp8 as spec_fp8
from spec.emulate import round_to

__all__ = ["FLASH_REGIMES", "alibi_slopes", "exact_sinks", "flash_cases", "fp8_inputs", "sink_logits",
           "softcaps", "window_sides"]

#: Value regimes drawn at the flash level (``values.REGIMES``), simplest first.
FLASH_REGIMES = ("normal", "large_logits", "near_ties", "wide_range", "ascending")
#: Gemma-2's attention logit soft-cap.
GEMMA_SOFTCAP = 50.0


def window_sides(draw: st.DrawFn, L: int, S: int) -> int:
    """One window side: -1, 0, 1, a random width, S - 1, S, S + 1 or L + S."""
    kind = weighted(draw, [("unbounded", 3), ("zero", 3), ("one", 3), ("random", 3), ("S-1", 2),
                           ("S", 2), ("S+1", 1), ("L+S", 1)])
    if kind == "random":
        return draw(st.integers(0, max(L, S)))
    return {"unbounded": -1, "zero": 0, "one": 1, "S-1": max(S - 1, 0), "S": S, "S+1": S + 1,
            "L+S": L + S}[kind]


def _window(draw: st.DrawFn, L: int, S: int) -> tuple[int, int]:
    """A window with at least one bounded side ((-1, -1) is no window)."""
    left, right = window_sides(draw, L, S), window_sides(draw, L, S)
    if (left, right) == (-1, -1):
        right = draw(st.integers(0, max(L, S)))
    return left, right


def softcaps(draw: st.DrawFn, max_logit: float) -> float:
    """A soft-cap relative to the largest |scaled logit| (exact in float32, > 0)."""
    m = max(max_logit, 1e-3)
    kind = weighted(draw, [("near", 3), ("far_below", 3), ("half", 2), ("above", 2), ("far_above", 1),
                           ("gemma", 1)])
    value = {"near": m, "far_below": m / 20, "half": m / 2, "above": 2 * m, "far_above": 20 * m,
             "gemma": GEMMA_SOFTCAP}[kind]
    return float(np.float32(value))


def alibi_slopes(draw: st.DrawFn, rng: np.random.Generator, B: int, N: int) -> np.ndarray:
    """Slopes (N,) or (B, N), exact in float32: geometric, random of either sign, with a zero."""
    per_batch = weighted(draw, [(False, 3), (True, 1)])
    shape = (B, N) if per_batch else (N,)
    kind = weighted(draw, [("geometric", 3), ("random", 3), ("with_zero", 1)])
    if kind == "geometric":
        slopes = np.broadcast_to(2.0 ** (-8.0 * (np.arange(N) + 1) / N), shape).copy()
    else:
        slopes = rng.uniform(-1.0, 1.0, shape)
        if kind == "with_zero":
            slopes[..., 0] = 0.0
    return slopes.astype(np.float32).astype(np.float64)


def exact_sinks(values: np.ndarray) -> np.ndarray:
    """Sink logits rounded to bfloat16 (8 significant bits), within float16's range and
    without its subnormals: exact in every dtype a kernel may read them in."""
    values = np.clip(round_to(np.asarray(values, dtype=np.float64), "bfloat16"), -60000.0, 60000.0)
    return np.where(np.abs(values) < 2.0 ** -10, 0.0, values)


def sink_logits(draw: st.DrawFn, rng: np.random.Generator, N: int, max_score: float) -> np.ndarray:
    """Sinks (N,) relative to the largest |score| m: zero, random in [-m, m] + noise, m + 20
    (the sink dominates), -m - 20 (negligible), m + 1000 (overflows exp(sink - key max))."""
    m = max(max_score, 1e-3)
    kind = weighted(draw, [("random", 4), ("zero", 2), ("above", 2), ("below", 1), ("huge", 1)])
    if kind == "zero":
        values = np.zeros(N)
    elif kind == "random":
        values = rng.uniform(-m - 2.0, m + 2.0, N)
    else:
        values = np.full(N, {"above": m + 20.0, "below": -m - 20.0, "huge": m + 1000.0}[kind])
        values[::2] = values[::2] * rng.uniform(0.9, 1.1)  # the heads' sinks differ
    return exact_sinks(values)


def _descale(draw: st.DrawFn, rng: np.random.Generator, x: np.ndarray, fmt: spec_fp8.FP8Format,
             per_head: bool, K: int) -> np.ndarray:
    """One descale factor (float32-exact, > 0): shape (1,), or (B, K) for ``x`` (B, T, H, X)
    whose H = K or N heads share K factors by group (query head h: h // (N // K))."""
    kind = weighted(draw, [("amax", 3), ("power_of_two", 2), ("random", 1)])
    shape = (x.shape[0], K) if per_head else (1,)
    if kind == "amax":  # the scale a quantiser picks: the largest |value| lands near the format's max
        B, T, H, X = x.shape
        grouped = np.abs(x).reshape(B, T, K, H // K, X)
        amax = grouped.max(axis=(1, 3, 4)) if per_head else np.abs(x).max(keepdims=True).reshape(1)
        d = np.maximum(amax, 2.0 ** -20) / fmt.max * rng.uniform(1.0, 2.0, shape)
    elif kind == "power_of_two":
        d = 2.0 ** rng.integers(-6, 7, shape).astype(np.float64)
    else:
        d = 2.0 ** rng.uniform(-8.0, 4.0, shape)
    return np.float32(d).astype(np.float64)


def fp8_inputs(draw: st.DrawFn, rng: np.random.Generator, case: FlashCase, formats: Sequence[str],
               descales: Sequence[str] = ("none", "per_tensor", "per_head")) -> FlashCase:
    """``case`` with q, k, v quantised to an FP8 format of ``formats`` (with their descales,
    each given in one of the forms ``descales``)."""
    fmt = spec_fp8.format_of(weighted(draw, [(name, 1) for name in formats]))
    changes: dict[str, Any] = {"fp8": fmt.name}
    forms = [(form, weight) for form, weight in (("none", 1), ("per_tensor", 2), ("per_head", 3)) if form in descales]
    for name, descale in (("query", "q_descale"), ("key", "k_descale"), ("value", "v_descale")):
        x = getattr(case, name)
        form = weighted(draw, forms)
        d = None if form == "none" else _descale(draw, rng, x, fmt, form == "per_head", case.K)
        if d is None:
            scaled = x
        elif name == "query" and d.shape != (1,):  # (B, K) read by query head h // (N // K)
            scaled = x / np.repeat(d, case.N // case.K, axis=1)[:, None, :, None]
        else:
            scaled = x / (d[:, None, :, None] if d.shape != (1,) else d)
        changes[name] = spec_fp8.quantize(scaled, fmt.name, saturate=True)
        changes[descale] = d
    return case.replace(**changes)


def flash_cases(*, dtype: str = "float64", device: str = "cpu", caps: Capabilities | None = None,
                window: bool | None = False, softcap: bool | None = False, alibi: bool | None = False,
                causal: bool | None = None, regimes: Sequence[str] | None = None,
                scale_kinds: Sequence[str] | bool = True, min_S: int = 1, max_L: int | None = 33,
                max_S: int | None = 33, max_heads: int = 4, gqa: bool | None = None,
                split: bool = False, shape_budget: int | None = None,
                sinks: bool | None = False, fp8: bool = False) -> st.SearchStrategy[FlashCase]:
    """Flash-level cases within ``caps``. Each feature: True (always), False (never),
    None (drawn, half the time, when ``caps.flash_features`` has it). ``causal`` likewise
    (needs ``caps.causal == "lower_right"``). ``split``: S >= 2 (the case is split in two
    key sets). ``shape_budget``: sizes from at most this many shapes (JIT implementations,
    :mod:`conformance.strategies.shape_budget`), one with L > S and one with L <= S among them.
    ``fp8``: q, k, v in one of ``caps.fp8_dtypes`` (:func:`fp8_inputs`), drawn last."""
    arguments = dict(locals())
    features = caps.flash_features if caps is not None else frozenset({"window", "softcap", "alibi", "sinks"})
    can_causal = caps is None or caps.causal == "lower_right"
    if caps is not None and caps.causal_only:  # every call causal (a property that needs
        causal = True                          # non-causal calls skips: its skip_reason)
    bounds = size_bounds(caps, min_batch=1, max_batch=2, min_heads=1, max_heads=max_heads, gqa=gqa,
                         min_L=1, max_L=max_L,
                         min_S=max(min_S, 2 * ((caps.seq_multiple if caps else None) or 1) if split else 1),
                         max_S=max_S,
                         min_head_dim=None, max_head_dim=None, different_v_dim=None,
                         default_max_length=33, default_max_head_dim=16)
    budget = check_shape_budget(shape_budget)
    pool = None
    if budget is not None:
        relations = ["L<=S"] if bounds.equal_lengths or bounds.max_L <= bounds.min_S else ["L<=S", "L>S"]
        pool = shape_pool(bounds, budget, [(relation, None) for relation in relations])
    kinds = _scale_kind_choices(scale_kinds, caps)
    regime_choices = list(regimes or FLASH_REGIMES)

    def use(draw: st.DrawFn, wanted: bool | None, available: bool) -> bool:
        if wanted is None:
            return available and draw(st.booleans())
        return bool(wanted) and available

    def draw_case(draw: st.DrawFn) -> FlashCase:
        sizes = pool.draw(draw, (None, None)) if pool is not None else draw_sizes(draw, bounds)
        regime = weighted(draw, [(r, 4 if i == 0 else 1) for i, r in enumerate(regime_choices)])
        scale = _draw_scale(draw, kinds, dtype)
        rng = draw_seed(draw)
        q, k, v = sdpa_values(rng, sizes, regime, dtype, scale, ())
        t = (0, 2, 1, 3)
        L, S, B, N = sizes["L"], sizes["S"], sizes["B"], sizes["N"]
        case = FlashCase(q.transpose(t).copy(), k.transpose(t).copy(), v.transpose(t).copy(),
                         scale=scale, dtype=dtype, device=device, regime=regime)
        changes: dict[str, Any] = {}
        if use(draw, causal, can_causal):
            changes["causal"] = True
        if use(draw, window, "window" in features):
            changes["window"] = _window(draw, L, S)
        if use(draw, softcap, "softcap" in features):
            s = case.scale if case.scale is not None else 1 / math.sqrt(sizes["E"])
            logits = s * (q @ np.swapaxes(np.repeat(k, N // sizes["K"], axis=1), -1, -2))
            changes["softcap"] = softcaps(draw, float(np.abs(logits).max()) if logits.size else 1.0)
        if use(draw, alibi, "alibi" in features):
            changes["alibi_slopes"] = alibi_slopes(draw, rng, B, N)
        if use(draw, sinks, "sinks" in features):
            scored = case.replace(**changes) if changes else case
            _, forward = _forward(scored)
            capped = forward.logits if scored.softcap == 0 else scored.softcap * np.tanh(forward.logits / scored.softcap)
            finite = np.abs(capped[np.isfinite(capped)])
            changes["sinks"] = sink_logits(draw, rng, N, float(finite.max()) if finite.size else 1.0)
        case = case.replace(**changes) if changes else case
        if fp8:
            case = (fp8_inputs(draw, rng, case, caps.fp8_dtypes, caps.fp8_descales) if caps is not None
                    else fp8_inputs(draw, rng, case, tuple(spec_fp8.FORMATS)))
        return case

    return named_strategy(flash_cases, arguments, draw_case)
