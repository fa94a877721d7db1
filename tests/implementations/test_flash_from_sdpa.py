"""The flash level derived from an SDPA callable (implementations/flash_from_sdpa.py):
the adapter agrees with spec.flash (outputs and gradients), declares only what masks can
express, is added by resolve (after --impl-option, never over an own flash level, off with
derived_flash=false), says so in describe, --impl=list and the certificate, and a failure
at the derived level is saved and reproduced through the same adapter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import spec
from implementations import registry
from implementations.base import Capabilities, Implementation, ImplementationError
from implementations.flash_from_sdpa import (
    DERIVED_FLASH_NOTE,
    FlashFromSDPA,
    derive_flash,
    derived_flash_capabilities,
    is_derived_flash,
)

ROOT = Path(__file__).resolve().parents[2]
SLOPES = np.array([0.5, -0.25, 1.0, 0.125])  # exact in float32, as FlashAttention reads them


def _call(flash, q, k, v, options, *, grad=None):
    """``flash`` on float64 tensors of q, k, v with spec.flash_attention's ``options``;
    the output and, with ``grad``, (dq, dk, dv)."""
    tensors = [torch.tensor(x, requires_grad=grad is not None) for x in (q, k, v)]
    kwargs = {"causal": options.get("causal", False), "window_size": options.get("window", (-1, -1)),
              "softmax_scale": options.get("scale")}
    if options.get("alibi_slopes") is not None:
        kwargs["alibi_slopes"] = torch.tensor(options["alibi_slopes"], dtype=torch.float32)
    out = flash(*tensors, **kwargs)
    if grad is None:
        return out.detach().numpy(), None
    out.backward(torch.tensor(grad))
    return out.detach().numpy(), [t.grad.numpy() for t in tensors]


CASES = [
    # (B, N, K, L, S, E, Ev), spec.flash_attention options
    ((1, 2, 2, 3, 5, 4, 4), {}),
    ((1, 2, 2, 3, 5, 4, 4), {"causal": True}),
    ((2, 2, 1, 5, 3, 3, 2), {"causal": True}),                              # L > S: rows emptied, GQA, Ev != E
    ((1, 4, 2, 4, 6, 2, 3), {"window": (1, 0)}),
    ((1, 2, 2, 6, 4, 2, 2), {"window": (0, 2), "causal": True, "scale": -0.7}),
    ((1, 4, 1, 3, 7, 2, 2), {"alibi_slopes": SLOPES}),
    ((2, 2, 2, 5, 3, 3, 3), {"alibi_slopes": np.stack([SLOPES[:2], SLOPES[2:]]), "window": (2, 1)}),
    ((1, 2, 2, 4, 2, 2, 2), {"alibi_slopes": SLOPES[:2], "causal": True}),   # ALiBi and emptied rows
]


def _qkv(sizes, seed=0):
    B, N, K, L, S, E, Ev = sizes
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, L, N, E)), rng.standard_normal((B, S, K, E)),
            rng.standard_normal((B, S, K, Ev)), rng.standard_normal((B, L, N, Ev)))


def _naive_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
    """Softmax of scores + an additive mask, nothing else: a row of -inf is NaN (policy nan)."""
    assert attn_mask is None or attn_mask.dtype != torch.bool, "declared additive masks only"
    assert not is_causal
    N, K = query.shape[-3], key.shape[-3]
    key, value = key.repeat_interleave(N // K, -3), value.repeat_interleave(N // K, -3)
    s = (query.shape[-1] ** -0.5 if scale is None else scale) * query @ key.transpose(-1, -2)
    if attn_mask is not None:
        s = s + attn_mask
    return torch.softmax(s, dim=-1) @ value


NAIVE = Implementation("naive-additive", sdpa=_naive_sdpa, capabilities=Capabilities(
    dtypes=("float64",), mask_kinds=frozenset({"none", "additive"}), fully_masked="nan"))


@pytest.mark.parametrize("impl_name", ["sdpa-math", "spec", "naive"])
@pytest.mark.parametrize(("sizes", "options"), CASES)
def test_the_adapter_agrees_with_spec_flash(impl_name, sizes, options):
    """Output = spec.flash_attention and dq, dk, dv = spec.flash_attention_vjp, causal
    lower-right, windows, ALiBi (N,) and (B, N), GQA, Ev != E, rows attending no key
    (0, also where the SDPA declares NaN for them: NAIVE, additive masks only)."""
    impl = derive_flash(NAIVE) if impl_name == "naive" else registry.resolve(impl_name)
    q, k, v, grad = _qkv(sizes)
    out, grads = _call(impl.flash, q, k, v, options, grad=grad)
    np.testing.assert_allclose(out, spec.flash_attention(q, k, v, **options), rtol=1e-12, atol=1e-12)
    for got, expected in zip(grads, spec.flash_attention_vjp(q, k, v, grad, **options), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-11)


def test_softcap_and_lse_cannot_be_expressed():
    flash = registry.resolve("sdpa").flash
    q, k, v, _ = (torch.tensor(x) for x in _qkv((1, 1, 1, 2, 2, 2, 2)))
    with pytest.raises(NotImplementedError, match="softcap"):
        flash(q, k, v, softcap=5.0)
    with pytest.raises(NotImplementedError, match="log-sum-exp"):
        flash(q, k, v, return_attn_probs=True)


@pytest.mark.parametrize(("mask_kinds", "causal", "features", "flash_causal"), [
    ({"none", "bool", "additive"}, "upper_left", {"window", "alibi"}, "lower_right"),
    ({"none", "bool"}, "upper_left", {"window"}, "lower_right"),
    ({"none", "additive"}, None, {"window", "alibi"}, "lower_right"),
    ({"none"}, "upper_left", set(), None),          # no mask, and the flag is the other rule
    ({"none"}, "lower_right", set(), "lower_right"),  # no mask: causal goes as the flag
])
def test_derived_capabilities_follow_the_sdpa_masks(mask_kinds, causal, features, flash_causal):
    sdpa_caps = Capabilities(dtypes=("float32", "float16"), mask_kinds=frozenset(mask_kinds), causal=causal,
                             gqa=False, autograd=False, fully_masked="uniform")
    caps = derived_flash_capabilities(sdpa_caps)
    assert (set(caps.flash_features), caps.causal) == (features, flash_causal)
    assert (caps.dtypes, caps.gqa, caps.autograd, caps.fully_masked) == (("float32", "float16"), False, False, "zero")
    assert DERIVED_FLASH_NOTE in caps.probe_notes


def test_causal_goes_as_the_flag_only_without_masks():
    """Without masks and with a lower-right flag, causal=True is is_causal=True; a window raises."""
    calls = []

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append((attn_mask, is_causal))
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scale)

    caps = Capabilities(mask_kinds=frozenset({"none"}), causal="lower_right")
    flash = FlashFromSDPA(sdpa, caps)
    q, k, v, _ = (torch.tensor(x) for x in _qkv((1, 1, 1, 2, 3, 2, 2)))
    flash(q, k, v, causal=True)
    assert calls == [(None, True)]
    with pytest.raises(NotImplementedError, match="no attn_mask"):
        flash(q, k, v, window_size=(1, 1))


def test_resolve_derives_the_flash_level_and_keeps_an_own_one():
    sdpa = registry.resolve("sdpa")
    assert isinstance(sdpa.flash, FlashFromSDPA) and is_derived_flash(sdpa)
    assert set(sdpa.caps("flash").flash_features) == {"window", "alibi"}
    assert sdpa.caps("flash").causal == "lower_right" and sdpa.caps("sdpa").causal == "upper_left"
    own = registry.resolve("flash-ref")
    assert not isinstance(own.flash, FlashFromSDPA) and not is_derived_flash(own)
    assert registry.resolve("sdpa", {"derived_flash": "false"}).flash is None
    assert registry.resolve("torch-mha").flash is None  # no SDPA callable: nothing to derive from
    assert registry.resolve("spec", {"shared_kv": "true"}).flash is None  # k and v cannot differ
    with pytest.raises(ImplementationError, match="derived_flash=maybe"):
        registry.resolve("sdpa", {"derived_flash": "maybe"})


def test_options_apply_before_derivation():
    """--impl-option changes the SDPA capabilities the flash level is derived from."""
    narrowed = registry.resolve("sdpa", {"mask_kinds": "none,bool", "dtypes": "float32"})
    assert set(narrowed.caps("flash").flash_features) == {"window"}
    assert narrowed.caps("flash").dtypes == ("float32",)
    assert set(registry.resolve("sdpa", {"flash_features": "alibi"}).caps("flash").flash_features) == {"alibi"}


def test_describe_list_and_certificate_say_derived():
    from conformance.reporting import certificate

    impl = registry.resolve("sdpa")
    assert "flash level (derived from the SDPA level through masks)" in registry.describe(impl)
    row = next(line for line in registry.listing().splitlines() if line.startswith("sdpa "))
    assert "sdpa+derived-flash" in row
    assert "flash level (derived" not in registry.describe(registry.resolve("flash-ref"))
    entry = certificate.implementation_entry(impl, "sdpa", {})
    cert = {"implementation": entry, "results": []}
    assert f"flash level: {DERIVED_FLASH_NOTE}" in certificate.details(cert)


def _window_failure(tmp_path):
    from conformance.calls.flash import FlashCallSpec, FlashCase
    from conformance.reporting import failures

    q, k, v, _ = _qkv((1, 2, 2, 2, 4, 2, 2))
    case = FlashCase(q, k, v, window=(1, 0))
    call = FlashCallSpec(case)
    path = failures.save_case(case, tmp_path / "failure.npz", call=call, property="window_equivalence",
                              impl="mutant:bool_mask_inverted", target="flash-float64-cpu")
    return path, failures.load_call(path)


def test_a_mask_bug_fails_at_the_derived_level_and_is_reproduced(tmp_path):
    """mutant:bool_mask_inverted (an SDPA mask bug) fails a window call at the derived level,
    sdpa passes it; the saved call's reproducer resolves the mutant, so it goes through the
    same adapter, and shows the failure in a fresh interpreter."""
    from conformance.calls.flash import report_flash_call
    from conformance.reporting import failures

    path, call = _window_failure(tmp_path)
    assert report_flash_call(registry.resolve("mutant:bool_mask_inverted"), call).shows_failure
    assert not report_flash_call(registry.resolve("sdpa"), call).shows_failure
    snippet = failures.reproducer(call, "mutant:bool_mask_inverted", path, {})
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert "FAILS: output values mismatch" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    off = failures.reproducer(call, "sdpa", path, {"derived_flash": "false"})
    assert "'derived_flash': 'false'" in off  # the options travel with the reproducer


def test_flash_cases_keep_to_a_shape_budget():
    """A JIT implementation's derived flash level (jax) draws its sizes from the run's shape
    budget, as its SDPA level does: at most that many shapes, one with L > S among them."""
    from hypothesis import HealthCheck, given, settings

    from conformance.strategies.flash import flash_cases

    shapes = set()

    @settings(max_examples=60, database=None, suppress_health_check=list(HealthCheck), deadline=None)
    @given(flash_cases(caps=registry.resolve("sdpa").caps("flash"), shape_budget=3, causal=None))
    def collect(case):
        shapes.add(tuple(case.sizes().values()))

    collect()
    assert 2 <= len(shapes) <= 3
    assert any(L > S for _, _, _, L, S, _, _ in shapes), shapes


def test_a_jit_implementation_gets_no_derived_level_unless_asked():
    pytest.importorskip("jax")
    from implementations.registry import resolve

    assert resolve("jax").capabilities.jit
    assert resolve("jax").flash is None  # one more level of shapes would double a JIT run
    assert resolve("jax", {"derived_flash": "true"}).flash is not None
