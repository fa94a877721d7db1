"""The diagnosis groups the many failures of one precision bug into one cause.

The test runs the runner as a subprocess under the ``ci`` profile with
``--conformance-report PATH`` in its own folder (parallel-safe: ``-n 2``) and reads
``PATH.json``: ~10 s. That the diagnosis names the bug of every bug-zoo mutant a variant
models is asked of the zoo's own runs, in ``tests/test_mutants.py`` (one run per chunk of
mutants kills them and reads their causes), as is the correct built-ins' certificates
having no causes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
IMPLS = ROOT / "tests" / "diagnosis" / "impls_for_diagnosis.py"
TIMEOUT_S = 1800


def certify(impl: str, workdir: Path, *args: str) -> tuple[dict, str]:
    """Run the suite's SDPA and MHA levels on ``impl`` in ``workdir``; (JSON report, the
    whole output)."""
    report = workdir / "report"
    ignored = ["--ignore", str(ROOT / "conformance" / "test_flash.py"),
               "--ignore", str(ROOT / "conformance" / "test_varlen.py")]
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "conformance"), f"--impl={impl}",
           "--hypothesis-profile=ci", "-q", "-p", "no:cacheprovider", "--conformance-report", str(report),
           "--impl-option", "derived_flash=false", *ignored, *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    env["ATTENTION_CONFORMANCE_FAILURES"] = str(workdir / "failures")
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    output = proc.stdout + proc.stderr
    json_path = report.with_suffix(".json")
    if not json_path.exists():
        pytest.fail(f"no report {json_path} written (exit code {proc.returncode}):\n{output[-4000:]}")
    return json.loads(json_path.read_text()), output


def test_a_float32_softmax_is_one_cause_covering_every_property_it_fails(tmp_path):
    report, output = certify(f"{IMPLS}:softmax_float32_impl", tmp_path, "--dtype", "float64")
    failed = sorted(r["property"] for r in report["results"] if r["outcome"] == "failed")
    assert len(failed) >= 3, output[-4000:]  # several properties see float32 rounding
    assert [g["variant"] for g in report["causes"]] == ["softmax_float32"], report["causes"]
    group = report["causes"][0]
    assert group["count"] == len(failed) and group["properties"] == failed
    assert group["dtypes"] == ["float64"] and group["devices"] == ["cpu"]
    low, high = group["relative_error"]
    assert 1e-10 < low <= high < 1e-5                          # float32 rounding, not a wrong convention
    assert "softmax_float32: " in output and "(float64 only; relative error" in output
