"""Hypothesis strategies and directed cases of the sharded level.

The world size is drawn first (1..min(4, max_world_size, and on CUDA the GPUs),
shrinking toward 1), then the layout among the declared ones, the length as a multiple
of the layout's divisor (W contiguous, 2W zigzag: ``spec.sharding.divisor``), less a
few positions where ``padding`` is declared (``sharded_features``: lengths that do not
divide, shrinking toward none), then B, the heads (GQA where declared; multiples of W
under ``sharded_heads_divisible``), E, Ev, causal, the scale, and where ``window`` is
declared a window ``(left, right)`` of 0..L or -1 per side (shrinking toward none; its
edges fall inside a shard or across a boundary as the draw puts them). Values are
standard normal, rounded to the dtype; about one case in eight is in the ``large`` regime (q and k scaled so that logits reach the hundreds: exp of an LSE
overflows in float32 there, and beyond 709 in float64).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from conformance.sharded import backends
from conformance.sharded.cases import ShardedCase
from spec import sharding
from spec.emulate import round_to

__all__ = ["sharded_cases", "sharded_directed", "make_case"]

#: The largest world size drawn (the worker group's size).
MAX_WORLD = backends.MAX_RANKS


def make_case(*, world_size: int, layout: str, B: int = 1, N: int = 1, K: int | None = None,
              shard: int = 1, E: int = 2, Ev: int | None = None, causal: bool = False,
              scale: float | None = None, dtype: str = "float64", device: str = "cpu", seed: int = 0,
              regime: str = "normal", pad: int = 0, window: tuple[int, int] = (-1, -1)) -> ShardedCase:
    """One case from sizes: L = shard units of the layout's divisor (``shard`` per rank and
    chunk pair: L = shard * divisor), less ``pad`` positions (the padding the ranks get)."""
    K = N if K is None else K
    Ev = E if Ev is None else Ev
    L = shard * sharding.divisor(layout, world_size) - pad
    if not 0 <= pad < shard * sharding.divisor(layout, world_size):
        raise ValueError(f"pad={pad} must leave at least one position of the {L + pad}")
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((B, N, L, E)), rng.standard_normal((B, K, L, E))
    v = rng.standard_normal((B, K, L, Ev))
    if regime == "large":  # logits in the hundreds (q.k up to ~ E * 30^2 * scale)
        q, k = 30 * q, 30 * k
    elif regime == "huge":  # every logit above 709: exp(lse) overflows in float64 too
        q, k = np.full_like(q, 30.0) + q, np.full_like(k, 30.0) + k
    return ShardedCase(round_to(q, dtype), round_to(k, dtype), round_to(v, dtype), world_size=world_size,
                       layout=layout, causal=causal, scale=scale, dtype=dtype, device=device, regime=regime,
                       window=window)


def top_world(caps: Any, device: str = "cpu") -> int:
    """The largest world size drawn for ``caps`` on ``device`` (the worker group's size)."""
    return backends.ranks_for(caps, device)


def _world_sizes(caps: Any, min_world: int, device: str) -> st.SearchStrategy[int]:
    top = top_world(caps, device)
    return st.integers(min(min_world, top), top)


@st.composite
def sharded_cases(draw: Any, *, dtype: str, device: str, caps: Any, min_world: int = 1,
                  layouts: tuple[str, ...] | None = None, causal: bool | None = None) -> ShardedCase:
    """A sharded case inside ``caps`` (module docstring)."""
    W = draw(_world_sizes(caps, min_world, device), label="world_size")
    layout = draw(st.sampled_from(sorted(layouts or caps.sharded_layouts)), label="layout")
    shard = draw(st.integers(1, 3), label="shard units")
    pad = 0
    if "padding" in caps.sharded_features:
        pad = draw(st.integers(0, sharding.divisor(layout, W) - 1), label="padding")
    B = draw(st.integers(1, 2), label="B")
    unit = W if caps.sharded_heads_divisible else 1
    K = unit * draw(st.integers(1, 2), label="kv heads / unit")
    group = draw(st.integers(1, 2), label="GQA group") if caps.gqa else 1
    E = draw(st.sampled_from([2, 1, 3, 4, 8]), label="E")
    Ev = draw(st.sampled_from([E, 1, 3, 5]), label="Ev") if caps.different_v_dim else E
    if causal is None:
        causal = draw(st.booleans(), label="causal") if caps.causal is not None else False
    scale = None
    if caps.custom_scale and draw(st.integers(0, 3), label="custom scale?") == 3:
        scale = draw(st.sampled_from([0.5, 2.0, 0.125, -1.0]), label="scale")
    window = (-1, -1)
    if "window" in caps.sharded_features and draw(st.integers(0, 1), label="window?"):
        L = shard * sharding.divisor(layout, W) - pad
        window = (draw(st.integers(-1, L), label="window left"), draw(st.integers(-1, L), label="window right"))
    regime = "large" if draw(st.integers(0, 7), label="regime") == 7 else "normal"
    seed = draw(st.integers(0, 2**32 - 1), label="seed")
    return make_case(world_size=W, layout=layout, B=B, N=K * group, K=K, shard=shard, E=E, Ev=Ev,
                     causal=causal, scale=scale, dtype=dtype, device=device, seed=seed, regime=regime,
                     pad=pad, window=window)


def _where(layout: str, W: int, shard: int) -> str:
    """Part of a directed case's name: the layout, the ranks and the positions on each."""
    per = {1: "one position", 2: "two positions"}[shard]
    return f"{layout} over {W} rank{'s' * (W != 1)}, {per} per {'rank' if layout == 'contiguous' else 'chunk'}"


def _named(case: ShardedCase, name: str) -> ShardedCase:
    return case.replace(notes=(f"directed: {name}",))


def sharded_directed(*, dtype: str, device: str, caps: Any, min_world: int = 1,
                     layouts: tuple[str, ...] | None = None, causal_only: bool = False) -> list[ShardedCase]:
    """Directed cases: causal masks whose diagonal crosses every shard boundary (one
    position per rank and chunk), each layout at every world size, a GQA case, the
    ``huge`` regime (logits above 709: a merge that exponentiates an LSE without the
    running max overflows in every dtype), and where declared windows whose edges fall
    inside a shard and across its boundaries (two positions per rank and chunk, one
    key back and one forward), and a padded sequence. Each carries its name (``notes``:
    ``directed: NAME``)."""
    top = top_world(caps, device)
    out = []
    for layout in sorted(layouts or caps.sharded_layouts):
        for W in range(max(2, min_world), top + 1):
            heads = W if caps.sharded_heads_divisible else 1
            for causal in ((True,) if causal_only or caps.causal is not None else ()) + (() if causal_only else (False,)):
                out.append(_named(make_case(world_size=W, layout=layout, N=heads, shard=1, E=2, causal=causal,
                                            dtype=dtype, device=device, seed=W),
                                  _where(layout, W, 1) + (", causal: the diagonal crosses every shard boundary"
                                                          if causal else "")))
    if not causal_only and out:
        W = 2 if top >= 2 else 1
        heads = W if caps.sharded_heads_divisible else 1
        layout = sorted(layouts or caps.sharded_layouts)[0]
        out.append(_named(make_case(world_size=W, layout=layout, N=heads, shard=2, E=4, dtype=dtype, device=device,
                                    seed=7, regime="huge"), f"every logit above 709, {_where(layout, W, 2)}"))
        if caps.gqa:
            out.append(_named(make_case(world_size=W, layout=layout, N=2 * heads, K=heads, shard=1, E=2,
                                        causal=caps.causal is not None, dtype=dtype, device=device, seed=3),
                              f"{2 * heads} query heads on {heads} kv head{'s' * (heads != 1)}, {_where(layout, W, 1)}"
                              + (", causal" if caps.causal is not None else "")))
    features = caps.sharded_features
    for layout in sorted(layouts or caps.sharded_layouts) if "window" in features else ():
        heads = top if caps.sharded_heads_divisible else 1
        for causal in ((True,) if causal_only or caps.causal is not None else ()) + (() if causal_only else (False,)):
            out.append(_named(make_case(world_size=top, layout=layout, N=heads, shard=2, E=2, causal=causal,
                                        window=(1, 1), dtype=dtype, device=device, seed=11),
                              f"window (1, 1), {_where(layout, top, 2)}{', causal' if causal else ''}"))
    if "padding" in features and not causal_only and top >= 2:
        layout = "contiguous" if "contiguous" in (layouts or caps.sharded_layouts) else "zigzag"
        heads = top if caps.sharded_heads_divisible else 1
        d = sharding.divisor(layout, top)
        case = make_case(world_size=top, layout=layout, N=heads, shard=2, E=2, pad=d - 1,
                         dtype=dtype, device=device, seed=13)
        last_padding = sharding.positions(case.padded_length, top, top - 1, layout).min() >= case.L
        out.append(_named(case, f"{case.L} positions padded to {case.padded_length}, {layout} over {top} ranks"
                                + (", the last rank holding padding only" if last_padding else "")))
    return out
