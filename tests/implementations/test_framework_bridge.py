"""The framework bridge (implementations.bridge): how a function of another framework is
recognised, declared and called, checked in process; and certificates of NumPy and Keras
functions under the ``ci`` profile, each run as a subprocess (Keras per backend, chosen by
KERAS_BACKEND before keras is imported). A wrong function of each framework fails there,
so the bridge is shown not to hide bugs. Tests of a framework that is not installed skip."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import spec
from implementations import registry
from implementations.base import ImplementationError
from implementations.bridge import detect_framework, make_bridge, map_arguments
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "frameworks" / "numpy_attention.py"
MODULES = Path(__file__).resolve().parent / "framework_modules"
TIMEOUT_S = 900


def installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def tensors(*shapes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


def oracle(q, k, v, **kw):
    return spec.sdpa(q.double().numpy(), k.double().numpy(), v.double().numpy(), **kw).output


# --------------------------------------------------------------------------- in process


def test_numpy_function_is_recognised_from_its_body_and_computes_sdpa():
    impl = registry.resolve(f"{EXAMPLE}:attention")
    caps = impl.capabilities
    assert caps.autograd is False and caps.mask_grad is False
    assert any(n.startswith("bridge: numpy") and "recognised from the numpy modules" in n for n in caps.probe_notes)
    assert "autograd: numpy has no automatic differentiation; declared off" in caps.probe_notes
    assert caps.causal == "upper_left" and caps.custom_scale and not caps.gqa  # no enable_gqa parameter
    q, k, v = tensors((2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3), dtype=torch.float64)
    attend = torch.rand(3, 5, generator=torch.Generator().manual_seed(1)) < 0.6
    attend[:, 0] = True
    got = impl.sdpa(q, k, v, attn_mask=attend, scale=-0.3)
    assert got.dtype == torch.float64 and got.shape == (2, 2, 3, 3) and not got.requires_grad
    np.testing.assert_allclose(got.numpy(), oracle(q, k, v, attend_mask=attend.numpy(), scale=-0.3), atol=1e-12)


def test_a_scale_parameter_with_its_own_default_is_always_given_sdpas(tmp_path):
    """Pallas' flash kernel has ``sm_scale=1.0``: SDPA's ``scale=None`` (1/sqrt(E)) must be
    passed explicitly, or every property fails as an unscaled kernel."""
    (tmp_path / "pallas_like.py").write_text(
        "import numpy as np\n\n\n"
        "def flash(q, k, v, sm_scale=1.0):\n"
        "    s = np.einsum('bnle,bnse->bnls', q, k) * sm_scale\n"
        "    w = np.exp(s - s.max(axis=-1, keepdims=True))\n"
        "    return np.einsum('bnls,bnse->bnle', w / w.sum(axis=-1, keepdims=True), v)\n")
    impl = registry.resolve(f"{tmp_path / 'pallas_like.py'}:flash")
    assert any("sm_scale (always given" in n for n in impl.capabilities.probe_notes)
    q, k, v = tensors((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4), dtype=torch.float64)
    np.testing.assert_allclose(impl.sdpa(q, k, v).numpy(), oracle(q, k, v), atol=1e-12)
    np.testing.assert_allclose(impl.sdpa(q, k, v, scale=0.3).numpy(), oracle(q, k, v, scale=0.3), atol=1e-12)
    # a None default is SDPA's own: left to the function
    P = inspect.Parameter
    qkv = [P(n, P.POSITIONAL_OR_KEYWORD) for n in ("q", "k", "v")]
    assert not map_arguments([*qkv, P("scale", P.KEYWORD_ONLY, default=None)], "f").explicit_scale
    assert map_arguments([*qkv, P("scale", P.KEYWORD_ONLY)], "f").explicit_scale   # required: MLX's


def test_a_function_of_a_framework_the_bridge_does_not_run_is_refused_with_the_reason(tmp_path, monkeypatch):
    """A function of an array framework the bridge does not run (PaddlePaddle's SDPA, before
    Paddle was bridged, got torch tensors and failed its first call with a hint about tile
    declarations) is refused at recognition, naming the framework and the bridged ones."""
    (tmp_path / "mindspore" / "ops").mkdir(parents=True)
    (tmp_path / "mindspore" / "__init__.py").write_text("def matmul(a, b):\n    return a @ b\n")
    (tmp_path / "mindspore" / "ops" / "__init__.py").write_text(
        "def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False):\n"
        "    raise TypeError('not a mindspore Tensor')\n")
    (tmp_path / "mine.py").write_text("import mindspore\n\n\ndef attention(q, k, v):\n"
                                      "    return mindspore.matmul(q, k)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec_ in ("mindspore.ops:scaled_dot_product_attention", f"{tmp_path / 'mine.py'}:attention"):
        with pytest.raises(ImplementationError, match="MindSpore function .* not a bridged framework.*paddle"):
            registry.resolve(spec_)


def test_torch_functions_are_not_bridged():
    import torch.nn.functional as F

    def uses_numpy_and_torch(query, key, value):
        return torch.softmax(query @ key.transpose(-1, -2) / np.sqrt(query.shape[-1]), -1) @ value

    assert detect_framework(F.scaled_dot_product_attention) is None
    assert detect_framework(uses_numpy_and_torch) is None  # this module imports torch


def test_declared_framework_and_layout_are_checked():
    with pytest.raises(ImplementationError, match="framework=pandas: unknown framework.*numpy"):
        registry.resolve(f"{EXAMPLE}:attention", {"framework": "pandas"})
    with pytest.raises(ImplementationError, match="layout=LBNE: unknown layout.*BLNE"):
        registry.resolve(f"{EXAMPLE}:attention", {"layout": "LBNE"})
    with pytest.raises(ImplementationError, match="bridge options apply to an SDPA-level function"):
        registry.resolve("sdpa", {"layout": "BLNE"})


def test_blne_layout_transposes_and_the_signature_maps_mask_and_bias():
    def blne(q, k, v, bias=None, mask=None, softmax_scale=None, causal=False):
        """(B, L, N, E) NumPy attention with JAX's argument names."""
        logits = np.einsum("blne,bsne->bnls", q, k) * (softmax_scale or 1 / np.sqrt(q.shape[-1]))
        if bias is not None:
            logits = logits + bias
        if mask is not None:
            logits = np.where(mask, logits, -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        return np.einsum("bnls,bsne->blne", w / w.sum(-1, keepdims=True), v)

    import inspect

    arguments = map_arguments(list(inspect.signature(blne).parameters.values()), "blne")
    assert (arguments.bool_mask, arguments.bias, arguments.scale, arguments.causal) == (
        "mask", "bias", "softmax_scale", "causal")
    bridged = make_bridge(blne, "numpy", layout="BLNE")
    q, k, v = tensors((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4), dtype=torch.float64)
    attend = torch.ones(3, 5, dtype=torch.bool)
    attend[:, 1] = False
    bias = torch.randn(3, 5, dtype=torch.float64)
    np.testing.assert_allclose(bridged(q, k, v, attn_mask=attend, scale=0.7).numpy(),
                               oracle(q, k, v, attend_mask=attend.numpy(), scale=0.7), atol=1e-12)
    np.testing.assert_allclose(bridged(q, k, v, attn_mask=bias).numpy(),
                               oracle(q, k, v, additive_mask=bias.numpy()), atol=1e-12)
    # no enable_gqa parameter: K < N heads go as they are; einsum broadcasts one head (GQA at K = 1)
    np.testing.assert_allclose(bridged(q, k[:, :1], v[:, :1], enable_gqa=True).numpy(),
                               oracle(q, k[:, :1], v[:, :1]), atol=1e-12)


def _numpy_attention(q, k, v):
    w = np.exp(q @ np.swapaxes(k, -1, -2) * q.dtype.type(1 / np.sqrt(q.shape[-1])))
    return (w / w.sum(-1, keepdims=True)) @ v


def repeats_heads(q, k, v):
    """GQA without an enable_gqa parameter: key/value heads repeated to the query's."""
    groups = q.shape[1] // k.shape[1]
    return _numpy_attention(q, np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1))


def broadcasts_heads(q, k, v):
    """No GQA: NumPy's broadcasting takes one key/value head (K = 1), no other K < N."""
    return _numpy_attention(q, k, v)


def test_gqa_is_read_from_what_the_function_does_not_from_a_parameter_name():
    """A bridged function without ``enable_gqa`` gets K < N heads as they are; the probe's
    call (N = 4, K = 2) decides: one that repeats the heads itself takes GQA (and computes
    it), one that merely broadcasts a single head (right at K = 1 only) does not."""
    from implementations.registry.probing import probe_sdpa

    q, k, v = tensors((1, 4, 3, 2), (1, 2, 5, 2), (1, 2, 5, 2), dtype=torch.float64)
    for fn, takes_gqa in ((repeats_heads, True), (broadcasts_heads, False)):
        bridged = make_bridge(fn, "numpy")
        caps = probe_sdpa(bridged, origin=fn.__name__, timeout=None)
        assert caps.gqa is takes_gqa, (fn.__name__, caps.probe_notes)
    bridged = make_bridge(repeats_heads, "numpy")
    np.testing.assert_allclose(bridged(q, k, v, enable_gqa=True).numpy(),
                               oracle(q, k, v), atol=1e-12)


def test_a_framework_that_changes_the_dtype_is_refused():
    bridged = make_bridge(lambda q, k, v: (q @ np.swapaxes(k, -1, -2) @ v).astype(np.float32), "numpy")
    q, k, v = tensors((1, 1, 2, 4), (1, 1, 2, 4), (1, 1, 2, 4), dtype=torch.float64)
    with pytest.raises(TypeError, match="returned torch.float32 for torch.float64 inputs"):
        bridged(q, k, v)


@pytest.mark.skipif(not installed("tensorflow"), reason="tensorflow is not installed (pip install tensorflow)")
def test_tensorflow_function_gradients_through_gradient_tape():
    import tensorflow as tf

    def tf_attention(query, key, value, attn_mask=None):
        logits = tf.matmul(query, key, transpose_b=True) / tf.sqrt(tf.cast(tf.shape(query)[-1], query.dtype))
        if attn_mask is not None:
            logits = logits + attn_mask
        return tf.matmul(tf.nn.softmax(logits, -1), value)

    bridged = make_bridge(tf_attention, "tensorflow")
    q, k, v = tensors((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4), dtype=torch.float64)
    q.requires_grad_(True)
    out = bridged(q, k, v)
    np.testing.assert_allclose(out.detach().numpy(), oracle(q.detach(), k, v), atol=1e-10)
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


@pytest.mark.skipif(not installed("jax"), reason="jax is not installed (pip install 'attention-conformance[jax]')")
def test_jax_function_of_the_users_module_gets_jax_vjp_gradients():
    import jax

    def jax_attention(query, key, value, is_causal=False):
        logits = jax.numpy.einsum("bnle,bnse->bnls", query, key) / np.sqrt(query.shape[-1])
        if is_causal:
            logits = jax.numpy.where(np.tril(np.ones(logits.shape[-2:], bool)), logits, -np.inf)
        return jax.numpy.einsum("bnls,bnse->bnle", jax.nn.softmax(logits, -1), value)

    assert detect_framework(jax_attention) is None  # this module imports torch: declared below
    bridged = make_bridge(jax_attention, "jax")
    q, k, v = tensors((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4), dtype=torch.float64)
    q.requires_grad_(True)
    out = bridged(q, k, v, is_causal=True)
    np.testing.assert_allclose(out.detach().numpy(), oracle(q.detach(), k, v, causal="upper_left"), atol=1e-12)
    (out * 2).sum().backward()
    expected = spec.sdpa_vjp(q.detach().numpy(), k.numpy(), v.numpy(), np.full(out.shape, 2.0),
                             causal="upper_left").dquery
    np.testing.assert_allclose(q.grad.numpy(), expected, atol=1e-10)


@pytest.mark.skipif(not installed("jax"), reason="jax is not installed (pip install 'attention-conformance[jax]')")
def test_a_jax_function_is_compiled_unless_declared_eager_and_one_that_does_not_trace_runs_eagerly():
    functions = MODULES / "jax_functions.py"
    q, k, v = tensors((2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3), dtype=torch.float64)
    for name, traces in (("attention", True), ("attention_with_a_value_branch", False)):
        impl = registry.resolve(f"{functions}:{name}")
        caps = impl.capabilities
        assert caps.jit and impl.flash is None  # a small budget of shapes; no derived flash level unless asked
        assert any(n.startswith("compiled: jax.jit per configuration") and "jit=false" in n
                   for n in caps.probe_notes), caps.probe_notes
        out = impl.sdpa(q, k, v, is_causal=True)
        np.testing.assert_allclose(out.numpy(), oracle(q, k, v, causal="upper_left"), atol=1e-12)
        compiled = [done for function in impl.sdpa.fallbacks for done in function.compiles.values()]
        assert compiled and set(compiled) == {traces}, (name, compiled)  # compiled, or eager where it cannot
    eager = registry.resolve(f"{functions}:attention", {"jit": "false"})
    assert not eager.capabilities.jit and not eager.sdpa.fallbacks and eager.flash is not None
    assert "eager: every call runs op by op (jit=false declared)" in eager.capabilities.probe_notes


@pytest.mark.skipif(not installed("mlx"), reason="mlx is not installed (pip install 'attention-conformance[frameworks]')")
def test_an_mlx_function_gets_every_dtype_exactly():
    """float64 stays float64 (``mx.array`` of a float64 array is float32 unless told) and
    bfloat16 comes back (an mlx bfloat16 array has no buffer format NumPy reads)."""
    from implementations.bridge.frameworks import framework_named

    mlx = framework_named("mlx")
    assert mlx.version.startswith("mlx ") and mlx.version != "mlx ?"
    impl = registry.resolve(f"{MODULES / 'mlx_attention.py'}:attention")
    assert impl.capabilities.dtypes == ("float64", "float32", "float16", "bfloat16")
    values = torch.tensor([1.0 + 2**-52, 3.140625, -0.0078125], dtype=torch.float64)
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        x = values.to(dtype)
        assert torch.equal(mlx.to_torch(mlx.from_torch(x), x), x)  # the values and the dtype, exactly
        q, k, v = tensors((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4), dtype=dtype)
        assert impl.sdpa(q, k, v).dtype == dtype


@pytest.mark.skipif(not installed("mlx"), reason="mlx is not installed (pip install 'attention-conformance[frameworks]')")
def test_mlx_fast_sdpa_is_read_from_its_nanobind_signature_with_no_wrapper():
    """``mx.fast.scaled_dot_product_attention(q, k, v, *, scale, mask=None)``: a signature
    Python cannot read (nanobind), scale required, causal as ``mask="causal"`` (lower-right),
    one mask parameter for both kinds, GQA by K < N heads."""
    import mlx.core as mx

    from implementations.bridge import signature_of

    parameters = signature_of(mx.fast.scaled_dot_product_attention).parameters
    assert list(parameters)[:4] == ["q", "k", "v", "scale"] and parameters["scale"].default is inspect.Parameter.empty
    impl = registry.resolve("mlx.core.fast:scaled_dot_product_attention", {"causal": "lower_right"})
    caps = impl.capabilities
    assert caps.gqa and caps.mask_kinds == {"none", "bool", "additive"} and caps.causal == "lower_right"
    assert caps.dtypes == ("float64", "float32", "float16", "bfloat16")
    assert any("is_causal -> mask='causal'" in n and "scale -> scale (always given" in n for n in caps.probe_notes)
    q, k, v = tensors((1, 4, 2, 8), (1, 2, 3, 8), (1, 2, 3, 8))
    out = impl.sdpa(q, k, v, is_causal=True, enable_gqa=True, scale=0.25)
    expected = oracle(q, k, v, causal="lower_right", scale=0.25)
    np.testing.assert_allclose(out.numpy(), expected, atol=1e-5)
    with pytest.raises(NotImplementedError, match="not both"):
        impl.sdpa(q, k, v, attn_mask=torch.ones(2, 3, dtype=torch.bool), is_causal=True, enable_gqa=True)


# --------------------------------------------------------------------------- certificates


def certify(impl: str, workdir: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[int, dict, str]:
    """Run ``pytest conformance --impl=impl --hypothesis-profile=ci`` in a subprocess:
    (exit code, the JSON certificate, output tail)."""
    report = workdir / "report"
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "conformance"), f"--impl={impl}",
           "--hypothesis-profile=ci", "-q", "-p", "no:cacheprovider", "--conformance-report", str(report), *extra]
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_", "KERAS_"))}
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")])
    environ["ATTENTION_CONFORMANCE_FAILURES"] = str(workdir / "failures")
    environ.update(env or {})
    proc = pytest_process.run(cmd, cwd=workdir, env=environ, capture_output=True, text=True, timeout=TIMEOUT_S)
    output = (proc.stdout + proc.stderr)[-4000:]
    path = report.with_suffix(".json")
    if not path.exists():
        pytest.fail(f"no report {path} written (exit code {proc.returncode}):\n{output}")
    return proc.returncode, json.loads(path.read_text()), output


def outcomes(report: dict) -> dict[tuple[str, str], str]:
    """(property, dtype) -> outcome."""
    return {(r["property"], r["dtype"]): r["outcome"] for r in report["results"]}


@pytest.mark.slow
@pytest.mark.skipif(not installed("mlx"), reason="mlx is not installed (pip install 'attention-conformance[frameworks]')")
def test_an_mlx_function_certifies_in_float32_and_its_float64_softmax_is_named(tmp_path):
    code, report, output = certify(f"{MODULES / 'mlx_attention.py'}:attention", tmp_path, "--dtype=float64,float32",
                                   "-k", "(forward_agreement or gradient_agreement) and not mha and not flash",
                                   "--impl-option", "derived_flash=false")
    got = outcomes(report)
    assert got[("forward_agreement", "float32")] == got[("gradient_agreement", "float32")] == "passed", output
    assert got[("forward_agreement", "float64")] == "failed", output      # float32-accurate exp on the CPU
    assert [c["variant"] for c in report["causes"]] == ["softmax_float32"], report["causes"]


@pytest.mark.slow
def test_numpy_function_certifies(tmp_path):
    code, report, output = certify(f"{EXAMPLE}:attention", tmp_path)
    assert code == 0, output
    got = outcomes(report)
    for dtype in ("float64", "float32", "float16", "bfloat16"):  # bfloat16 as ml_dtypes'
        assert got[("forward_agreement", dtype)] == "passed"
        assert got[("gradient_agreement", dtype)] == "skipped"  # no autodiff: declared off


@pytest.mark.slow
def test_numpy_function_that_ignores_scale_fails(tmp_path):
    code, report, output = certify(f"{MODULES / 'numpy_scale_ignored.py'}:attention", tmp_path, "--dtype=float64",
                                   "-k", "(temperature or forward_agreement or head_independence) and not flash")
    assert code == 1, output
    got = outcomes(report)
    assert got[("temperature", "float64")] == "failed", output
    assert got[("forward_agreement", "float64")] == "failed", output
    assert got[("head_independence", "float64")] == "passed"


#: Keras on jax runs op by op (no jit) and took longer than TIMEOUT_S under ``ci`` on the
#: shared two-core machine (float32 alone): only the torch backend certifies in CI.
KERAS_BACKENDS = [b for b in ("torch",) if installed(b)]


@pytest.mark.slow
@pytest.mark.skipif(not installed("keras"), reason="keras is not installed (pip install 'attention-conformance[frameworks]')")
@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_keras_dot_product_attention_certifies(tmp_path, backend):
    """No adapter: ``--impl=keras.ops:dot_product_attention`` under KERAS_BACKEND, its
    fully-masked policy declared. The certificate holds the measured deviations of Keras
    (the torch backend inherits torch SDPA's NaN rows for a causal flag with scale <= 0)."""
    policy = {"torch": "bool:uniform,additive:zero", "jax": "bool:uniform,additive:nan"}[backend]
    code, report, output = certify("keras.ops:dot_product_attention", tmp_path, "--dtype=float32",
                                   "--impl-option", f"fully_masked={policy}", env={"KERAS_BACKEND": backend})
    got = outcomes(report)
    notes = json.dumps(report)
    assert "keras" in notes and f"({backend} backend)" in notes and "layout BLNE" in notes, output
    for prop in ("output_contract", "head_independence", "batch_independence", "masked_keys_ignored",
                 "key_permutation", "value_linearity", "fully_masked_rows", "bool_additive_equivalence"):
        assert got[(prop, "float32")] == "passed", (prop, output)
    assert got[("gradient_agreement", "float32")] in ("passed", "failed")  # run: autograd declared
    if backend == "torch":
        forward = next(r for r in report["results"] if r["property"] == "forward_agreement")
        assert forward["outcome"] == "failed" and "causal_before_scale" in json.dumps(forward), output


@pytest.mark.slow
@pytest.mark.skipif(not installed("keras"), reason="keras is not installed (pip install 'attention-conformance[frameworks]')")
def test_keras_function_with_an_inverted_mask_fails(tmp_path):
    backend = KERAS_BACKENDS[0]
    code, report, output = certify(f"{MODULES / 'keras_mask_inverted.py'}:attention", tmp_path, "--dtype=float32",
                                   "--impl-option", "layout=BLNE", "-k", "masked_keys or output_contract",
                                   env={"KERAS_BACKEND": backend})
    assert code == 1, output
    got = outcomes(report)
    assert got[("masked_keys_ignored", "float32")] == "failed", output
    assert got[("output_contract", "float32")] == "passed", output


TINYGRAD = MODULES / "tinygrad_attention.py"


@pytest.mark.skipif(not installed("tinygrad"), reason="tinygrad is not installed (pip install 'attention-conformance[frameworks]')")
def test_tinygrad_is_recognised_from_what_a_method_call_body_imports():
    import importlib.util as iu

    spec_ = iu.spec_from_file_location("tinygrad_attention_probe", TINYGRAD)
    module = iu.module_from_spec(spec_)
    sys.modules[spec_.name] = module
    try:
        spec_.loader.exec_module(module)
        assert detect_framework(module.attention) == "tinygrad"
    finally:
        del sys.modules[spec_.name]


@pytest.mark.slow
@pytest.mark.skipif(not installed("tinygrad"), reason="tinygrad is not installed (pip install 'attention-conformance[frameworks]')")
def test_tinygrad_function_certifies_and_its_single_key_softmax_is_caught(tmp_path):
    """tinygrad (its Python device: no clang needed) with no adapter and no declaration:
    forward and gradients (tinygrad's own autodiff) agree with the oracle; a row whose one
    key is masked gives that key's value (softmax of a single -inf is 1 in tinygrad 0.14;
    NaN from two keys on), against the NaN policy probed on a longer row."""
    code, report, output = certify(f"{TINYGRAD}:attention", tmp_path, "--dtype=float32", "--shape-budget=4",
                                   "-k", "forward_agreement or gradient_agreement or fully_masked_rows",
                                   env={"DEV": "PYTHON"})
    got = outcomes(report)
    assert "tinygrad" in json.dumps(report["implementation"]), output
    assert got[("forward_agreement", "float32")] == "passed", output
    assert got[("gradient_agreement", "float32")] == "passed", output
    assert code == 1 and got[("fully_masked_rows", "float32")] == "failed", output
    failed = next(r for r in report["results"] if r["property"] == "fully_masked_rows")
    assert "'S': 1" in json.dumps(failed) or '"S": 1' in json.dumps(failed), output


@pytest.mark.skipif(not installed("jax"), reason="jax is not installed (pip install 'attention-conformance[jax]')")
def test_jax_float64_is_switched_on_for_the_float64_call_only():
    """The bridge does not turn on ``jax_enable_x64`` for the process (it changes the code
    under test: index dtypes, what some kernels accept): a float64 call runs inside JAX's
    thread-local switch and keeps float64's precision, a float32 call runs as JAX runs by
    default, and the process setting is left as it was."""
    import jax
    import jax.numpy as jnp

    seen = []

    def attention(query, key, value):
        seen.append(jnp.arange(2).dtype.name)  # int64 only with x64 on
        w = jax.nn.softmax(jnp.einsum("bnle,bnse->bnls", query, key) / jnp.sqrt(query.shape[-1]), -1)
        return jnp.einsum("bnls,bnse->bnle", w, value)

    before = jax.config.jax_enable_x64
    bridged = make_bridge(attention, "jax")
    for dtype, index in ((torch.float64, "int64"), (torch.float32, "int32")):
        q, k, v = tensors((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4), dtype=dtype)
        out = bridged(q, k, v)
        assert out.dtype == dtype and seen[-1] == index, (dtype, seen)
        atol = 1e-13 if dtype == torch.float64 else 1e-6
        np.testing.assert_allclose(out.double().numpy(), oracle(q, k, v), atol=atol)
    assert jax.config.jax_enable_x64 == before


def indexes_kv_by_query_head(q, k, v):
    """No GQA, and no check either: kv head h for query head h, the heads past K read as
    the last one (a kernel that indexes past its kv heads reads whatever lies there)."""
    idx = np.minimum(np.arange(q.shape[1]), k.shape[1] - 1)
    return _numpy_attention(q, k[:, idx], v[:, idx])


def tiles_heads(q, k, v):
    """GQA with the wrong grouping (query head h reads kv head h % K): the bug gqa_tiled."""
    groups = q.shape[1] // k.shape[1]
    return _numpy_attention(q, np.tile(k, (1, groups, 1, 1)), np.tile(v, (1, groups, 1, 1)))


def test_gqa_read_from_behaviour_tells_no_gqa_from_a_wrong_grouping():
    """Without an enable_gqa parameter, a call that runs is not enough: the output must be the
    function's own with the kv heads repeated (as repeat_interleave or as tile). A function
    that reads kv heads by the query head index computes no GQA: declared off, and K < N is
    then refused by the bridge; a tiled grouping is GQA done wrong: declared on, so that
    gqa_equivalence fails it (not absorbed)."""
    from implementations.bridge import bridged_implementation
    from implementations.registry.probing import probe_sdpa

    q, k, v = tensors((1, 4, 3, 2), (1, 2, 5, 2), (1, 2, 5, 2), dtype=torch.float64)
    expected = {indexes_kv_by_query_head: False, tiles_heads: True, repeats_heads: True}
    for fn, takes_gqa in expected.items():
        impl = bridged_implementation(fn, "numpy", name=fn.__name__, origin=fn.__name__, probe=probe_sdpa,
                                      timeout=None)
        assert impl.capabilities.gqa is takes_gqa, (fn.__name__, impl.capabilities.probe_notes)
        if not takes_gqa:
            assert "did not compute grouped-query attention" in impl.capabilities.probe_note("gqa")
            with pytest.raises(NotImplementedError, match="does not compute GQA"):
                impl.sdpa(q, k, v, enable_gqa=True)
    assert probe_sdpa(make_bridge(tiles_heads, "numpy"), origin="t", timeout=None).gqa


def test_call_kwargs_fill_parameters_sdpa_does_not():
    """``--impl-option call_kwargs=NAME=VALUE,...``: a required parameter SDPA's arguments do
    not fill (Pallas' segment_ids) or a mode switch (interpret=True) given to every call;
    a name SDPA fills, a name the function lacks, or a value that is no literal is refused."""
    from implementations.base import ImplementationError

    def with_extras(q, k, v, segment_ids, interpret=False, scale=None):
        assert segment_ids is None and interpret is True, (segment_ids, interpret)
        return _numpy_attention(q, k, v)

    with pytest.raises(ImplementationError, match="requires \\['segment_ids'\\].*call_kwargs=segment_ids=VALUE"):
        make_bridge(with_extras, "numpy")
    bridged = make_bridge(with_extras, "numpy", call_kwargs={"segment_ids": None, "interpret": True})
    q, k, v = tensors((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4), dtype=torch.float64)
    np.testing.assert_allclose(bridged(q, k, v).numpy(), oracle(q, k, v), atol=1e-12)
    for given, match in (({"scale": 1.0}, "fills from scaled_dot_product_attention"),
                         ({"nope": 1}, "not a parameter")):
        with pytest.raises(ImplementationError, match=match):
            make_bridge(with_extras, "numpy", call_kwargs={"segment_ids": None, **given})
    from implementations.bridge import parse_call_kwargs

    assert parse_call_kwargs("interpret=True, segment_ids=None,block=(64, 64)") == {
        "interpret": True, "segment_ids": None, "block": (64, 64)}
    for bad in ("interpret", "x=[1]", "x=os.getcwd()", ""):
        with pytest.raises(ImplementationError, match="call_kwargs"):
            parse_call_kwargs(bad)


@pytest.mark.slow
@pytest.mark.skipif(not installed("jax"), reason="jax is not installed (pip install 'attention-conformance[jax]')")
def test_pallas_flash_attention_certifies_with_declarations_only(tmp_path):
    """JAX's Pallas flash-attention kernel (its GPU kernel in interpret mode on the CPU), with
    declarations only: its own failures are reported, not excused as the jax built-in's
    (causal with more queries than keys: every row NaN; logits near 1e9: -inf rows, its
    eager call too); GQA declared off (it reads kv heads by the query head's index)."""
    code, report, output = certify(
        "jax.experimental.pallas.ops.gpu.attention:mha", tmp_path, "--dtype=float32",
        "-k", "(forward_agreement or convex_hull or output_contract) and not mha and not flash",
        "--impl-option", "call_kwargs=segment_ids=None,interpret=True", "--impl-option", "layout=BLNE",
        "--impl-option", "seq_block=128", "--impl-option", "derived_flash=false")
    got = outcomes(report)
    assert got[("output_contract", "float32")] == "passed", output
    assert got[("forward_agreement", "float32")] == "failed", output
    assert "known deviation of the built-in `jax`" not in output, output
    assert report["implementation"]["capabilities"]["gqa"] is False


# --------------------------------------------------------------------------- Flax's two functions

FLAX_FUNCTIONS = ["flax.linen:dot_product_attention", "flax.nnx:dot_product_attention"]


@pytest.mark.skipif(not installed("flax"), reason="flax is not installed (pip install 'attention-conformance[frameworks]')")
@pytest.mark.parametrize("spec_name", FLAX_FUNCTIONS)
def test_flax_functions_are_read_as_jax_functions(spec_name):
    """No adapter: (B, L, N, E), a bool mask as ``mask`` and a float one as ``bias``; no
    causal flag, dropout probability or scale; fully-masked rows probed per kind and not
    adopted (uniform for a bool mask, NaN for a -inf bias); GQA only where it runs (NNX's)."""
    caps = registry.resolve(spec_name).capabilities
    notes = " ".join(caps.probe_notes)
    assert "layout BLNE" in notes and "bool attn_mask -> mask" in notes and "float attn_mask -> bias" in notes
    assert caps.mask_kinds == {"none", "bool", "additive"} and not caps.dropout and not caps.custom_scale
    assert "probed bool:uniform,additive:nan" in notes and "not adopted" in notes
    assert caps.gqa is spec_name.startswith("flax.nnx")
    assert caps.dtypes == ("float64", "float32", "float16", "bfloat16")


@pytest.mark.slow
@pytest.mark.skipif(not installed("flax"), reason="flax is not installed (pip install 'attention-conformance[frameworks]')")
def test_flax_nnx_function_has_jax_nn_float64_softmax_and_linen_does_not(tmp_path):
    """Linen's function is Flax's own float64 softmax; NNX's hands the call to
    ``jax.nn.dot_product_attention``, whose float64 softmax runs in float32: named
    ``softmax_float32`` (docs/FINDINGS.md, Flax's two dot_product_attention functions)."""
    chosen = ("--dtype=float64", "-k", "forward_agreement and not flash and not mha",
              "--impl-option", "fully_masked=bool:uniform,additive:nan")
    for name in ("linen", "nnx"):
        (tmp_path / name).mkdir()
    linen_code, linen, linen_output = certify(FLAX_FUNCTIONS[0], tmp_path / "linen", *chosen)
    nnx_code, nnx, nnx_output = certify(FLAX_FUNCTIONS[1], tmp_path / "nnx", *chosen)
    assert linen_code == 0 and outcomes(linen)[("forward_agreement", "float64")] == "passed", linen_output
    assert nnx_code == 1 and outcomes(nnx)[("forward_agreement", "float64")] == "failed", nnx_output
    assert [c["variant"] for c in nnx["causes"]] == ["softmax_float32"], nnx["causes"]
