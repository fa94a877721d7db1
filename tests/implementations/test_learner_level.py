"""The learner level: tutorial-style modules certify with no adapter, and the probes
choose conventions without absorbing the classic mistakes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from implementations import ImplementationError, registry
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]
MODULES_DIR = "tests/implementations/learner_modules"
MODULES = f"{MODULES_DIR}/tutorial_modules.py"
CONTROLS = ["KeepMaskAttention", "AnnotatedMultiHeadedAttention", "FusedBlockedAttention", "CrossAttention",
            "GPTStyleAttention", "PerHeadFusedAttention", "SDPAAttention", "D2LAttention"]


def _certify(impl: str, tmp_path: Path, *, keyword: str = "mha") -> dict:
    """The JSON ``ci`` certificate of the MHA properties ``keyword`` selects (-k), float64
    and float32. A test that asserts a failure and its cause selects the failing property
    alone (``mha_agreement``): the rest would only cost time."""
    report = tmp_path / "cert"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    pytest_process.run([sys.executable, "-m", "pytest", "conformance", f"--impl={impl}", "--hypothesis-profile=ci",
                    "-q", "-k", keyword, "--dtype", "float64,float32", f"--conformance-report={report}"],
                   cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    return json.loads(Path(f"{report}.json").read_text())


@pytest.mark.parametrize("name", CONTROLS)
def test_tutorial_module_certifies_with_no_adapter(name, tmp_path):
    cert = _certify(f"{MODULES}:{name}", tmp_path)
    outcomes = {r["property"] + "-" + r["dtype"]: r["outcome"] for r in cert["results"] if r["level"] == "mha"}
    assert "failed" not in outcomes.values() and "error" not in outcomes.values(), outcomes
    assert outcomes["mha_agreement-float64"] == "passed" and outcomes["mha_agreement-float32"] == "passed"


MISTAKES = "tests/implementations/learner_modules/tutorial_mistakes.py"


@pytest.mark.parametrize("impl, cause", [("mutant:learner_scale_d_model", "mha_scale_model_dim"),
                                         ("mutant:learner_softmax_over_queries", "mha_softmax_over_queries"),
                                         (f"{MISTAKES}:ScaledByModelDim", "mha_scale_model_dim"),
                                         (f"{MISTAKES}:ViewWithoutTranspose",
                                          "mha_heads_split_without_transpose")])
def test_classic_mistake_fails_with_its_cause(impl, cause, tmp_path):
    """The cause is named on the shrunk case, also where it is one of the directed cases
    with fully-masked rows filled uniform by a -1e9 mask (the bound of those rows is
    the property's own, not that of rows filled with zeros)."""
    cert = _certify(impl, tmp_path, keyword="mha_agreement")
    failed = [r for r in cert["results"] if r["outcome"] == "failed"]
    assert any(r["property"] == "mha_agreement" for r in failed)
    assert cause in {c["variant"] for c in cert["causes"]}


def test_probed_conventions_are_on_the_notes():
    caps = registry.resolve(f"{MODULES}:FusedBlockedAttention").caps("mha")
    notes = " ".join(caps.probe_notes)
    assert "qkv, proj" in notes and "True = blocked" in notes and "(B, S)" in notes
    assert {"need_weights", "per_head_weights", "key_padding_mask"} <= caps.mha_features
    assert "attn_mask" not in caps.mha_features and "cross_attention" not in caps.mha_features
    annotated = registry.resolve(f"{MODULES}:AnnotatedMultiHeadedAttention").caps("mha")
    assert {"attn_mask", "is_causal", "cross_attention"} <= annotated.mha_features
    assert "heads first" in annotated.probe_notes[0] and "linears.0 q, linears.1 k" in annotated.probe_notes[0]
    assert "q read by linears.0" in annotated.probe_notes[0]  # the dataflow, not the definition order


def test_lazy_layers_are_read_and_lengths_are_not_taken_for_a_mask():
    caps = registry.resolve(f"{MODULES}:D2LAttention").caps("mha")
    notes = " ".join(caps.probe_notes)
    assert "W_q q, W_k k, W_v v, W_o out" in notes and "valid_lens is read as valid lengths" in notes
    assert "key_padding_mask" not in caps.mha_features and "cross_attention" in caps.mha_features


def test_learner_options_are_validated_and_override():
    with pytest.raises(ImplementationError, match="learner_fused"):
        registry.resolve(f"{MODULES}:GPTStyleAttention", {"learner_fused": "nonsense"})
    with pytest.raises(ImplementationError, match="valid: learner_mask"):
        registry.resolve(f"{MODULES}:GPTStyleAttention", {"learner_colour": "red"})
    with pytest.raises(ImplementationError, match="apply to a hand-written"):
        registry.resolve("torch-mha", {"learner_mask": "keep"})
    impl = registry.resolve(f"{MODULES}:GPTStyleAttention", {"learner_fused": "kqv"})
    assert impl.mha.plan.fused == "kqv" and "learner_fused" in impl.caps("mha").probe_notes[0]


def _usage_error(tmp_path: Path, name: str, init: str, body: str, forward: str) -> str:
    """The message of the ImplementationError resolving class ``name`` (``__init__(self,
    init)`` with ``body``, ``forward(self, forward)`` returning x) raises."""
    path = tmp_path / "module.py"
    path.write_text(f"import torch.nn as nn\n\nclass {name}(nn.Module):\n    def __init__(self, {init}):\n"
                    f"        super().__init__()\n        {body}\n\n    def forward(self, {forward}):\n"
                    "        return x\n")
    with pytest.raises(ImplementationError) as info:
        registry.resolve(f"{path}:{name}")
    return str(info.value)


def _distance(snippet: str) -> float:
    """What a snippet in a module's own terms prints: max |out - expected|."""
    ran = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT)
    assert ran.returncode == 0, ran.stderr
    return float(ran.stdout.rsplit("=", 1)[1])


def test_unusual_module_is_a_one_line_usage_error(tmp_path):
    message = _usage_error(tmp_path, "Odd", "d_model, n_heads", "self.a = nn.Linear(d_model, d_model)", "x, mask=None")
    assert "\n" not in message and "learner_projections" in message and "a (8x8)" in message


@pytest.mark.parametrize("impl, names", [(f"{MISTAKES}:ScaledByModelDim", ("module.w_q.weight", "mask = ")),
                                         ("mutant:learner_fused_cut_last_head", ("module.qkv.weight", "padding_mask"))])
def test_a_failure_is_shown_in_the_modules_own_terms(impl, names):
    """The failing call as the module received it: its class, its Linear layers, its
    forward's argument names and mask convention, and the spec's output; the snippet runs
    with torch alone and shows the mistake (a nonzero difference)."""
    from conformance.core.target import Target
    from conformance.directed.examples import mha_directed
    from conformance.reporting.failures import _in_own_terms

    target = Target(registry.resolve(impl), "mha", "float64", "cpu")
    case = next(c for c in mha_directed(target) if c.key_padding_mask is not None or c.attn_mask is not None)
    snippet = _in_own_terms(target, case)
    assert snippet is not None and all(n in snippet for n in names), snippet
    assert "in_proj_weight" not in snippet and "conformance" not in snippet
    assert _distance(snippet) > 1e-3


@pytest.mark.parametrize("name", ["AnnotatedMultiHeadedAttention", "FusedBlockedAttention", "KeepMaskAttention"])
def test_a_correct_modules_call_in_its_own_terms_agrees_with_the_spec(name):
    from conformance.core.target import Target
    from conformance.directed.examples import mha_directed
    from conformance.reporting.failures import _in_own_terms

    target = Target(registry.resolve(f"{MODULES}:{name}"), "mha", "float64", "cpu")
    for case in mha_directed(target)[:4]:
        snippet = _in_own_terms(target, case)
        if snippet is None:
            continue
        assert _distance(snippet) < 1e-12, snippet


def test_a_config_constructor_is_read_and_its_attributes_shown(tmp_path):
    """A module built from one config object: the learner level hands it a namespace (no
    config class in the file), records what it read, and bounds L by its block_size."""
    path = tmp_path / "module.py"
    path.write_text("import torch.nn as nn\n\nclass Attn(nn.Module):\n    def __init__(self, config):\n"
                    "        super().__init__()\n        self.n_head = config.n_head\n"
                    "        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)\n"
                    "        self.c_proj = nn.Linear(config.n_embd, config.n_embd)\n\n"
                    "    def forward(self, x):\n        return self.c_proj(x)\n")
    message = _usage_error_or_none(f"{path}:Attn")
    assert message is None or "takes one object" not in message
    caps = registry.resolve(f"{MODULES_DIR}/nanogpt_style.py:CausalSelfAttention",
                            {"learner_config": "block_size=12"}).caps("mha")
    assert "config: GPTConfig(n_embd, n_head" in caps.probe_notes[0] and "block_size 12 → L ≤ 12" in caps.probe_notes[0]
    assert caps.max_seq_len == 12 and caps.causal_only


def _usage_error_or_none(impl: str) -> str | None:
    try:
        registry.resolve(impl)
    except ImplementationError as exc:
        return str(exc)
    return None


# --------------------------------------------------------------------------- the modules people copy

COPIED_MISTAKES = f"{MODULES_DIR}/copied_mistakes.py"
COPIED = [f"{MODULES_DIR}/{m}" for m in (
    "nanogpt_style.py:CausalSelfAttention", "nanogpt_style.py:SlowCausalSelfAttention",
    "nanogpt_style.py:LoggedAttention", "mingpt_style.py:CausalSelfAttention", "build_gpt_style.py:MultiHeadAttention",
    "espnet_style.py:MultiHeadedAttention", "labml_style.py:MultiHeadAttention",
    "packaged/attention.py:PackagedAttention", "timm_style.py:Attention")]


@pytest.mark.parametrize("impl", COPIED)
def test_copied_module_certifies_with_no_adapter(impl, tmp_path):
    cert = _certify(impl, tmp_path)
    outcomes = {r["property"] + "-" + r["dtype"]: r["outcome"] for r in cert["results"] if r["level"] == "mha"}
    assert "failed" not in outcomes.values() and "error" not in outcomes.values(), outcomes
    assert outcomes["mha_agreement-float64"] == "passed" and outcomes["mha_agreement-float32"] == "passed"


def test_opennmt_style_certifies_in_float32_and_its_float32_softmax_fails_float64(tmp_path):
    """forward(key, value, query, mask) bound by name; the softmax taken in float32
    (``scores.float()``) is a float64 deviation, diagnosed as one: the SDPA level's
    ``softmax_float32`` lifted to the MHA level names every float64 failure, the
    fully-masked rows its -1e18 fill makes uniform (1/S in float32) included."""
    cert = _certify(f"{MODULES_DIR}/opennmt_style.py:MultiHeadedAttention", tmp_path)
    outcomes = {r["property"] + "-" + r["dtype"]: r["outcome"] for r in cert["results"] if r["level"] == "mha"}
    assert not {k for k, v in outcomes.items() if k.endswith("float32") and v in ("failed", "error")}, outcomes
    assert outcomes["mha_agreement-float64"] == "failed"
    assert {c["variant"] for c in cert["causes"]} == {"softmax_float32"}, cert["causes"]


def test_parameters_the_constructor_leaves_uninitialised_are_drawn(tmp_path):
    """OpenNMT-py makes its projections with skip_init: their memory is garbage until its
    model initialises them, and a probe reading the module's own weights got a different
    reading in each process. They are found (two builds from one seed differ) and drawn."""
    impl = f"{MODULES_DIR}/opennmt_style.py:GarbageInitAttention"
    notes, _ = _notes(impl)
    assert "left uninitialised by the constructor: linear_keys.weight, linear_values.weight, " \
           "linear_query.weight, final_linear.weight" in notes
    factory = registry.resolve(impl).mha
    first, second = (factory(8, 2).inner.linear_keys.weight.detach().clone() for _ in range(2))
    assert first.isfinite().all() and first.abs().max() <= 8 ** -0.5 and (first == second).all()
    notes, _ = _notes(f"{MODULES_DIR}/nanogpt_style.py:CausalSelfAttention")
    assert "uninitialised" not in notes
    cert = _certify(impl, tmp_path)
    outcomes = {r["property"] + "-" + r["dtype"]: r["outcome"] for r in cert["results"] if r["level"] == "mha"}
    assert not {k for k, v in outcomes.items() if k.endswith("float32") and v in ("failed", "error")}, outcomes
    assert outcomes["mha_agreement-float32"] == "passed"


@pytest.mark.parametrize("impl, cause", [(f"{MODULES_DIR}/nanogpt_style.py:ForgotTheCausalScale", "mha_scale_model_dim"),
                                         (f"{MODULES_DIR}/build_gpt_style.py:HeadsConcatenatedReversed", None),
                                         (f"{MODULES_DIR}/nanogpt_style.py:CausalMaskOffByOne", None),
                                         (f"{COPIED_MISTAKES}:MinGPTScaledByEmbedding", "mha_scale_model_dim"),
                                         (f"{COPIED_MISTAKES}:ESPnetSoftmaxOverQueries", "mha_softmax_over_queries"),
                                         (f"{COPIED_MISTAKES}:LabmlScaledByModelDim", "mha_scale_model_dim"),
                                         (f"{COPIED_MISTAKES}:TimmMergedWithoutTranspose",
                                          "mha_heads_merged_without_transpose")])
def test_a_mistake_in_a_copied_module_fails(impl, cause, tmp_path):
    cert = _certify(impl, tmp_path, keyword="mha_agreement")
    assert any(r["property"] == "mha_agreement" and r["outcome"] == "failed" for r in cert["results"])
    assert cause is None or cause in {c["variant"] for c in cert["causes"]}


def _notes(impl: str, options: dict | None = None) -> tuple[str, object]:
    caps = registry.resolve(impl, options).caps("mha")
    return " ".join(caps.probe_notes), caps


def test_always_causal_modules_are_read_from_their_code():
    notes, caps = _notes(f"{MODULES_DIR}/nanogpt_style.py:SlowCausalSelfAttention")
    assert caps.causal_only and "a lower-triangular buffer bias" in notes and "c_attn fused q|k|v" in notes
    notes, caps = _notes(f"{MODULES_DIR}/nanogpt_style.py:CausalSelfAttention")
    assert caps.causal_only and "is_causal=True in its code" in notes
    notes, caps = _notes(f"{MODULES_DIR}/build_gpt_style.py:MultiHeadAttention")
    assert caps.causal_only and "heads.*.query q per head" in notes and "num_heads, head_size = d_model" in notes
    # A module that takes a mask says it is not causal: a causal rule in it is a mistake.
    notes, caps = _notes("implementations.mutants.mha.copied_mutants:AccidentallyCausal")
    assert not caps.causal_only and "always causal" not in notes


def test_subclass_forwarding_args_is_read_through_its_base():
    notes, caps = _notes(f"{MODULES_DIR}/nanogpt_style.py:LoggedAttention")
    assert "read through CausalSelfAttention's signature" in notes and caps.causal_only


def test_inputs_are_bound_by_name_in_any_order_and_keyword_only():
    notes, caps = _notes(f"{MODULES_DIR}/opennmt_style.py:MultiHeadedAttention")
    assert "forward(key, value, query, mask=...)" in notes and "query=query, key=key, value=value" in notes
    assert "q read by linear_query" in notes and "cross_attention" in caps.mha_features
    notes, caps = _notes(f"{MODULES_DIR}/labml_style.py:MultiHeadAttention")
    assert "forward(*, query, key, value, mask=...)" in notes and "sequence-first (L, B, D)" in notes
    notes, caps = _notes(f"{MODULES_DIR}/espnet_style.py:MultiHeadedAttention")  # dropout and mask required
    assert "key_padding_mask" in caps.mha_features and caps.dropout and caps.fully_masked == "zero"


def test_learner_layout_and_config_options_are_validated():
    with pytest.raises(ImplementationError, match="learner_layout"):
        registry.resolve(f"{MODULES_DIR}/labml_style.py:MultiHeadAttention", {"learner_layout": "sideways"})
    with pytest.raises(ImplementationError, match="NAME=VALUE"):
        registry.resolve(f"{MODULES_DIR}/nanogpt_style.py:CausalSelfAttention", {"learner_config": "block_size"})


def test_transformers_attention_classes_are_read_with_their_config():
    pytest.importorskip("transformers")
    notes, caps = _notes("transformers.models.bert.modeling_bert:BertSelfAttention")
    assert "config: BertConfig(hidden_size, num_attention_heads" in notes and "no output projection" in notes
    assert "need_weights" in caps.mha_features
    notes, caps = _notes("transformers.models.gpt2.modeling_gpt2:GPT2Attention",
                         {"learner_config": "_attn_implementation=sdpa", "causal_only": "true"})
    assert "c_attn fused q|k|v, c_proj out" in notes  # Conv1D layers, weights stored (in, out)
    assert caps.causal_only and "_attn_implementation='sdpa' (learner_config)" in notes
    notes, _ = _notes("transformers.models.bart.modeling_bart:BartAttention")
    assert "key_value_states read as the key/value input" in notes


def test_rotary_and_hidden_signatures_are_refused_with_the_reason(tmp_path):
    message = _usage_error(tmp_path, "Rotated", "d_model, n_heads", "self.wq = nn.Linear(d_model, d_model)",
                           "x, freqs_cis, mask=None")
    assert "\n" not in message and "rotary embeddings" in message and "kvcache level" in message
    message = _usage_error(tmp_path, "Hidden", "*args, **kwargs", "self.wq = nn.Linear(8, 8)", "x")
    assert "a decorator hides its signature" in message and "learner_init" not in message


def test_query_axis_masks_without_heads_carry_attn_mask_and_causal_cases():
    """ESPnet's and OpenNMT-py's masks take (B, L, S) and (B, 1, S), no head axis: attn_mask
    and causal cases run as one (L, S) mask for every head (the MHA level draws no per-head
    mask for them), and the note says so; a (B, H, L, S) mask carries per-head ones too."""
    for impl in ("espnet_style.py:MultiHeadedAttention", "opennmt_style.py:MultiHeadedAttention"):
        notes, caps = _notes(f"{MODULES_DIR}/{impl}")
        assert {"attn_mask", "is_causal"} <= caps.mha_features and "per_head_attn_mask" not in caps.mha_features
        assert "run as one (L, S) mask for every head" in notes and "per-head (B*H, L, S)" in notes
    notes, caps = _notes(f"{MODULES}:KeepMaskAttention")
    assert "per_head_attn_mask" in caps.mha_features and "attn_mask and causal cases run as one full" in notes


def test_a_mask_shape_read_against_the_convention_is_kept():
    """A (B, L, S) mask applied with its query and key axes swapped does not follow the
    convention its (B, 1, S) masks show: the shape is kept (it runs and changes the output),
    so the mistake fails instead of leaving the module certified for key padding only."""
    notes, caps = _notes("mutant:learner_mask_axes_swapped")
    assert {"attn_mask", "is_causal"} <= caps.mha_features
    assert "(B, L, S) run and change the output but their rows do not follow" in notes


def test_a_file_importing_its_own_package_is_imported_as_its_member():
    """``path/pkg/module.py:Class`` whose file imports ``pkg`` by name (minGPT's
    ``from mingpt.utils import ...``) or relatively is imported as a member of its package
    (the message used to say "fix the error in that file", which was not the error)."""
    for impl in ("packaged/absolute.py:AbsolutelyImportedAttention", "packaged/attention.py:PackagedAttention"):
        assert _usage_error_or_none(f"{MODULES_DIR}/{impl}") is None
    notes, _ = _notes(f"{MODULES_DIR}/packaged/absolute.py:AbsolutelyImportedAttention")
    assert "learner module: AbsolutelyImportedAttention" in notes


def test_attention_dropout_alone_takes_p_and_a_set_value_is_kept():
    """minGPT's config has attn_pdrop (attention weights) and resid_pdrop (the output):
    only the first takes the case's p, so dropout is certified; a value given with
    learner_config is the one the module gets."""
    impl = f"{MODULES_DIR}/mingpt_style.py:CausalSelfAttention"
    _, caps = _notes(impl)
    assert caps.dropout
    _, caps = _notes(impl, {"learner_config": "resid_pdrop=0.25"})
    assert not caps.dropout and "resid_pdrop=0.25 (learner_config)" in " ".join(caps.probe_notes)


def test_a_mask_handed_to_sdpa_takes_both_kinds():
    """timm's Attention hands its mask to F.scaled_dot_product_attention as it comes: a bool
    keep mask and an additive float one both work, so float masks are declared (and
    mha_mask_conventions runs); a module whose bool convention refuses floats gets none."""
    notes, caps = _notes(f"{MODULES_DIR}/timm_style.py:Attention")
    assert "additive" in caps.mask_kinds and "additive float masks (0 = keep, -inf = blocked) followed too" in notes
    notes, caps = _notes(f"{MODULES}:SDPAAttention")
    assert "additive" not in caps.mask_kinds and "followed too" not in notes


def test_one_key_value_input_is_certified_on_cross_attention_with_key_equal_to_value():
    """forward(x, memory): cross-attention cases hand it one key/value array (the MHA
    feature kv_cross_attention), so a module that projects its values from the query input
    (right on self-attention) fails; key and value apart are not drawn for it."""
    notes, caps = _notes("implementations.mutants.mha.copied_mutants:MemoryAttention")
    assert "kv_cross_attention" in caps.mha_features and "cross_attention" not in caps.mha_features
    assert "cross-attention cases draw it as one array" in notes
