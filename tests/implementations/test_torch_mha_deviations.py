"""The deviations listed in implementations/xfail/torch-mha.toml are still real on the
installed torch (a fixed one must be removed from the file), and the combination the
file does NOT list really conforms. Each test is one measurement on a tiny case."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import spec
from implementations import registry


def build(batch_first=True):
    impl = registry.resolve("torch-mha")
    rng = np.random.default_rng(0)
    params = spec.MHAParams.random(rng, 8, 2)
    module = impl.mha(8, 2, batch_first=batch_first)
    impl.load_weights(module, params)
    module.eval()
    return module, params


def fully_masked_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, generator=g)  # (B, L, D) batch_first
    kpm = torch.zeros(2, 3, dtype=torch.bool)
    kpm[0] = True  # every key of batch 0 blocked: its 3 query rows are fully masked
    return x, kpm


def listed(property_id, **attrs):
    """The torch-mha expected failure covering a case with these attributes, or None."""
    base = {"level": "mha", "key_padding_mask": None, "attn_mask": None, "is_causal": False,
            "batch_first": False, "self_attention": False, "add_bias_kv": False,
            "add_zero_attn": False, "need_weights": True, "fully_masked_rows": False,
            "N": 2, "unbatched": False, "kdim_vdim": False, "bias": True, "grad": False,
            "training": False, "dropout_p": 0.0}
    case = {**base, **attrs}
    entries = registry.resolve("torch-mha").expected_failures
    return next((entry for entry in entries if entry.applies(property_id, case)), None)


def test_need_weights_true_gives_nan_rows_and_nan_gradients():
    assert listed("mha_fully_masked_rows", need_weights=True, fully_masked_rows=True)
    module, _ = build()
    x, kpm = fully_masked_inputs()
    x = x.clone().requires_grad_()
    out, weights = module(x, x, x, key_padding_mask=kpm, need_weights=True)
    assert torch.isnan(out[0]).all() and not torch.isnan(out[1]).any()  # other rows untouched
    assert torch.isnan(weights[0]).all()
    out.nan_to_num().sum().backward()  # even with the NaN rows zeroed out of the loss
    assert torch.isnan(module.in_proj_weight.grad).any()


def test_fast_path_gives_nan_rows():
    assert listed("mha_fully_masked_rows", need_weights=False, batch_first=True, self_attention=True,
                  fully_masked_rows=True, key_padding_mask="bool")
    # With autograd on (the module's parameters require grad) the slow path runs.
    assert not listed("mha_fully_masked_rows", need_weights=False, batch_first=True, self_attention=True,
                      fully_masked_rows=True, key_padding_mask="bool", grad=True)
    module, _ = build(batch_first=True)
    x, kpm = fully_masked_inputs()
    with torch.no_grad():  # eval + no grad + self-attention + need_weights=False: the fast path
        out, _ = module(x, x, x, key_padding_mask=kpm, need_weights=False)
    assert torch.isnan(out[0]).all() and not torch.isnan(out[1]).any()


def test_slow_path_without_weights_conforms_so_it_is_not_listed():
    module, params = build(batch_first=True)
    x, kpm = fully_masked_inputs()
    out, _ = module(x, x, x, key_padding_mask=kpm, need_weights=False)  # grad enabled: slow path
    expected, _ = spec.mha_forward(params, x.double().numpy(), x.double().numpy(), x.double().numpy(),
                                   key_padding_mask=kpm.numpy(), need_weights=False, batch_first=True)
    np.testing.assert_allclose(out.detach().double().numpy(), expected, atol=1e-5)
    np.testing.assert_allclose(expected[0], np.broadcast_to(params.out_proj_bias, (3, 8)), atol=1e-12)
    assert not listed("mha_fully_masked_rows", need_weights=False, batch_first=True, self_attention=False,
                      fully_masked_rows=True)
    assert not listed("mha_agreement", need_weights=False, fully_masked_rows=True)


def test_fast_path_ignores_is_causal_without_a_mask():
    """Not listed (TOML cannot match attn_mask=None); documented in the file's header."""
    module, _ = build(batch_first=True)
    x, _ = fully_masked_inputs()
    with pytest.raises(RuntimeError, match="attn_mask"):
        module(x, x, x, is_causal=True, need_weights=False)  # slow path refuses, as the spec does
    with torch.no_grad():
        causal, _ = module(x, x, x, is_causal=True, need_weights=False)
        plain, _ = module(x, x, x, need_weights=False)
    assert torch.equal(causal, plain)  # the fast path computed non-causal attention


@pytest.mark.parametrize("extra", ["add_zero_attn", "add_bias_kv"])
def test_is_causal_with_an_appended_key_blocks_it(extra):
    """need_weights=False, no key_padding_mask: the causal flag replaces the padded mask."""
    for property_id in ("mha_agreement", "mha_gradients", "mha_mask_conventions"):
        assert listed(property_id, is_causal=True, attn_mask="bool", need_weights=False, **{extra: True})
    assert not listed("mha_agreement", is_causal=True, attn_mask="bool", need_weights=False,
                      key_padding_mask="bool", **{extra: True})
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(4, 2, **{extra: True}).double().eval()
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    causal_blocked = ~torch.ones(3, 3, dtype=torch.bool).tril()
    with_hint, _ = module(x, x, x, attn_mask=causal_blocked, is_causal=True, need_weights=False)
    mask_only, _ = module(x, x, x, attn_mask=causal_blocked, need_weights=False)
    with_weights, _ = module(x, x, x, attn_mask=causal_blocked, is_causal=True, need_weights=True)
    assert not torch.allclose(with_hint, mask_only)
    assert torch.allclose(with_weights, mask_only)
