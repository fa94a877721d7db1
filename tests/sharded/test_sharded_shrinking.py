"""Shrinking works across the group: a failing sharded case shrinks to the smallest world
size and sequence that still show the bug (world size 1 where one rank shows it, two ranks
of one position each where it takes a boundary), read from real certificates."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]

#: Each mutant's smallest failing case (world_size, layout, L, window), as its record says.
SMALLEST = {
    "sharded_last_step_skipped": (1, "contiguous", 1, (-1, -1)),     # one rank attends no block at all
    "sharded_window_local": (2, "contiguous", 2, (0, 0)),            # rank 1's window placed at 0
}


def test_a_failing_sharded_case_shrinks_to_a_small_world_and_sequence(tmp_path):
    report = tmp_path / "report"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    env.update(PYTHONPATH=str(ROOT), ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "failures"))
    proc = pytest_process.run(
        [sys.executable, "-m", "pytest", str(ROOT / "conformance"),
         "--impl=" + ",".join(f"mutant:{name}" for name in SMALLEST), "--hypothesis-profile=ci",
         "--dtype=float64", "-k", "test_sharded_forward", "-q", "-p", "no:cacheprovider",
         "--conformance-report", str(report)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert report.with_suffix(".json").exists(), out[-3000:]
    certificates = json.loads(report.with_suffix(".json").read_text())["certificates"]
    for cert in certificates:
        name = cert["implementation"]["spec"].removeprefix("mutant:")
        [result] = [r for r in cert["results"] if r["property"] == "sharded_forward"]
        assert result["outcome"] == "failed", (name, result)
        shrunk = result["counterexample"]
        got = (shrunk["world_size"], shrunk["sharding"], shrunk["L"], (shrunk["window_left"], shrunk["window_right"]))
        assert got == SMALLEST[name], (name, shrunk)
        assert (shrunk["B"], shrunk["N"]) == (1, 1), (name, shrunk)
