"""The dropout-spread check (``conformance.calls.sdpa.check_dropout_spread``) at the
rounding floor: outputs that dropout cannot move (every dropped term is 0) must read as
a spread of 0, not as the rounding of numpy's one-at-a-time sums along a strided axis."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.calls.sdpa import _sample_std, check_dropout_spread
from conformance.core.compare import PropertyFailure


def _near_constant(seed: int = 0) -> np.ndarray:
    """(L=1, samples=2048, D=2): 0.915 give or take one ulp, as torch-mha's float64
    train-mode outputs were when the only key dropout could drop had value 0."""
    rng = np.random.default_rng(seed)
    x = 0.9150413 + rng.integers(-1, 2, size=(1, 2048, 2)) * np.spacing(0.9150413)
    return np.ascontiguousarray(x)


def test_a_spread_of_ulps_is_read_at_the_rounding_floor():
    x = _near_constant()
    assert (x.std(axis=1, ddof=1) > 1e-14).all()  # numpy's strided sums: a 1e-14 floor
    assert (_sample_std(x, 1) < 2e-16).all()
    np.testing.assert_allclose(_sample_std(np.random.default_rng(1).normal(size=(3, 500, 2)), 1),
                               np.random.default_rng(1).normal(size=(3, 500, 2)).std(axis=1, ddof=1), rtol=1e-12)


def test_a_spread_that_must_be_zero_passes_within_the_outputs_rounding():
    x = _near_constant()
    zero = np.zeros((1, 2))
    rounding = np.full((1, 2), 1.63e-15)  # float64 output rounding of that case
    ratio = check_dropout_spread(x, zero, zero, rounding, np.ones((1, 2), bool), "dropout=0.5", axis=1)
    assert ratio < 1


def test_a_spread_where_none_should_be_still_fails():
    x = _near_constant()
    x[:, ::2, :] += 0.01  # a dropout that moves outputs the oracle says it cannot move
    zero = np.zeros((1, 2))
    with pytest.raises(PropertyFailure, match="standard deviation of 2048 dropout outputs"):
        check_dropout_spread(x, zero, zero, np.full((1, 2), 1.63e-15), np.ones((1, 2), bool), "dropout=0.5", axis=1)


def test_a_sample_set_with_an_empty_dimension_has_an_empty_spread():
    """A varlen batch can hold no row of some shape: (0, N, L, samples) has no spread to
    sum (numpy's apply_along_axis refuses an empty array)."""
    assert _sample_std(np.zeros((0, 3, 5, 1024)), 3).shape == (0, 3, 5)
