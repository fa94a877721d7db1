"""Keras' MultiHeadAttention layer at the MHA level with no adapter (implementations/bridge/mha.py).

In process, without Keras: how a Keras layer class is recognised, and how nn.MultiheadAttention's
forward arguments become the layer's (a stub layer records them). Certificates as subprocesses
with KERAS_BACKEND=torch (chosen before keras is imported): ``keras.layers:MultiHeadAttention``
certifies under ``ci`` with its shipped expected-failures file by its short name
(``--xfail-file=keras-mha``, implementations/xfail/libraries/keras-mha.toml), each of that file's
deviations still fails without it, and a subclass with the model-dim scaling bug fails.
``tf.keras`` (TensorFlow is not in the extras) skips where TensorFlow is not installed."""

from __future__ import annotations

import importlib.util
import json
import types

import pytest
import torch

from implementations.bridge.mha import KerasMHA, keras_mha_framework
from tests.implementations.test_framework_bridge import MODULES, certify, outcomes

needs_keras = pytest.mark.skipif(
    importlib.util.find_spec("keras") is None or importlib.util.find_spec("torch") is None,
    reason="keras is not installed (pip install 'attention-conformance[frameworks]')")


# --------------------------------------------------------------------------- in process, no keras


def _fake_keras_mha(module: str):
    def __init__(self, num_heads, key_dim, value_dim=None, dropout=0.0, use_bias=True):
        pass

    return type("MultiHeadAttention", (), {"__module__": module, "__init__": __init__})


def test_a_keras_mha_class_or_subclass_is_recognised_by_its_bases():
    keras_mha = _fake_keras_mha("keras.src.layers.attention.multi_head_attention")
    assert keras_mha_framework(keras_mha) == "keras"
    assert keras_mha_framework(type("Mine", (keras_mha,), {"__module__": "my_model"})) == "keras"
    assert keras_mha_framework(_fake_keras_mha("tf_keras.src.layers")) == "tensorflow"
    assert keras_mha_framework(_fake_keras_mha("my_model")) is None  # not Keras'
    assert keras_mha_framework(torch.nn.MultiheadAttention) is None


class _Recorder(torch.nn.Module):
    """Stands in for a built Keras layer: records each call's arguments, returns the query
    and per-head scores (B, N, L, S) of ones."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.heads, self.calls = heads, []

    def forward(self, query, value, key=None, **kwargs):
        self.calls.append(dict(kwargs, query=query, value=value, key=key))
        scores = torch.ones(query.shape[0], self.heads, query.shape[1], value.shape[1])
        return (query, scores) if kwargs.get("return_attention_scores") else query


def _module(batch_first=False, heads=2):
    factory = types.SimpleNamespace(native_torch=True, framework=None)
    return KerasMHA(_Recorder(heads), factory, embed_dim=4, num_heads=heads, kdim=4, vdim=4,
                    batch_first=batch_first, dtype=torch.float32)


def test_forward_arguments_become_the_layers():
    module = _module().eval()
    q, kv = torch.randn(3, 2, 4), torch.randn(5, 2, 4)  # (L, B, D), (S, B, D)
    padding = torch.tensor([[False, False, False, True, True], [False] * 5])  # True = blocked
    blocked = torch.zeros(3, 5, dtype=torch.bool)
    blocked[0, 1] = True
    out, weights = module(q, kv, kv, key_padding_mask=padding, attn_mask=blocked, average_attn_weights=True)
    call = module.layer.calls[-1]
    assert call["query"].shape == (2, 3, 4) and torch.equal(out, q)  # (B, L, D) in, (L, B, D) back
    attend = call["attention_mask"]
    assert attend.shape == (2, 3, 5) and attend.dtype == torch.bool  # Keras' (B, L, S), True = attend
    assert not attend[0, :, 3:].any() and attend[1, 1:].all() and not attend[:, 0, 1].any()
    assert call["return_attention_scores"] and weights.shape == (2, 3, 5)  # averaged over heads
    assert not call["training"]
    module(q, kv, kv, attn_mask=blocked, is_causal=True, need_weights=False)
    call = module.layer.calls[-1]
    assert call["use_causal_mask"] and "attention_mask" not in call  # the hint: Keras' own causal mask
    assert "return_attention_scores" not in call
    module.train()(q, kv, kv)
    assert module.layer.calls[-1]["training"]  # train() is Keras' training=True (dropout)


def test_per_head_masks_go_as_four_dims_and_float_masks_are_refused():
    module = _module(batch_first=True, heads=2)
    x = torch.randn(2, 3, 4)
    per_head = torch.zeros(4, 3, 3, dtype=torch.bool)  # (B*N, L, S)
    per_head[1, 2, 0] = True  # batch 0, head 1
    module(x, x, x, attn_mask=per_head, need_weights=False)
    attend = module.layer.calls[-1]["attention_mask"]
    assert attend.shape == (2, 2, 3, 3) and not attend[0, 1, 2, 0] and attend.sum() == 35
    with pytest.raises(NotImplementedError, match="float attn_mask.*boolean"):
        module(x, x, x, attn_mask=torch.zeros(3, 3))
    with pytest.raises(NotImplementedError, match="float key_padding_mask"):
        module(x, x, x, key_padding_mask=torch.zeros(2, 3))
    out, _ = module(x[0], x[0], x[0], key_padding_mask=torch.tensor([False, False, True]))  # unbatched
    assert out.shape == (3, 4) and module.layer.calls[-1]["attention_mask"].shape == (1, 3, 3)


# --------------------------------------------------------------------------- certificates


@pytest.mark.slow
@pytest.mark.release
@needs_keras
def test_keras_mha_certifies_with_its_expected_failures(tmp_path):
    code, report, output = certify("keras.layers:MultiHeadAttention", tmp_path, "--dtype=float64,float32",
                                   "--xfail-file=keras-mha", env={"KERAS_BACKEND": "torch"})
    assert code == 0, output
    got = outcomes(report)
    for prop in ("mha_agreement", "mha_averaged_weights", "mha_causal_flag_equivalence", "mha_gradients",
                 "mha_dropout_expectation", "mha_output_contract"):
        assert got[(prop, "float32")] == "passed", (prop, output)
    assert got[("mha_agreement", "float64")] == "xfailed"  # float32 rounding on the fused path
    assert got[("mha_mask_conventions", "float32")] == "skipped"  # no float masks: bool only
    assert not [r for r in report["results"] if r["outcome"] in ("failed", "error", "stale-xfail")], output
    notes = json.dumps(report["implementation"]["mha_capabilities"])
    assert "keras 3" in notes and "(torch backend)" in notes and "float masks declared unsupported" in notes


@pytest.mark.slow
@needs_keras
def test_keras_mha_deviations_fail_without_the_file(tmp_path):
    """Each deviation the xfail file names is real: without it they fail (float32 and float64)."""
    code, report, output = certify("keras.layers:MultiHeadAttention", tmp_path, "--dtype=float64,float32",
                                   "-k", "fully_masked or need_weights or agreement", env={"KERAS_BACKEND": "torch"})
    assert code == 1, output
    got = outcomes(report)
    assert got[("mha_fully_masked_rows", "float32")] == "failed"  # uniform rows on the fused path
    assert got[("mha_need_weights_equivalence", "float32")] == "failed"
    assert got[("mha_agreement", "float64")] == "failed"  # float32 rounding
    assert got[("mha_agreement", "float32")] == "passed"


@pytest.mark.slow
@needs_keras
def test_a_keras_mha_subclass_scaled_by_the_model_dim_fails(tmp_path):
    code, report, output = certify(f"{MODULES / 'keras_mha_scale_model_dim.py'}:ModelDimScaledMHA", tmp_path,
                                   "--dtype=float32", "-k", "mha_agreement or mha_output_contract",
                                   env={"KERAS_BACKEND": "torch"})
    assert code == 1, output
    got = outcomes(report)
    assert got[("mha_agreement", "float32")] == "failed", output
    assert got[("mha_output_contract", "float32")] == "passed", output
    assert "mha_scale_model_dim" in json.dumps(report["causes"]), output


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                    reason="tensorflow is not installed (not in the extras): tf.keras.layers.MultiHeadAttention "
                           "is certified only where it is")
@pytest.mark.slow
def test_tf_keras_mha_certifies(tmp_path):
    code, report, output = certify("tensorflow.keras.layers:MultiHeadAttention", tmp_path, "--dtype=float32",
                                   "-k", "mha_agreement or mha_output_contract", env={"KERAS_BACKEND": "tensorflow"})
    got = outcomes(report)
    assert got[("mha_agreement", "float32")] == "passed", output
