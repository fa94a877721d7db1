"""What a run of the suite loads before its first example, and in which order it
certifies the properties (issue: bugs caught per second).

Each start-up test runs pytest in a fresh interpreter (what is imported, and how, is
per process) and prints what it finds there.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.harness import ordering
from conformance.plugin import LEVEL_ORDER

ROOT = Path(__file__).resolve().parents[2]
pytest_plugins = ["pytester"]

_PROBE = """\
import gc, json, sys
import pytest
code = pytest.main([{conformance!r}, "--impl=spec", "--co", "-q", "-p", "no:cacheprovider"])
def loader(name):
    return type(getattr(sys.modules.get(name), "__loader__", None)).__name__
own = {{name: loader(name) for name in ("spec", "implementations.guard", "conformance.harness.runner",
                                       "conformance.test_sdpa_agreement")}}
print("PROBE " + json.dumps({{"code": int(code), "hypothesis_loader": loader("hypothesis"), "own_loaders": own,
                              "ml_dtypes": "ml_dtypes" in sys.modules, "frozen": gc.get_freeze_count()}}))
"""


@pytest.fixture(scope="module")
def probe() -> dict:
    """What one ``pytest conformance --impl=spec --co`` in a fresh interpreter left behind
    (a run of its own, as from a shell: without the outer pytest's settings)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    # From the checkout's root, as a user of a checkout runs it: pytest marks more for
    # rewriting there (the project's own packages, found from the working directory).
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(conformance=str(ROOT / "conformance"))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, f"no probe line (exit code {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}"
    found = json.loads(lines[-1][len("PROBE "):])
    assert found["code"] == 0, found
    return found


def _kill_matrix():
    """``benchmarks/kill_matrix.py`` as a module."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import kill_matrix
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return kill_matrix


def _entry_point_installed() -> bool:
    return any(ep.name == "attention_conformance" for ep in importlib.metadata.entry_points(group="pytest11"))


@pytest.mark.skipif(not _entry_point_installed(), reason="the package is not installed: its pytest11 "
                    "entry point (conformance/activation.py) is what switches the rewriting off")
def test_hypothesis_is_imported_without_assertion_rewriting(probe):
    # pytest would compile each of Hypothesis' modules from source in every run that
    # cannot cache rewritten bytecode; the suite takes them off the rewrite list.
    assert probe["hypothesis_loader"] == "SourceFileLoader", probe


@pytest.mark.skipif(not _entry_point_installed(), reason="the package is not installed: its pytest11 "
                    "entry point (conformance/activation.py) is what switches the rewriting off")
def test_the_projects_own_modules_are_imported_without_assertion_rewriting(probe):
    # pytest marks every module of a distribution with a pytest11 entry point for
    # rewriting, which compiles each from source where no bytecode can be cached
    # (ignoring what pip compiled); the suite's collected test modules stay rewritten.
    loaders = probe["own_loaders"]
    assert {loaders[n] for n in ("spec", "implementations.guard", "conformance.harness.runner")} == {"SourceFileLoader"}, loaders
    assert loaders["conformance.test_sdpa_agreement"] == "AssertionRewritingHook", loaders


def test_collection_does_not_import_ml_dtypes(probe):
    # ml_dtypes costs a second of start-up on two cores; the strategies and the bfloat16
    # rounding of the spec do without it.
    assert probe["ml_dtypes"] is False, probe


def test_heap_is_frozen_before_pytests_final_collections(probe):
    # pytest ends with five full garbage collections; the suite freezes the heap first, so
    # that they do not walk every object torch, NumPy and Hypothesis allocated.
    assert probe["frozen"] > 10_000, probe


def test_heap_is_not_frozen_by_a_run_nested_in_a_test(monkeypatch):
    import gc

    from conformance import plugin

    was = plugin._FROZEN
    before = gc.get_freeze_count()
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "outer")
    plugin._freeze_heap()
    assert gc.get_freeze_count() == before and plugin._FROZEN == was
    # this test runs inside pytest's own session: one wrap_session frame; a nested run adds one
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    assert not plugin._nested_pytest_run()


def test_in_process_run_in_a_test_leaves_the_heap_unfrozen(pytester):
    from hypothesis import settings

    settings.register_profile("_outer_startup", parent=settings.default)
    try:
        _run_nested(pytester)
    finally:
        settings.load_profile("_outer_startup")


def _run_nested(pytester) -> None:
    import gc

    from conformance import plugin

    was, before = plugin._FROZEN, gc.get_freeze_count()
    result = pytester.runpytest_inprocess(str(ROOT / "conformance"), f"--rootdir={ROOT}", "-p", "no:cacheprovider",
                                          "--impl=spec", "--dtype=float64", "--hypothesis-profile=ci",
                                          "-k", "forward_agreement and sdpa")
    assert result.ret == 0, result.stdout.str()[-2000:]
    assert gc.get_freeze_count() == before and plugin._FROZEN == was


def test_property_order_file_lists_each_levels_properties_once():
    # A property it does not list yet runs after the listed ones of its level
    # (test_unlisted_property_goes_after_the_listed_ones): adding one needs no kill-matrix run.
    from conformance.core.registry import registered_properties

    data = json.loads(ordering.ORDER_FILE.read_text())
    known = {(p.level, p.id) for p in registered_properties().values()}
    assert set(data["levels"]) <= set(LEVEL_ORDER)
    for level, props in data["levels"].items():
        assert len(props) == len(set(props)), f"{level}: a property listed twice"
        unknown = [p for p in props if (level, p) not in known]
        assert not unknown, f"{level}: {unknown} are not properties of that level"


def test_unlisted_property_goes_after_the_listed_ones(monkeypatch, tmp_path):
    order = tmp_path / "order.json"
    order.write_text(json.dumps({"levels": {"sdpa": ["b", "a"]}}))
    monkeypatch.setattr(ordering, "ORDER_FILE", order)
    ordering._ranks.cache_clear()
    try:
        assert [ordering.property_rank("sdpa", p) for p in ("b", "a", "new")] == [0, 1, 2]
        assert ordering.property_rank("mha", "x") == 0
    finally:
        ordering._ranks.cache_clear()


def test_unreadable_order_file_keeps_collection_order(monkeypatch, tmp_path):
    broken = tmp_path / "order.json"
    broken.write_text("{not json")
    monkeypatch.setattr(ordering, "ORDER_FILE", broken)
    ordering._ranks.cache_clear()
    try:
        assert ordering.property_rank("sdpa", "forward_agreement") == 0
    finally:
        ordering._ranks.cache_clear()


def test_property_order_is_the_one_its_kill_matrix_gives():
    # The order is data measured by benchmarks/kill_matrix.py; its raw kill matrix and costs
    # are kept next to the other results, so the order can be derived again from them.
    kill_matrix = _kill_matrix()
    data = json.loads(ordering.ORDER_FILE.read_text())
    raw = sorted((ROOT / "benchmarks" / "results").glob("kill-matrix-*.json"))[-1]
    kills, costs, properties, _ = kill_matrix.load_raw(raw)
    assert kill_matrix.greedy_order(kills, costs, properties, kill_matrix.FIRST) == data["levels"], (
        f"{ordering.ORDER_FILE.name} is not the order {raw.name} gives: "
        "python benchmarks/kill_matrix.py --from that file --write")
    for level, order in data["levels"].items():
        first = [prop for prop in kill_matrix.FIRST if prop in order]
        assert order[:len(first)] == first, f"{level}: the agreement properties {first} go first"


def test_greedy_order_puts_most_new_kills_per_second_first():
    kill_matrix = _kill_matrix()
    S = "sdpa"
    kills = {"m1": {(S, "slow_all")}, "m2": {(S, "slow_all"), (S, "cheap")}, "m3": {(S, "slow_all"), (S, "cheap")},
             "m4": {(S, "slow_all"), (S, "rare")}, "m5": {(S, "agree")}}
    costs = {(S, "slow_all"): 10.0, (S, "cheap"): 0.5, (S, "rare"): 1.0, (S, "none"): 0.1, (S, "agree"): 3.0}
    props = {S: {"slow_all", "cheap", "rare", "none", "agree"}}
    # cheap: 2 new / 0.5 s; rare: 1 / 1 s; agree: 1 / 3 s; slow_all: the last (m1) / 10 s;
    # none kills nothing: last
    assert kill_matrix.greedy_order(kills, costs, props)[S] == ["cheap", "rare", "agree", "slow_all", "none"]
    # a property named first goes first, and what it kills no longer counts as new:
    # m5 is left for agree; then the rest by all their kills per second (cheap 4/s, rare 1/s)
    assert kill_matrix.greedy_order(kills, costs, props, ("slow_all",))[S] == ["slow_all", "agree", "cheap", "rare", "none"]


def test_a_merged_kill_matrix_keeps_what_was_not_measured_again(tmp_path):
    kill_matrix = _kill_matrix()
    S, F = "sdpa", "flash"
    old = tmp_path / "old.json"
    kill_matrix.save_raw(old, {"scale_ignored": {(S, "forward_agreement")}, "gone_from_the_zoo": {(S, "a")},
                               "flash_lse_log2": {(F, "flash_agreement")}},
                         {(S, "forward_agreement"): 1.0, (F, "flash_agreement"): 2.0},
                         {S: {"forward_agreement"}, F: {"flash_agreement"}}, ["sdpa"])
    kills, costs, props, correct = kill_matrix.merge_raw(
        old, {"flash_lse_log2": {(F, "lse_agreement")}}, {(F, "flash_agreement"): 3.0, (F, "lse_agreement"): 0.5},
        {F: {"flash_agreement", "lse_agreement"}}, ["flash-ref"])
    assert kills == {"scale_ignored": {(S, "forward_agreement")}, "flash_lse_log2": {(F, "lse_agreement")}}
    assert costs == {(S, "forward_agreement"): 1.0, (F, "flash_agreement"): 3.0, (F, "lse_agreement"): 0.5}
    assert props == {S: {"forward_agreement"}, F: {"flash_agreement", "lse_agreement"}}
    assert correct == ["sdpa", "flash-ref"]
