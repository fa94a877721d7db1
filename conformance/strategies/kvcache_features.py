"""The KV cache's own options in the kvcache strategies: rotary tables, ``cache_batch_idx``,
``cache_leftpad`` and ``num_splits`` (drawn by ``conformance.strategies.varlen.kvcache_cases``),
and the directed examples of each (:func:`kvcache_feature_directed`).

Each option is drawn only where ``caps.kvcache_features`` declares it and inside the
other declarations: rotary only with appended keys (``kv_append``) and a head dim that
holds a rotary dim (an even multiple of ``caps.rotary_dim_multiple``); ``cache_batch_idx``
and ``cache_leftpad`` only with contiguous caches (FlashAttention pages neither).
Rotary tables are cos/sin of random angles rounded to the dtype (FlashAttention takes
them in q's dtype), at least as long as the cache's capacity (FlashAttention's check)
and every rotated position.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from conformance.calls.declarations import fit_head_dims
from conformance.calls.kvcache import KVCacheCase
from conformance.strategies._drawing import weighted
from implementations.base import Capabilities
from spec.emulate import round_to

__all__ = ["CACHE_FEATURES", "LARGE_LOGITS", "batch_rows", "fit_rotary_window", "kvcache_feature_directed",
           "num_splits_fields",
           "leftpads", "rotary_multiple", "rotary_tables", "wanted_cache"]

#: The cache options, by ``ALL_KVCACHE_FEATURES`` name.
CACHE_FEATURES = ("rotary", "cache_batch_idx", "cache_leftpad", "num_splits")
#: A query scaled by this (exact: a power of two) gives logits whose exp overflows float32
#: (> 88) and often float64 (> 709) in a split-KV merge without the running max.
LARGE_LOGITS = 512.0


def rotary_multiple(caps: Capabilities | None) -> int:
    """The step of the rotary dims drawn: ``caps.rotary_dim_multiple``, else 2."""
    return (caps.rotary_dim_multiple if caps is not None else None) or 2


def wanted_cache(draw: st.DrawFn, declared: frozenset[str], wanted: dict[str, bool | None], *,
                 can_append: bool, paged: bool, E: int, caps: Capabilities | None) -> set[str]:
    """The cache options to draw: each True (always, where declared and possible), False
    (never) or None (half the time); no draw at all for an option left False."""
    possible = {"rotary": can_append and E >= rotary_multiple(caps), "cache_batch_idx": not paged,
                "cache_leftpad": not paged, "num_splits": True}
    chosen = set()
    for name in CACHE_FEATURES:
        want = wanted.get(name)
        if want is False or name not in declared or not possible[name]:
            continue
        if want is True or draw(st.booleans()):
            chosen.add(name)
    return chosen


def batch_rows(draw: st.DrawFn, B: int) -> tuple[int, tuple[int, ...]]:
    """(B_cache, distinct cache rows (B,)): 0..2 spare rows, the rows shuffled; shrinks to
    no spare row in order."""
    spare = draw(st.integers(0, 2))
    order = draw(st.permutations(range(B + spare)))
    return B + spare, tuple(int(r) for r in order[:B])


def leftpads(draw: st.DrawFn, seqlens: tuple[int, ...]) -> tuple[int, ...]:
    """A pad in [0, cache_seqlens[b]] per sequence (the whole valid cache included)."""
    return tuple(draw(st.integers(0, n)) for n in seqlens)


def rotary_tables(draw: st.DrawFn, rng: np.random.Generator, *, E: int, caps: Capabilities | None, rows: int,
                  dtype: str) -> dict[str, Any]:
    """Case fields: cos/sin of random angles (rows, R/2) rounded to ``dtype``, R an even
    multiple of the declared step <= E, interleaved or not."""
    m = rotary_multiple(caps)
    R = m * draw(st.integers(1, E // m))
    interleaved = draw(st.booleans())
    angle = rng.uniform(0.0, 2 * np.pi, (rows, R // 2))
    return {"rotary_cos": round_to(np.cos(angle), dtype), "rotary_sin": round_to(np.sin(angle), dtype),
            "rotary_interleaved": bool(interleaved)}


def fit_rotary_window(draw: st.DrawFn, window: tuple[int, int], capacity: int) -> tuple[int, int]:
    """A window keeping a bounded side below the cache capacity: FlashAttention-2 rewrites
    wider sides to -1 and would then rotate the queries as for a call with no window."""
    left, right = window
    if any(0 <= side < capacity for side in (left, right)):
        return window
    return left, draw(st.integers(0, max(capacity - 1, 0)))


def num_splits_fields(draw: st.DrawFn) -> tuple[int, float]:
    """(num_splits in 2..4, the factor applied to the query: 1, or LARGE_LOGITS a quarter of the time)."""
    return draw(st.integers(2, 4)), weighted(draw, [(1.0, 3), (LARGE_LOGITS, 1)])


# -- directed examples ---------------------------------------------------------------------


def _seeded(seed: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return round_to(np.random.default_rng(seed).standard_normal(shape), dtype)


def _table(seed: int, rows: int, R: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    angle = np.random.default_rng(seed).uniform(0.0, 2 * np.pi, (rows, R // 2))
    return round_to(np.cos(angle), dtype), round_to(np.sin(angle), dtype)


def kvcache_feature_directed(feature: str, *, dtype: str = "float64", device: str = "cpu",
                             caps: Capabilities | None = None) -> list[KVCacheCase]:
    """The smallest cases of each option's known bugs, inside the declarations:

    * ``rotary``: a cache already holding keys (so positions are not 0), two queries with
      and without the causal flag, the widest rotary dim (both layouts) and one pair only;
    * ``cache_batch_idx``: two sequences naming rows 2 and 0 of a three-row cache;
    * ``cache_leftpad``: pads of 1 and 2, causal with L = 2 (the diagonal must not move);
    * ``num_splits``: 2 splits over logits beyond float64's exp range (a merge without the
      running max overflows), and 3 splits of a causal step.

    Each carries its name (``notes``: ``directed: NAME``)."""
    caps = caps or Capabilities(kvcache_features=frozenset(CACHE_FEATURES), causal="lower_right")
    N, K = (2, 1) if caps.gqa else (1, 1)
    dims = fit_head_dims(caps, 4, 4)
    if dims is None:
        return []
    E = Ev = dims[0]
    append = caps.kv_append
    causal_ok = caps.causal == "lower_right"
    flags = [True] if caps.causal_only and causal_ok else ([False, True] if causal_ok else [False])
    cases: list[KVCacheCase] = []

    def case(i: int, B: int, L: int, seqlens: tuple[int, ...], new: int, capacity: int, causal: bool, name: str,
             rows: int | None = None, **fields: Any) -> KVCacheCase:
        rows = B if rows is None else rows
        name += ", causal" if causal else ""
        return KVCacheCase(
            _seeded(11 * i, (B, L, N, E), dtype), _seeded(11 * i + 1, (rows, capacity, K, E), dtype),
            _seeded(11 * i + 2, (rows, capacity, K, Ev), dtype), cache_seqlens=seqlens,
            k_new=_seeded(11 * i + 3, (B, new, K, E), dtype) if new else None,
            v_new=_seeded(11 * i + 4, (B, new, K, Ev), dtype) if new else None,
            causal=causal, dtype=dtype, device=device, notes=(f"directed: {name}",), **fields)

    if feature == "rotary":
        m = rotary_multiple(caps)
        if not append or E < m:
            return []
        widest = E // m * m
        for i, (causal, R, interleaved) in enumerate((c, R, inter) for c in flags
                                                     for R, inter in ((widest, True), (widest, False), (m, True))):
            cos, sin = _table(i, 6, R, dtype)
            layout = "interleaved" if interleaved else "halves"
            cases.append(case(i, 2, 2, (1, 2), 1, 4, causal,
                              f"rotary dim {R} ({layout}) past caches of 1 and 2 keys, 2 queries",
                              rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved))
    elif feature == "cache_batch_idx":
        for i, causal in enumerate(flags):
            cases.append(case(20 + i, 2, 1 + causal, (1, 2), 1 if append else 0, 4, causal,
                              "two sequences naming rows 2 and 0 of a three-row cache", rows=3,
                              cache_batch_idx=(2, 0)))
    elif feature == "cache_leftpad":
        for i, causal in enumerate(flags):
            cases.append(case(30 + i, 2, 2, (2, 3), 1 if append else 0, 5, causal,
                              "left pads of 1 and 2, 2 queries", cache_leftpad=(1, 2)))
    elif feature == "num_splits":
        huge = case(40, 1, 1, (3,), 0, 4, flags[0], "2 splits over logits beyond float64's exp range",
                    num_splits=2)
        signs = np.where(np.arange(4 * K * E).reshape(1, 4, K, E) % 3 == 1, -30.0, 30.0)
        cases.append(huge.replace(query=np.full(huge.query.shape, 30.0), k_cache=signs))
        cases.append(case(41, 1, 2, (3,), 1 if append else 0, 5, flags[-1], "3 splits of a step of 2 queries",
                          num_splits=3))
    return cases
