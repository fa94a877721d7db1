"""The runner end to end: options, errors, certificate, failures, replay, misbehaviour."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]
IMPLS = "tests/runner/impls_for_tests.py"


def run(*args: str, tmp_path: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "failures"))
    return pytest_process.run(
        [sys.executable, "-m", "pytest", "conformance", "-p", "no:cacheprovider", "-q",
         "--hypothesis-profile=ci", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env,
    )


def report(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "cert.json").read_text())


def test_unknown_impl_is_a_usage_error_listing_the_registered_names(tmp_path):
    proc = run("--impl=no-such-impl", tmp_path=tmp_path)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    err = proc.stderr
    assert "no-such-impl" in err and "handwritten" in err and "sdpa-math" in err


def test_conformance_without_impl_is_a_usage_error(tmp_path):
    proc = run(tmp_path=tmp_path)
    assert proc.returncode == 4
    assert "--impl" in proc.stderr


def test_bad_dtype_and_impl_option_are_usage_errors(tmp_path):
    proc = run("--impl=sdpa", "--dtype=float8", tmp_path=tmp_path)
    assert proc.returncode == 4 and "float8" in proc.stderr and "float64" in proc.stderr
    proc = run("--impl=sdpa", "--impl-option", "causal", tmp_path=tmp_path)
    assert proc.returncode == 4 and "KEY=VALUE" in proc.stderr


def test_impl_list_shows_every_builtin(tmp_path):
    proc = run("--impl=list", tmp_path=tmp_path)
    assert proc.returncode == 0
    for name in ("spec", "handwritten", "sdpa", "sdpa-math", "sdpa-flash", "torch-mha", "triton"):
        assert re.search(rf"\b{re.escape(name)}\b", proc.stdout), name
    assert "mutant:" not in proc.stdout


def test_passing_run_writes_the_certificate(tmp_path):
    proc = run("--impl=spec", "-v", "--dtype=float64", "-k", "forward_agreement or output_contract or mha_agreement",
               f"--conformance-report={tmp_path}/cert", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "attention-conformance: impl=spec" in proc.stdout  # report header
    assert "attention-conformance certificate" in proc.stdout
    cert = report(tmp_path)
    outcomes = {(r["property"], r["dtype"]): r for r in cert["results"]}
    forward = outcomes[("forward_agreement", "float64")]
    assert forward["outcome"] == "passed" and forward["examples"] > 0
    assert forward["worst_ratio"] is not None and forward["worst_ratio"] <= 1
    assert cert["implementation"]["capabilities"]["fully_masked"] == "zero"
    assert (tmp_path / "cert.md").read_text().startswith("# attention-conformance certificate")


def test_failure_is_shrunk_saved_reproduced_and_replayed(tmp_path):
    proc = run(f"--impl={IMPLS}:ignores_scale", "--dtype=float64", "-k", "forward_agreement",
               f"--conformance-report={tmp_path}/cert", tmp_path=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:]
    out = proc.stdout
    assert "property forward_agreement (spec.sdpa) failed for implementation" in out
    assert "shrunk case: B=1 N=1 K=1 L=1" in out
    [result] = [r for r in report(tmp_path)["results"] if r["property"] == "forward_agreement"]
    assert result["outcome"] == "failed"
    ce = result["counterexample"]
    assert ce["B"] == ce["N"] == ce["L"] == 1 and ce["S"] <= 2 and ce["scale"] is not None
    saved = Path(result["failure_file"])
    assert saved.exists() and saved.suffix == ".npz"
    # The reproducer snippet runs in a fresh interpreter and shows the mismatch.
    repro = subprocess.run([sys.executable, "-c", result["reproducer"]], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert repro.returncode == 0, repro.stderr
    diff = float(repro.stdout.split("max |out - oracle| = ")[1].split()[0])
    assert diff > 1e-6 and "FAILS: output values mismatch" in repro.stdout
    # --replay re-runs exactly that case: still failing for the buggy one, passing for sdpa.
    again = run(f"--impl={IMPLS}:ignores_scale", f"--replay={saved}", tmp_path=tmp_path)
    assert again.returncode == 1 and "1 failed" in again.stdout
    fixed = run(f"--impl={IMPLS}:correct", f"--replay={saved}", tmp_path=tmp_path)
    assert fixed.returncode == 0 and "1 passed" in fixed.stdout


@pytest.mark.parametrize("attr, message", [
    ("raises_impl", "raised on a case it claims to support: RuntimeError: kernel launch failed"),
    ("wrong_shape_impl", "shape="),
])
def test_misbehaving_implementation_fails_properties_not_the_run(tmp_path, attr, message):
    proc = run(f"--impl={IMPLS}:{attr}", "--dtype=float64", "-k", "forward_agreement or temperature",
               f"--conformance-report={tmp_path}/cert", tmp_path=tmp_path)
    assert proc.returncode == 1
    assert message in proc.stdout
    assert {r["outcome"] for r in report(tmp_path)["results"]} == {"failed"}


def test_hang_is_a_failed_property_after_the_timeout(tmp_path):
    proc = run(f"--impl={IMPLS}:hangs_impl", "--dtype=float64", "-k", "forward_agreement",
               "--example-timeout=0.5", tmp_path=tmp_path, timeout=300)
    assert proc.returncode == 1
    # The first float64 call may compile: it is given 5 x the timeout, and the message says so.
    assert "did not return within 2.5s (its first call: 5 x the 0.5s timeout allowed" in proc.stdout


def test_expected_failure_and_stale_entry_on_the_certificate(tmp_path):
    proc = run(f"--impl={IMPLS}:known_scale_bug", "--dtype=float64", "-k", "forward_agreement and not flash",
               f"--conformance-report={tmp_path}/cert", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    [r] = report(tmp_path)["results"]
    assert r["outcome"] == "xfailed" and r["xfail_hits"] > 0 and "drops the explicit scale" in r["xfail_reason"]
    assert "expected failure forward_agreement" in proc.stdout
    proc = run(f"--impl={IMPLS}:stale_entry", "--dtype=float64", "-k", "output_contract",
               f"--conformance-report={tmp_path}/cert", tmp_path=tmp_path)
    assert proc.returncode == 0
    [r] = [x for x in report(tmp_path)["results"] if x["property"] == "output_contract"]
    assert r["outcome"] == "stale-xfail"
    assert "STALE expected failure output_contract" in proc.stdout


def test_xdist_collects_every_record(tmp_path):
    proc = run("--impl=sdpa-math", "-n", "2", "--dtype=float32", "-k", "agreement or permutation",
               f"--conformance-report={tmp_path}/cert", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    passed = int(re.search(r"(\d+) passed", proc.stdout).group(1))
    skipped = int((re.search(r"(\d+) skipped", proc.stdout) or [0, 0])[1])
    assert len(report(tmp_path)["results"]) == passed + skipped


def test_a_projects_own_device_and_dtype_options_keep_working_beside_the_suite(tmp_path):
    """A project whose conftest.py registers --device and --dtype runs the suite from its
    own directory: those names stay the project's, the suite's are --conformance-device
    and --conformance-dtype (found through the installed entry point, which loads the
    plugin after the project's conftest.py)."""
    from importlib.metadata import entry_points

    if not any(ep.name == "attention_conformance" for ep in entry_points(group="pytest11")):
        pytest.skip("the package is not installed (no pytest11 entry point): pip install -e .")
    project = tmp_path / "project"
    project.mkdir()
    (project / "conftest.py").write_text(
        "def pytest_addoption(parser):\n"
        "    parser.addoption('--device', default='gpu0')\n"
        "    parser.addoption('--dtype', default='int8')\n")
    (project / "test_own.py").write_text(
        "def test_own(request):\n"
        "    assert request.config.getoption('--device') == 'npu1'\n"
        "    assert request.config.getoption('--dtype') == 'int8'\n")
    env = dict(os.environ, ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "failures"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = pytest_process.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--hypothesis-profile=ci",
         "--pyargs", "conformance", "test_own.py", "--impl=spec", "--device=npu1",
         "--conformance-dtype=float64", "--conformance-device=cpu",
         "-k", "own or (forward_agreement and not flash)", "-p", "no:randomly"],
        cwd=project, capture_output=True, text=True, timeout=600, env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"\b2 passed\b", out), out   # the project's test and forward_agreement[float64]
    assert "forward_agreement" in out and "float32" not in out.split("summary")[0], out
