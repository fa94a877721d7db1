"""``benchmarks/derived_profiles.py``: ``PROFILE-maxN`` is PROFILE with at most N random
examples per test (what ``certify_speed.py --max-examples`` and ``mutation_score.py
--profile ci-max5`` time and score)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from derived_profiles import MODULE, derived_profile, plugin_args  # noqa: E402
from tests import pytest_process


def test_only_derived_names_get_a_plugin(tmp_path):
    assert plugin_args(tmp_path, "ci") == []
    assert plugin_args(tmp_path, "ci-max0") == []  # no profile with zero examples
    assert not (tmp_path / f"{MODULE}.py").exists()
    assert plugin_args(tmp_path, "ci-max3") == ["-p", MODULE]
    assert (tmp_path / f"{MODULE}.py").exists()
    assert derived_profile("ci", 5) == "ci-max5"
    with pytest.raises(ValueError, match="at least 1"):
        derived_profile("ci", 0)


def _examples(tmp_path: Path, profile: str) -> int:
    workdir = tmp_path / profile
    workdir.mkdir()
    report = workdir / "report"
    proc = pytest_process.run(
        [sys.executable, "-m", "pytest", str(ROOT / "conformance"), f"--rootdir={ROOT}", "--impl=spec",
         "-k", "test_temperature and float64", f"--hypothesis-profile={profile}", "-q",
         "-p", "no:cacheprovider", "--conformance-report", str(report), *plugin_args(workdir, profile)],
        cwd=workdir, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    certificate = json.loads(report.with_suffix(".json").read_text())
    assert certificate["profile"] == profile
    (row,) = [r for r in certificate["results"] if r["property"] == "temperature"]
    return row["examples"]


def test_a_derived_profile_cuts_the_random_examples_only(tmp_path):
    full, cut = _examples(tmp_path, "ci"), _examples(tmp_path, "ci-max1")
    # ci draws up to 20 random examples on top of the directed ones; ci-max1 one.
    assert cut < full
    assert full - cut >= 10, (full, cut)
