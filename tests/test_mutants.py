"""The conformance suite fails every mutant of the bug zoo and passes the correct built-ins.

Each test runs the runner as a subprocess under the ``ci`` profile,
``pytest conformance --impl=X --hypothesis-profile=ci -x --conformance-report PATH``,
and reads ``PATH.json`` (docs/CONTRACTS.md). Slow: one subprocess per implementation;
parallelise with ``pytest tests/test_mutants.py -n 2`` (about 13 minutes on two
shared cores: ~30 s per mutant, up to 5 minutes for a correct implementation).

A mutant that survives is a missing strategy or property in the suite, not a reason
to weaken the mutant: the failure message names the property expected to catch it.
A correct implementation's certificate also has no diagnosis (no ``causes``); that the
diagnosis names each mutant's bug is tested in ``tests/diagnosis/``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from implementations.mutants import MUTANTS
from implementations.mutants.controls import CONTROLS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
#: Correct built-ins (registry names) and the zoo's own correct bases (module:attr).
CORRECT = ["spec", "handwritten", "sdpa", "sdpa-math", "torch-mha", "triton"] + [
    f"implementations.mutants.controls:{name}" for name in CONTROLS
]
TIMEOUT_S = 1800


def run_conformance(impl: str, workdir: Path, *, stop_at_first_failure: bool) -> tuple[int, dict, str]:
    """Run the suite on ``impl`` in ``workdir``; (exit code, JSON report, output tail)."""
    report = workdir / "report"
    cmd = [
        sys.executable, "-m", "pytest", str(ROOT / "conformance"), f"--impl={impl}",
        "--hypothesis-profile=ci", "-q", "-p", "no:cacheprovider",
        "--conformance-report", str(report),
    ]
    if stop_at_first_failure:
        cmd.append("-x")
    # The outer pytest (maybe an xdist worker) must not leak its settings into the run.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    output = (proc.stdout + proc.stderr)[-4000:]
    json_path = report.with_suffix(".json")
    if not json_path.exists():
        pytest.fail(f"no report {json_path} written (exit code {proc.returncode}):\n{output}")
    return proc.returncode, json.loads(json_path.read_text()), output


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_killed(name, tmp_path):
    mutant = MUTANTS[name]
    if name.startswith("triton_"):
        _require_triton()
    code, report, output = run_conformance(f"mutant:{name}", tmp_path, stop_at_first_failure=True)
    failed = [r for r in report["results"] if r["outcome"] == "failed"]
    assert code != 0 and failed, (
        f"mutant {name} survived the ci profile (exit code {code}): {mutant.bug}. "
        f"Expected {mutant.expected_property} to catch it on {mutant.smallest_case}.\n{output}"
    )


def _require_triton() -> None:
    from implementations.registry import resolve

    impl = resolve("triton")
    if not impl.available:
        pytest.skip(f"triton unavailable: {impl.unavailable_reason}")


@pytest.mark.parametrize("impl", CORRECT)
def test_correct_implementation_passes(impl, tmp_path):
    if impl == "triton":
        _require_triton()
    code, report, output = run_conformance(impl, tmp_path, stop_at_first_failure=False)
    bad = [
        f"{r['property']}[{r['level']}-{r['dtype']}]: {r['outcome']} {r.get('message', '')[:300]}"
        for r in report["results"] if r["outcome"] in ("failed", "error", "stale-xfail")
    ]
    assert code == 0 and not bad, f"{impl} should pass (exit code {code}):\n" + "\n".join(bad) + f"\n{output}"
    diagnosed = [f"{r['property']}[{r['level']}-{r['dtype']}]: {r['causes']}" for r in report["results"] if r.get("causes")]
    assert report["causes"] == [] and not diagnosed, f"{impl} was given a diagnosis:\n" + "\n".join(diagnosed)
