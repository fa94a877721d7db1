"""One failure, one story: with two distinct failures in one property (a raise on one rank,
a value mismatch on two), the reported failure's shrunk case, the call the report shows,
the saved case and the reproducer all come from the same failure, and the other failure
is listed after it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]


def test_two_failures_are_reported_each_with_its_own_call(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    env.update(PYTHONPATH=str(ROOT), ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "failures"))
    report = tmp_path / "cert"
    proc = pytest_process.run(
        [sys.executable, "-m", "pytest", str(ROOT / "conformance" / "test_sharded.py"),
         f"--impl={ROOT}/tests/sharded/broken_sharded.py:two_stories", "--hypothesis-profile=ci",
         "--dtype=float32", "-k", "test_sharded_forward", "-q", "-p", "no:cacheprovider",
         "--conformance-report", str(report)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False)
    out = proc.stdout + proc.stderr
    assert report.with_suffix(".json").exists(), out[-3000:]
    cert = json.loads(report.with_suffix(".json").read_text())
    [result] = [r for r in cert["results"]
                if r["property"] == "sharded_forward"]
    assert result["outcome"] == "failed", result
    assert "distinct failures" in result["message"] and "other failure 1" in result["message"], result["message"]
    shrunk = result["counterexample"]
    called = (result.get("called") or {}).get("case", shrunk)
    assert called["world_size"] == shrunk["world_size"], (shrunk, called)   # the same failure's call
    raised = "refuses to run on one rank" in result["message"].split("other failure 1")[0]
    assert raised == (shrunk["world_size"] == 1), result["message"][:600]
    with np.load(result["failure_file"], allow_pickle=False) as saved:
        meta = json.loads(str(saved["meta"])) if "meta" in saved.files else None
    if meta is not None:
        assert meta.get("world_size", shrunk["world_size"]) == shrunk["world_size"], meta
