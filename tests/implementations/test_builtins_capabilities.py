"""Capability declarations of the built-ins are true on this machine: every claimed
feature runs, and every feature an SDPA-level built-in does not claim raises (so the
suite skips it instead of certifying a silent wrong answer)."""

from __future__ import annotations

import pytest
import torch

from implementations import registry
from implementations.base import ALL_DTYPES

SDPA_BUILTINS = ["spec", "handwritten", "sdpa", "sdpa-math", "sdpa-flash", "flex"]
MHA_BUILTINS = ["spec", "handwritten", "torch-mha"]


def qkv(N=2, K=2, L=3, S=4, E=8, Ev=8, dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, N, L, E, generator=g).to(dtype)
    k = torch.randn(2, K, S, E, generator=g).to(dtype)
    v = torch.randn(2, K, S, Ev, generator=g).to(dtype)
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


def backward(impl, mask_grad=False):
    q, k, v = qkv(requires_grad=True)
    mask = torch.randn(3, 4, requires_grad=True) if mask_grad else None
    impl.sdpa(q, k, v, attn_mask=mask).sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    if mask_grad:
        assert mask.grad is not None


def last_dim_strided():
    q, k, v = qkv()
    return torch.randn(2, 2, 3, 16)[..., ::2], k, v


FEATURES = {
    # capability -> (is it claimed?, call that uses the feature)
    "different_v_dim": (lambda c: c.different_v_dim, lambda impl: impl.sdpa(*qkv(Ev=5))),
    "gqa": (lambda c: c.gqa, lambda impl: impl.sdpa(*qkv(N=4, K=2), enable_gqa=True)),
    "dropout": (lambda c: c.dropout, lambda impl: impl.sdpa(*qkv(), dropout_p=0.5)),
    "custom_scale": (lambda c: c.custom_scale, lambda impl: impl.sdpa(*qkv(), scale=-0.7)),
    "autograd": (lambda c: c.autograd, lambda impl: backward(impl)),
    "mask_grad": (lambda c: c.mask_grad, lambda impl: backward(impl, mask_grad=True)),
    "non_contiguous": (lambda c: c.non_contiguous, lambda impl: impl.sdpa(*last_dim_strided())),
    "bool_mask": (lambda c: "bool" in c.mask_kinds,
                  lambda impl: impl.sdpa(*qkv(), attn_mask=torch.rand(3, 4) < 0.5)),
    "additive_mask": (lambda c: "additive" in c.mask_kinds,
                      lambda impl: impl.sdpa(*qkv(), attn_mask=torch.randn(2, 1, 3, 4))),
    "causal": (lambda c: c.causal is not None, lambda impl: impl.sdpa(*qkv(), is_causal=True)),
    "batch_dims_3d": (lambda c: True, lambda impl: impl.sdpa(*[x[0] for x in qkv()])),
    "batch_dims_5d": (lambda c: True, lambda impl: impl.sdpa(*[x[None] for x in qkv()])),
    "mask_rank_3": (lambda c: "bool" in c.mask_kinds,
                    lambda impl: impl.sdpa(*qkv(), attn_mask=torch.rand(1, 3, 4) < 0.5)),
}
FEATURES.update({
    f"dtype_{d}": (lambda c, d=d: d in c.dtypes, lambda impl, d=d: impl.sdpa(*qkv(dtype=getattr(torch, d))))
    for d in ALL_DTYPES
})


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("name", SDPA_BUILTINS)
def test_sdpa_claims_are_true_and_refusals_raise(name, feature):
    impl = registry.resolve(name)
    claimed, call = FEATURES[feature]
    if claimed(impl.capabilities):
        out = call(impl)
        assert out is None or torch.isfinite(out).all()
    else:
        with pytest.raises(Exception):  # noqa: B017 - an undeclared feature may fail in any way
            call(impl)


@pytest.mark.parametrize("name", SDPA_BUILTINS)
def test_output_dtype_follows_the_input(name):
    impl = registry.resolve(name)
    for d in impl.capabilities.dtypes:
        assert impl.sdpa(*qkv(dtype=getattr(torch, d))).dtype == getattr(torch, d)


def test_cuda_only_backends_are_marked_and_unavailable_without_cuda():
    for name in ("sdpa-flash-cuda", "sdpa-efficient", "sdpa-cudnn"):
        impl = registry.resolve(name)
        assert impl.capabilities.devices == ("cuda",)
        assert impl.available == torch.cuda.is_available()


MHA_FEATURE_CALLS = {
    "cross_attention": ({}, {}),  # every call below has distinct query, key and value
    "no_bias": ({"bias": False}, {}),
    "kdim_vdim": ({"kdim": 3, "vdim": 5}, {}),
    "bias_kv": ({"add_bias_kv": True}, {}),
    "zero_attn": ({"add_zero_attn": True}, {}),
    "batch_first": ({"batch_first": True}, {}),
    "unbatched": ({}, {}),
    "key_padding_mask": ({}, {"key_padding_mask": torch.tensor([[False, True, False, False]] * 2)}),
    "attn_mask": ({}, {"attn_mask": torch.randn(3, 4)}),
    "is_causal": ({}, {"attn_mask": ~torch.ones(3, 4, dtype=torch.bool).tril(), "is_causal": True}),
    "need_weights": ({}, {"need_weights": True}),
    "per_head_weights": ({}, {"need_weights": True, "average_attn_weights": False}),
    "dropout": ({"dropout": 0.5}, {}),
}


@pytest.mark.parametrize("feature", sorted(MHA_FEATURE_CALLS))
@pytest.mark.parametrize("name", MHA_BUILTINS)
def test_mha_claimed_features_run(name, feature):
    impl = registry.resolve(name)
    caps = impl.caps("mha")
    build, forward = MHA_FEATURE_CALLS[feature]
    g = torch.Generator().manual_seed(0)
    kdim, vdim = build.get("kdim", 8), build.get("vdim", 8)
    query, key, value = torch.randn(3, 2, 8, generator=g), torch.randn(4, 2, kdim, generator=g), torch.randn(4, 2, vdim, generator=g)
    if feature == "batch_first":
        query, key, value = (x.transpose(0, 1) for x in (query, key, value))
    if feature == "unbatched":
        query, key, value = query[:, 0], key[:, 0], value[:, 0]

    def run():
        module = impl.mha(8, 2, **build)
        module.train(feature == "dropout")
        return module(query, key, value, **forward)

    if feature not in caps.mha_features:
        with pytest.raises(Exception):  # noqa: B017 - an undeclared feature may fail in any way
            run()
        return
    output, weights = run()
    assert torch.isfinite(output).all()
    if feature == "per_head_weights":
        assert weights.shape == (2, 2, 3, 4)
    if feature == "need_weights":
        assert weights.shape == (2, 3, 4)


@pytest.mark.parametrize("name", MHA_BUILTINS)
def test_mha_dtypes_and_autograd(name):
    impl = registry.resolve(name)
    caps = impl.caps("mha")
    for d in caps.dtypes:
        dtype = getattr(torch, d)
        module = impl.mha(8, 2, dtype=dtype)
        x = torch.randn(3, 2, 8, dtype=dtype)
        assert module(x, x, x)[0].dtype == dtype
    module = impl.mha(8, 2)
    x = torch.randn(3, 2, 8, requires_grad=True)
    if caps.autograd:
        module(x, x, x)[0].sum().backward()
        assert x.grad is not None
    else:
        with pytest.raises(Exception):  # noqa: B017 - an undeclared feature may fail in any way
            module(x, x, x)[0].sum().backward()
