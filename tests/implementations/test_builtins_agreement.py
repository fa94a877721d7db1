"""Every available built-in agrees with the float64 oracle on a small case, at each level
it exposes, including its declared fully-masked-row policy."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

import spec
from implementations import registry
from tests import pytest_process

NAMES = sorted(registry.registered())


def in_fresh_process(request) -> bool:
    """Run the triton cases in a fresh interpreter: flex_attention (eager) imports triton
    without TRITON_INTERPRET, after which the Triton built-in's interpreted kernel fails
    ("Cannot call @triton.jit'd outside of the scope of a kernel") in the same process."""
    if os.environ.get("IMPL_TESTS_ISOLATED") == "1":
        return False
    result = pytest_process.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
        cwd=request.config.rootpath, env={**os.environ, "IMPL_TESTS_ISOLATED": "1"},
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode in (0, 5), result.stdout[-3000:] + result.stderr[-2000:]
    return True


def available(name: str, request):
    """The built-in, or None when the test already ran (and passed) in a fresh process."""
    if name == "triton" and in_fresh_process(request):
        return None
    impl = registry.resolve(name)
    if not impl.available:
        pytest.skip(f"{name}: {impl.unavailable_reason}")
    return impl


def dtype_for(impl, caps) -> tuple[torch.dtype, float]:
    """float64, unless it is not declared or listed as a known deviation (then float32)."""
    deviates = any(e.applies("forward_agreement", {"dtype": "float64"}) for e in impl.expected_failures)
    if "float64" in caps.dtypes and not deviates:
        return torch.float64, 1e-10
    return torch.float32, 2e-5


@pytest.mark.parametrize("name", NAMES)
def test_sdpa_level_agrees_with_the_oracle(name, request):
    impl = available(name, request)
    if impl is None:
        return
    if impl.sdpa is None:
        pytest.skip(f"{name} has no SDPA level")
    c = impl.capabilities
    dtype, tol = dtype_for(impl, c)
    rng = np.random.default_rng(0)
    N, K = 4, (2 if c.gqa else 4)
    E, Ev = 8, (6 if c.different_v_dim else 8)
    q = rng.standard_normal((2, N, 3, E))
    k = rng.standard_normal((2, K, 5, E))
    v = rng.standard_normal((2, K, 5, Ev))
    attend = rng.random((2, 1, 3, 5)) < 0.7
    attend[..., 0] = True  # no fully-masked row here
    mask_args, torch_mask = {}, None
    if "bool" in c.mask_kinds:
        mask_args, torch_mask = {"attend_mask": attend}, torch.from_numpy(attend)
    scale = 0.3 if c.custom_scale else None
    expected = spec.sdpa(q, k, v, scale=scale, **mask_args).output
    t = lambda a: torch.from_numpy(a).to(dtype)  # noqa: E731
    got = impl.sdpa(t(q), t(k), t(v), attn_mask=torch_mask, scale=scale, enable_gqa=N != K)
    assert got.dtype == dtype and tuple(got.shape) == expected.shape
    np.testing.assert_allclose(got.double().numpy(), expected, atol=tol, rtol=tol)
    if c.causal is not None:
        expected = spec.sdpa(q, k, v, causal=c.causal).output
        got = impl.sdpa(t(q), t(k), t(v), is_causal=True, enable_gqa=N != K)
        np.testing.assert_allclose(got.double().numpy(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", NAMES)
def test_sdpa_level_fully_masked_rows_follow_the_declared_policy(name, request):
    impl = available(name, request)
    if impl is None:
        return
    if impl.sdpa is None or "bool" not in impl.capabilities.mask_kinds:
        pytest.skip(f"{name} has no SDPA level with bool masks")
    c = impl.capabilities
    dtype, tol = dtype_for(impl, c)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(s) for s in ((1, 2, 3, 8), (1, 2, 4, 8), (1, 2, 4, 8)))
    attend = np.ones((3, 4), dtype=bool)
    attend[1] = False
    declared = c.fully_masked_policy("bool")
    policy = declared if declared != "unspecified" else "zero"
    expected = spec.sdpa(q, k, v, attend_mask=attend, fully_masked=policy).output
    t = lambda a: torch.from_numpy(a).to(dtype)  # noqa: E731
    got = impl.sdpa(t(q), t(k), t(v), attn_mask=torch.from_numpy(attend)).double().numpy()
    other_rows = [0, 2]
    np.testing.assert_allclose(got[:, :, other_rows], expected[:, :, other_rows], atol=tol, rtol=tol)
    if declared != "unspecified":
        np.testing.assert_allclose(got[:, :, 1], expected[:, :, 1], atol=tol, rtol=tol)


def mha_case(seed: int = 0):
    rng = np.random.default_rng(seed)
    params = spec.MHAParams.random(rng, 8, 2)
    query = rng.standard_normal((3, 2, 8))  # (L, B, D)
    key = rng.standard_normal((5, 2, 8))  # (S, B, D)
    value = rng.standard_normal((5, 2, 8))
    key_padding_mask = np.zeros((2, 5), dtype=bool)
    key_padding_mask[1, 3:] = True  # True = blocked
    return params, query, key, value, key_padding_mask


@pytest.mark.parametrize("name", NAMES)
def test_mha_level_agrees_with_the_oracle(name, request):
    impl = available(name, request)
    if impl is None:
        return
    if impl.mha is None:
        pytest.skip(f"{name} has no MHA level")
    c = impl.caps("mha")
    dtype, tol = dtype_for(impl, c)
    params, query, key, value, kpm = mha_case()
    module = impl.mha(8, 2, dtype=dtype)
    impl.load_weights(module, params)
    module.eval()
    t = lambda a: torch.from_numpy(a).to(dtype)  # noqa: E731
    with torch.no_grad():
        got, weights = module(t(query), t(key), t(value), key_padding_mask=torch.from_numpy(kpm))
    expected, expected_weights = spec.mha_forward(params, query, key, value, key_padding_mask=kpm)
    np.testing.assert_allclose(got.double().numpy(), expected, atol=tol, rtol=tol)
    if "need_weights" in c.mha_features:
        np.testing.assert_allclose(weights.double().numpy(), expected_weights, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", ["spec", "handwritten", "sdpa", "sdpa-math", "sdpa-flash"])
def test_sdpa_gradients_agree_with_the_oracle_vjp(name):
    impl = registry.resolve(name)
    c = impl.capabilities
    assert c.autograd
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s) for s in ((1, 4, 3, 8), (1, 2, 5, 8), (1, 2, 5, 8)))
    additive = rng.standard_normal((3, 5))
    additive[1] = -np.inf  # a fully-masked row: zero gradient, never NaN
    grad_out = rng.standard_normal((1, 4, 3, 8))
    expected = spec.sdpa_vjp(q, k, v, grad_out, additive_mask=additive)
    tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    mask = torch.from_numpy(additive).requires_grad_(c.mask_grad)
    impl.sdpa(tq, tk, tv, attn_mask=mask, enable_gqa=True).backward(torch.from_numpy(grad_out))
    for got, want in ((tq.grad, expected.dquery), (tk.grad, expected.dkey), (tv.grad, expected.dvalue)):
        np.testing.assert_allclose(got.numpy(), want, atol=1e-10)
    if c.mask_grad:
        np.testing.assert_allclose(mask.grad.numpy(), expected.dadditive_mask, atol=1e-10)
