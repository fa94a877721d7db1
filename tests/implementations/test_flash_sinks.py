"""Learned sinks at the flash level: flash-ref and the bug zoo's base agree with
spec.flash_attention(sinks=...) (output, LSE, gradients); a function naming a sinks
argument (``sinks``, ``learnable_sink``, ``s_aux``) is recognised and probed for it, one
without (``**kwargs`` included) does not claim it; each sink mutant's smallest case
exposes its bug and its safe case does not."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

import spec
from implementations import registry
from implementations.base import DEFAULT_FLASH_FEATURES, Capabilities
from implementations.mutants import MUTANTS

OPTIONS = [{}, {"causal": True}, {"window": (1, 0), "softcap": 1.5}, {"alibi_slopes": np.array([0.5, -0.25, 1.0, 0.0])},
           {"causal": True, "scale": -0.7}]
SINKS = [np.array([0.5, -1.0, 2.0, 0.0]), np.full(4, 1000.0), np.full(4, -1000.0)]


def _call(flash, q, k, v, options, sinks, *, grad=None):
    kwargs = {"causal": options.get("causal", False), "window_size": options.get("window", (-1, -1)),
              "softcap": options.get("softcap", 0.0), "softmax_scale": options.get("scale")}
    if "alibi_slopes" in options:
        kwargs["alibi_slopes"] = torch.tensor(options["alibi_slopes"])
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out, lse, _ = flash(tq, tk, tv, return_attn_probs=True, sinks=torch.tensor(sinks), **kwargs)
    grads = None
    if grad is not None:
        out.backward(torch.tensor(grad))
        grads = (tq.grad, tk.grad, tv.grad)
    return out.detach().numpy(), lse.detach().numpy(), grads


@pytest.mark.parametrize("name", ["flash-ref", "mutant-base"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("sinks", SINKS, ids=["varied", "far_above", "far_below"])
@pytest.mark.parametrize("L, S", [(3, 5), (5, 2)])
def test_flash_sinks_agree_with_spec(name, options, sinks, L, S):
    if name == "flash-ref":
        flash = registry.resolve("flash-ref").flash
    else:
        from implementations.mutants.flash.flash_mutants import FlashBase

        flash = FlashBase()
    rng = np.random.default_rng(L * 10 + S)
    q, k, v = rng.standard_normal((2, L, 4, 3)), rng.standard_normal((2, S, 2, 3)), rng.standard_normal((2, S, 2, 3))
    want = spec.flash_attention(q, k, v, return_lse=True, sinks=sinks, **options)
    grad = rng.standard_normal(want.output.shape)
    out, lse, grads = _call(flash, q, k, v, options, sinks, grad=grad)
    np.testing.assert_allclose(out, want.output, atol=1e-12)
    assert np.isfinite(out).all()
    if name == "flash-ref":  # the LSE is the keys' (unchanged by the sinks)
        finite = np.isfinite(want.lse)
        np.testing.assert_array_equal(np.isneginf(lse), ~finite)
        np.testing.assert_allclose(lse[finite], want.lse[finite], atol=1e-12)
    vjp = spec.flash_attention_vjp(q, k, v, grad, sinks=sinks, **options)
    for got, expected in zip(grads, vjp, strict=True):
        np.testing.assert_allclose(got.numpy(), expected, atol=1e-11)


def test_flash_ref_declares_sinks_and_the_default_does_not():
    assert "sinks" in registry.resolve("flash-ref").caps("flash").flash_features
    assert "sinks" not in Capabilities().flash_features and Capabilities().flash_features == DEFAULT_FLASH_FEATURES


SOURCE = textwrap.dedent(
    """
    import torch
    from implementations.builtins.references.flash_reference import flash_attn_func as reference

    def named_sinks(q, k, v, softmax_scale=None, causal=False, sinks=None):
        return reference(q, k, v, softmax_scale=softmax_scale, causal=causal, sinks=sinks)

    def fa3_style(q, k, v, softmax_scale=None, causal=False, learnable_sink=None):
        return reference(q, k, v, softmax_scale=softmax_scale, causal=causal, sinks=learnable_sink)

    def sinks_raise(q, k, v, softmax_scale=None, causal=False, s_aux=None):
        if s_aux is not None:
            raise NotImplementedError("no sinks in this kernel")
        return reference(q, k, v, softmax_scale=softmax_scale, causal=causal)

    def swallows(q, k, v, softmax_scale=None, causal=False, **kwargs):
        return reference(q, k, v, softmax_scale=softmax_scale, causal=causal)
    """
)


def test_sink_arguments_are_recognised_and_probed(tmp_path):
    path = tmp_path / "user_sinks.py"
    path.write_text(SOURCE)
    for name, claimed in (("named_sinks", True), ("fa3_style", True), ("sinks_raise", False), ("swallows", False)):
        impl = registry.resolve(f"{path}:{name}")
        caps = impl.caps("flash")
        assert ("sinks" in caps.flash_features) == claimed, (name, caps.flash_features, caps.probe_notes)
        if name == "sinks_raise":
            assert any(note.startswith("sinks:") for note in caps.probe_notes)
    # the alias is handed the suite's sinks= argument
    impl = registry.resolve(f"{path}:fa3_style")
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 2, 4)) for _ in range(3))
    out = impl.flash(*(torch.tensor(x) for x in (q, k, v)), sinks=torch.tensor([3.0, -1.0]))
    np.testing.assert_allclose(out.numpy(), spec.flash_attention(q, k, v, sinks=[3.0, -1.0]), atol=1e-12)


def _agrees(mutant, case) -> bool:
    g = torch.Generator().manual_seed(0)
    B, N, K, L, S, E, Ev = (case[d] for d in ("B", "N", "K", "L", "S", "E", "Ev"))
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64)
               for shape in ((B, L, N, E), (B, S, K, E), (B, S, K, Ev)))
    sinks = case.get("sinks")
    want = spec.flash_attention(q.numpy(), k.numpy(), v.numpy(), sinks=sinks)
    got = mutant.build().flash(q, k, v, sinks=None if sinks is None else torch.tensor(sinks))
    return bool(np.allclose(got.numpy(), want, atol=1e-9))


@pytest.mark.parametrize("name", sorted(n for n in MUTANTS if n.startswith("flash_sink")))
def test_sink_mutant_cases_expose_their_bug(name):
    mutant = MUTANTS[name]
    assert mutant.expected_property in ("sink_agreement", "sink_equivalence")
    assert "sinks" in mutant.build().capabilities.flash_features
    assert not _agrees(mutant, mutant.smallest_case), "the smallest case does not expose the bug"
    assert _agrees(mutant, mutant.safe_case), "the safe case exposes the bug"
