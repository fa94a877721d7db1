"""The flash level: a function with flash_attn_func's signature is recognised with no
adapter and probed feature by feature; the flash-ref built-in agrees with spec.flash;
the suite certifies a bare flash_attn_func file end to end."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import spec
from implementations import registry
from implementations.base import ImplementationError
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]

#: A pure-PyTorch flash_attn_func (the user's file): window, softcap, ALiBi, LSE, GQA.
FLASH_SOURCE = textwrap.dedent(
    """
    import math
    import torch

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
        B, L, N, E = q.shape
        S, K = k.shape[1], k.shape[2]
        scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(E)
        qh = q.transpose(1, 2).double()
        kh = k.transpose(1, 2).repeat_interleave(N // K, 1).double()
        vh = v.transpose(1, 2).repeat_interleave(N // K, 1).double()
        s = scale * qh @ kh.transpose(-1, -2)
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(L)[:, None] + S - L
        j = torch.arange(S)[None, :]
        if alibi_slopes is not None:
            s = s - alibi_slopes.double().reshape(-1, N, 1, 1) * (i - j).abs()
        left, right = window_size
        right = 0 if causal else right
        ok = torch.ones(L, S, dtype=torch.bool)
        if left >= 0:
            ok &= j >= i - left
        if right >= 0:
            ok &= j <= i + right
        s = s.masked_fill(~ok, float("-inf"))
        m = s.amax(-1, keepdim=True).detach()
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = (s - m).exp()
        t = e.sum(-1, keepdim=True)
        t1 = torch.where(t == 0, torch.ones_like(t), t)
        out = ((e / t1) @ vh).transpose(1, 2).to(q.dtype)
        if return_attn_probs:
            lse = torch.where(t == 0, torch.full_like(t, float("-inf")), m + t1.log())
            return out, lse[..., 0].float(), None
        return out

    def no_extras(q, k, v, softmax_scale=None, causal=False):
        return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal)

    def top_left(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1)):
        L, S = q.shape[1], k.shape[1]
        if causal:  # flash-attn < 2.1: the triangle from the top-left corner
            return flash_attn_func(q[:, :, :, :], k[:, :L] if S >= L else k, v[:, :L] if S >= L else v,
                                   softmax_scale=softmax_scale, causal=True)
        return flash_attn_func(q, k, v, softmax_scale=softmax_scale, window_size=window_size)

    def ignores_softcap(q, k, v, softmax_scale=None, causal=False, softcap=0.0):
        return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal)
    """
)


@pytest.fixture
def user_file(tmp_path) -> Path:
    path = tmp_path / "user_flash.py"
    path.write_text(FLASH_SOURCE)
    return path


def test_flash_attn_func_signature_is_recognised_and_probed(user_file):
    impl = registry.resolve(f"{user_file}:flash_attn_func")
    assert impl.flash is not None and impl.sdpa is None and impl.mha is None
    caps = impl.caps("flash")
    assert caps.flash_features == {"window", "softcap", "alibi", "lse"}
    assert (caps.causal, caps.gqa, caps.different_v_dim, caps.autograd) == ("lower_right", True, True, True)
    assert set(caps.dtypes) == {"float64", "float32", "float16", "bfloat16"}
    assert impl.not_supported_reasons({"level": "sdpa"}) and not impl.not_supported_reasons({"level": "flash"})


def test_missing_optional_parameters_are_unsupported_features(user_file):
    impl = registry.resolve(f"{user_file}:no_extras")
    assert impl.caps("flash").flash_features == frozenset()
    q = torch.randn(1, 2, 1, 4)
    with pytest.raises(NotImplementedError, match="softcap"):
        impl.flash(q, q, q, softcap=1.0)
    assert impl.flash(q, q, q, softcap=0.0).shape == (1, 2, 1, 4)  # the default passes through
    reasons = impl.not_supported_reasons({"level": "flash", "flash_features": {"window"}})
    assert reasons == ["flash features not supported: ['window']"]


def test_a_feature_without_effect_stays_declared_with_a_note(user_file):
    """softcap= runs but has no effect: the contract's softcap is declared (so
    softcap_agreement runs and fails), the note says what the probe saw."""
    impl = registry.resolve(f"{user_file}:ignores_softcap")
    caps = impl.caps("flash")
    assert "softcap" in caps.flash_features and caps.source("flash_features") == "contract"
    [note] = [n for n in caps.probe_notes if n.startswith("softcap:")]
    assert note.startswith("softcap: softcap=0.05 has no effect") and "is tested and fails" in note


def test_top_left_causal_keeps_the_contracts_lower_right(user_file):
    impl = registry.resolve(f"{user_file}:top_left")
    caps = impl.caps("flash")
    assert caps.causal == "lower_right" and caps.source("causal") == "contract"
    [note] = [n for n in caps.probe_notes if n.startswith("causal:")]
    assert "behaved as the upper-left triangle (query length 2, key length 3" in note, note


def test_a_feature_that_raises_is_unsupported_with_a_note(user_file):
    caps = registry.resolve(f"{user_file}:no_extras").caps("flash")
    assert "window" not in caps.flash_features
    assert any(n.startswith("window: window_size=(0, 0) raised NotImplementedError") for n in caps.probe_notes)


def test_contract_deviations_fail_their_properties(user_file, tmp_path):
    """What the old probe declared away (softcap without effect -> unsupported, upper-left
    causal -> no causal flag) now fails: softcap_agreement and flash_agreement."""
    report = tmp_path / "cert"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "conformance"),
           f"--impl={user_file}:ignores_softcap,{user_file}:top_left", "--impl-exitfirst",
           "--hypothesis-profile=ci", "-q", "-p", "no:cacheprovider", "--dtype=float64",
           "-k", "softcap_agreement or flash_agreement", "--conformance-report", str(report)]
    proc = pytest_process.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    certs = {c["implementation"]["spec"].rsplit(":", 1)[1]: c
             for c in json.loads(report.with_suffix(".json").read_text())["certificates"]}
    failed = {name: {r["property"] for r in c["results"] if r["outcome"] == "failed"} for name, c in certs.items()}
    assert "softcap_agreement" in failed["ignores_softcap"], failed
    assert "flash_agreement" in failed["top_left"], failed


def test_options_override_flash_features(user_file):
    impl = registry.resolve(f"{user_file}:ignores_softcap", {"flash_features": "softcap,lse"})
    assert impl.caps("flash").flash_features == {"softcap", "lse"}
    with pytest.raises(ImplementationError, match="flash_features"):
        registry.resolve(f"{user_file}:ignores_softcap", {"flash_features": "rotary"})


@pytest.mark.parametrize("options", [
    {}, {"causal": True}, {"window": (0, 0)}, {"window": (2, -1), "causal": True}, {"softcap": 0.3},
    {"alibi_slopes": np.array([0.5, -0.25, 1.0, 0.0])}, {"alibi_slopes": np.ones((2, 4)), "causal": True},
    {"window": (1, 3), "softcap": 2.0, "alibi_slopes": np.array([0.5, 0.25, 0.125, 1.0]), "scale": -0.7},
], ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("L, S", [(3, 5), (5, 3), (1, 1)])
def test_flash_ref_agrees_with_spec_flash(options, L, S):
    flash = registry.resolve("flash-ref").flash
    rng = np.random.default_rng(L * 10 + S)
    q, k, v = rng.standard_normal((2, L, 4, 3)), rng.standard_normal((2, S, 2, 3)), rng.standard_normal((2, S, 2, 5))
    want = spec.flash_attention(q, k, v, return_lse=True, **options)
    kwargs = {"causal": options.get("causal", False), "window_size": options.get("window", (-1, -1)),
              "softcap": options.get("softcap", 0.0), "softmax_scale": options.get("scale")}
    if "alibi_slopes" in options:
        kwargs["alibi_slopes"] = torch.tensor(options["alibi_slopes"])
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out, lse, _ = flash(tq, tk, tv, return_attn_probs=True, **kwargs)
    np.testing.assert_allclose(out.detach().numpy(), want.output, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse.detach().numpy()), np.isneginf(want.lse))
    finite = np.isfinite(want.lse)
    np.testing.assert_allclose(lse.detach().numpy()[finite], want.lse[finite], atol=1e-12)
    grad = rng.standard_normal(out.shape)
    out.backward(torch.tensor(grad))
    vjp = spec.flash_attention_vjp(q, k, v, grad, **options)
    for got, expected in zip((tq.grad, tk.grad, tv.grad), vjp, strict=True):
        np.testing.assert_allclose(got.numpy(), expected, atol=1e-11)


def test_the_suite_certifies_a_bare_flash_attn_func_file(user_file, tmp_path):
    """Zero adapter: --impl=file.py:flash_attn_func runs the flash properties (and skips the
    SDPA and MHA ones), and a mutant-like bug in the same file fails its property."""
    report = tmp_path / "cert"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "conformance"), f"--impl={user_file}:flash_attn_func",
           "--hypothesis-profile=ci", "-q", "-p", "no:cacheprovider", "--dtype=float64",
           "-k", "window_equivalence or lse_agreement or flash_agreement or forward_agreement",
           "--conformance-report", str(report)]
    proc = pytest_process.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    results = json.loads(report.with_suffix(".json").read_text())["results"]
    outcomes = {(r["property"], r["outcome"]) for r in results}
    assert {("window_equivalence", "passed"), ("lse_agreement", "passed"),
            ("flash_agreement", "passed"), ("forward_agreement", "skipped")} <= outcomes, outcomes


def _flash_case():
    from conformance.calls.flash import FlashCase

    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((1, 3, 2, 2)), rng.standard_normal((1, 4, 1, 2)), rng.standard_normal((1, 4, 1, 3))
    return FlashCase(q, k, v, causal=True, window=(1, 0), softcap=0.75,
                     alibi_slopes=np.array([0.5, -0.25]), scale=0.5)


def test_a_flash_failure_is_saved_reloaded_and_reproduced(tmp_path):
    from conformance.calls.flash import FlashCallSpec, report_flash_call
    from conformance.core.registry import registered_properties
    from conformance.isolation import supervisor as isolation
    from conformance.reporting import failures

    case = _flash_case()
    call = FlashCallSpec(case, lse=True, grad_output=np.ones((1, 3, 2, 3)))
    path = failures.save_case(case, tmp_path / "failure.npz", call=call, property="lse_agreement",
                              impl="flash-ref", target="flash-float64-cpu")
    loaded, meta = failures.load_case(path)
    failures.validate_saved(loaded, meta, registered_properties())
    assert loaded.describe() == case.describe()
    np.testing.assert_array_equal(loaded.alibi_slopes, case.alibi_slopes)
    again = failures.load_call(path)
    assert again.lse and np.array_equal(again.grad_output, call.grad_output)
    assert "show_flash_call(resolve('flash-ref'), call)" in failures.reproducer(again, "flash-ref", path, {})
    assert not report_flash_call(registry.resolve("flash-ref"), again).shows_failure
    assert report_flash_call(registry.resolve("mutant:flash_lse_log2"), again).shows_failure
    meta, arrays = isolation.encode_case(case)  # the isolated worker's wire format
    assert isolation.decode_case(meta, arrays).describe() == case.describe()


def test_flash_case_attributes_are_the_levels_match_keys():
    from conformance.core.expectations import attributes_of_level

    attrs = _flash_case().attrs(grad=False, lse=True)
    assert set(attrs) == attributes_of_level("flash")
    assert (attrs["causal"], attrs["window_left"], attrs["alibi"], attrs["flash_features"]) == (
        "lower_right", 1, True, {"window", "softcap", "alibi"})
