"""Directed examples (conformance.directed.examples): the smallest case of each bug class,
only cases the target claims and the property's strategy could draw."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis.errors import InvalidArgument

from conformance.core.cases import MHACase, SDPACase
from conformance.core.registry import registered_properties
from conformance.core.target import Target
from conformance.directed import examples as directed
from conformance.reporting.failures import load_case
from implementations import registry
from implementations.base import Capabilities, Implementation
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]


def _unused(*args, **kwargs):
    raise AssertionError("directed examples are built without calling the implementation")


#: Capabilities that rule out one kind of example each.
NARROW = {
    "lower-right": Capabilities(causal="lower_right", dtypes=("float32",)),
    "no-gqa-no-ev-no-scale": Capabilities(gqa=False, different_v_dim=False, custom_scale=False,
                                          dtypes=("float16",)),
    "contiguous-bool-only": Capabilities(non_contiguous=False, mask_kinds=frozenset({"none", "bool"}),
                                         causal=None, max_seq_len=16, dtypes=("bfloat16",)),
}
IMPLS = [registry.resolve(name) for name in ("spec", "sdpa-flash", "torch-mha")] + [
    Implementation(name=name, capabilities=caps, sdpa=_unused) for name, caps in NARROW.items()]


def _targets(impl: Implementation, level: str):
    if getattr(impl, level) is None:  # sdpa, mha, varlen, kvcache
        return []
    return [Target(impl, level, dtype, "cpu") for dtype in impl.caps(level).dtypes]


def _directed_by_property():
    """(property, target, its strategy's arguments or None, directed cases) for every pair."""
    for info in registered_properties().values():
        if info.directed is None:
            continue
        for impl in IMPLS:
            for target in _targets(impl, info.level):
                try:
                    strategy = info.cases(target)
                except InvalidArgument:  # the property's `requires` skips this target
                    continue
                yield info, target, getattr(strategy, "case_arguments", None), info.directed(target)


def test_every_directed_case_is_claimed_by_the_target_and_drawable_by_the_property():
    checked = 0
    for info, target, arguments, cases in _directed_by_property():
        caps = target.caps
        assert len(cases) <= directed.MAX_DIRECTED, (info.id, target.id, len(cases))
        for case in cases:
            where = (info.id, target.id, case.describe())
            assert case.dtype == target.dtype and case.device == target.device, where
            if isinstance(case, SDPACase):
                assert caps.gqa or case.K == case.N, where
                assert caps.different_v_dim or case.E == case.Ev, where
                assert case.causal in (None, caps.causal), where
                assert caps.non_contiguous or case.layout == "contiguous", where
                assert caps.custom_scale or case.scale is None, where
                assert case.mask_kind in caps.mask_kinds, where
                assert max(case.L, case.S) <= (caps.max_seq_len or 65), where
            elif info.level == "mha":
                assert isinstance(case, MHACase), where
                assert case.mha_features() - {"dropout"} <= set(caps.mha_features) | {"need_weights"}, where
            if arguments is not None:  # the strategy's own arguments (not the directed ones)
                assert directed.admitted(target, case, **arguments), where
            checked += 1
    assert checked > 500


def test_properties_with_preconditions_get_only_cases_that_meet_them():
    spec = registry.resolve("spec")
    t = Target(spec, "sdpa", "float32", "cpu")
    props = registered_properties()
    assert all(c.fully_masked_rows().any() for c in props["fully_masked_rows"].directed(t))
    assert not any(c.fully_masked_rows().any() for c in props["gradient_agreement"].directed(t))
    assert all(c.S >= 2 for c in props["masked_keys_ignored"].directed(t))
    assert all(c.K < c.N for c in props["gqa_equivalence"].directed(t))
    assert all(c.causal == "upper_left" and c.mask_kind == "none"
               for c in props["causal_flag_equivalence"].directed(t))
    assert all(c.layout != "contiguous" for c in props["layout_independence"].directed(t))
    assert {c.layout for c in props["layout_independence"].directed(t)} >= {"transposed", "stride0", "poisoned"}
    mha = Target(registry.resolve("torch-mha"), "mha", "float32", "cpu")
    assert all(c.fully_masked_rows() for c in props["mha_fully_masked_rows"].directed(mha))
    assert all(c.is_causal for c in props["mha_causal_flag_equivalence"].directed(mha))


def test_forward_agreement_starts_with_the_smallest_case_of_each_bug_class():
    t = Target(registry.resolve("spec"), "sdpa", "float32", "cpu")
    cases = registered_properties()["forward_agreement"].directed(t)
    shapes = {(c.L, c.S, c.N, c.K, c.E, c.Ev, c.causal, c.mask_kind, c.scale, c.regime) for c in cases}
    assert (1, 2, 1, 1, 4, 4, "upper_left", "none", None, "normal") in shapes   # causal, L = 1 < S
    assert any(c.L > c.S and c.causal for c in cases)                          # causal, L > S
    assert any((c.N, c.K) == (4, 2) for c in cases)                            # GQA
    assert any(c.fully_masked_rows().any() and c.mask_kind == "bool" for c in cases)
    assert {17, 33} <= {c.S for c in cases}                                    # a key block + 1
    assert any(c.E != c.Ev for c in cases)
    assert {0.0, -0.5} <= {c.scale for c in cases}
    assert any(c.regime == "wide_range" and (c.L, c.S, c.E) == (4, 12, 2) for c in cases)
    assert {c.regime for c in cases} == set(directed.REGIMES)
    # Built once per dtype from fixed seeds: the same cases every run.
    again = registered_properties()["forward_agreement"].directed(t)
    assert all(np.array_equal(a.query, b.query) for a, b in zip(cases, again, strict=True))


def test_lower_right_flag_alone_empties_rows_without_a_mask():
    impl = next(i for i in IMPLS if i.name == "lower-right")
    t = Target(impl, "sdpa", "float32", "cpu")
    props = registered_properties()
    for pid in ("causal_flag_equivalence", "fully_masked_rows"):
        cases = props[pid].directed(t)
        assert any(c.causal == "lower_right" and c.L > c.S and c.mask_kind == "none"
                   and c.fully_masked_rows().any() for c in cases), pid
    assert not any(c.causal == "upper_left" for c in props["forward_agreement"].directed(t))


def test_without_cross_attention_every_mha_case_is_self_attention():
    impl = Implementation(name="self-only", sdpa=_unused, capabilities=Capabilities(
        mha_features=frozenset({"attn_mask", "key_padding_mask", "need_weights", "is_causal"})))
    t = Target(impl, "mha", "float64", "cpu")
    cases = registered_properties()["mha_agreement"].directed(t)
    assert cases and all(c.key is c.query and c.value is c.query for c in cases)


def test_a_failing_directed_case_is_reported_as_it_is(tmp_path):
    # ignores_scale drops an explicit scale: the directed "scale = 0" case (L = 1, S = 2)
    # fails before any drawn one and, in a run that stops at its first failure (-x), is
    # saved unshrunk, with the bug class in its notes (without -x the search goes on and
    # reports a smaller case if it finds one: tests/runner/test_directed_first.py).
    env = dict(os.environ, ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "failures"))
    proc = pytest_process.run(
        [sys.executable, "-m", "pytest", "conformance", "-p", "no:cacheprovider", "-q",
         "--hypothesis-profile=ci", "--impl=tests/runner/impls_for_tests.py:ignores_scale",
         "--dtype=float64", "-k", "forward_agreement", "-x", f"--conformance-report={tmp_path}/cert"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 1, proc.stdout[-3000:]
    [r] = [r for r in json.loads((tmp_path / "cert.json").read_text())["results"]
           if r["property"] == "forward_agreement"]
    ce = r["counterexample"]
    assert (ce["L"], ce["S"], ce["scale"]) == (1, 2, 0.0)
    case, _ = load_case(r["failure_file"])
    assert any(note.startswith("directed: scale = 0") for note in case.notes)
    assert r["examples"] <= directed.MAX_DIRECTED  # found among the directed examples


@pytest.mark.parametrize("regime", directed.REGIMES)
def test_a_regime_left_out_of_the_examples_is_filled_in(regime):
    t = Target(registry.resolve("spec"), "sdpa", "float64", "cpu")
    cases = directed.sdpa_directed(t, layouts=("contiguous",), regimes=(regime,))
    assert cases and {c.regime for c in cases} == {regime}
