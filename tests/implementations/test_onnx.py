"""ONNX (implementations.onnx): ``--impl=onnx:SPEC`` exports an SDPA-level torch function per
export key and certifies the graph in ONNX Runtime; ``--impl=model.onnx`` certifies an
existing graph. Options and errors in process; certificates under the ``ci`` profile as
subprocesses (the built-in ``sdpa`` exported at opset 17 certifies, its measured deviations
expected; a wrong function's export fails; an existing graph certifies). Tests skip without
onnx and onnxruntime (``pip install 'attention-conformance[onnx]'``)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import spec
from implementations import onnx as onnx_impl
from implementations import registry
from implementations.base import ImplementationError
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]
MODULES = Path(__file__).resolve().parent / "framework_modules"
TIMEOUT_S = 900
HAVE_ONNX = all(importlib.util.find_spec(n) is not None for n in ("onnx", "onnxruntime"))
needs_onnx = pytest.mark.skipif(not HAVE_ONNX, reason="onnx and onnxruntime are not installed "
                                "(pip install 'attention-conformance[onnx]')")


def tensors(*shapes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


def oracle(q, k, v, **kw):
    return spec.sdpa(q.double().numpy(), k.double().numpy(), v.double().numpy(), **kw).output


class _SDPA(torch.nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, query, key, value, attn_mask=None):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=self.causal)


def export_graph(path: Path, names=("query", "key", "value", "attn_mask"), *, causal=False, mask=True,
                 dynamic=True) -> Path:
    """An SDPA graph at ``path`` (opset 17), every axis dynamic unless ``dynamic`` is False."""
    q, k, v = tensors((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4))
    args = (q, k, v, torch.ones(1, 2, 3, 5, dtype=torch.bool)) if mask else (q, k, v)
    axes = [{0: "B", 1: "N", 2: "L", 3: "E"}, {0: "B", 1: "K", 2: "S", 3: "E"}, {0: "B", 1: "K", 2: "S", 3: "Ev"},
            {0: "B", 1: "N", 2: "L", 3: "S"}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_SDPA(causal), args, str(path), dynamo=False, opset_version=17,
                          input_names=list(names[:len(args)]), output_names=["output"],
                          dynamic_axes=dict(zip(names, axes, strict=False)) if dynamic else None)
    return path


# --------------------------------------------------------------------------- options


def test_onnx_specs_are_told_apart():
    assert onnx_impl.onnx_target("onnx:sdpa") == ("export", "sdpa")
    assert onnx_impl.onnx_target("onnx:pkg.mod:fn") == ("export", "pkg.mod:fn")
    assert onnx_impl.onnx_target("onnx:dir/attn.py:fn") == ("export", "dir/attn.py:fn")
    assert onnx_impl.onnx_target("dir/model.onnx") == ("graph", "dir/model.onnx")
    assert onnx_impl.onnx_target("onnx:model.onnx") == ("graph", "model.onnx")
    assert onnx_impl.onnx_target("sdpa") is None and onnx_impl.onnx_target("pkg.onnx:fn") is None


def test_bad_onnx_options_are_usage_errors_naming_the_rule():
    with pytest.raises(ImplementationError, match="onnx_exporter=jit: expected .*dynamo.*torchscript"):
        registry.resolve("onnx:sdpa", {"onnx_exporter": "jit"})
    with pytest.raises(ImplementationError, match="onnx_opset=seventeen: expected .*integer"):
        registry.resolve("onnx:sdpa", {"onnx_opset": "seventeen"})
    with pytest.raises(ImplementationError, match="onnx_inputs: applies to an existing graph"):
        registry.resolve("onnx:sdpa", {"onnx_inputs": "q,k,v"})
    with pytest.raises(ImplementationError, match="onnx_exporter: applies to an exported implementation"):
        registry.resolve("sdpa", {"onnx_exporter": "dynamo"})
    with pytest.raises(ImplementationError, match="nothing after 'onnx:'"):
        registry.resolve("onnx:")


def test_without_onnxruntime_the_implementation_is_unavailable_saying_what_to_install(monkeypatch):
    monkeypatch.setattr(onnx_impl, "missing_packages", lambda exporter: ["onnxruntime"])
    impl = registry.resolve("onnx:sdpa")
    assert not impl.available
    assert "pip install onnxruntime" in impl.unavailable_reason and "[onnx]" in impl.unavailable_reason
    assert impl.not_supported_reasons({"level": "sdpa"})[0].startswith("onnx:sdpa is unavailable")
    graph = registry.resolve("model.onnx")  # the file is not read without onnxruntime
    assert not graph.available and "running an ONNX graph needs onnxruntime" in graph.unavailable_reason


@needs_onnx
def test_an_implementation_without_an_sdpa_callable_or_not_in_torch_is_refused():
    with pytest.raises(ImplementationError, match="torch-mha has no SDPA-level callable to export"):
        registry.resolve("onnx:torch-mha")
    if importlib.util.find_spec("jax") is not None:
        with pytest.raises(ImplementationError, match="runs in jax, not torch"):
            registry.resolve("onnx:jax")


# --------------------------------------------------------------------------- onnx:SPEC


@needs_onnx
def test_a_users_function_is_exported_and_run_in_onnx_runtime():
    impl = registry.resolve(f"onnx:{MODULES / 'onnx_mask_inverted.py'}:attention")
    caps = impl.capabilities
    assert caps.jit and not caps.autograd and not caps.dropout and caps.causal == "upper_left"
    assert caps.probe_notes[0].startswith("onnx: ") and "torchscript exporter, opset 17" in caps.probe_notes[0]
    q, k, v = tensors((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4))
    before = impl.sdpa.exports
    got = impl.sdpa(q, k, v, scale=0.7)
    np.testing.assert_allclose(got.numpy(), oracle(q, k, v, scale=0.7), atol=1e-6)
    impl.sdpa(*tensors((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4), seed=1), scale=0.7)  # same export key
    assert impl.sdpa.exports == before + 1
    impl.sdpa(q, k, v, scale=0.5)  # a new scale is a new export
    assert impl.sdpa.exports == before + 2
    assert f"{before + 2} exports" in impl.run_notes()[0]


@needs_onnx
def test_the_opset_option_reaches_the_graph():
    impl = registry.resolve("onnx:sdpa", {"onnx_opset": "18"})
    q, k, v = tensors((1, 1, 2, 4), (1, 1, 3, 4), (1, 1, 3, 4))
    impl.sdpa(q, k, v)
    assert impl.sdpa.opsets == {18} and "opset 18" in impl.capabilities.probe_notes[0]


# --------------------------------------------------------------------------- path/model.onnx


@needs_onnx
def test_an_existing_graph_is_read_from_its_signature(tmp_path):
    path = export_graph(tmp_path / "sdpa.onnx")
    impl = registry.resolve(str(path))
    caps = impl.capabilities
    assert caps.dtypes == ("float32",) and caps.batch_dims == 1 and caps.mask_kinds == {"none", "bool"}
    assert not caps.custom_scale and caps.causal is None and not caps.gqa and not caps.autograd
    assert "inputs query=query, key=key, value=value, mask attn_mask (bool" in caps.probe_notes[0]
    q, k, v = tensors((2, 3, 4, 5), (2, 3, 6, 5), (2, 3, 6, 2))
    attend = torch.rand(4, 6, generator=torch.Generator().manual_seed(2)) < 0.6
    attend[:, 0] = True
    np.testing.assert_allclose(impl.sdpa(q, k, v, attn_mask=attend).numpy(),
                               oracle(q, k, v, attend_mask=attend.numpy()), atol=1e-6)
    np.testing.assert_allclose(impl.sdpa(q, k, v).numpy(), oracle(q, k, v), atol=1e-6)  # no mask: all True


@needs_onnx
def test_a_causal_graph_with_other_input_names_is_declared(tmp_path):
    path = export_graph(tmp_path / "causal.onnx", names=("q_in", "k_in", "v_in"), causal=True, mask=False)
    with pytest.raises(ImplementationError, match="none is named query, key, value.*onnx_inputs=QUERY"):
        registry.resolve(str(path))
    impl = registry.resolve(str(path), {"onnx_inputs": "q_in,k_in,v_in", "onnx_causal": "upper_left"})
    assert impl.capabilities.causal == "upper_left" and impl.capabilities.causal_only
    q, k, v = tensors((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4))
    np.testing.assert_allclose(impl.sdpa(q, k, v, is_causal=True).numpy(),
                               oracle(q, k, v, causal="upper_left"), atol=1e-6)
    with pytest.raises(NotImplementedError, match="declared causal"):
        impl.sdpa(q, k, v)


@needs_onnx
def test_a_graph_with_fixed_lengths_is_a_usage_error_naming_the_axes(tmp_path):
    path = export_graph(tmp_path / "fixed.onnx", mask=False, dynamic=False)
    with pytest.raises(ImplementationError, match="the graph fixes query axis 0 = 1.*dynamic axes"):
        registry.resolve(str(path))
    with pytest.raises(ImplementationError, match="onnx_inputs=a,b,c: give the graph's query, key, value"):
        registry.resolve(str(path), {"onnx_inputs": "a,b,c"})
    with pytest.raises(ImplementationError, match="no file 'missing.onnx'"):
        registry.resolve("missing.onnx")


# --------------------------------------------------------------------------- certificates


def certify(impl: str, workdir: Path, *extra: str) -> tuple[int, dict, str]:
    """Run ``pytest conformance --impl=impl --hypothesis-profile=ci`` in a subprocess:
    (exit code, the JSON certificate, output tail)."""
    report = workdir / "report"
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "conformance"), f"--impl={impl}",
           "--hypothesis-profile=ci", "-q", "-p", "no:cacheprovider", "--conformance-report", str(report), *extra]
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")])
    environ["ATTENTION_CONFORMANCE_FAILURES"] = str(workdir / "failures")
    proc = pytest_process.run(cmd, cwd=workdir, env=environ, capture_output=True, text=True, timeout=TIMEOUT_S)
    output = (proc.stdout + proc.stderr)[-4000:]
    path = report.with_suffix(".json")
    if not path.exists():
        pytest.fail(f"no report {path} written (exit code {proc.returncode}):\n{output}")
    return proc.returncode, json.loads(path.read_text()), output


def outcomes(report: dict) -> dict[tuple[str, str], str]:
    return {(r["property"], r["dtype"]): r["outcome"] for r in report["results"]}


@pytest.mark.slow
@pytest.mark.release
@needs_onnx
def test_sdpa_exported_at_opset_17_certifies(tmp_path):
    """``--impl=onnx:sdpa``: every property passes or is an expected failure of
    implementations/xfail/onnx-torchscript-sdpa.toml; the number of exports is on the certificate."""
    code, report, output = certify("onnx:sdpa", tmp_path)
    assert code == 0, output
    got = outcomes(report)
    assert {d for _, d in got} == {"float64", "float32", "float16"}  # bfloat16: no CPU Sqrt kernel
    assert got[("value_linearity", "float32")] == "passed" and got[("temperature", "float16")] == "passed"
    assert got[("fully_masked_rows", "float32")] == "xfailed"  # -inf rows NaN, eager 0
    assert got[("output_contract", "float16")] == "xfailed"  # float32 output with a bool mask or causal flag
    assert not [r for r in report["results"] if r["outcome"] in ("failed", "error", "stale-xfail")]
    run = report["implementation"]["run_notes"][0]
    assert " exports (" in run and "torchscript exporter, opset 17" in run


@pytest.mark.slow
@needs_onnx
def test_an_export_that_ignores_the_scale_fails(tmp_path):
    code, report, output = certify(f"onnx:{MODULES / 'onnx_scale_ignored.py'}:attention", tmp_path,
                                   "--dtype=float32", "-k", "temperature or forward_agreement or value_linearity")
    assert code == 1, output
    got = outcomes(report)
    assert got[("temperature", "float32")] == "failed", output
    assert got[("forward_agreement", "float32")] == "failed", output
    assert got[("value_linearity", "float32")] == "passed", output


@pytest.mark.slow
@needs_onnx
def test_an_export_with_the_mask_inverted_fails(tmp_path):
    code, report, output = certify(f"onnx:{MODULES / 'onnx_mask_inverted.py'}:attention", tmp_path,
                                   "--dtype=float32", "-k", "masked_keys or output_contract")
    assert code == 1, output
    got = outcomes(report)
    assert got[("masked_keys_ignored", "float32")] == "failed", output
    assert got[("output_contract", "float32")] == "passed", output


@pytest.mark.slow
@needs_onnx
def test_an_existing_graph_certifies(tmp_path):
    path = export_graph(tmp_path / "sdpa.onnx")
    code, report, output = certify(str(path), tmp_path, "--impl-option", "derived_flash=false")
    assert code == 0, output
    got = outcomes(report)
    assert got[("forward_agreement", "float32")] == "passed" and got[("masked_keys_ignored", "float32")] == "passed"
    assert got[("temperature", "float32")] == "skipped"  # the graph's scale is its own
