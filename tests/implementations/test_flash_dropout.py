"""Dropout at the flash level: flash-ref's output and gradients are exactly spec.flash's
with the pattern its S_dmask returns, its LSE is the dropout-free one, and the mean over
many seeds is the dropout-free output; a flash_attn_func whose dropout_p runs is declared
to drop out (one without effect noted), its S_dmask probed for the pattern; the derived
flash level leaves dropout to the SDPA level; each dropout mutant's smallest case exposes
its bug through the returned pattern and its safe case does not."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

import spec
from implementations import registry
from implementations.mutants import MUTANTS
from implementations.mutants.flash.flash_mutants import FlashBase

OPTIONS = [{}, {"causal": True}, {"window_size": (1, 0), "softcap": 1.5}, {"sinks": [0.5, -1.0, 2.0, 0.0]},
           {"alibi_slopes": [0.5, -0.25, 1.0, 0.0]}]


def _spec_options(options):
    out = {"causal": options.get("causal", False), "window": options.get("window_size", (-1, -1)),
           "softcap": options.get("softcap", 0.0)}
    if "sinks" in options:
        out["sinks"] = np.array(options["sinks"])
    if "alibi_slopes" in options:
        out["alibi_slopes"] = np.array(options["alibi_slopes"])
    return out


def _call(flash, q, k, v, options, p, *, seed=0, grad=None):
    kwargs = {k_: torch.tensor(v_) if isinstance(v_, list) else v_ for k_, v_ in options.items()}
    tq, tk, tv = (torch.tensor(x, requires_grad=grad is not None) for x in (q, k, v))
    torch.manual_seed(seed)
    out, lse, probs = flash(tq, tk, tv, dropout_p=p, return_attn_probs=True, **kwargs)
    grads = None
    if grad is not None:
        out.backward(torch.tensor(grad))
        grads = (tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy())
    return out.detach().numpy(), lse.detach().numpy(), probs.numpy(), grads


def _qkv(seed, L=3, S=5):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((2, L, 4, 3)), rng.standard_normal((2, S, 2, 3)), rng.standard_normal((2, S, 2, 2))


@pytest.mark.parametrize("name", ["flash-ref", "zoo-base"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("L, S", [(3, 5), (5, 2)])
def test_output_and_gradients_are_those_of_the_returned_pattern(name, options, L, S):
    flash = registry.resolve("flash-ref").flash if name == "flash-ref" else FlashBase()
    q, k, v = _qkv(L * 10 + S, L, S)
    grad = np.random.default_rng(1).standard_normal((2, L, 4, 2))
    out, lse, probs, grads = _call(flash, q, k, v, options, 0.3, grad=grad)
    assert probs.shape[:2] == (2, 4) and probs.shape[2] >= L and probs.shape[3] >= S
    keep = ~(probs[:, :, :L, :S] < 0)
    assert 0 < keep.mean() < 1
    opts = _spec_options(options)
    want = spec.flash_attention(q, k, v, return_lse=True, dropout_p=0.3, dropout_mask=keep, **opts)
    np.testing.assert_allclose(out, want.output, atol=1e-12)
    finite = np.isfinite(want.lse)
    np.testing.assert_array_equal(np.isneginf(lse), ~finite)
    np.testing.assert_allclose(lse[finite], want.lse[finite], atol=1e-12)    # the dropout-free LSE
    vjp = spec.flash_attention_vjp(q, k, v, grad, dropout_p=0.3, dropout_mask=keep, **opts)
    for got, expected in zip(grads, vjp, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-11)


def test_the_mean_over_seeds_is_the_output_without_dropout():
    q, k, v = _qkv(4)
    flash = registry.resolve("flash-ref").flash
    mean = np.mean([_call(flash, q, k, v, {}, 0.5, seed=s)[0] for s in range(2000)], axis=0)
    want = spec.flash_attention(q, k, v)
    assert np.abs(mean - want).max() < 0.1 * np.abs(v).max()
    # the same seed gives the same pattern (the suite seeds torch's generator per call)
    a, b = (_call(flash, q, k, v, {}, 0.5, seed=7)[2] for _ in range(2))
    np.testing.assert_array_equal(a, b)


SOURCE = textwrap.dedent(
    """
    from implementations.builtins.references.flash_reference import flash_attn_func as reference

    def with_pattern(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, return_attn_probs=False):
        return reference(q, k, v, dropout_p, softmax_scale, causal, return_attn_probs=return_attn_probs)

    def without_pattern(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, return_attn_probs=False):
        out = reference(q, k, v, dropout_p, softmax_scale, causal, return_attn_probs=return_attn_probs)
        return (out[0], out[1], None) if return_attn_probs else out

    def ignores_dropout(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
        return reference(q, k, v, 0.0, softmax_scale, causal)

    def refuses_dropout(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
        if dropout_p:
            raise NotImplementedError("no dropout here")
        return reference(q, k, v, 0.0, softmax_scale, causal)
    """
)


def test_dropout_is_probed_and_the_pattern_read_from_the_third_result(tmp_path):
    path = tmp_path / "user_dropout.py"
    path.write_text(SOURCE)
    caps = {name: registry.resolve(f"{path}:{name}").caps("flash")
            for name in ("with_pattern", "without_pattern", "ignores_dropout", "refuses_dropout")}
    assert caps["with_pattern"].dropout and "dropout_pattern" in caps["with_pattern"].flash_features
    assert caps["without_pattern"].dropout and "dropout_pattern" not in caps["without_pattern"].flash_features
    assert any(n.startswith("dropout_pattern: return_attn_probs=True with dropout_p=0.5 returned no S_dmask")
               for n in caps["without_pattern"].probe_notes)
    # runs without effect: declared (the contract's meaning is tested and fails), with a note
    assert caps["ignores_dropout"].dropout
    assert any("dropout_p=0.5 has no effect" in n for n in caps["ignores_dropout"].probe_notes)
    assert not caps["refuses_dropout"].dropout
    assert any(n.startswith("dropout: dropout_p=0.5 raised") for n in caps["refuses_dropout"].probe_notes)


def test_flash_ref_declares_dropout_and_the_derived_level_does_not():
    ref = registry.resolve("flash-ref").caps("flash")
    assert ref.dropout and "dropout_pattern" in ref.flash_features
    derived = registry.resolve("sdpa").caps("flash")
    assert registry.resolve("sdpa").caps("sdpa").dropout and not derived.dropout


DROPOUT_MUTANTS = sorted(n for n in MUTANTS if n.startswith("flash_dropout"))


def _agrees(mutant, case: dict) -> bool:
    """Output (and the LSE with ``lse``, gradients with ``grad``) of one seeded call against
    spec.flash with the pattern the call returned (dropout_p = 0: without dropout)."""
    B, N, K, L, S, E, Ev = (case[d] for d in ("B", "N", "K", "L", "S", "E", "Ev"))
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal(s) for s in ((B, L, N, E), (B, S, K, E), (B, S, K, Ev)))
    p = case.get("dropout_p", 0.0)
    grad = rng.standard_normal((B, L, N, Ev)) if case.get("grad") else None
    flash = mutant.build().flash
    tq, tk, tv = (torch.tensor(x, requires_grad=grad is not None) for x in (q, k, v))
    torch.manual_seed(0)
    out, lse, probs = flash(tq, tk, tv, dropout_p=p, return_attn_probs=True)
    keep = None if probs is None else ~(probs.numpy()[:, :, :L, :S] < 0)
    want = spec.flash_attention(q, k, v, return_lse=True, dropout_p=p, dropout_mask=keep)
    ok = np.allclose(out.detach().numpy(), want.output, atol=1e-9)
    if case.get("lse"):
        ok &= np.allclose(lse.detach().numpy(), want.lse, atol=1e-9)
    if grad is not None:
        out.backward(torch.tensor(grad))
        vjp = spec.flash_attention_vjp(q, k, v, grad, dropout_p=p, dropout_mask=keep)
        ok &= all(np.allclose(t.grad.numpy(), g, atol=1e-9) for t, g in zip((tq, tk, tv), vjp, strict=True))
    return bool(ok)


@pytest.mark.parametrize("name", DROPOUT_MUTANTS)
def test_dropout_mutant_cases_expose_their_bug(name):
    mutant = MUTANTS[name]
    assert mutant.expected_property in ("flash_dropout_expectation", "dropout_pattern_agreement")
    attrs = {"level": "flash", "dropout_p": mutant.smallest_case["dropout_p"], "grad": bool(mutant.smallest_case.get("grad"))}
    assert mutant.build().not_supported_reasons(attrs) == []
    assert not _agrees(mutant, mutant.smallest_case), "the smallest case does not expose the bug"
    assert _agrees(mutant, mutant.safe_case), "the safe case exposes the bug"
