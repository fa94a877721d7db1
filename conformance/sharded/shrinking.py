"""Shrinking a failing directed case of the sharded level (``conformance.directed.shrink``
does the other levels; ``conformance.harness.directed_shrink`` picks these for a sharded
case): a sharded case in its sequence, world size (where a group of another size starts
cheaply: ranks forked on the CPU; else as written), window sides, batch, heads, head dims
and values, its layout, causal flag and scale as written; and :func:`admitted`, whether
the property's strategy could draw a proposal."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from conformance.calls.declarations import outside_declarations
from conformance.directed.shrink_sizes import (
    _head_dims,
    _heads,
    _quarters,
    _simple_arrays,
    _smaller,
    _through,
    _value_dims,
)
from conformance.sharded import forkserver
from conformance.sharded.cases import ShardedCase
from conformance.sharded.strategies import top_world
from spec import sharding

__all__ = ["admitted", "passes"]

#: The lengths a sharded case may have at a world size and layout: 1..3 units of the
#: layout's divisor (``sharding.divisor``), the strategy's draw (fewer with padding).
_SHARD_UNITS = 3


def _sharded_resized(case: ShardedCase, **sizes: int) -> ShardedCase:
    """``case`` with a smaller world size, sequence (its first ``L`` positions), batch,
    heads or head dims; a window side longer than the sequence cut to its length (the
    same window: a side of L - 1 or more reaches every key)."""
    s = {"world_size": case.world_size, "B": case.B, "N": case.N, "K": case.K, "L": case.L, "E": case.E,
         "Ev": case.Ev, **sizes}
    B, N, K, L, E, Ev = (s[d] for d in ("B", "N", "K", "L", "E", "Ev"))
    window = tuple(side if side <= L else L for side in case.window)
    return case.replace(query=np.ascontiguousarray(case.query[:B, :N, :L, :E]),
                        key=np.ascontiguousarray(case.key[:B, :K, :L, :E]),
                        value=np.ascontiguousarray(case.value[:B, :K, :L, :Ev]),
                        world_size=s["world_size"], window=window)


def _sharded_world(case: ShardedCase) -> Iterator[ShardedCase]:
    """Fewer ranks, fewest first, the sequence cut to the most positions the strategy
    draws at that world size (and to a multiple of its divisor, for a target without
    padding). Only where a group of another world size starts cheaply: on the CPU its
    ranks are forked from the run's fork server (``conformance.sharded.forkserver``); a
    CUDA group spawns a process per rank and initialises NCCL, so there the world size is
    kept as written."""
    if not forkserver.available(case.device):
        return
    for W in _smaller(case.world_size):
        d = sharding.divisor(case.layout, W)
        L = min(case.L, _SHARD_UNITS * d)
        yield _sharded_resized(case, world_size=W, L=L)
        if L % d and L > d:
            yield _sharded_resized(case, world_size=W, L=L - L % d)


def _sharded_window(case: ShardedCase) -> Iterator[ShardedCase]:
    """A narrower window: each bounded side shorter, towards 0 (still a window: the
    directed case's feature; an unbounded side stays so)."""
    for i, side in enumerate(case.window):
        for v in _smaller(side, low=0) if side > 0 else ():
            window = list(case.window)
            window[i] = v
            yield case.replace(window=tuple(window))


def _sharded_values(case: ShardedCase) -> Iterator[ShardedCase]:
    if _simple_arrays([case.query, case.key, case.value]):
        return
    for steps in (1, 2, 4):
        yield case.replace(query=_quarters(case.query, steps), key=_quarters(case.key, steps),
                           value=_quarters(case.value, steps), regime="normal")


def passes(case: ShardedCase) -> list[Callable[[ShardedCase], Iterator[ShardedCase]]]:
    def size(name: str) -> Callable[[ShardedCase], Iterator[ShardedCase]]:
        return lambda c: (_sharded_resized(c, **{name: v}) for v in _smaller(getattr(c, name)))

    def by(changes: Callable[[Any], Iterator[dict[str, int]]]) -> Callable[[ShardedCase], Iterator[ShardedCase]]:
        return _through(_sharded_resized, changes, lambda c: (c.key, c.value))

    return [size("L"), _sharded_world, _sharded_window, size("B"), by(_heads), by(_head_dims), by(_value_dims),
            _sharded_values]


#: What ``sharded_cases`` draws: E, Ev besides E, and a custom scale.
_SHARDED_E, _SHARDED_EV, _SHARDED_SCALES = (1, 2, 3, 4, 8), (1, 3, 5), (0.5, 2.0, 0.125, -1.0)


def admitted(target: Any, case: ShardedCase, **arguments: Any) -> bool:
    """Whether ``sharded_cases`` with the property's ``arguments`` (``min_world``,
    ``layouts``, ``causal``) draws ``case``'s sizes and options: a world size from
    ``min_world`` (or the largest, if smaller) to the largest the target runs here, a
    declared layout among ``layouts``, 1..3 units of the layout's divisor less up to one
    unit where ``padding`` is declared, B of 1 or 2, K of 1 or 2 per unit (W ranks under
    ``sharded_heads_divisible``), N a multiple of K by 1 or 2 (1 without GQA), E and Ev
    among those it draws, causal only where declared, a custom scale among those it draws,
    window sides in -1..L where ``window`` is declared; and the target claims the case
    (``outside_declarations``). The values are not the strategy's business: a directed
    case's ``huge`` logits are no draw of it, and its quarters neither."""
    caps = target.caps
    top = top_world(caps, target.device)
    W, L, d = case.world_size, case.L, sharding.divisor(case.layout, case.world_size)
    unit = W if caps.sharded_heads_divisible else 1
    features = caps.sharded_features
    causal = arguments.get("causal")
    inside = (min(arguments.get("min_world", 1), top) <= W <= top
              and case.layout in (arguments.get("layouts") or caps.sharded_layouts)
              and 1 <= L <= 3 * d and (L % d == 0 or "padding" in features)
              and 1 <= case.B <= 2 and case.K % unit == 0 and 1 <= case.K // unit <= 2
              and case.N % case.K == 0 and 1 <= case.N // case.K <= (2 if caps.gqa else 1)
              and case.E in _SHARDED_E and (case.Ev == case.E or caps.different_v_dim and case.Ev in _SHARDED_EV)
              and (causal is None or causal == case.causal) and (caps.causal is not None or not case.causal)
              and (case.scale is None or caps.custom_scale and case.scale in _SHARDED_SCALES)
              and (case.window == (-1, -1) or "window" in features and all(-1 <= s <= L for s in case.window)))
    return inside and not outside_declarations(target, case)
