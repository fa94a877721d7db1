"""TensorFlow through the framework bridge, with no adapter: an SDPA-level TensorFlow
function (``examples/frameworks/tf_attention.py``, gradients by ``tf.GradientTape``) and
``tensorflow.keras.layers:MultiHeadAttention`` (Keras 3 on its tensorflow backend) at the
MHA level with its expected failures (``examples/frameworks/keras_mha_tensorflow_xfail.toml``).

TensorFlow is not in the project's extras (tensorflow-cpu 2.20 installs 1.4 GB), so CI skips
these; measured where it is installed (``pip install tensorflow-cpu``): the function
certifies in ~45 s under ``ci`` (four dtypes), the layer in ~45 s.
"""

from __future__ import annotations

import pytest

from tests.implementations.test_framework_bridge import ROOT, certify, installed, outcomes

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not installed("tensorflow"), reason="tensorflow is not installed (pip install tensorflow-cpu)"),
]

FUNCTION = ROOT / "examples" / "frameworks" / "tf_attention.py"
TF_XFAIL = ROOT / "examples" / "frameworks" / "keras_mha_tensorflow_xfail.toml"
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
                                   "--xfail-file", str(TF_XFAIL), env={**QUIET, "KERAS_BACKEND": "tensorflow"})
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
