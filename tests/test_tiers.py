"""The project's test tiers (docs/SPEED.md#the-tiers), and the quick tier's certificate.

- quick: ``pytest -m "not slow"``: the oracle, strategies, runner, diagnosis and registry
  tests, and (below) a ``ci`` certificate of one built-in, the README's main job.
- the test command: ``pytest -n 2``: everything but the release tier.
- release: ``pytest -n 2 --release-tier``: adds the certificates marked ``release``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[1]


def _collected(*args: str) -> list[str]:
    proc = pytest_process.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_the_release_tier_is_left_out_unless_asked():
    plain = _collected("tests/test_mutants.py", "-k", "correct_implementation_passes and jax")
    release = _collected("tests/test_mutants.py", "-k", "correct_implementation_passes and jax", "--release-tier")
    assert [i for i in plain if i.endswith("[jax-float32]")] and not [i for i in plain if "float16" in i]
    assert set(plain) < set(release) and [i for i in release if i.endswith("[jax-float16]")]


def test_the_quick_tier_leaves_out_the_slow_tests():
    quick = _collected("tests/test_mutants.py", "tests/runner/test_option_spelling.py", "tests/runner/test_hostile.py",
                       "-m", "not slow")
    assert quick and not [i for i in quick if i.startswith("tests/test_mutants.py")]
    # Marked where measured (tests/quick_tier.py), not in its file: left out all the same.
    assert not [i for i in quick if "test_hang_costs_one_timeout_per_property" in i]
    assert [i for i in quick if i.startswith("tests/runner/test_hostile.py")]  # its quick tests stay


def test_the_quick_tier_certifies_a_builtin_under_ci(tmp_path):
    """The README's main job, on the reference built-in in float32: every property passes."""
    report = tmp_path / "report"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    env["ATTENTION_CONFORMANCE_FAILURES"] = str(tmp_path / "failures")
    proc = pytest_process.run(
        [sys.executable, "-m", "pytest", str(ROOT / "conformance"), "--impl=handwritten", "--dtype=float32",
         "--hypothesis-profile=ci", "-q", "-p", "no:cacheprovider", "--conformance-report", str(report)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    results = json.loads(report.with_suffix(".json").read_text())["results"]
    outcomes = {r["outcome"] for r in results}
    assert "passed" in outcomes and not outcomes & {"failed", "error", "stale-xfail"}, outcomes
