"""The staged comparison helper and the tolerance rule (meta tests)."""

import numpy as np
import pytest

from conformance.core.compare import PropertyFailure, compare_values
from conformance.core import tolerance


def test_exact_match_has_ratio_zero():
    a = np.arange(6.0).reshape(2, 3)
    assert compare_values("x", a, a.copy(), 1e-9).ratio == 0


def test_shape_is_checked_first():
    with pytest.raises(PropertyFailure, match=r"x shape=\(2, 3\), but should be \(3, 2\)"):
        compare_values("x", np.zeros((2, 3)), np.zeros((3, 2)), 1.0)


def test_nan_where_finite_is_reported_with_count_and_index():
    a = np.zeros((2, 2))
    a[1, 0] = np.nan
    with pytest.raises(PropertyFailure, match=r"NaN where it should be finite: 1/4 elements \(25.0%\) at \(1, 0\)"):
        compare_values("x", a, np.zeros((2, 2)), 1.0)


def test_missing_nan_and_inf_sign():
    with pytest.raises(PropertyFailure, match="finite where it should be NaN"):
        compare_values("x", np.zeros(2), np.array([0.0, np.nan]), 1.0)
    with pytest.raises(PropertyFailure, match="inf of the wrong sign"):
        compare_values("x", np.array([np.inf]), np.array([-np.inf]), 1.0)


def test_value_mismatch_names_worst_ratio_abs_and_rel():
    expected = np.array([1.0, 100.0, 0.001])
    actual = expected + np.array([0.0, 0.5, 0.01])
    with pytest.raises(PropertyFailure) as info:
        compare_values("output", actual, expected, np.array([0.1, 1.0, 0.001]))
    msg = str(info.value)
    assert "1/3 elements (33.3%) at (2,)" in msg
    assert "worst error/allowed = 10 at (2,)" in msg
    assert "allowed 0.001" in msg


def test_where_restricts_the_comparison():
    expected = np.zeros(3)
    actual = np.array([0.0, 5.0, np.nan])
    r = compare_values("x", actual, expected, 0.1, where=np.array([True, False, False]))
    assert r.ratio == 0


def test_ratio_reports_headroom():
    assert compare_values("x", np.array([1.05]), np.array([1.0]), 0.1).ratio == pytest.approx(0.5)


def test_tolerance_table_is_complete_and_scales_with_naive_error():
    assert set(tolerance.TOLERANCES) == {"float64", "float32", "tf32", "float16", "bfloat16"}
    small = tolerance.sdpa_allowed("float16", 0.0, np.array([1.0]))
    large = tolerance.sdpa_allowed("float16", 1e-2, np.array([1.0]))
    assert large[0] == pytest.approx(small[0] + 8 * 1e-2)
    assert tolerance.sdpa_allowed("float64", 0.0, np.array([1.0]))[0] < 1e-12


def test_mha_bound_and_derivative():
    one = np.array([1.0])
    # k × naive + eps × (floor × magnitude + value_floor × |expected|), per the module table.
    tol, eps = tolerance.mha_tolerance_for("float16")
    got = tolerance.mha_bound("float16", 1e-3, one, 2 * one)[0]
    assert got == pytest.approx(tol.k * 1e-3 + eps * (tol.floor + 2 * tol.value_floor))
    # TF32 declared: the TF32 row and eps, for the bound and the derivative alike.
    tf32 = tolerance.mha_derivative_allowed("float32", analytic_size=1.0, numeric=0.0, logit_range=0.0,
                                            cancellation=0.0, step=1e-5, tf32=True)
    assert tf32 == pytest.approx(tolerance.MHA_TOLERANCES["tf32"].grad_floor * 2.0**-11 + 1e-6)


def test_statistical_bounds():
    # Hoeffding: width·sqrt(ln(2/δ) / 2M), δ = 1e-7 / elements.
    half = tolerance.hoeffding_halfwidth(1.0, samples=1024, elements=10)
    assert half == pytest.approx(np.sqrt(np.log(2 / 1e-8) / 2048))
    assert tolerance.mha_dropout_allowed(1.0, 1024, 10, 0.0) == pytest.approx(2 * half + 1e-6)
    assert tolerance.scaling_variance_accepted(1.9) and not tolerance.scaling_variance_accepted(0.49)
    assert tolerance.scaling_variance_ratio(2.0) == pytest.approx(1.0)
