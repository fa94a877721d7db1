"""A shape budget: a strategy draws its sizes from a few shapes fixed in advance.

A JIT-compiled implementation (JAX, torch.compile) pays one compilation for each
new input shape, which dwarfs the call itself (JAX on a CPU: about 0.3 s to compile,
0.2 ms to run). With ``sdpa_cases(..., shape_budget=n)`` every example takes its
sizes (B, N, K, L, S, E, Ev) from a pool of at most ``n`` shapes, drawn once per
strategy; masks, values, scale, layout and causal flag still vary per example.

The pool:

* is drawn from the same size distribution as without a budget, by a NumPy
  Generator seeded with a stable digest (CRC-32) of the size bounds, so every
  strategy with the same bounds, in every process and run, uses the same shapes
  (and a JIT cache warmed by one property serves the next);
* holds, first, the smallest shape of each kind of case the strategy draws (the
  shape Hypothesis would shrink to), so a failure still shrinks to the smallest
  size that fails among those the pool holds;
* is ordered simplest first (by the elements of q, k, v and the logits), and an
  example draws an index into the shapes that fit it: shrinking the index
  shrinks the shape.

Kinds of case: a lower-right causal case may need L > S (to force fully-masked
rows) or L <= S (to forbid them), and a ``stride0`` layout needs B >= 2; the pool
keeps at least one shape for each kind the strategy can draw.

SDPA strategies now budget whole configurations (shapes, scale, causal flag, mask
kind, layout: :mod:`conformance.strategies.compile_budget`); the flash strategy
budgets its shapes with this pool. The runner passes ``--compile-budget`` (older name
``--shape-budget``; default :data:`JIT_SHAPE_BUDGET` for an implementation declaring
``Capabilities.jit``) through ``Target.shape_budget``.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from conformance.strategies._validation import fail
from conformance.strategies.sizes import SeededDraw, SizeBounds, draw_sizes
from implementations.base import Capabilities

__all__ = ["JIT_SHAPE_BUDGET", "ShapePool", "check_shape_budget", "shape_budget_for", "shape_pool"]

#: The compile budget an implementation declaring ``Capabilities.jit`` gets by default:
#: configurations per strategy (``conformance.strategies.compile_budget``), and twice as
#: many sizes per sweep.
JIT_SHAPE_BUDGET = 8

#: Kind of case: (length relation "L>S" / "L<=S" / None, batch minimum or None).
CaseKind = tuple[str | None, int | None]

_SIZE_KEYS = ("B", "N", "K", "L", "S", "E", "Ev")
_ATTEMPTS_PER_SHAPE = 50


def check_shape_budget(budget: object, *, name: str = "shape_budget") -> int | None:
    """The checked budget: None (no budget) or an int >= 1."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise fail(name, budget, "must be None (no budget) or an int >= 1",
                   f"pass e.g. {name}=8")
    return budget


def shape_budget_for(caps: Capabilities, requested: int | None = None, *,
                     name: str = "--shape-budget") -> int | None:
    """The budget a run gives a target: ``requested`` (a ``--compile-budget`` /
    ``--shape-budget`` option, ``name``; 0 means none) when given, else
    :data:`JIT_SHAPE_BUDGET` when ``caps.jit``, else none."""
    if requested is not None:
        return check_shape_budget(requested, name=name) if requested else None
    return JIT_SHAPE_BUDGET if caps.jit else None


def _fits(sizes: dict[str, int], kind: CaseKind) -> bool:
    relation, min_batch = kind
    if min_batch is not None and sizes["B"] < min_batch:
        return False
    if relation == "L>S":
        return sizes["L"] > sizes["S"]
    if relation == "L<=S":
        return sizes["L"] <= sizes["S"]
    if relation == "L=S":
        return sizes["L"] == sizes["S"]
    return True


def _work(sizes: dict[str, int]) -> tuple[int, ...]:
    """Simplest first: elements of q, k, v and the logits, then the sizes themselves."""
    B, N, K, L, S, E, Ev = (sizes[k] for k in _SIZE_KEYS)
    return (B * (N * L * E + K * S * (E + Ev) + N * L * S), *(sizes[k] for k in _SIZE_KEYS))


def _seed(bounds: SizeBounds, kinds: Iterable[CaseKind]) -> int:
    """A stable seed (never Python's salted hash): CRC-32 of the bounds and kinds."""
    return zlib.crc32(repr((bounds, sorted(kinds, key=repr))).encode())


@dataclass(frozen=True)
class ShapePool:
    """The shapes a budgeted strategy draws from, simplest first."""

    shapes: tuple[dict[str, int], ...]

    def draw(self, draw: st.DrawFn, kind: CaseKind) -> dict[str, int]:
        """A copy of one shape fitting ``kind``; shrinks toward the simplest such shape."""
        fitting = [s for s in self.shapes if _fits(s, kind)]
        return dict(fitting[draw(st.integers(0, len(fitting) - 1))])


def shape_pool(bounds: SizeBounds, budget: int, kinds: Iterable[CaseKind], *,
               block_weight: int = 4) -> ShapePool:
    """At most ``budget`` shapes inside ``bounds``, at least one for each kind of case.

    The smallest shape of each kind comes first; the rest are drawn from a generator
    seeded by the bounds and kinds. Raises InvalidArgument when the budget cannot
    hold the smallest shape of each kind.
    """
    kinds = sorted(set(kinds), key=repr)
    shapes: list[dict[str, int]] = []
    for relation, min_batch in kinds:
        smallest = draw_sizes(SeededDraw(None), bounds, relation=relation, min_batch=min_batch)
        if smallest not in shapes:
            shapes.append(smallest)
    if len(shapes) > budget:
        raise fail("shape_budget", budget, f"cannot hold the {len(shapes)} smallest shapes the "
                   f"strategy's kinds of case need ({', '.join(map(str, kinds))})",
                   f"pass shape_budget>={len(shapes)}")
    rng = np.random.default_rng(_seed(bounds, kinds))
    for attempt in range(_ATTEMPTS_PER_SHAPE * budget):
        if len(shapes) >= budget:
            break
        relation, min_batch = kinds[attempt % len(kinds)]  # each kind gets its share
        sizes = draw_sizes(SeededDraw(rng), bounds, relation=relation, min_batch=min_batch,
                           block_weight=block_weight)
        if sizes not in shapes:
            shapes.append(sizes)
    return ShapePool(tuple(sorted(shapes, key=_work)))
