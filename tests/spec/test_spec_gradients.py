"""spec.sdpa_vjp against central finite differences and torch autograd (spec section: gradients)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

import spec
from spec_test_cases import assert_close, describe_case, sdpa_cases, torch_sdpa

INPUTS = ("query", "key", "value", "additive_mask")


def _loss(case, upstream):
    """Scalar loss sum(output ⊙ upstream), whose gradient w.r.t. the output is ``upstream``."""
    return float((spec.sdpa(**case).output * upstream).sum())


def finite_difference_gradient(case, upstream, name, step=1e-6):
    """Central differences of the loss w.r.t. every finite entry of ``case[name]``."""
    base = case[name]
    grad = np.zeros_like(base)
    for index in np.ndindex(*base.shape):
        if not np.isfinite(base[index]):
            continue                                  # -inf mask entries: gradient 0 by definition
        plus, minus = base.copy(), base.copy()
        plus[index] += step
        minus[index] -= step
        grad[index] = (_loss({**case, name: plus}, upstream) - _loss({**case, name: minus}, upstream)) / (2 * step)
    return grad


def _vjp_case(case):
    return {n: case[n] for n in ("query", "key", "value", "attend_mask", "additive_mask", "causal", "scale")}


@settings(deadline=None, max_examples=60)
@given(sdpa_cases(max_size=3, policies=("zero",)))
def test_vjp_matches_central_finite_differences(case):
    upstream = np.random.default_rng(0).normal(size=spec.sdpa(**case).output.shape)
    grads = spec.sdpa_vjp(grad_output=upstream, **_vjp_case(case))
    call = describe_case(case)
    for name, grad in zip(INPUTS, grads, strict=True):
        if case[name] is None:
            assert grad is None, call
            continue
        assert grad.shape == case[name].shape, call
        expected = finite_difference_gradient(case, upstream, name)
        assert_close(f"d{name}", grad, expected, atol=1e-6, rtol=1e-6, call=call)


@settings(deadline=None, max_examples=80)
@given(sdpa_cases(policies=("zero",)))
def test_vjp_matches_torch_autograd(case):
    torch = pytest.importorskip("torch")
    output, leaves = torch_sdpa(case, requires_grad=True)
    upstream = np.random.default_rng(1).normal(size=tuple(output.shape))
    output.backward(torch.from_numpy(upstream))
    grads = spec.sdpa_vjp(grad_output=upstream, **_vjp_case(case))
    call = describe_case(case)
    for name, grad in zip(INPUTS, grads, strict=True):
        if case[name] is None:
            continue
        expected = leaves[name].grad
        expected = np.zeros(case[name].shape) if expected is None else expected.numpy()
        assert_close(f"d{name}", grad, expected, atol=1e-12, rtol=1e-11, call=call)


def test_fully_masked_rows_get_zero_gradient_and_leave_others_alone():
    rng = np.random.default_rng(2)
    q, k, v = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 5, 4)), rng.normal(size=(2, 5, 3))
    attend = rng.random((2, 3, 5)) < 0.6
    attend[..., 0] = True
    attend[1, 2] = False                              # head 1, query 2: fully masked
    upstream = rng.normal(size=(2, 3, 3))
    grads = spec.sdpa_vjp(q, k, v, upstream, attend_mask=attend)
    assert (grads.dquery[1, 2] == 0).all()
    # the fully-masked row's upstream gradient reaches nothing
    changed = upstream.copy()
    changed[1, 2] = 1e6
    other = spec.sdpa_vjp(q, k, v, changed, attend_mask=attend)
    for a, b in zip(grads[:3], other[:3], strict=True):
        np.testing.assert_array_equal(a, b)


def test_gqa_gradients_sum_over_groups():
    """dK, dV of a GQA call equal the group sums of the same call with K/V repeated."""
    rng = np.random.default_rng(3)
    q, k, v = rng.normal(size=(1, 4, 3, 2)), rng.normal(size=(1, 2, 5, 2)), rng.normal(size=(1, 2, 5, 3))
    upstream = rng.normal(size=(1, 4, 3, 3))
    grouped = spec.sdpa_vjp(q, k, v, upstream)
    repeated = spec.sdpa_vjp(q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1), upstream)
    np.testing.assert_allclose(grouped.dquery, repeated.dquery, rtol=0, atol=1e-15)
    np.testing.assert_allclose(grouped.dkey, repeated.dkey.reshape(1, 2, 2, 5, 2).sum(2), atol=1e-15)
    np.testing.assert_allclose(grouped.dvalue, repeated.dvalue.reshape(1, 2, 2, 5, 3).sum(2), atol=1e-15)


def test_broadcast_additive_mask_gradient_is_reduced_to_its_shape():
    rng = np.random.default_rng(4)
    q, k, v = rng.normal(size=(2, 2, 3, 2)), rng.normal(size=(2, 2, 4, 2)), rng.normal(size=(2, 2, 4, 2))
    upstream = rng.normal(size=(2, 2, 3, 2))
    shared = rng.normal(size=(1, 3, 4))                            # broadcasts over B and N=2
    full = np.broadcast_to(shared, (2, 2, 3, 4)).copy()
    reduced = spec.sdpa_vjp(q, k, v, upstream, additive_mask=shared).dadditive_mask
    expanded = spec.sdpa_vjp(q, k, v, upstream, additive_mask=full).dadditive_mask
    assert reduced.shape == (1, 3, 4)
    np.testing.assert_allclose(reduced, expanded.sum(axis=(0, 1))[None], atol=1e-14)
