"""The diagnosis names the bug of every bug-zoo mutant that a variant models, and groups
the many failures of one precision bug into one cause.

Each test runs the runner as a subprocess under the ``ci`` profile with
``--conformance-report PATH`` in its own folder (parallel-safe: ``-n 2``) and reads
``PATH.json``. Slow: ~15 s per mutant (the Triton ones ~2 minutes, under the interpreter),
~70 s for the float32-softmax run. The correct built-ins' certificates having no causes
is checked where they already run, in ``tests/test_mutants.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from implementations.mutants import MUTANTS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
IMPLS = ROOT / "tests" / "diagnosis" / "impls_for_diagnosis.py"
WITH_CAUSE = sorted(name for name, m in MUTANTS.items() if m.expected_cause)
TIMEOUT_S = 1800


def certify(impl: str, workdir: Path, *args: str) -> tuple[dict, str]:
    """Run the suite on ``impl`` in ``workdir``; (JSON report, the whole output)."""
    report = workdir / "report"
    # spec.variants models SDPA and MHA conventions; a flash level (derived from an SDPA
    # mutant, or the Triton kernel's own), collected first, would fail first with no
    # variant to name: the flash, varlen and kvcache levels are left out.
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "conformance"), f"--impl={impl}",
           "--hypothesis-profile=ci", "-q", "-p", "no:cacheprovider", "--conformance-report", str(report),
           "--impl-option", "derived_flash=false",
           "--ignore", str(ROOT / "conformance" / "test_flash.py"),
           "--ignore", str(ROOT / "conformance" / "test_varlen.py"), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    env["ATTENTION_CONFORMANCE_FAILURES"] = str(workdir / "failures")
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    output = proc.stdout + proc.stderr
    json_path = report.with_suffix(".json")
    if not json_path.exists():
        pytest.fail(f"no report {json_path} written (exit code {proc.returncode}):\n{output[-4000:]}")
    return json.loads(json_path.read_text()), output


@pytest.mark.parametrize("name", WITH_CAUSE)
def test_the_diagnosis_names_the_mutants_bug_first(name, tmp_path):
    mutant = MUTANTS[name]
    if name.startswith("triton_"):
        from implementations.builtins.triton_attention import make_implementation

        reason = make_implementation().unavailable_reason
        if reason:
            pytest.skip(f"triton unavailable: {reason}")
    report, output = certify(f"mutant:{name}", tmp_path, "-x")
    failed = [r for r in report["results"] if r["outcome"] == "failed"]
    assert failed, f"mutant {name} survived:\n{output[-4000:]}"
    named = [c["variant"] for c in failed[0]["causes"]]
    assert named and named[0] == mutant.expected_cause, (
        f"{name} ({mutant.bug}) failed {failed[0]['property']}[{failed[0]['dtype']}]; the diagnosis named "
        f"{named or 'nothing'}, expected {mutant.expected_cause} first\n{output[-4000:]}")
    assert report["causes"][0]["variant"] == mutant.expected_cause
    assert f"probable cause: {mutant.expected_cause} — " in output


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
