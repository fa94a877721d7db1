"""The examples resolve from their file paths and compute the right answer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import spec
from implementations import registry

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_sdpa_function_example():
    impl = registry.resolve(f"{EXAMPLES / 'sdpa_function.py'}:attention")
    c = impl.capabilities
    assert impl.sdpa is not None and c.gqa and c.different_v_dim and c.causal == "upper_left"
    assert c.fully_masked == "zero" and c.mask_grad
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 4, 3, 8)), rng.standard_normal((2, 2, 5, 8)), rng.standard_normal((2, 2, 5, 6))
    attend = rng.random((3, 5)) < 0.6
    attend[1] = False  # a fully-masked row
    additive = rng.standard_normal((2, 1, 3, 5))
    t = torch.from_numpy
    for kwargs, expected in [
        ({"attn_mask": t(attend)}, spec.sdpa(q, k, v, attend_mask=attend)),
        ({"attn_mask": t(additive), "scale": -0.4}, spec.sdpa(q, k, v, additive_mask=additive, scale=-0.4)),
        ({"is_causal": True}, spec.sdpa(q, k, v, causal="upper_left")),
    ]:
        got = impl.sdpa(t(q), t(k), t(v), enable_gqa=True, **kwargs)
        np.testing.assert_allclose(got.numpy(), expected.output, atol=1e-12)


def mha_inputs(rng, batch_first=False):
    x = rng.standard_normal((2, 4, 8) if batch_first else (4, 2, 8))
    return x


@pytest.mark.parametrize("batch_first", [False, True])
def test_mha_dropin_example(batch_first):
    impl = registry.resolve(f"{EXAMPLES / 'mha_dropin.py'}:SimpleMultiheadAttention")
    caps = impl.caps("mha")
    assert impl.mha is not None and "need_weights" in caps.mha_features
    assert {"bias_kv", "zero_attn", "kdim_vdim", "dropout"}.isdisjoint(caps.mha_features)
    assert {"batch_first", "key_padding_mask", "attn_mask", "unbatched", "per_head_weights",
            "cross_attention"} <= caps.mha_features
    rng = np.random.default_rng(1)
    params = spec.MHAParams.random(rng, 8, 2)
    q, kv = mha_inputs(rng, batch_first), mha_inputs(rng, batch_first)
    kpm = np.array([[False, False, True, True], [False, False, False, False]])
    attn_mask = rng.standard_normal((4, 4))
    module = impl.mha(8, 2, batch_first=batch_first, dtype=torch.float64)
    impl.load_weights(module, params)
    t = torch.from_numpy
    got, weights = module(t(q), t(kv), t(kv), key_padding_mask=t(kpm), attn_mask=t(attn_mask),
                          average_attn_weights=False)
    expected, expected_weights = spec.mha_forward(params, q, kv, kv, key_padding_mask=kpm, attn_mask=attn_mask,
                                                  batch_first=batch_first, average_attn_weights=False)
    np.testing.assert_allclose(got.detach().numpy(), expected, atol=1e-12)
    np.testing.assert_allclose(weights.detach().numpy(), expected_weights, atol=1e-12)


def test_learner_module_example():
    """The learner's class resolves with no adapter: the learner level reads and probes it."""
    impl = registry.resolve(f"{EXAMPLES / 'learner_module.py'}:SelfAttention")
    caps = impl.caps("mha")
    assert impl.mha is not None and "cross_attention" not in caps.mha_features
    assert {"key_padding_mask", "batch_first", "unbatched"} <= caps.mha_features
    assert caps.fully_masked == "zero"
    notes = " ".join(caps.probe_notes)
    assert "w_q, w_k, w_v, w_o" in notes and "1/True = keep" in notes and "forward(x, mask=...)" in notes
    rng = np.random.default_rng(2)
    params = spec.MHAParams.random(rng, 8, 2)
    x = rng.standard_normal((4, 2, 8))  # (L, B, D), self-attention
    kpm = np.array([[False, False, False, True], [True, True, True, True]])  # item 1: every key padded
    module = impl.mha(8, 2, dtype=torch.float64)
    impl.load_weights(module, params)
    t = torch.from_numpy
    got, _ = module(t(x), t(x), t(x), key_padding_mask=t(kpm))
    expected, _ = spec.mha_forward(params, x, x, x, key_padding_mask=kpm)
    np.testing.assert_allclose(got.detach().numpy(), expected, atol=1e-12)
    # a float 0/-inf key padding mask means the same as the bool one
    got_float, _ = module(t(x), t(x), t(x), key_padding_mask=t(np.where(kpm, -np.inf, 0.0)))
    np.testing.assert_allclose(got_float.detach().numpy(), expected, atol=1e-12)


def test_learner_module_refuses_what_it_cannot_do():
    impl = registry.resolve(f"{EXAMPLES / 'learner_module.py'}:SelfAttention")
    module = impl.mha(8, 2)
    x, other = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    with pytest.raises(NotImplementedError, match="self-attention only"):
        module(x, other, other)
    with pytest.raises(NotImplementedError, match="float bias"):
        module(x, x, x, attn_mask=torch.randn(4, 4))
    with pytest.raises(NotImplementedError):
        impl.mha(8, 2, add_bias_kv=True)
    with pytest.raises(NotImplementedError, match="dropout"):
        impl.mha(8, 2, dropout=0.1)
