"""A compile budget: a strategy draws each example's configuration from a few fixed ones.

An implementation that compiles per configuration (JAX's ``jax.jit``, an ONNX export,
tinygrad, torch.compile) pays one compilation for each new combination of the things
its compiled code depends on, and a compilation dwarfs the call (JAX on a CPU: about
0.3 s to compile, 0.3 ms to run). Shapes are one such key, not the only one: the scale,
the causal flag, the mask kind and the memory layout can each be one too. With
``sdpa_cases(..., shape_budget=n)`` every random example takes its

* layout, sizes (B, N, K, L, S, E, Ev), causal flag, mask kind and scale

from a pool of at most ``n`` :class:`Configuration` records fixed once per strategy;
the regime, the seed (so q, k, v and the mask's entries), the mask's pattern and
broadcast form, and the stride-0 dims still vary per example. A derived call a
property makes from a case (the temperature property's ``c·s``, a permuted or
identity-valued copy) is a configuration of its own, as is every directed example.

The pool:

* covers every option of every dimension the strategy can draw at least once (each
  layout, each causal option with each way its lengths may relate, each mask kind and
  each kind of scale): the first configurations take the options in turn. A budget
  below the count of layouts or of causal/length options (kinds of case whose sizes
  differ: stride 0 needs B >= 2, a lower-right flag may need L > S) raises and names
  the number it needs; one below the count of mask kinds or of kinds of scale (five:
  default, positive, tiny, negative, zero) draws the first ones only (the runner's
  default, 8, covers them all);
* fills the rest from a NumPy Generator seeded with a stable digest (CRC-32) of the
  size bounds and options, so every strategy with the same bounds and options, in
  every process and run, uses the same configurations, and a compilation cache warmed
  by one property serves the next;
* uses fixed scales: None (the default 1/sqrt(E)), 0.5, 1e-6, -0.5, 0.0, and, past
  the first round, positive magnitudes from (0.5, 0.25, 1.0, 0.125, 1.5) with their
  signs: a handful of scale values in all, so a scale that is a compile key
  (an ONNX export) costs a handful of exports;
* is ordered simplest first (the smallest sizes, then contiguous, no causal flag, no
  mask, the default scale), and an example draws an index into it: shrinking the
  index shrinks the configuration, toward the simplest.

The runner gives implementations declaring ``Capabilities.jit`` a budget of
:data:`~conformance.strategies.shape_budget.JIT_SHAPE_BUDGET` configurations per
strategy (``--compile-budget``) through ``Target.shape_budget``, and says so on the
certificate.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from conformance.strategies._validation import fail
from conformance.strategies.shape_budget import _work
from conformance.strategies.sizes import SeededDraw, SizeBounds, draw_sizes

__all__ = ["Branch", "ConfigPool", "Configuration", "config_pool", "fixed_scale"]

#: Positive magnitudes the pool's later configurations take their scales from.
_MAGNITUDES = (0.5, 0.25, 1.0, 0.125, 1.5)


@dataclass(frozen=True)
class Branch:
    """One way an example may be drawn for a causal option: the mask kinds it allows,
    the relation of L to S it needs (None: free), and whether the causal flag alone
    empties rows (no mask, L > S)."""

    causal: str | None
    mask_kinds: tuple[str, ...]
    relation: str | None = None
    flag_dead_rows: bool = False


@dataclass(frozen=True)
class Configuration:
    """What a compiled implementation's code may depend on, fixed for the examples
    that draw it."""

    layout: str
    sizes: tuple[tuple[str, int], ...]
    causal: str | None
    mask_kind: str
    scale: float | None
    flag_dead_rows: bool = False

    def size_dict(self) -> dict[str, int]:
        return dict(self.sizes)


@dataclass(frozen=True)
class ConfigPool:
    """The configurations a budgeted strategy draws from, simplest first."""

    configurations: tuple[Configuration, ...]

    def draw(self, draw: st.DrawFn) -> Configuration:
        """One configuration; shrinks toward the simplest."""
        return self.configurations[draw(st.integers(0, len(self.configurations) - 1))]

    @property
    def shapes(self) -> list[dict[str, int]]:
        """The distinct shapes among the configurations."""
        out: list[dict[str, int]] = []
        for c in self.configurations:
            if c.size_dict() not in out:
                out.append(c.size_dict())
        return out


def fixed_scale(kind: str, dtype: str, magnitude: float = 0.5) -> float | None:
    """The pool's scale of ``kind`` (one of ``values.SCALE_KINDS``)."""
    if kind == "default":
        return None
    if kind == "tiny":
        return 1e-6 if dtype == "float64" else float(np.float32(1e-6))
    if kind == "zero":
        return 0.0
    return magnitude if kind == "positive" else -magnitude


def _seed(*parts: object) -> int:
    """A stable seed (never Python's salted hash)."""
    return zlib.crc32(repr(parts).encode())


def config_pool(bounds: SizeBounds, budget: int, *, layouts: Sequence[str],
                branches: Sequence[Branch], scale_kinds: Sequence[str], dtype: str,
                block_weight: int = 4) -> ConfigPool:
    """At most ``budget`` configurations inside ``bounds``, covering every layout,
    branch, mask kind and scale kind at least once (raises InvalidArgument, naming the
    budget needed, when ``budget`` cannot)."""
    layouts, branches, scale_kinds = list(layouts), list(branches), list(scale_kinds)
    kinds = sorted({k for b in branches for k in b.mask_kinds},
                   key=("none", "bool", "additive").index)
    needed = max(len(layouts), len(branches))
    if needed > budget:
        raise fail("shape_budget", budget, f"cannot give each kind of case its configuration "
                   f"({len(layouts)} layouts, {len(branches)} causal/length options)",
                   f"pass shape_budget>={needed}")
    rounds = max(needed, len(kinds), len(scale_kinds))  # past the budget: the first options only
    seed = _seed(bounds, layouts, branches, scale_kinds)
    rng = np.random.default_rng(seed)
    configurations: list[Configuration] = []
    for i in range(budget):
        if i < rounds:  # the first round: every option of every dimension in turn
            layout, branch = layouts[i % len(layouts)], branches[i % len(branches)]
            fitting = [k for k in kinds if k in branch.mask_kinds]
            kind = kinds[i % len(kinds)] if kinds[i % len(kinds)] in branch.mask_kinds else fitting[i % len(fitting)]
            scale = fixed_scale(scale_kinds[i % len(scale_kinds)], dtype)
        else:
            layout = layouts[int(rng.integers(len(layouts)))]
            branch = branches[int(rng.integers(len(branches)))]
            kind = branch.mask_kinds[int(rng.integers(len(branch.mask_kinds)))]
            scale = fixed_scale(scale_kinds[int(rng.integers(len(scale_kinds)))], dtype,
                                _MAGNITUDES[int(rng.integers(len(_MAGNITUDES)))])
        min_batch = 2 if layout == "stride0" else None
        # The first configuration (and any that repeats an earlier one) is the smallest
        # shape its branch allows; the others are drawn as without a budget.
        # Seeded by the bounds, the index and the length relation only: strategies with the
        # same bounds share their shapes (a cache warmed by one property serves the next).
        size_rng = np.random.default_rng(_seed(bounds, i, branch.relation, min_batch))
        sizes = draw_sizes(SeededDraw(size_rng if i else None), bounds, relation=branch.relation,
                           min_batch=min_batch, block_weight=block_weight)
        config = Configuration(layout, tuple(sizes.items()), branch.causal, kind, scale,
                               branch.flag_dead_rows)
        if config not in configurations:
            configurations.append(config)
    options = {"layout": layouts, "causal": [b.causal for b in branches], "kind": kinds}

    def simplicity(c: Configuration) -> tuple:
        scale_rank = (0 if c.scale is None else 1, abs(c.scale or 0.0) != 0.5)
        return (_work(c.size_dict()), options["layout"].index(c.layout),
                options["causal"].index(c.causal), options["kind"].index(c.mask_kind), scale_rank)

    return ConfigPool(tuple(sorted(configurations, key=simplicity)))
