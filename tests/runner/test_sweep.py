"""small_sizes_sweep: bugs that live at one size are found in every dtype, as the
smallest failing (L, S), saved and replayable; a correct implementation passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conformance.harness.sweep import Sweep, sweep_property
from conformance.test_sdpa_sweep import EDGE_LENGTHS, SIZES, length_order, size_order
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]
IMPLS = "tests/runner/impls_for_tests.py"
DTYPES = ("float64", "float32", "float16", "bfloat16")


def sweep(impl: str, tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "failures"))
    proc = pytest_process.run(
        [sys.executable, "-m", "pytest", "conformance", "-p", "no:cacheprovider", "-q",
         "--hypothesis-profile=ci", f"--impl={IMPLS}:{impl}", "-k", "small_sizes_sweep",
         f"--conformance-report={tmp_path}/cert", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=env,
    )
    results = json.loads((tmp_path / "cert.json").read_text())["results"]
    return proc, {r["dtype"]: r for r in results if r["property"] == "small_sizes_sweep"}


def test_sizes_come_block_edges_first_and_all_of_them():
    order = size_order(33)
    assert len(order) == len(set(order)) == 33 * 33
    edges = len([n for n in EDGE_LENGTHS if n <= 33])
    assert set(order[: edges**2]) == {(L, S) for L in EDGE_LENGTHS for S in EDGE_LENGTHS}
    assert length_order(33)[:edges] == list(EDGE_LENGTHS)
    assert order[0] == (1, 1)


@pytest.mark.parametrize("impl, size", [("nan_at_one_size_impl", (3, 4)),
                                        ("scaled_at_one_size_impl", (7, 13))])
def test_a_bug_at_one_size_is_found_in_every_dtype(impl, size, tmp_path):
    proc, results = sweep(impl, tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:]
    for dtype in DTYPES:
        r = results[dtype]
        assert r["outcome"] == "failed", (dtype, r)
        assert (r["counterexample"]["L"], r["counterexample"]["S"]) == size, (dtype, r["counterexample"])
        assert Path(r["failure_file"]).exists()
    assert f"smallest failing size of the sweep: L={size[0]}, S={size[1]}" in proc.stdout
    # The saved case replays: failing for the buggy implementation.
    again, _ = sweep(impl, tmp_path, f"--replay={results['bfloat16']['failure_file']}")
    assert again.returncode == 1 and "1 failed" in again.stdout


def test_the_correct_computation_passes_every_size(tmp_path):
    proc, results = sweep("math_impl", tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    for dtype in DTYPES:
        r = results[dtype]
        assert r["outcome"] == "passed" and 0 <= r["worst_ratio"] < 1, (dtype, r)
        # A count, not what fits in a time: the ci profile's sizes on any machine.
        assert r["examples"] == SIZES["ci"] and f"visited {SIZES['ci']} of 1089 sizes" in r["reason"]
        assert f"the ci profile's first {SIZES['ci']}" in r["reason"]


def test_an_isolated_implementation_is_swept_in_its_worker(tmp_path):
    """--isolate=always: only the worker process may call the implementation, so each
    size's cases are checked there; the correct one passes, the bug's size is found
    and its saved case replays (in a worker too)."""
    proc, results = sweep("math_impl", tmp_path, "--isolate=always", "--dtype=float64")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert results["float64"]["outcome"] == "passed" and results["float64"]["examples"] == SIZES["ci"]
    proc, results = sweep("scaled_at_one_size_impl", tmp_path, "--isolate=always", "--dtype=float32")
    assert proc.returncode == 1, proc.stdout[-3000:]
    r = results["float32"]
    assert (r["counterexample"]["L"], r["counterexample"]["S"]) == (7, 13), r["counterexample"]
    assert "smallest failing size of the sweep: L=7, S=13" in proc.stdout
    again, _ = sweep("scaled_at_one_size_impl", tmp_path, "--isolate=always", f"--replay={r['failure_file']}")
    assert again.returncode == 1 and "1 failed" in again.stdout, again.stdout[-3000:]


def test_the_profiles_counts_cover_the_block_edges_and_grow():
    edges = len(EDGE_LENGTHS) ** 2
    assert edges <= SIZES["ci"] <= SIZES["dev"] and SIZES["thorough"] is None
    order = size_order(33)
    assert set(order[:edges]) <= set(order[:SIZES["ci"]])


def test_a_sweep_visits_its_profiles_count_and_says_when_the_safety_limit_stopped_it():
    from conformance.core.registry import Record

    record = Record("small_sizes_sweep", "sdpa", "float32", "cpu")
    target = SimpleNamespace(impl=SimpleNamespace(expected_failures=()))
    sweep = Sweep("small_sizes_sweep", target, record, 5, profile="ci", safety_s=0.0)
    assert sweep.budget(list(range(10))) == [0, 1, 2, 3, 4]
    assert sweep.out_of_time()  # a 0 s safety limit has passed
    record.examples = 3
    said = sweep.describe(10)
    assert said.startswith("visited 3 of 10 sizes (the ci profile's first 5, block edges first)")
    assert "stopped by the 0 s safety limit (a hang guard, not a budget" in said


def test_sweep_sizes_are_checked():
    with pytest.raises(ValueError, match="sizes must name the dev profile"):
        sweep_property("x", level="sdpa", section="", check=lambda t, c: None, sizes={"ci": 5})
    with pytest.raises(ValueError, match="count >= 1"):
        sweep_property("x", level="sdpa", section="", check=lambda t, c: None, sizes={"dev": 0})


def test_the_long_sweep_visits_kernel_block_edges_inside_the_declarations():
    from conformance.test_sdpa_sweep import LONG_LENGTHS, LONG_SIZES, _long_lengths, _long_lengths_skip, square_order

    def target(**caps):
        return SimpleNamespace(caps=SimpleNamespace(**{"max_seq_len": None, "seq_multiple": None, "seq_block": None,
                                                      **caps}))

    order = square_order(list(LONG_LENGTHS))
    assert len(order) == len(set(order)) == len(LONG_LENGTHS) ** 2
    # ci's 16 sizes: every pair of 1, 129, 257, 128 (past and at a block of 128 and 256)
    assert set(order[:LONG_SIZES["ci"]]) == {(L, S) for L in (1, 129, 257, 128) for S in (1, 129, 257, 128)}
    assert _long_lengths(target()) == list(LONG_LENGTHS)
    assert _long_lengths(target(max_seq_len=200)) == [1, 129, 128, 127, 65, 64]
    assert _long_lengths(target(seq_multiple=64)) == [128, 256, 64]
    assert _long_lengths(target(seq_block=128)) == [1, 128, 256, 127, 65, 64]  # up to 128, or its multiples
    assert _long_lengths_skip(target()) is None
    assert "max_seq_len=32" in _long_lengths_skip(target(max_seq_len=32, seq_multiple=64))


def test_a_bug_past_the_first_block_of_128_is_found_by_the_long_sweep(tmp_path):
    env = dict(os.environ, ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "failures"))
    proc = pytest_process.run(
        [sys.executable, "-m", "pytest", "conformance", "-p", "no:cacheprovider", "-q",
         "--hypothesis-profile=ci", "--impl=mutant:query_block128_causal_offset", "--dtype=float64",
         "-k", "sizes_sweep", f"--conformance-report={tmp_path}/cert"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=env,
    )
    results = {r["property"]: r for r in json.loads((tmp_path / "cert.json").read_text())["results"]}
    assert results["small_sizes_sweep"]["outcome"] == "passed", results["small_sizes_sweep"]
    assert results["long_sizes_sweep"]["outcome"] == "failed", proc.stdout[-3000:]
    assert (results["long_sizes_sweep"]["counterexample"]["L"], results["long_sizes_sweep"]["counterexample"]["S"]) == (129, 128)
