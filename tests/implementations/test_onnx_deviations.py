"""``onnx:sdpa`` (F.scaled_dot_product_attention exported by the TorchScript exporter at
opset 17, run in ONNX Runtime's CPU provider): every entry of
implementations/xfail/onnx-torchscript-sdpa.toml is still a real deviation of the installed
torch and onnxruntime, eager PyTorch is right on the same calls, and the refusals the probes
declare are still refusals. Skips without onnx and onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import spec


@pytest.fixture(scope="module")
def impl():
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from implementations import registry

    built = registry.resolve("onnx:sdpa")
    assert built.available, built.unavailable_reason
    return built


def entry_for(impl, property_id, **attrs):
    return next((e for e in impl.expected_failures if e.applies(property_id, attrs)), None)


def tensors(*shapes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


def oracle(q, k, v, **kw):
    return spec.sdpa(q.double().numpy(), k.double().numpy(), v.double().numpy(), **kw).output


def test_a_negative_scale_is_nan_or_zero_where_eager_is_finite(impl):
    assert entry_for(impl, "forward_agreement", scale_sign="negative") is not None
    assert entry_for(impl, "forward_agreement", scale_sign="positive") is None
    q, k, v = tensors((1, 1, 2, 4), (1, 1, 3, 4), (1, 1, 3, 4))
    expected = oracle(q, k, v, scale=-0.5)
    np.testing.assert_allclose(F.scaled_dot_product_attention(q, k, v, scale=-0.5).numpy(), expected, atol=1e-6)
    assert torch.isnan(impl.sdpa(q, k, v, scale=-0.5)).all()  # Sqrt(-0.5) on query and key
    attend = torch.ones(2, 3, dtype=torch.bool)
    assert torch.equal(impl.sdpa(q, k, v, attn_mask=attend, scale=-0.5), torch.zeros(1, 1, 2, 4))  # NaN set to 0
    np.testing.assert_allclose(impl.sdpa(q, k, v, scale=0.5).numpy(), oracle(q, k, v, scale=0.5), atol=1e-6)


def test_an_additive_fully_masked_row_is_nan_where_eager_gives_zero(impl):
    assert entry_for(impl, "fully_masked_rows", mask_kind="additive", fully_masked_rows=True) is not None
    assert entry_for(impl, "fully_masked_rows", mask_kind="bool", fully_masked_rows=True) is None
    q, k, v = tensors((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4))
    attend = torch.ones(3, 5, dtype=torch.bool)
    attend[1] = False
    bias = torch.zeros(3, 5).masked_fill(~attend, float("-inf"))
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=bias)[:, :, 1], torch.zeros(1, 2, 4))
    assert torch.isnan(impl.sdpa(q, k, v, attn_mask=bias)[:, :, 1]).all()
    assert torch.equal(impl.sdpa(q, k, v, attn_mask=attend)[:, :, 1], torch.zeros(1, 2, 4))  # bool: zeroed


def test_float16_with_a_bool_mask_or_the_causal_flag_returns_float32(impl):
    for match in ({"is_causal": True}, {"mask_kind": "bool"}):
        for prop in ("forward_agreement", "output_contract"):
            assert entry_for(impl, prop, dtype="float16", **match) is not None, (prop, match)
    q, k, v = tensors((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4), dtype=torch.float16)
    assert impl.sdpa(q, k, v).dtype == torch.float16
    assert impl.sdpa(q, k, v, attn_mask=torch.zeros(3, 5, dtype=torch.float16)).dtype == torch.float16
    causal = impl.sdpa(q, k, v, is_causal=True)
    assert causal.dtype == torch.float32
    np.testing.assert_allclose(causal.numpy(), oracle(q, k, v, causal="upper_left"), atol=2e-3)
    assert impl.sdpa(q, k, v, attn_mask=torch.ones(3, 5, dtype=torch.bool)).dtype == torch.float32


def test_the_refusals_are_declared_with_notes(impl):
    caps = impl.capabilities
    assert "bfloat16" not in caps.dtypes and not caps.gqa and not caps.dropout and not caps.autograd
    assert caps.dtype_differences("mask_kinds")["float64"] == frozenset({"none", "bool"})
    notes = " ".join(caps.probe_notes)
    assert "Unsupported type for attn_mask" in notes and "enable_gqa is True" in notes and "Sqrt" in notes
    q, k, v = tensors((1, 1, 2, 4), (1, 1, 3, 4), (1, 1, 3, 4), dtype=torch.float64)
    with pytest.raises(ValueError, match="Unsupported type for attn_mask"):
        impl.sdpa(q, k, v, attn_mask=torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(NotImplementedError, match="inference graph"):
        impl.sdpa(q, k, v, dropout_p=0.1)


def test_eager_deviations_are_not_inherited(impl):
    """The graph does not run eager's CPU kernels: is_causal with scale 0 is finite here (NaN in
    eager, implementations/xfail/sdpa.toml), and that entry is not attached."""
    q, k, v = tensors((1, 1, 2, 4), (1, 1, 3, 4), (1, 1, 3, 4))
    assert torch.isnan(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.0)).any()
    np.testing.assert_allclose(impl.sdpa(q, k, v, is_causal=True, scale=0.0).numpy(),
                               oracle(q, k, v, causal="upper_left", scale=0.0), atol=1e-6)
    assert entry_for(impl, "forward_agreement", scale_sign="zero", causal="upper_left", mask_kind="none",
                     different_v_dim=False) is None
