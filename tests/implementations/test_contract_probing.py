"""Probing finds capabilities, never semantics: per-dtype capabilities, provenance of each
semantic value (declared / contract / probed), and the fully-masked consistency rule."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conformance.core.target import Target
from conformance.reporting import certificate
from implementations import registry
from implementations.base import Capabilities, ImplementationError
from implementations.mutants._base import NaiveSDPA
from implementations.registry.probing import _fully_masked_declaration, probe_sdpa
from implementations.registry.recognition import recognise
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]


_CORRECT = NaiveSDPA()  # the bug zoo's correct straight-line SDPA (every dtype)


def torch_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _CORRECT(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


class _NoFloat32Backward(torch.autograd.Function):
    """Identity whose backward raises in float32 (a backend with a float64-only backward)."""

    @staticmethod
    def forward(ctx, x):
        ctx.dtype = x.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.dtype == torch.float32:
            raise NotImplementedError("no float32 backward kernel")
        return grad


def float64_backward_only(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                          enable_gqa=False):
    return _NoFloat32Backward.apply(torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                               enable_gqa))


def no_half_masks(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
    if attn_mask is not None and query.dtype in (torch.float16, torch.bfloat16):
        raise TypeError(f"masks are not supported in {query.dtype}")
    return torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def test_a_backward_that_works_in_float64_only_is_declared_per_dtype():
    impl = recognise(float64_backward_only, name="f64_backward")
    caps = impl.capabilities
    assert caps.autograd is False and caps.for_dtype("float64").autograd is True
    assert caps.dtype_differences("autograd") == {"float64": True, "float16": True, "bfloat16": True}
    notes = [n for n in caps.probe_notes if n.startswith("autograd:")]
    assert any("in float32 raised NotImplementedError" in n and "no float32 backward kernel" in n for n in notes)
    assert any("in float64 works" in n for n in notes), notes
    # Every property sees the target's dtype.
    assert Target(impl, "sdpa", "float64", "cpu").caps.autograd is True
    assert Target(impl, "sdpa", "float32", "cpu").caps.autograd is False
    assert impl.not_supported_reasons({"level": "sdpa", "dtype": "float64", "grad": True}) == []
    assert impl.not_supported_reasons({"level": "sdpa", "dtype": "float32", "grad": True}) == \
        ["autograd not supported"]


def test_masks_that_raise_in_16_bit_dtypes_are_unsupported_there_only():
    impl = recognise(no_half_masks, name="no_half_masks")
    caps = impl.capabilities
    assert {"bool", "additive"} <= caps.mask_kinds
    for dtype in ("float16", "bfloat16"):
        assert caps.for_dtype(dtype).mask_kinds == {"none"}
        assert any(n.startswith(f"mask_kinds: a bool mask in {dtype} raised TypeError") for n in caps.probe_notes)
    reasons = impl.not_supported_reasons({"level": "sdpa", "dtype": "float16", "mask_kind": "bool"})
    assert reasons == ["mask_kind='bool' not in declared ['none'] in float16"]
    assert impl.not_supported_reasons({"level": "sdpa", "dtype": "float32", "mask_kind": "bool"}) == []
    assert "mask_kinds=none in float16 (probed)" in registry.describe(impl)


def test_a_declared_option_holds_in_every_dtype():
    impl = registry.apply_options(recognise(float64_backward_only, name="x"), {"autograd": "false"})
    assert impl.capabilities.by_dtype == () and impl.capabilities.for_dtype("float64").autograd is False
    assert not any(n.startswith("autograd:") for n in impl.capabilities.probe_notes)


def test_by_dtype_and_sources_are_checked_with_a_clear_error():
    with pytest.raises(ImplementationError, match=r"'float8' is not a dtype .* fields among"):
        Capabilities(by_dtype={"float8": {"autograd": False}})
    with pytest.raises(ImplementationError, match=r"\['causal'\] cannot differ per dtype"):
        Capabilities(by_dtype={"float16": {"causal": None}})
    with pytest.raises(ImplementationError, match="is not \\(semantic field, source\\)"):
        Capabilities(sources={"causal": "guessed"})
    assert Capabilities().source("causal") == "declared"


def test_the_sdpa_builtin_function_probes_clean_with_contract_and_probed_sources():
    caps = probe_sdpa(F.scaled_dot_product_attention, origin="torch")
    assert (caps.causal, caps.shared_kv) == ("upper_left", False)
    assert caps.source("causal") == caps.source("shared_kv") == "contract"
    assert caps.source("fully_masked") == "probed" and caps.fully_masked in ("zero", "nan")
    assert not caps.probe_note("causal") and not caps.probe_note("shared_kv")


@pytest.mark.parametrize("observed, declared, source, hint", [
    ({"bool": "zero", "additive": "zero"}, "zero", "probed", None),
    ({"bool": "nan", "additive": "nan"}, "nan", "probed", None),
    ({"bool": "zero", "additive": "zero", "causal": "uniform"}, "zero", "contract",
     "fully_masked=bool:zero,additive:zero,causal:uniform"),
    ({"bool": "uniform", "additive": "uniform"}, "zero", "contract", "fully_masked=uniform"),
    ({"bool": "zero", "additive": "nan"}, "zero", "contract", "fully_masked=bool:zero,additive:nan"),
    ({"bool": "uniform", "additive": "nan"}, "nan", "contract", "fully_masked=bool:uniform,additive:nan"),
    ({"bool": "unspecified"}, "zero", "contract", "fully_masked=unspecified"),
    ({}, "zero", "contract", None),
])
def test_a_probed_fully_masked_policy_is_adopted_only_when_consistent(observed, declared, source, hint):
    notes: list[str] = []
    assert _fully_masked_declaration(observed, notes) == (declared, source)
    if hint is None:
        assert all("not adopted" not in n for n in notes)
    else:
        [note] = notes
        assert "not adopted" in note and note.endswith(f"declare --impl-option {hint}"), note


def test_the_certificate_and_header_show_where_each_semantic_value_came_from():
    impl = registry.resolve("tests.runner.impls_for_declarations:jax_style_attention")
    entry = certificate.implementation_entry(impl, "x", {})
    json.dumps(entry)
    caps = entry["capabilities"]
    assert caps["sources"] == {"causal": "contract", "fully_masked": "contract", "shared_kv": "contract"}
    lines = certificate.details({"implementation": entry, "results": []})
    assert lines[0].startswith("policies: fully-masked rows=nan [contract] (probe: probed bool:uniform")
    assert lines[1].startswith("semantics: contract (the signature's documented meaning")
    declared = registry.resolve("tests.runner.impls_for_declarations:jax_style_attention",
                                {"fully_masked": "bool:uniform,additive:nan", "causal": "upper_left"})
    line = certificate.details({"implementation": certificate.implementation_entry(declared, "x", {}),
                                "results": []})[1]
    assert "declared (by the implementation or --impl-option): causal flag=upper_left, fully-masked rows=" in line
    assert "contract (" in line and "key is value=False" in line
    # A built-in declares everything: the line reads as before.
    sdpa = certificate.implementation_entry(registry.resolve("sdpa"), "sdpa", {})
    assert certificate.details({"implementation": sdpa, "results": []})[0].startswith("declared policies: ")
    assert certificate.provenance(sdpa["capabilities"]) == ""
    listing = registry.describe(impl)
    assert "causal=upper_left(contract)" in listing and "fully_masked=nan(contract)" in listing


def test_a_float64_only_backward_certifies_float64_gradients(tmp_path):
    """The gradient tests run (and pass) in float64 and skip in float32, with the reason."""
    source = tmp_path / "f64.py"
    source.write_text("from tests.implementations.test_contract_probing import float64_backward_only\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "conformance"), f"--impl={source}:float64_backward_only",
           "--hypothesis-profile=ci", "-q", "-p", "no:cacheprovider", "-k", "test_gradient_agreement and sdpa",
           "--dtype=float64,float32", "--impl-option", "derived_flash=false",
           "--conformance-report", str(tmp_path / "cert")]
    proc = pytest_process.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    cert = json.loads((tmp_path / "cert.json").read_text())
    got = {r["dtype"]: r for r in cert["results"] if r["property"] == "gradient_agreement"}
    assert got["float64"]["outcome"] == "passed", got
    assert got["float32"]["outcome"] == "skipped" and "autograd" in got["float32"]["reason"]
    assert "autograd (probe: backward through query, key, value in float32 raised" in \
        "\n".join(certificate.details(cert))


def test_sources_and_by_dtype_survive_the_isolated_workers_json():
    from conformance.isolation.protocol import _caps_from_json, _caps_to_json

    caps = recognise(no_half_masks, name="no_half_masks").capabilities
    again = _caps_from_json(json.loads(json.dumps(_caps_to_json(caps))))
    assert again == caps
    assert again.for_dtype("float16").mask_kinds == {"none"} and again.source("causal") == "contract"


class NanForBoolPadding(torch.nn.MultiheadAttention):
    """nn.MultiheadAttention whose rows a bool key_padding_mask blocks entirely are NaN
    (a float -inf mask gives torch's own zero): a policy that differs per kind."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        out, weights = super().forward(query, key, value, key_padding_mask=key_padding_mask,
                                       need_weights=need_weights, attn_mask=attn_mask,
                                       average_attn_weights=average_attn_weights, is_causal=is_causal)
        if key_padding_mask is not None and key_padding_mask.dtype == torch.bool:
            dead = key_padding_mask.all(dim=-1)  # (B,): every key of that batch item blocked
            batch_dim = 0 if self.batch_first or out.dim() == 2 else 1
            if out.dim() == 2:
                dead = dead.reshape(())
                out = torch.where(dead, torch.full_like(out, float("nan")), out)
            else:
                shape = [1, 1, 1]
                shape[batch_dim] = -1
                out = torch.where(dead.reshape(shape), torch.full_like(out, float("nan")), out)
        return out, weights


def test_an_mha_policy_that_differs_per_kind_is_not_adopted_and_fails_with_the_hint(tmp_path):
    caps = recognise(NanForBoolPadding, name="nan_bool").capabilities
    assert caps.fully_masked == "zero" and caps.source("fully_masked") == "contract"
    assert caps.probe_note("fully_masked").endswith("declare --impl-option fully_masked=bool:nan,additive:zero")
    source = tmp_path / "mha.py"
    source.write_text("from tests.implementations.test_contract_probing import NanForBoolPadding\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    env["PYTHONPATH"] = str(ROOT)

    def certify() -> tuple[int, dict]:
        cmd = [sys.executable, "-m", "pytest", str(ROOT / "conformance"), f"--impl={source}:NanForBoolPadding",
               "--hypothesis-profile=ci", "-q", "-p", "no:cacheprovider", "-k", "mha_fully_masked_rows",
               "--dtype=float64", "--conformance-report", str(tmp_path / "cert")]
        proc = pytest_process.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
        [result] = json.loads((tmp_path / "cert.json").read_text())["results"]
        return proc.returncode, result

    code, result = certify()
    assert code == 1 and result["outcome"] == "failed", result
    assert "probe: fully_masked: probed bool:nan,additive:zero at the MHA level" in result["message"]


class FiniteFillPadding(torch.nn.MultiheadAttention):
    """nn.MultiheadAttention that turns a bool key_padding_mask into a finite -1e30 float
    one: a row with every key blocked attends them all equally (uniform)."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if key_padding_mask is not None and key_padding_mask.dtype == torch.bool:
            key_padding_mask = torch.zeros(key_padding_mask.shape, dtype=query.dtype).masked_fill(
                key_padding_mask, -1e30)
        return super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                               attn_mask=attn_mask, average_attn_weights=average_attn_weights,
                               is_causal=is_causal)


def test_mha_uniform_rows_are_recognised_and_not_adopted():
    caps = recognise(FiniteFillPadding, name="finite_fill").capabilities
    assert caps.fully_masked == "zero" and caps.source("fully_masked") == "contract"
    note = caps.probe_note("fully_masked")
    assert "uniform rows attend the keys" in note
    # float16's rows differ (its -1e30 fill raises there), so the hint is float32's own
    assert "declare --impl-option float32.fully_masked=bool:uniform,additive:zero" in note, note
    plain = recognise(torch.nn.MultiheadAttention, name="torch").capabilities
    assert plain.source("fully_masked") == "probed" and plain.source("causal") == "contract"
    assert "in float32" not in plain.probe_note("fully_masked")  # every dtype alike: one policy, one note


class NanInFloat16(torch.nn.MultiheadAttention):
    """Haiku-like: blocked keys get a -1e30 fill, finite in float32, float64 and bfloat16
    (a row with every key blocked is uniform) and -inf in float16 (the row is NaN)."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        blocked = None
        if key_padding_mask is not None:
            blocked = key_padding_mask if key_padding_mask.dtype == torch.bool else torch.isinf(key_padding_mask)
            key_padding_mask = torch.zeros(blocked.shape).masked_fill(blocked, -1e30).to(query.dtype)
        out, weights = super().forward(query, key, value, key_padding_mask=key_padding_mask,
                                       need_weights=need_weights, attn_mask=attn_mask,
                                       average_attn_weights=average_attn_weights, is_causal=is_causal)
        if blocked is not None and query.dtype == torch.float16 and query.dim() == 3:
            rows = blocked.all(-1).view(-1, 1, 1) if self.batch_first else blocked.all(-1).view(1, -1, 1)
            out = out.masked_fill(rows, float("nan"))  # a softmax over -inf everywhere
        return out, weights


def test_the_mha_probe_reads_fully_masked_rows_in_every_dtype():
    """The MHA probe ran in float32 only, so Haiku's float16 NaN rows (uniform elsewhere) went
    unseen and its hint, a global declaration, would have broken the other dtypes."""
    caps = recognise(NanInFloat16, name="nan16").capabilities
    assert caps.fully_masked == "zero" and caps.source("fully_masked") == "contract"
    assert caps.for_dtype("float16").fully_masked == "nan"
    assert caps.for_dtype("bfloat16").fully_masked == caps.for_dtype("float64").fully_masked == "zero"
    notes = [n for n in caps.probe_notes if n.startswith("fully_masked")]
    assert any("in float32" in n and n.endswith("declare --impl-option float32.fully_masked=uniform")
               for n in notes), notes
    assert any("in float16" in n and "this probed policy is adopted" in n for n in notes), notes
