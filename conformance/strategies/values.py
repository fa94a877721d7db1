"""What the arrays of an SDPA case hold and how they are handed over: value
regimes, ``scale`` arguments, memory layouts, and the q/k/v arrays themselves.

Values are drawn in float64 from a NumPy Generator and rounded through the
case's dtype (``spec.emulate.round_to``), so a case holds exactly the values an
implementation stores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from hypothesis import strategies as st

from conformance.core.cases import LAYOUTS
from conformance.core.tolerance import EPS as UNIT_ROUNDOFF
from conformance.strategies._drawing import named_strategy, weighted
from conformance.strategies._validation import choices, fail
from implementations.base import Capabilities
from spec.emulate import round_to

__all__ = ["REGIMES", "SCALE_KINDS", "layouts", "scales", "value_regimes"]

#: Value regimes, simplest first (shrinking goes to "normal").
REGIMES = ("normal", "large_logits", "near_ties", "tiny", "constant_rows", "wide_range", "ascending")
#: Kinds of ``scale``, simplest first: None (1/sqrt(E)), an explicit positive
#: value, 1e-6, a negative value, 0.
SCALE_KINDS = ("default", "positive", "tiny", "negative", "zero")
_SCALE_WEIGHTS = {"default": 6, "positive": 2, "tiny": 1, "negative": 1, "zero": 1}

#: Largest |q·k| partial sum (scale included) a float16 case may reach: float16
#: overflows at 65504; leave room for implementations that scale before the dot.
_FLOAT16_DOT_LIMIT = 2.0e4
#: Target max |scale · q·k| of the "large_logits" regime, per dtype.
_LARGE_LOGITS = {"float16": 1.5e4, "bfloat16": 1.0e5, "float32": 1.0e5, "float64": 1.0e6}
#: Magnitude of the "tiny" regime, per dtype (products stay normal numbers).
_TINY = {"float16": 2.0**-6, "bfloat16": 2.0**-30, "float32": 2.0**-30, "float64": 2.0**-100}
#: Spread (powers of two) of the "wide_range" regime across rows and batch items.
_WIDE_EXPONENT = {"float16": 3, "bfloat16": 8, "float32": 8, "float64": 12}


# ---------------------------------------------------------------------------
# regimes, scales, layouts
# ---------------------------------------------------------------------------

def value_regimes(*, regimes: Sequence[str] | None = None) -> st.SearchStrategy[str]:
    """Names of value regimes (see :data:`REGIMES`):

    "normal" unit normal; "large_logits" scaled logits near the dtype's safe range
    (float16: every |q·k| partial sum, scale included, below 2e4); "near_ties" keys
    within a few ulps of each other per head; "tiny" every value ~2^-6 (float16) to
    2^-100 (float64); "constant_rows" some heads with all keys / values / queries
    equal along the sequence; "wide_range" row and batch magnitudes spread over
    powers of two; "ascending" logits that grow along the keys for about half the
    queries (the running max of a tiled softmax changes in every key block).
    Shrinks toward "normal".
    """
    arguments = dict(locals())
    chosen = choices("regimes", regimes, REGIMES, REGIMES)
    return named_strategy(value_regimes, arguments, lambda draw: draw(st.sampled_from(chosen)))


def _scale_kind_choices(scale_kinds: Any, caps: Capabilities | None) -> list[str]:
    custom = caps is None or caps.custom_scale
    if scale_kinds is True:
        return _positive_only(list(SCALE_KINDS) if custom else ["default"], caps)
    if scale_kinds is False:
        return ["default"]
    chosen = choices("scale_kinds", scale_kinds, SCALE_KINDS, SCALE_KINDS)
    if not custom and chosen != ["default"]:
        raise fail("scale_kinds", scale_kinds, "asks for explicit scales but caps.custom_scale=False",
                   "pass scale_kinds=False")
    return _positive_only(chosen, caps)


def _positive_only(kinds: list[str], caps: Capabilities | None) -> list[str]:
    """``kinds`` without negative and zero scales where ``caps.positive_scale`` (at least the default)."""
    if caps is None or not caps.positive_scale:
        return kinds
    return [k for k in kinds if k not in ("negative", "zero")] or ["default"]


def _draw_scale(draw: st.DrawFn, kinds: Sequence[str], dtype: str) -> float | None:
    kind = weighted(draw, [(k, _SCALE_WEIGHTS[k]) for k in kinds])
    if kind == "default":
        return None
    if kind == "tiny":
        return 1e-6 if dtype == "float64" else float(np.float32(1e-6))
    if kind == "zero":
        return 0.0
    magnitude = draw(st.one_of(st.sampled_from([0.5, 0.25, 1.0, 0.125, 1.5]),
                               st.floats(0.01, 1.5, allow_nan=False)))
    # Exact in float32, so every implementation sees the same number.
    magnitude = float(np.float32(magnitude)) if dtype != "float64" else magnitude
    return magnitude if kind == "positive" else -magnitude


def scales(*, scale_kinds: Sequence[str] | bool = True, dtype: str = "float64",
           caps: Capabilities | None = None) -> st.SearchStrategy[float | None]:
    """``scale`` arguments: None (default 1/sqrt(E), the most common), an explicit
    positive value in [0.01, 1.5], 1e-6, a negative value, 0.0.

    ``scale_kinds``: True (all that ``caps.custom_scale`` allows), False (None
    only), or a subset of :data:`SCALE_KINDS`. Explicit values are exact in
    float32 (unless ``dtype="float64"``). Shrinks toward None, then 0.5.
    """
    arguments = dict(locals())
    kinds = _scale_kind_choices(scale_kinds, caps)
    return named_strategy(scales, arguments, lambda draw: _draw_scale(draw, kinds, dtype))


def layout_choices(layouts: Any, caps: Capabilities | None) -> list[str]:
    """The checked ``layouts`` argument (None: every layout ``caps`` allows)."""
    if layouts is None and caps is not None and not caps.non_contiguous:
        layouts = ("contiguous",)
    chosen = choices("layouts", layouts, LAYOUTS, LAYOUTS)
    if caps is not None and not caps.non_contiguous and chosen != ["contiguous"]:
        raise fail("layouts", layouts, "asks for non-contiguous layouts but "
                   "caps.non_contiguous=False", "pass layouts=('contiguous',)")
    return chosen


def layouts(*, layouts: Sequence[str] | None = None,
            caps: Capabilities | None = None) -> st.SearchStrategy[str]:
    """Memory layouts (:data:`conformance.core.cases.LAYOUTS`): "contiguous",
    "transposed", "stride0", "poisoned", restricted to ``layouts`` (None: all)
    and to what ``caps.non_contiguous`` allows. Shrinks toward "contiguous"."""
    arguments = dict(locals())
    chosen = layout_choices(layouts, caps)
    return named_strategy(_layouts, arguments, lambda draw: draw(st.sampled_from(chosen)))


_layouts = layouts  # inside ``layouts`` the name is its argument


# ---------------------------------------------------------------------------
# q, k, v
# ---------------------------------------------------------------------------

def _dot_bound(query: np.ndarray, key: np.ndarray) -> float:
    """max over (b, n, l, s) of sum_e |q||k| (kv heads repeated): bounds every q·k partial sum."""
    group = query.shape[1] // key.shape[1]
    key = np.repeat(np.abs(key), group, axis=1)
    return float(np.max(np.abs(query) @ np.swapaxes(key, -1, -2), initial=0.0))


def _constant_rows(rng: np.random.Generator, query: np.ndarray, key: np.ndarray,
                   value: np.ndarray) -> None:
    """In place: about half the heads get keys, values, queries equal along the sequence."""
    B, N, K = query.shape[0], query.shape[1], key.shape[1]
    for b in range(B):
        for h in range(K):
            if rng.random() < 0.5:
                key[b, h] = key[b, h, :1]
            if rng.random() < 0.5:
                value[b, h] = value[b, h, :1]
        for h in range(N):
            if rng.random() < 0.5:
                query[b, h] = query[b, h, :1]
    key[0, 0] = key[0, 0, :1]  # at least one head with uniform weights


def _regime_values(rng: np.random.Generator, sizes: dict[str, int], regime: str,
                   dtype: str, extreme: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    B, N, K, L, S, E, Ev = (sizes[d] for d in ("B", "N", "K", "L", "S", "E", "Ev"))
    query = rng.standard_normal((B, N, L, E))
    key = rng.standard_normal((B, K, S, E))
    value = rng.standard_normal((B, K, S, Ev))
    if regime == "near_ties":
        base = key[:, :, :1, :]                                      # (B, K, 1, E)
        # machine epsilon (twice the unit roundoff) of the dtype; float64 cases use
        # float32's: near ties that a float32 computation still tells apart
        eps = 2 * UNIT_ROUNDOFF["float32" if dtype == "float64" else dtype]
        key = base + rng.standard_normal(key.shape) * 4 * eps * np.abs(base)
    elif regime == "tiny":
        query, key, value = (x * _TINY[dtype] for x in (query, key, value))
    elif regime == "constant_rows":
        _constant_rows(rng, query, key, value)
    elif regime == "ascending":
        direction = rng.standard_normal((B, K, 1, E))                 # (B, K, 1, E)
        steps = np.linspace(0.0, 3.0, S).reshape(1, 1, S, 1)         # (1, 1, S, 1)
        key = steps * direction + 0.1 * key
    elif regime == "wide_range":
        r = _WIDE_EXPONENT[dtype]

        def exponents(shape: tuple[int, ...]) -> np.ndarray:
            # extreme: the top of the range for every row and batch item (largest logits)
            return np.full(shape, r) if extreme else rng.integers(-r, r + 1, size=shape)

        batch = 2.0 ** exponents((B, 1, 1, 1))
        query = query * batch * 2.0 ** exponents((B, N, L, 1))
        key = key * batch * 2.0 ** exponents((B, K, S, 1))
        value = value * batch * 2.0 ** exponents((B, K, S, 1))
    return query, key, value


def _aim_large_logits(query: np.ndarray, key: np.ndarray, dtype: str,
                      effective_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Scale q and k so that max |scale·q·k| is the dtype's target, with raw q·k
    kept finite (a zero or tiny scale would otherwise ask for astronomically
    large q and k)."""
    target = _LARGE_LOGITS[dtype] / (effective_scale or 1.0)
    limit = _FLOAT16_DOT_LIMIT / max(1.0, effective_scale) if dtype == "float16" else 1e12
    bound = _dot_bound(query, key)
    if bound > 0:
        factor = math.sqrt(min(target, limit) / bound)
        query, key = query * factor, key * factor
    return query, key


def _keep_float16_dots_finite(query: np.ndarray, key: np.ndarray,
                              effective_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Shrink float16 q and k until every partial sum of q·k (and of scale·q·k) is finite."""
    limit = _FLOAT16_DOT_LIMIT / max(1.0, effective_scale)
    for _ in range(8):
        bound = _dot_bound(query, key)
        if bound <= limit:
            break
        factor = math.sqrt(limit / bound) * 0.95
        query, key = round_to(query * factor, "float16"), round_to(key * factor, "float16")
    return query, key


def sdpa_values(rng: np.random.Generator, sizes: dict[str, int], regime: str, dtype: str,
                scale: float | None, stride0_axes: Sequence[int], *, extreme: bool = False
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """query, key, value of ``regime``, exact in ``dtype``; key and value equal
    along each of ``stride0_axes`` (handed over expanded with stride 0).
    ``extreme``: the regime at the edge of its range ("wide_range": every row and
    batch item at the largest power of two; the other regimes have no edge)."""
    query, key, value = _regime_values(rng, sizes, regime, dtype, extreme)
    for axis in stride0_axes:
        key = np.broadcast_to(key.take([0], axis=axis), key.shape).copy()
        value = np.broadcast_to(value.take([0], axis=axis), value.shape).copy()
    effective_scale = abs(scale) if scale is not None else 1.0 / math.sqrt(sizes["E"])
    if regime == "large_logits":
        query, key = _aim_large_logits(query, key, dtype, effective_scale)
    query, key, value = (round_to(x, dtype) for x in (query, key, value))
    if dtype == "float16":
        query, key = _keep_float16_dots_finite(query, key, effective_scale)
    return query, key, value
