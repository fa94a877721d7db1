"""TensorFlow through the framework bridge, with no adapter: an SDPA-level TensorFlow
function (``examples/frameworks/tf_attention.py``, gradients by ``tf.GradientTape``) and
``tensorflow.keras.layers:MultiHeadAttention`` (Keras 3 on its tensorflow backend) at the
MHA level with its expected failures (``--xfail-file=keras-mha-tensorflow``, shipped in implementations/xfail/libraries/).

TensorFlow is not in the project's extras (tensorflow-cpu 2.20 installs 1.4 GB), so CI skips
these; measured where it is installed (``pip install tensorflow-cpu``): the function
certifies in ~45 s under ``ci`` (four dtypes), the layer in ~45 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.implementations.test_framework_bridge import ROOT, certify, installed, outcomes

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not installed("tensorflow"), reason="tensorflow is not installed (pip install tensorflow-cpu)"),
]

FUNCTION = ROOT / "examples" / "frameworks" / "tf_attention.py"
TF_XFAIL = ROOT / "implementations" / "xfail" / "libraries" / "keras-mha-tensorflow.toml"  # --xfail-file=keras-mha-tensorflow
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2"}


def test_a_tensorflow_function_certifies_with_gradient_tape_gradients(tmp_path):
    code, report, output = certify(f"{FUNCTION}:attention", tmp_path, "--dtype=float64,float32", env=QUIET)
    assert code == 0, output
    got = outcomes(report)
    for dtype in ("float64", "float32"):
        assert got[("forward_agreement", dtype)] == "passed"
        assert got[("gradient_agreement", dtype)] == "passed"  # tf.GradientTape through the bridge
    assert "tensorflow" in report["implementation"]["version"]


def test_tf_keras_mha_certifies_with_its_expected_failures(tmp_path):
    code, report, output = certify("tensorflow.keras.layers:MultiHeadAttention", tmp_path, "--dtype=float64,float32",
                                   "--xfail-file=keras-mha-tensorflow", env={**QUIET, "KERAS_BACKEND": "tensorflow"})
    assert code == 0, output
    got = outcomes(report)
    for prop in ("mha_agreement", "mha_averaged_weights", "mha_causal_flag_equivalence", "mha_output_contract"):
        assert got[(prop, "float32")] == "passed", (prop, output)
    assert got[("mha_agreement", "float64")] == "xfailed"  # float32 rounding on both paths
    assert not [r for r in report["results"] if r["outcome"] in ("failed", "error", "stale-xfail")], output


def test_tf_keras_mha_deviations_fail_without_the_file(tmp_path):
    code, report, output = certify("tensorflow.keras.layers:MultiHeadAttention", tmp_path, "--dtype=float64,float32",
                                   "-k", "fully_masked or agreement", env={**QUIET, "KERAS_BACKEND": "tensorflow"})
    assert code == 1, output
    got = outcomes(report)
    assert got[("mha_fully_masked_rows", "float32")] == "failed"  # uniform rows on the fused path
    assert got[("mha_agreement", "float64")] == "failed"  # float32 rounding
    assert got[("mha_agreement", "float32")] == "passed"


# One call of the bridged layer per S (L = 1, D = 2, N = 2: head dim 1; random biases), in a
# subprocess (keras picks its backend once per process): |output - spec.mha_forward| per S,
# whether the file's entries cover each case, and keras.ops.add's own broadcast.
HEAD_DIM_ONE = r"""
import json, sys
import numpy as np, torch
import keras
from conformance.core.cases import MHACase
from implementations.registry import resolve
from implementations.registry.expected_failures import load_expected_failures_file
import spec

rng = np.random.default_rng(0)
D, N = 2, 2
params = spec.MHAParams(
    embed_dim=D, num_heads=N, in_proj_weight=rng.standard_normal((3 * D, D)),
    in_proj_bias=rng.standard_normal(3 * D), out_proj_weight=rng.standard_normal((D, D)),
    out_proj_bias=rng.standard_normal(D), kdim=D, vdim=D, add_zero_attn=False)
impl = resolve("tensorflow.keras.layers:MultiHeadAttention")
entries = load_expected_failures_file(sys.argv[1])
module = impl.mha(D, N, dropout=0.0, bias=True, dtype=torch.float32)
impl.load_weights(module, params)
module.eval()
result = {"backend": keras.backend.backend(),
          "add": np.asarray(keras.ops.add(np.zeros((1, 2, 2, 1), "float32"),
                                          np.array([[1.0], [2.0]], "float32"))).ravel().tolist()}
for S in (2, 3):
    query, key, value = rng.standard_normal((1, 1, D)), rng.standard_normal((S, 1, D)), rng.standard_normal((S, 1, D))
    with torch.no_grad():
        out, _ = module(*(torch.tensor(a, dtype=torch.float32) for a in (query, key, value)), need_weights=False)
    expected = spec.mha_forward(params, query, key, value, need_weights=False)
    expected = expected[0] if isinstance(expected, tuple) else expected
    attrs = MHACase(params, query, key, value, need_weights=False, dtype="float32", device="cpu").attrs()
    result[S] = {"diff": float(np.abs(out.double().numpy() - expected).max()),
                 "covered": any(e.applies("mha_agreement", attrs) for e in entries)}
print(json.dumps(result))
"""


def test_tf_keras_head_dim_one_bias_broadcast_is_a_listed_deviation(tmp_path):
    """keras.ops.add on the tensorflow backend adds an (N, 1) bias to a (B, T, N, 1)
    projection along T when T == N (tf.nn.bias_add, channels-first): the layer with head dim
    1 is wrong when S == N and right otherwise, and the file's entries cover exactly the
    first case. If Keras fixes its add, this fails: drop the entries."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERAS_", "PYTEST_"))}
    env.update(QUIET, KERAS_BACKEND="tensorflow",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", HEAD_DIM_ONE, str(TF_XFAIL)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["backend"] == "tensorflow"
    assert got["add"] == [1.0, 1.0, 2.0, 2.0]  # NumPy's broadcast: [1, 2, 1, 2]
    assert got["2"]["diff"] > 1e-2 and got["2"]["covered"], got  # S == N: the bias along S
    assert got["3"]["diff"] < 1e-5 and not got["3"]["covered"], got  # S != N: right, and tested
