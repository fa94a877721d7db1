"""transformers' own attention classes at the learner level, with no adapter: built from
their config, read by dataflow (Conv1D layers, ``key_value_states``, no output projection),
certified as what they are, and a classic mistake written into each fails with its cause.
Skipped where transformers is not installed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from implementations import registry
from tests import pytest_process

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
BART = "transformers.models.bart.modeling_bart:BartAttention"
WHISPER = "transformers.models.whisper.modeling_whisper:WhisperAttention"
BERT = "transformers.models.bert.modeling_bert:BertSelfAttention"
GPT2 = "transformers.models.gpt2.modeling_gpt2:GPT2Attention"
SDPA = {"learner_config": "_attn_implementation=sdpa"}
CAUSAL = {"causal_only": "true"}
MISTAKES = "tests/implementations/learner_modules/transformers_mistakes.py"


def _certify(impl: str, options: dict[str, str], tmp_path: Path, *, keyword: str = "mha") -> tuple[dict[str, str], dict]:
    """The ``ci`` certificate of the MHA properties ``keyword`` selects (-k), float64 and
    float32: the outcomes by property-dtype, and the JSON certificate. A test that asserts
    a failure selects the failing property alone (``mha_agreement``): the rest would only
    cost time."""
    report = tmp_path / "cert"
    flags = [f"--impl-option={k}={v}" for k, v in options.items()]
    pytest_process.run([sys.executable, "-m", "pytest", "conformance", f"--impl={impl}", *flags,
                    "--hypothesis-profile=ci", "-q", "-p", "no:cacheprovider", "-k", keyword,
                    "--dtype", "float64,float32", f"--conformance-report={report}"],
                   cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                   timeout=900)
    cert = json.loads(Path(f"{report}.json").read_text())
    return {r["property"] + "-" + r["dtype"]: r["outcome"] for r in cert["results"] if r["level"] == "mha"}, cert


@pytest.mark.parametrize("impl, options", [(BART, {}), (WHISPER, {}), (BERT, {}), (GPT2, {}),
                                           (GPT2, {**SDPA, **CAUSAL})],
                         ids=["bart", "whisper", "bert", "gpt2-eager", "gpt2-sdpa-causal"])
def test_transformers_class_certifies_as_what_it_is(impl, options, tmp_path):
    """GPT-2's eager path (the default of a standalone config) is bidirectional without a
    mask; its sdpa path is causal there, so it certifies when declared causal_only."""
    outcomes, _ = _certify(impl, options, tmp_path)
    assert "failed" not in outcomes.values() and "error" not in outcomes.values(), outcomes
    assert outcomes["mha_agreement-float64"] == "passed" and outcomes["mha_agreement-float32"] == "passed"


@pytest.mark.parametrize("options", [SDPA, CAUSAL], ids=["sdpa-undeclared", "eager-declared-causal"])
def test_gpt2_declared_as_what_it_is_not_fails(options, tmp_path):
    """The disagreement of GPT-2's two paths on a call without a mask (docs/FINDINGS.md):
    each fails where it is declared as the other."""
    outcomes, _ = _certify(GPT2, options, tmp_path, keyword="mha_agreement")
    assert outcomes["mha_agreement-float64"] == "failed" and outcomes["mha_agreement-float32"] == "failed"


@pytest.mark.parametrize("cls", ["BartScaledByModelDim", "WhisperScaledByModelDim", "GPT2ScaledByModelDim",
                                 "BertScaledByModelDim"])
def test_a_mistake_in_a_transformers_class_fails_with_its_cause(cls, tmp_path):
    """A subclass forwarding *args (its config found in its base's module: GPT2Config) that
    scales the scores by 1/sqrt(embed_dim)."""
    outcomes, cert = _certify(f"{MISTAKES}:{cls}", {}, tmp_path, keyword="mha_agreement")
    assert outcomes["mha_agreement-float64"] == "failed" and outcomes["mha_agreement-float32"] == "failed"
    assert "mha_scale_model_dim" in {c["variant"] for c in cert["causes"]}


def test_key_value_states_is_read_as_cross_attention_with_key_equal_to_value():
    """BART's and Whisper's key_value_states is their cross-attention input: certified on
    cross-attention calls whose key is their value (kv_cross_attention); calls with key
    and value apart are what one input cannot take."""
    for impl in (BART, WHISPER):
        caps = registry.resolve(impl).caps("mha")
        notes = " ".join(caps.probe_notes)
        assert "key_value_states read as the key/value input" in notes
        assert "cross-attention cases draw it as one array (kv_cross_attention)" in notes
        assert "kv_cross_attention" in caps.mha_features and "cross_attention" not in caps.mha_features


def test_gpt2_conv1d_layers_are_read_on_both_paths():
    for options in ({}, {**SDPA, **CAUSAL}):
        caps = registry.resolve(GPT2, options).caps("mha")
        notes = " ".join(caps.probe_notes)
        assert "c_attn fused q|k|v, c_proj out" in notes and "matches the oracle exactly" in notes
        assert caps.causal_only == bool(options)
