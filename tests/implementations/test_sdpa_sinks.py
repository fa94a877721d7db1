"""Learned sinks at the SDPA level: the handwritten built-in and the zoo's sink base agree
with spec.sdpa(sinks=...) (output and gradients, with masks, GQA and the causal flag); an
SDPA-signature function naming a sinks argument (``sinks``, ``s_aux``, ``learnable_sink``)
is recognised and probed for it, one without (``**kwargs`` included) does not claim it,
and the suite passes ``sinks=`` only for cases that have sinks."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

import spec
from implementations import registry
from implementations.base import Capabilities
from implementations.mutants.sdpa.sdpa_sink_mutants import SinkSDPA

MASKS = [{}, {"causal": True}, {"attend": "row0_blocked"}, {"additive": True}]
SINKS = [np.array([0.5, -1.0, 2.0, 0.0]), np.full(4, 1000.0), np.full(4, -1000.0)]


def _problem(masks, L, S, rng):
    q, k, v = rng.standard_normal((2, 4, L, 3)), rng.standard_normal((2, 2, S, 3)), rng.standard_normal((2, 2, S, 2))
    attend = additive = None
    if masks.get("attend"):
        attend = np.ones((L, S), bool)
        attend[0] = False
    if masks.get("additive"):
        additive = np.where(rng.random((L, S)) < 0.3, -np.inf, rng.standard_normal((L, S)))
    return q, k, v, attend, additive


@pytest.mark.parametrize("name", ["handwritten", "zoo-base"])
@pytest.mark.parametrize("masks", MASKS, ids=lambda m: ",".join(m) or "none")
@pytest.mark.parametrize("sinks", SINKS, ids=["varied", "far_above", "far_below"])
@pytest.mark.parametrize("L, S", [(3, 5), (5, 2)])
def test_sdpa_sinks_agree_with_spec(name, masks, sinks, L, S):
    sdpa = registry.resolve("handwritten").sdpa if name == "handwritten" else SinkSDPA()
    rng = np.random.default_rng(L * 10 + S)
    q, k, v, attend, additive = _problem(masks, L, S, rng)
    causal = "upper_left" if masks.get("causal") else None
    want = spec.sdpa(q, k, v, attend_mask=attend, additive_mask=additive, causal=causal, sinks=sinks)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    mask = None if attend is None and additive is None else torch.tensor(attend if attend is not None else additive)
    out = sdpa(tq, tk, tv, attn_mask=mask, is_causal=bool(causal), enable_gqa=True, sinks=torch.tensor(sinks))
    np.testing.assert_allclose(out.detach().numpy(), want.output, atol=1e-12)
    assert np.isfinite(out.detach().numpy()).all()
    grad = rng.standard_normal(want.output.shape)
    out.backward(torch.tensor(grad))
    vjp = spec.sdpa_vjp(q, k, v, grad, attend_mask=attend, additive_mask=additive, causal=causal, sinks=sinks)
    for got, expected in zip((tq.grad, tk.grad, tv.grad), vjp[:3], strict=True):
        np.testing.assert_allclose(got.numpy(), expected, atol=1e-11)


def test_handwritten_declares_sinks_and_the_default_does_not():
    assert registry.resolve("handwritten").caps("sdpa").sdpa_sinks
    assert not Capabilities().sdpa_sinks
    assert not registry.resolve("sdpa").caps("sdpa").sdpa_sinks       # torch's SDPA has no sinks argument
    reasons = registry.resolve("sdpa").not_supported_reasons({"level": "sdpa", "sinks": True})
    assert reasons == ["learned sinks not supported at the SDPA level (sdpa_sinks)"]


SOURCE = textwrap.dedent(
    """
    from implementations.builtins.references.handwritten import scaled_dot_product_attention as reference

    def named_sinks(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False, sinks=None):
        return reference(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks=sinks)

    def vllm_style(query, key, value, attn_mask=None, is_causal=False, scale=None, s_aux=None):
        return reference(query, key, value, attn_mask, 0.0, is_causal, scale, sinks=s_aux)

    def sinks_raise(query, key, value, attn_mask=None, is_causal=False, scale=None, learnable_sink=None):
        if learnable_sink is not None:
            raise NotImplementedError("no sinks in this kernel")
        return reference(query, key, value, attn_mask, 0.0, is_causal, scale)

    def swallows(query, key, value, attn_mask=None, is_causal=False, scale=None, **kwargs):
        return reference(query, key, value, attn_mask, 0.0, is_causal, scale)
    """
)


def test_sink_arguments_are_recognised_and_probed(tmp_path):
    path = tmp_path / "user_sdpa_sinks.py"
    path.write_text(SOURCE)
    for name, claimed in (("named_sinks", True), ("vllm_style", True), ("sinks_raise", False), ("swallows", False)):
        caps = registry.resolve(f"{path}:{name}").caps("sdpa")
        assert caps.sdpa_sinks == claimed, (name, caps.probe_notes)
        if name == "sinks_raise":
            assert any(note.startswith("sdpa_sinks: sinks=[1.5, -0.5] raised") for note in caps.probe_notes)
    impl = registry.resolve(f"{path}:vllm_style")                 # the alias is handed the suite's sinks=
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 3, 4)) for _ in range(3))
    out = impl.sdpa(*(torch.tensor(x) for x in (q, k, v)), sinks=torch.tensor([3.0, -1.0]))
    np.testing.assert_allclose(out.numpy(), spec.sdpa(q, k, v, sinks=[3.0, -1.0]).output, atol=1e-12)
    # a function without a sinks parameter behind the adapter refuses sinks rather than drop them
    with pytest.raises(NotImplementedError, match="has no sinks parameter"):
        registry.resolve(f"{path}:sinks_raise").sdpa.__class__(lambda *a, **kw: None, set())(
            *(torch.tensor(x) for x in (q, k, v)), sinks=torch.tensor([3.0, -1.0]))


def test_a_case_without_sinks_passes_no_sinks_argument():
    """Every other SDPA property calls a function that has no sinks parameter unchanged."""
    from conformance.calls.call_specs import SDPACallSpec, run_sdpa_call
    from conformance.core.cases import SDPACase
    from implementations.base import Implementation

    seen = []

    def plain(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        seen.append("called")
        return torch.nn.functional.scaled_dot_product_attention(query, key, value)

    rng = np.random.default_rng(2)
    case = SDPACase(*(rng.standard_normal((1, 1, 2, 2)) for _ in range(3)))
    run_sdpa_call(Implementation(name="plain", sdpa=plain), SDPACallSpec(case))
    assert seen == ["called"]
