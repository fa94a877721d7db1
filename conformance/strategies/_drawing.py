"""Drawing helpers shared by the strategies: weighted choices, seeds, named strategies."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
from hypothesis import strategies as st

T = TypeVar("T")

_MAX_SEED = 2**32 - 1


def weighted(draw: st.DrawFn, options: Sequence[tuple[T, int]]) -> T:
    """Draw one option with the given integer weights; shrinks toward the first."""
    options = [(value, weight) for value, weight in options if weight > 0]
    index = draw(st.integers(0, sum(w for _, w in options) - 1))
    for value, weight in options:
        if index < weight:
            return value
        index -= weight
    raise AssertionError("unreachable")


def draw_seed(draw: st.DrawFn) -> np.random.Generator:
    """A NumPy Generator from one drawn seed: array values never go element by
    element through Hypothesis (fast), and the seed shrinks to 0."""
    return np.random.default_rng(draw(st.integers(0, _MAX_SEED)))


def named_strategy(public: Callable[..., Any], arguments: Mapping[str, Any],
                   draw_example: Callable[[st.DrawFn], T]) -> st.SearchStrategy[T]:
    """A strategy drawing ``draw_example(draw)`` whose repr is the call of the
    public strategy function, e.g. ``sdpa_cases(dtype='float16', caps=...)``
    (arguments left at their defaults are omitted)."""
    signature = inspect.signature(public)

    # Hypothesis labels a composite's spans by its function's code and defaults,
    # and its mutator pairs up spans with equal labels. The name as a default gives
    # each public strategy its own label, as if each had its own function: without
    # it, scales() drawn inside sdpa_cases() would pair with it and change which
    # examples a derandomized run draws.
    def draw_named(draw: st.DrawFn, *, _name: str = public.__name__, **_arguments: Any) -> T:
        return draw_example(draw)

    draw_named.__name__ = draw_named.__qualname__ = public.__name__
    draw_named.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[inspect.Parameter("draw", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                    *signature.parameters.values()])
    return st.composite(draw_named)(**arguments)
