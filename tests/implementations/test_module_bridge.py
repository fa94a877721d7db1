"""Other frameworks' multi-head layers at the MHA level with no adapter: the generic part
(implementations/bridge/modules.py) and the tables (module_tables.py).

In process: each table's layer, built by the factory with the drawn weights written into it,
agrees with the float64 oracle ``spec.mha_forward`` (masks, per-head masks, the causal flag,
need_weights), and shows the weights back under nn.MultiheadAttention's names. Paddle's
layer: tests/implementations/test_paddle_bridge.py too. (Their ``ci``
certificates are not pinned here yet: docs/FRAMEWORKS.md.) Tests of a framework that is not
installed skip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import spec
from implementations import registry
from implementations.base import ImplementationError
from implementations.bridge import module_table
from implementations.bridge.modules import ModuleMHAFactory, load_module_weights
from tests.implementations.test_framework_bridge import installed

needs_flax = pytest.mark.skipif(not installed("flax"), reason="flax is not installed (pip install flax)")

#: (id, package to import, pip name, class path) of every table's layer.
LAYERS = [
    ("nnx", "flax", "flax", "flax.nnx:MultiHeadAttention"),
    ("linen", "flax", "flax", "flax.linen:MultiHeadDotProductAttention"),
    ("equinox", "equinox", "equinox", "equinox.nn:MultiheadAttention"),
    ("haiku", "haiku", "dm-haiku", "haiku:MultiHeadAttention"),
    ("paddle", "paddle", "paddlepaddle", "paddle.nn:MultiHeadAttention"),
]


def layer_params():
    return [pytest.param(spec_, id=name, marks=pytest.mark.skipif(
        not installed(package), reason=f"{package} is not installed (pip install {pip})"))
        for name, package, pip, spec_ in LAYERS]


def layer_class(path: str):
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)

D, N, L, S, B = 4, 2, 3, 5, 2


def drawn(seed=0):
    rng = np.random.default_rng(seed)
    params = spec.MHAParams(
        embed_dim=D, num_heads=N, in_proj_weight=rng.standard_normal((3 * D, D)),
        in_proj_bias=rng.standard_normal(3 * D), out_proj_weight=rng.standard_normal((D, D)),
        out_proj_bias=rng.standard_normal(D), kdim=D, vdim=D, add_zero_attn=False)
    return params, rng


def built(cls, params, **options):
    factory = ModuleMHAFactory(cls, module_table(cls))
    module = factory(D, N, dtype=torch.float64, kdim=params.kdim, vdim=params.vdim, **options)
    load_module_weights(module, params)
    return module


@pytest.mark.parametrize("path", layer_params())
def test_layers_compute_nn_multihead_attention(path):
    """Each table's layer, the drawn weights written into it, is the oracle in float64:
    padding with a per-head mask, with one mask for every head, with none; the weights
    shown back under nn.MultiheadAttention's names; the layer's own attention weights
    where its table reads them (Flax), None where the layer returns none."""
    cls = layer_class(path)
    params, rng = drawn()
    module = built(cls, params)
    q, k, v = rng.standard_normal((L, B, D)), rng.standard_normal((S, B, D)), rng.standard_normal((S, B, D))
    padding = np.zeros((B, S), bool)
    padding[0, 1] = True
    per_head = rng.random((B * N, L, S)) < 0.3
    per_head[..., 0] = False
    t = torch.tensor
    for attn_mask in (per_head, per_head[0], None):
        given = None if attn_mask is None else t(attn_mask)
        out, weights = module(t(q), t(k), t(v), key_padding_mask=t(padding), attn_mask=given,
                              average_attn_weights=False)
        want, want_weights = spec.mha_forward(params, q, k, v, key_padding_mask=padding, attn_mask=attn_mask,
                                              average_attn_weights=False)
        np.testing.assert_allclose(out.numpy(), want, atol=1e-12)
        if path.startswith(("flax", "paddle")):
            np.testing.assert_allclose(weights.numpy(), want_weights, atol=1e-12)
        else:
            assert weights is None
    torch.testing.assert_close(module.in_proj_weight, t(params.in_proj_weight))
    torch.testing.assert_close(module.in_proj_bias, t(params.in_proj_bias))
    torch.testing.assert_close(module.out_proj.weight, t(params.out_proj_weight))
    torch.testing.assert_close(module.out_proj.bias, t(params.out_proj_bias))
    causal = np.triu(np.ones((L, L), bool), 1)
    out, none = module(t(q), t(q), t(q), attn_mask=t(causal), is_causal=True, need_weights=False)
    want = spec.mha_forward(params, q, q, q, attn_mask=causal, need_weights=False)
    want = want[0] if isinstance(want, tuple) else want
    assert none is None
    np.testing.assert_allclose(out.numpy(), want, atol=1e-6)  # NNX's fused path: a float32 softmax


@needs_flax
def test_flax_layers_are_recognised_and_refuse_what_they_lack():
    from flax import nnx

    assert module_table(nnx.MultiHeadAttention).name == "flax.nnx.MultiHeadAttention"
    assert module_table(torch.nn.MultiheadAttention) is None
    factory = ModuleMHAFactory(nnx.MultiHeadAttention, module_table(nnx.MultiHeadAttention))
    with pytest.raises(NotImplementedError, match="one width for key and value"):
        factory(D, N, kdim=3, vdim=5)
    module = factory(D, N)
    x = torch.randn(L, B, D)
    with pytest.raises(NotImplementedError, match="bool masks only"):
        module(x, x, x, key_padding_mask=torch.zeros(B, L))
    with pytest.raises(ImplementationError, match="MHA level"):
        registry.resolve("flax.nnx:MultiHeadAttention", options={"layout": "BLNE"})



@pytest.mark.parametrize("path", [p for p in layer_params() if p.id in ("equinox", "haiku", "paddle")])
def test_layers_with_separate_key_and_value_widths(path):
    """Equinox's, Haiku's and Paddle's projections take any input width: kdim and vdim pass
    through."""
    cls = layer_class(path)
    params, rng = drawn()
    w = rng.standard_normal((3 * D, D))
    params = spec.MHAParams(embed_dim=D, num_heads=N, in_proj_weight=None, in_proj_bias=params.in_proj_bias,
                            out_proj_weight=params.out_proj_weight, out_proj_bias=params.out_proj_bias,
                            q_proj_weight=w[:D], k_proj_weight=rng.standard_normal((D, 3)),
                            v_proj_weight=rng.standard_normal((D, 5)), kdim=3, vdim=5, add_zero_attn=False)
    module = built(cls, params)
    q, k, v = rng.standard_normal((L, B, D)), rng.standard_normal((S, B, 3)), rng.standard_normal((S, B, 5))
    t = torch.tensor
    out, _ = module(t(q), t(k), t(v), need_weights=False)
    want = spec.mha_forward(params, q, k, v, need_weights=False)
    np.testing.assert_allclose(out.numpy(), want[0] if isinstance(want, tuple) else want, atol=1e-12)


@pytest.mark.parametrize("path", [p for p in layer_params() if p.id in ("equinox", "haiku")])
def test_equinox_and_haiku_layers_are_recognised(path):
    """``--impl=equinox.nn:MultiheadAttention`` and ``--impl=haiku:MultiHeadAttention`` resolve
    to the MHA level through their tables, with no adapter."""
    impl = registry.resolve(path)
    assert impl.mha is not None and impl.sdpa is None
    assert module_table(layer_class(path)).framework == "jax"


@needs_flax
def test_measured_deviations_attach_to_the_library_class_only():
    """Linen's measured file is attached to ``flax.linen.MultiHeadDotProductAttention``
    itself; a subclass (which may compute otherwise) is told the file's short name instead."""
    import flax.linen as nn

    from implementations.bridge import _module_deviations
    from implementations.registry.expected_failures import LIBRARY_XFAIL_DIR

    cls = nn.MultiHeadDotProductAttention
    entries, notes = _module_deviations(cls, module_table(cls))
    assert entries == registry.load_expected_failures("flax-linen-mha", LIBRARY_XFAIL_DIR)
    assert {e.property for e in entries} == {"mha_fully_masked_rows", "mha_dropout_expectation"}
    assert "attached to the library's own class" in notes[0]

    class Mine(nn.MultiHeadDotProductAttention):
        pass

    entries, notes = _module_deviations(Mine, module_table(Mine))
    assert entries == ()
    assert "--xfail-file=flax-linen-mha" in notes[0] and "not attached" in notes[0]


@pytest.mark.parametrize("path", [p for p in layer_params() if p.id == "haiku"])
def test_haiku_fully_masked_rows_are_uniform_but_nan_in_float16(path):
    """haiku-mha.toml's two entries, re-measured (a fix upstream fails here): Haiku fills
    blocked scores with -1e30, so a row whose keys are all blocked attends every key
    uniformly where -1e30 is finite, and is NaN in float16, where it overflows to -inf."""
    cls = layer_class(path)
    params, rng = drawn()
    x = rng.standard_normal((L, B, D))
    padding = np.zeros((B, L), bool)
    padding[0] = True  # batch row 0: every key blocked
    for dtype in (torch.float32, torch.float16):
        factory = ModuleMHAFactory(cls, module_table(cls))
        module = factory(D, N, dtype=dtype)
        load_module_weights(module, params)
        t = torch.tensor(x, dtype=dtype)
        out, _ = module(t, t, t, key_padding_mask=torch.tensor(padding), need_weights=False)
        if dtype == torch.float16:
            assert torch.isnan(out[:, 0]).all()
        else:
            w_v, b_v = params.in_proj_weight[2 * D:], params.in_proj_bias[2 * D:]
            # the output of a row attending every key equally: out_proj(mean of the projected values)
            want = (x[:, 0] @ w_v.T + b_v).mean(axis=0) @ params.out_proj_weight.T + params.out_proj_bias
            np.testing.assert_allclose(out[:, 0].double().numpy(), np.broadcast_to(want, (L, D)), atol=1e-5)
