"""The compile budget (``conformance.strategies.compile_budget``, ``--compile-budget``):
an implementation declared ``jit`` sees a bounded number of configurations per property
(counted by an implementation that records its calls), the certificate says so, a
non-jit implementation's draws are those of a run without a budget, and wrong
jit-declared implementations are still caught with the budget on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import hypothesis
import pytest
from hypothesis import HealthCheck, given, settings

from conformance.core.target import Target
from conformance.directed.helpers import cases_for
from implementations.base import Capabilities, Implementation
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[1].parent
IMPLS = "tests/runner/jit_impls_for_tests.py"


def run(tmp_path: Path, name: str, *args: str, configs: Path | None = None) -> tuple[dict, str]:
    env = dict(os.environ, ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "failures"),
               ATTENTION_CONFORMANCE_STATE=str(tmp_path / "state"))
    env = {k: v for k, v in env.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    if configs is not None:
        env["CONFORMANCE_TEST_CONFIGS"] = str(configs)
    proc = pytest_process.run(
        [sys.executable, "-m", "pytest", "conformance", "-p", "no:cacheprovider", "-q",
         "--hypothesis-profile=ci", f"--conformance-report={tmp_path}/{name}", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env, check=False,
    )
    output = proc.stdout + proc.stderr
    report = tmp_path / f"{name}.json"
    assert report.exists(), output[-3000:]
    return json.loads(report.read_text()), output


def _configs(path: Path) -> set[str]:
    return set(path.read_text().splitlines()) if path.exists() else set()


def test_a_jit_implementation_sees_a_bounded_number_of_configurations(tmp_path):
    """forward_agreement: its directed examples, then its random search. With a budget of
    3 the search adds at most 3 configurations to the directed ones; without one, many."""
    selection = ("--dtype", "float32", "-k", "forward_agreement")
    budgeted, unbudgeted = tmp_path / "budget.configs", tmp_path / "none.configs"
    report, output = run(tmp_path, "budget", f"--impl={IMPLS}:recording_jit_impl", *selection,
                         "--compile-budget=3", configs=budgeted)
    rows = [r for r in report["results"] if r["outcome"] != "skipped"]
    assert [r["outcome"] for r in rows] == ["passed"], output[-3000:]
    assert report["implementation"]["compile_budget"] == 3
    assert "compile budget: 3 configurations per property" in output
    run(tmp_path, "none", f"--impl={IMPLS}:recording_jit_impl", *selection, "--compile-budget=0",
        configs=unbudgeted)
    from conformance.directed import examples
    from implementations.registry import resolve

    impl = resolve(f"{IMPLS}:recording_jit_impl")
    target = Target(impl, "sdpa", "float32", "cpu", shape_budget=3)
    directed = {json.dumps(_key(case)) for case in examples.sdpa_directed(target, layouts=("contiguous",))}
    searched = _configs(budgeted) - directed
    free = _configs(unbudgeted) - directed
    assert len(searched) <= 3, sorted(searched)
    assert len(free) > len(searched) + 5  # without a budget the search draws a new one nearly every time


def _key(case) -> list:
    mask = {"none": None, "bool": "bool", "additive": "additive"}[case.mask_kind]
    return [[case.B, case.N, case.L, case.E], [case.B, case.K, case.S, case.E], [case.B, case.K, case.S, case.Ev],
            mask, case.causal is not None, case.scale]


def _configurations(strategy) -> set[tuple]:
    seen: set[tuple] = set()

    @settings(max_examples=120, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case):
        seen.add((case.layout, tuple(case.sizes().values()), case.causal, case.mask_kind, case.scale))

    collect()
    return seen


def test_every_sdpa_property_strategy_keeps_to_the_budget():
    """Every registered SDPA property's random strategy, drawn many times for a jit
    target, yields at most ``budget`` (layout, shape, causal, mask kind, scale)."""
    from conformance.core.registry import registered_properties

    impl = Implementation(name="x", capabilities=Capabilities(dtypes=("float32",), jit=True, dropout=True),
                          sdpa=lambda *a, **k: None)
    target = Target(impl, "sdpa", "float32", "cpu", shape_budget=8)
    checked = 0
    for name, info in registered_properties().items():
        if info.level != "sdpa" or info.sweep is not None or info.cases is None:
            continue
        seen = _configurations(info.cases(target))
        assert 1 <= len(seen) <= 8, (name, len(seen))
        checked += 1
    assert checked >= 15


def test_the_sweep_visits_fewer_sizes_under_a_budget():
    from types import SimpleNamespace

    from conformance.harness.sweep import Sweep

    record = SimpleNamespace(examples=16)
    sweep = Sweep("small_sizes_sweep", SimpleNamespace(shape_budget=8, impl=SimpleNamespace(expected_failures=())),
                  record, 361)
    assert len(sweep.budget(list(range(1089)))) == 16
    assert "the compile budget's first 16" in sweep.describe(1089, "sizes")
    plain = Sweep("small_sizes_sweep", SimpleNamespace(shape_budget=None, impl=SimpleNamespace(expected_failures=())),
                  record, 361)
    assert len(plain.budget(list(range(1089)))) == 361


#: Digests of the first 40 derandomized draws of three strategies without a budget,
#: recorded before the compile budget existed (hypothesis 6.155.2, in a fresh process:
#: inside a test session the derandomized draws depend on what ran before): a non-jit
#: run draws exactly what it drew then.
_UNBUDGETED = "a9650d96b990475d 337124c25aa26eaa c425d065b551df3c"
_DIGESTS = """
import hashlib
from hypothesis import HealthCheck, given, settings
from conformance.strategies import sdpa_cases
from implementations.base import Capabilities

def digest(strategy, n=40):
    h = hashlib.sha256()
    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case):
        h.update(repr((case.describe(), case.query.tobytes(), case.scale, case.causal, case.layout, case.mask_kind,
                       None if case.attend_mask is None else case.attend_mask.tobytes(),
                       None if case.additive_mask is None else case.additive_mask.tobytes())).encode())
    collect()
    return h.hexdigest()[:16]

print(digest(sdpa_cases(dtype="float32", layouts=None)),
      digest(sdpa_cases(dtype="float32", caps=Capabilities(causal="lower_right"), fully_masked=True, causal_dead_rows=True)),
      digest(sdpa_cases(dtype="float64", length_relations=("L=S", "L>S"))))
"""


@pytest.mark.skipif(hypothesis.__version__ != "6.155.2",
                    reason="the pinned draws were recorded with hypothesis 6.155.2")
def test_a_non_jit_implementations_draws_are_unchanged(tmp_path):
    script = tmp_path / "digests.py"
    script.write_text(_DIGESTS)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env=env, check=True).stdout
    assert out.split() == _UNBUDGETED.split()


def test_a_non_jit_target_gets_no_budget():
    impl = Implementation(name="x", capabilities=Capabilities(), sdpa=lambda *a, **k: None)
    strategy = cases_for(Target(impl, "sdpa", "float32", "cpu"))
    assert strategy.config_pool is None


@pytest.mark.parametrize("impl,caught_by", [("negative_scale_jit_impl", {"forward_agreement", "temperature"}),
                                            ("bias_ignored_jit_impl", {"forward_agreement",
                                                                        "bool_additive_equivalence"})])
def test_a_wrong_jit_implementation_is_caught_with_the_budget_on(tmp_path, impl, caught_by):
    report, output = run(tmp_path, "cert", f"--impl={IMPLS}:{impl}", "--dtype", "float32",
                         "-k", " or ".join(sorted(caught_by)))
    assert report["implementation"]["compile_budget"] == 8
    failed = {r["property"] for r in report["results"] if r["outcome"] == "failed"}
    assert failed & caught_by, output[-3000:]

