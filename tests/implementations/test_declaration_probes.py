"""A field a declaration gives is not probed: probe calls counted (``_Prober.call``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from implementations import registry
from implementations.registry import prober
from implementations.registry.declaration import toml_value

EXAMPLE = "examples/sdpa_function.py:attention"
#: Every field the SDPA probe finds, as a declaration (what the example supports).
FULL = {"dtypes": ["float64", "float32", "float16", "bfloat16"], "mask_kinds": ["none", "bool", "additive"],
        "gqa": True, "different_v_dim": True, "autograd": True, "mask_grad": True, "dropout": True,
        "custom_scale": True, "non_contiguous": True, "batch_dims": "none", "causal": "upper_left",
        "fully_masked": "zero"}


@pytest.fixture
def count_calls(monkeypatch):
    """The probe calls each resolve makes, by what was tried."""
    seen: list[str] = []
    real = prober._Prober.call

    def call(self, what, fn):
        seen.append(what)
        return real(self, what, fn)

    monkeypatch.setattr(prober._Prober, "call", call)
    return seen


def _declare(tmp_path: Path, values: dict) -> str:
    path = tmp_path / "decl.toml"
    path.write_text("\n".join(f"{k} = {toml_value(v)}" for k, v in {"spec": EXAMPLE, **values}.items()) + "\n")
    return str(path)


def _plain(caps):
    return caps.replace(sources={}, probe_notes=())


def test_declared_fields_are_not_probed_and_resolve_alike(tmp_path, count_calls):
    undeclared = registry.resolve(EXAMPLE)
    probed = len(count_calls)
    count_calls.clear()
    some = registry.resolve(_declare(tmp_path, {k: FULL[k] for k in ("dtypes", "gqa", "mask_kinds")}))
    partly = len(count_calls)
    assert not any(what.startswith(("dtype ", "GQA", "a bool mask", "a float mask")) for what in count_calls)
    count_calls.clear()
    full = registry.resolve(_declare(tmp_path, FULL))
    assert count_calls == ["a plain call"], count_calls  # the signature's check: nothing else is probed
    assert 1 < partly < probed, (partly, probed)
    for impl in (some, full):
        assert _plain(impl.caps("sdpa")) == _plain(undeclared.caps("sdpa"))
    print(f"probe calls: undeclared {probed}, 3 fields declared {partly}, fully declared 1")


def test_the_same_values_on_the_command_line_are_probed_as_before(count_calls):
    registry.resolve(EXAMPLE)
    probed = len(count_calls)
    count_calls.clear()
    # --impl-option keeps its behaviour: probed, and a claim the probe saw fail refused.
    registry.resolve(EXAMPLE, {"gqa": "true", "mask_kinds": "none,bool,additive"})
    assert len(count_calls) == probed


@pytest.mark.parametrize("spec, options", [
    ("tests/implementations/declared_kernels.py:tiled_16bit",
     {"dtypes": "float16,bfloat16", "min_head_dim": "16", "seq_multiple": "16"}),
    ("tests/implementations/declared_kernels.py:causal_only", {"causal_only": "true"}),
    ("tests/runner/partial_support_impls.py:blocks_of_4", {"seq_multiple": "4"}),
    ("examples/mha_dropin.py:SimpleMultiheadAttention", {}),
])
def test_a_kernel_read_back_from_its_draft_is_probed_once(spec, options, tmp_path, count_calls):
    """The draft a run writes (declaration.draft_declaration) declares every field the SDPA,
    flash and MHA probes find: read back, the implementation gets its plain call only, and
    the same capabilities."""
    from implementations.registry.declaration import draft_declaration

    probed = registry.resolve(spec, options)
    calls = len(count_calls)
    count_calls.clear()
    (tmp_path / "d.toml").write_text(draft_declaration(probed, spec, options))
    declared = registry.resolve(str(tmp_path / "d.toml"))
    assert count_calls == ["a plain call"] and calls > 10, (calls, count_calls)
    for level in ("sdpa", "mha", "flash"):
        assert _plain(declared.caps(level)) == _plain(probed.caps(level)), level


@pytest.mark.parametrize("cls", ["KeepMaskAttention", "FusedBlockedAttention", "AnnotatedMultiHeadedAttention"])
def test_a_learner_module_read_back_from_its_draft_skips_its_convention_probes(cls, tmp_path, monkeypatch):
    """The draft of a hand-written module declares the conventions the learner level
    probed (layout, fused cut, mask convention): read back, the module is read the same
    and those probes are not made again."""
    from implementations.registry.declaration import draft_declaration
    from implementations.registry.learner import probes

    seen: list[str] = []
    for method in ("call", "value"):
        real = getattr(probes._Probe, method)
        monkeypatch.setattr(probes._Probe, method, lambda self, what, fn, _real=real: (seen.append(what),
                                                                                       _real(self, what, fn))[1])
    spec = f"tests/implementations/learner_modules/tutorial_modules.py:{cls}"
    probed = registry.resolve(spec)
    before, calls = list(seen), len(seen)
    seen.clear()
    draft = draft_declaration(probed, spec)
    assert "learner_layout = " in draft and "learner_mask = " in draft, draft
    (tmp_path / "d.toml").write_text(draft)
    declared = registry.resolve(str(tmp_path / "d.toml"))
    fields = ("mask", "mask_dtype", "mask_shapes", "also_additive", "fused", "seq_first", "projections", "causal")
    assert ({f: getattr(declared.mha.plan, f) for f in fields} == {f: getattr(probed.mha.plan, f) for f in fields})
    assert _plain(declared.caps("mha")) == _plain(probed.caps("mha"))
    assert "the layout" in before and "the layout" not in seen, seen
    assert len(seen) < calls, (calls, len(seen))


def test_a_bridged_function_s_draft_holds_its_framework_and_layout(tmp_path):
    """JAX's own dot_product_attention, read as JAX's and (B, L, N, E): its draft says so,
    and read back it is bridged alike, with the same capabilities."""
    pytest.importorskip("jax")
    from implementations.registry.declaration import draft_declaration

    spec = "jax.nn:dot_product_attention"
    probed = registry.resolve(spec)
    draft = draft_declaration(probed, spec)
    assert 'framework = "jax"  # read' in draft and 'layout = "BLNE"  # read' in draft, draft
    (tmp_path / "d.toml").write_text(draft)
    declared = registry.resolve(str(tmp_path / "d.toml"))
    assert (declared.sdpa.framework.name, declared.sdpa.layout) == ("jax", "BLNE")
    assert _plain(declared.capabilities) == _plain(probed.capabilities)
