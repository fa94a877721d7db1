"""The ``jax`` built-in: every entry of implementations/xfail/jax.toml is still a real
deviation of the installed jax, the argument mapping it relies on still holds (causal
alignment, mask polarity, GQA), the jit failure the 16-bit dtypes' compiled calls work
around is still there, float16's compiled call computes what the eager call does, and without jax the built-in is unavailable with a reason, never an
import error. Tests needing jax skip without it."""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest
import torch

import spec
from implementations import registry
from implementations.builtins.frameworks import jax_attention


@pytest.fixture(scope="module")
def impl():
    pytest.importorskip("jax")
    built = registry.resolve("jax")
    assert built.available, built.unavailable_reason
    return built


def entry_for(impl, property_id, **attrs):
    return next((e for e in impl.expected_failures if e.applies(property_id, attrs)), None)


def tensors(*shapes, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


def oracle(q, k, v, **kw):
    return spec.sdpa(q.double().numpy(), k.double().numpy(), v.double().numpy(), **kw).output


def test_float64_carries_float32_softmax_rounding(impl):
    assert entry_for(impl, "forward_agreement", dtype="float64") is not None
    assert entry_for(impl, "forward_agreement", dtype="float32") is None
    q, k, v = tensors((1, 1, 4, 8), (1, 1, 16, 8), (1, 1, 16, 8))
    out = impl.sdpa(q, k, v)
    assert out.dtype == torch.float64
    rel = np.abs(out.numpy() - oracle(q, k, v)).max() / np.abs(oracle(q, k, v)).max()
    assert 1e-12 < rel < 1e-5, rel  # float32's rounding, far above float64's


def test_additive_minus_inf_row_is_nan_while_bool_blocked_row_is_uniform(impl):
    # Declared per kind, not an expected failure.
    assert entry_for(impl, "fully_masked_rows", mask_kind="additive") is None
    assert impl.capabilities.fully_masked_policies == {"bool": "uniform", "additive": "nan", "causal": "uniform"}
    q, k, v = tensors((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4), dtype=torch.float32)
    attend = torch.ones(3, 5, dtype=torch.bool)
    attend[1] = False
    by_bool = impl.sdpa(q, k, v, attn_mask=attend)
    uniform = oracle(q, k, v, attend_mask=attend.numpy(), fully_masked="uniform")
    np.testing.assert_allclose(by_bool.double().numpy(), uniform, atol=1e-6)
    by_additive = impl.sdpa(q, k, v, attn_mask=torch.where(attend, 0.0, float("-inf")))
    assert torch.isnan(by_additive[:, :, 1]).all()
    assert torch.isfinite(by_additive[:, :, [0, 2]]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_jitted_calls_give_nan_rows_for_logits_near_1e9(impl, dtype):
    name = str(dtype).removeprefix("torch.")
    assert entry_for(impl, "forward_agreement", dtype=name, regime="wide_range") is not None
    assert entry_for(impl, "forward_agreement", dtype=name, regime="normal") is None
    assert entry_for(impl, "forward_agreement", dtype="float16", regime="wide_range") is None  # not measured there
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(1, 16, 4, 2, generator=g) * 3e4).to(dtype)  # logits ~1e9 with scale 1/sqrt(2)
    k = (torch.randn(1, 16, 12, 2, generator=g) * 3e4).to(dtype)
    v = torch.randn(1, 16, 12, 2, generator=g).to(dtype)
    out = impl.sdpa(q, k, v)
    assert np.isfinite(oracle(q, k, v)).all()
    bad_heads = int(torch.isnan(out).flatten(2).any(-1).sum())
    assert bad_heads > 0, f"jitted {name} jax is finite at logits ~1e9 now: drop the entry"


def test_bfloat16_is_jitted_and_a_shape_the_compiler_refuses_runs_eagerly(impl):
    """bfloat16 runs jitted (jax_attention._jit_for: "fallback"); the shapes XLA refuses run
    op by op, with JAX's own precision fallback, and give the same values as an eager call."""
    import jax

    g = torch.Generator().manual_seed(3)
    for shape in ((1, 2, 3, 4), (1, 1, 1, 1)):  # compiles; refused (B = N = L = S = 1)
        q, k, v = (torch.randn(*shape, generator=g).bfloat16() for _ in range(3))
        out = impl.sdpa(q, k, v)
        assert out.dtype == torch.bfloat16
        np.testing.assert_allclose(out.double().numpy(), oracle(q, k, v), atol=2e-2)
    compiled = [state for fn in impl.sdpa.fallbacks for state in fn.compiles.values()]
    assert True in compiled and False in compiled
    import ml_dtypes

    one = np.ones((1, 1, 1, 1), ml_dtypes.bfloat16)
    np.testing.assert_allclose(np.asarray(jax.nn.dot_product_attention(one, one, one), np.float64), 1.0)


def test_float16_is_compiled_with_the_eager_calls_default_precision_retry(impl):
    """float16 runs compiled (jax_attention._jit_for: "default-precision"): the matmul
    precision XLA refuses on a CPU is the default one in the compiled program, the retry the
    eager call makes, so outputs and gradients are those of the eager call up to the
    rounding of a compiled program (a float16 ulp of the largest value)."""
    import jax

    from implementations.bridge.frameworks import torch_to_numpy

    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, 5, 8, generator=g).half().requires_grad_()
    k = torch.randn(2, 3, 7, 8, generator=g).half().requires_grad_()
    v = torch.randn(2, 3, 7, 8, generator=g).half().requires_grad_()
    cot = torch.randn(2, 3, 5, 8, generator=g).half()
    out = impl.sdpa(q, k, v, is_causal=True, scale=0.4)
    out.backward(cot)
    compiled = [state for fn in impl.sdpa.fallbacks for key, state in fn.compiles.items()
                if key[0] == ((2, 5, 3, 8), "float16")]  # this call's, forward and backward
    assert compiled == [True, True], compiled  # compiled, no eager fallback

    def eager(q_, k_, v_):
        return jax.nn.dot_product_attention(q_, k_, v_, is_causal=True, scale=0.4)

    blne = [jax.numpy.asarray(torch_to_numpy(t.detach().transpose(1, 2))) for t in (q, k, v)]
    want, pullback = jax.vjp(eager, *blne)
    grads = pullback(jax.numpy.asarray(torch_to_numpy(cot.transpose(1, 2))))
    for got, expected in ((out, want), *zip((q.grad, k.grad, v.grad), grads, strict=True)):
        expected = np.asarray(expected, np.float64).transpose(0, 2, 1, 3)
        np.testing.assert_allclose(got.detach().double().numpy(), expected, rtol=0,
                                   atol=2 ** -10 * max(1.0, np.abs(expected).max()))
    q, k, v = (t.detach() for t in (q, k, v))
    np.testing.assert_allclose(out.double().detach().numpy(), oracle(q, k, v, causal="upper_left", scale=0.4),
                               atol=5e-3)


def test_default_precision_rewrites_only_what_the_backend_refuses(impl):
    """The rewrite behind "default-precision" sets precision None on float16's refused
    F16_F16_F32 matmul and keeps bfloat16's BF16_BF16_F32, which the CPU accepts."""
    import jax
    import ml_dtypes
    from jax.extend.core import ClosedJaxpr

    rewrite = impl.sdpa.framework.with_default_precision(jax.nn.dot_product_attention)

    def precisions(jaxpr):
        found = []
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(eqn.params["precision"])
            for value in eqn.params.values():
                if isinstance(value, ClosedJaxpr):
                    found += precisions(value.jaxpr)
        return found

    for dtype, explicit, kept in ((np.float16, "F16_F16_F32", False), (ml_dtypes.bfloat16, "BF16_BF16_F32", True)):
        q = np.ones((1, 2, 1, 4), dtype)
        traced = jax.make_jaxpr(jax.nn.dot_product_attention)(q, q, q).jaxpr
        assert explicit in [str(p).rsplit(".", 1)[-1] for p in precisions(traced)]
        got = [str(p).rsplit(".", 1)[-1] for p in precisions(rewrite._rewrite(traced))]
        assert (explicit in got) == kept, got
    q = np.ones((1, 2, 1, 4), np.float16)
    np.testing.assert_allclose(np.asarray(jax.jit(rewrite)(q, q, q), np.float64), 1.0)


def test_jit_fails_for_16_bit_dtypes_on_cpu_but_eager_calls_work(impl):
    """Why the adapter compiles float16 with the default-precision rewrite and bfloat16 with
    an eager fallback per shape (see jax_attention._jit_for)."""
    import jax
    import ml_dtypes

    jitted = jax.jit(jax.nn.dot_product_attention)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        q = np.ones((1, 1, 1, 4), dtype)  # (B, L, N, E): B = N = L = S = 1
        with pytest.raises(Exception, match="not supported"):
            np.asarray(jitted(q, q, q))
        np.testing.assert_allclose(np.asarray(jax.nn.dot_product_attention(q, q, q), np.float64), 1.0)


def test_is_causal_is_upper_left(impl):
    assert impl.capabilities.causal == "upper_left"
    q, k, v = tensors((1, 1, 2, 4), (1, 1, 3, 4), (1, 1, 3, 4), dtype=torch.float32)  # L < S
    got = impl.sdpa(q, k, v, is_causal=True).double().numpy()
    np.testing.assert_allclose(got, oracle(q, k, v, causal="upper_left"), atol=1e-6)
    assert not np.allclose(got, oracle(q, k, v, causal="lower_right"), atol=1e-3)


def test_masks_keep_their_polarity_and_gqa_groups_heads(impl):
    q, k, v = tensors((2, 4, 3, 4), (2, 2, 5, 4), (2, 2, 5, 4), dtype=torch.float32)
    attend = torch.rand(3, 5, generator=torch.Generator().manual_seed(1)) < 0.6
    attend[:, 0] = True
    got = impl.sdpa(q, k, v, attn_mask=attend, enable_gqa=True, scale=-0.7)
    expected = oracle(q, k, v, attend_mask=attend.numpy(), scale=-0.7)
    np.testing.assert_allclose(got.double().numpy(), expected, atol=1e-6)
    bias = torch.randn(2, 1, 3, 5, generator=torch.Generator().manual_seed(2))
    got = impl.sdpa(q, k, v, attn_mask=bias, enable_gqa=True)
    np.testing.assert_allclose(got.double().numpy(), oracle(q, k, v, additive_mask=bias.double().numpy()),
                               atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_dtype_device_and_gradients_come_back(impl, dtype):
    q, k, v = tensors((1, 2, 3, 4), (1, 1, 5, 4), (1, 1, 5, 4), dtype=dtype)
    bias = torch.zeros(3, 5, dtype=dtype, requires_grad=True)
    q.requires_grad_(True)
    out = impl.sdpa(q, k, v, attn_mask=bias, enable_gqa=True)
    assert out.dtype == dtype and out.device == q.device and out.shape == (1, 2, 3, 4)
    out.float().sum().backward()
    assert q.grad.dtype == dtype and q.grad.shape == q.shape
    assert bias.grad.shape == bias.shape and torch.isfinite(bias.grad.float()).all()


def test_unavailable_without_jax_with_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)  # "import jax" raises ImportError
    module = importlib.reload(jax_attention)  # importing the module needs no jax
    built = module.make_implementation()
    assert not built.available and "jax is not importable" in built.unavailable_reason
    assert built.not_supported_reasons({"level": "sdpa"}) == [
        f"jax is unavailable: {built.unavailable_reason}"]
    assert "[jax]" in built.unavailable_reason  # says how to install it
