"""spec.sdpa against a brute-force element-by-element loop (spec section: SDPA)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings

import spec
from spec_test_cases import assert_close, brute_force_sdpa, describe_case, sdpa_cases


@settings(deadline=None, max_examples=150)
@given(sdpa_cases())
def test_sdpa_equals_brute_force(case):
    result = spec.sdpa(**case)
    output, weights, logits = brute_force_sdpa(**case)
    call = describe_case(case)
    assert_close("logits", result.logits, logits, call=call)
    assert_close("weights", result.weights, weights, call=call)
    assert_close("output", result.output, output, call=call)


@settings(deadline=None, max_examples=40)
@given(sdpa_cases(policies=("zero",)))
def test_fully_masked_rows_agree_with_masks_module(case):
    """masks.fully_masked_rows marks exactly the rows whose weights are all zero."""
    result = spec.sdpa(**case)
    rows = spec.masks.fully_masked_rows(result.weights.shape, case["attend_mask"],
                                        case["additive_mask"], case["causal"])
    assert rows.shape == result.weights.shape[:-1]
    np.testing.assert_array_equal(rows, (result.weights == 0).all(axis=-1))
    assert (result.output[rows] == 0).all()


def test_lengths_one_and_unequal_both_ways():
    """L = 1, S = 1, L > S and L < S under both causal alignments, fixed shapes."""
    rng = np.random.default_rng(7)
    for L, S in [(1, 1), (1, 4), (4, 1), (2, 5), (5, 2)]:
        for causal in (None, "upper_left", "lower_right"):
            for policy in ("zero", "nan", "uniform"):
                case = dict(query=rng.normal(size=(2, L, 3)), key=rng.normal(size=(1, S, 3)),
                            value=rng.normal(size=(1, S, 2)), causal=causal, fully_masked=policy)
                output, weights, _ = brute_force_sdpa(**case)
                result = spec.sdpa(**case)
                assert_close("output", result.output, output, call=describe_case(case))
                assert_close("weights", result.weights, weights, call=describe_case(case))


def test_extreme_finite_logits_do_not_overflow():
    """Logits near the float64 limit: the max subtraction keeps softmax finite and exact."""
    query = np.array([[[1e154, 0.0]]])                            # (N=1, L=1, E=2)
    key = np.array([[[1e154, 0.0], [-1e154, 0.0], [0.5e154, 0.0]]])  # (K=1, S=3, E=2)
    value = np.array([[[1.0], [2.0], [3.0]]])                     # (K=1, S=3, Ev=1)
    result = spec.sdpa(query, key, value, scale=1.0)
    # logits 1e308, -1e308, 5e307: finite; logit - max = 0, -2e308 (-> -inf), -5e307
    np.testing.assert_array_equal(result.logits, [[[1e308, -1e308, 5e307]]])
    np.testing.assert_array_equal(result.weights, [[[1.0, 0.0, 0.0]]])
    np.testing.assert_array_equal(result.output, [[[1.0]]])
    # equal huge logits share the weight exactly
    tied = spec.sdpa(query, np.array([[[1e154, 0.0], [1e154, 0.0]]]), value[:, :2], scale=1.0)
    np.testing.assert_array_equal(tied.weights, [[[0.5, 0.5]]])


def test_negative_infinity_additive_entries_block_like_bool():
    rng = np.random.default_rng(3)
    q, k, v = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 5, 4)), rng.normal(size=(2, 5, 2))
    attend = rng.random((2, 3, 5)) < 0.5
    with_bool = spec.sdpa(q, k, v, attend_mask=attend)
    with_additive = spec.sdpa(q, k, v, additive_mask=spec.masks.to_additive(attend))
    np.testing.assert_array_equal(with_bool.output, with_additive.output)
    np.testing.assert_array_equal(with_bool.weights, with_additive.weights)
