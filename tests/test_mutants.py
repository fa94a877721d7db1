"""The conformance suite fails every mutant of the bug zoo and passes the correct built-ins.

Each test runs the runner as a subprocess under the ``ci`` profile,
``pytest conformance --impl=X --hypothesis-profile=ci -x --conformance-report PATH``,
and reads ``PATH.json`` (docs/CONTRACTS.md). Slow: one subprocess per implementation;
parallelise with ``pytest tests/test_mutants.py -n 2`` (about 25 minutes on two
shared cores: ~15 s per mutant and run, up to 5 minutes for a correct implementation).

Every mutant is run twice: with the whole suite (some property must kill it) and
with its record's ``expected_property`` alone (``-k test_<property>``: that property
must kill it on its own, so no property is only ever a back-up for another). A
mutant whose expected property is not a property of the suite fails, naming it.

A mutant that survives is a missing strategy or property in the suite, not a reason
to weaken the mutant: the failure message names the property expected to catch it.
A correct implementation's certificate also has no diagnosis (no ``causes``); that the
diagnosis names each mutant's bug is tested in ``tests/diagnosis/``.
"""

from __future__ import annotations

import importlib
import importlib.util
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
CORRECT = ["spec", "handwritten", "sdpa", "sdpa-math", "torch-mha", "flash-ref", "triton", "jax", "varlen-reference"] + [
    f"implementations.mutants.controls:{name}" for name in CONTROLS
]
TIMEOUT_S = 1800


def registered_properties() -> set[str]:
    """Property ids the suite defines (the runner's registry: every ``conformance/test_*.py``)."""
    from conformance.runner import registered_properties as registry

    return set(registry())


def _require_expected_property(name: str) -> None:
    expected = MUTANTS[name].expected_property
    if expected not in registered_properties():
        pytest.fail(f"{name}'s expected property {expected!r} is not a property of the suite")


def run_conformance(impl: str, workdir: Path, *, stop_at_first_failure: bool,
                    only_property: str | None = None) -> tuple[int, dict, str]:
    """Run the suite on ``impl`` in ``workdir`` (only one property's test with
    ``only_property``); (exit code, JSON report, output tail)."""
    report = workdir / "report"
    cmd = [
        sys.executable, "-m", "pytest", str(ROOT / "conformance"), f"--impl={impl}",
        "--hypothesis-profile=ci", "-q", "-p", "no:cacheprovider",
        "--conformance-report", str(report),
    ]
    if stop_at_first_failure:
        cmd.append("-x")
    if only_property is not None:
        cmd += ["-k", f"test_{only_property}"]
    # The outer pytest (maybe an xdist worker) must not leak its settings into the run.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    output = (proc.stdout + proc.stderr)[-4000:]
    json_path = report.with_suffix(".json")
    if not json_path.exists():
        pytest.fail(f"no report {json_path} written (exit code {proc.returncode}):\n{output}")
    return proc.returncode, json.loads(json_path.read_text()), output


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_killed(name, tmp_path):
    mutant = MUTANTS[name]
    _require_expected_property(name)
    if name.startswith("triton_"):
        _require_builtin("triton")
    code, report, output = run_conformance(f"mutant:{name}", tmp_path, stop_at_first_failure=True)
    failed = [r for r in report["results"] if r["outcome"] == "failed"]
    assert code != 0 and failed, (
        f"mutant {name} survived the ci profile (exit code {code}): {mutant.bug}. "
        f"Expected {mutant.expected_property} to catch it on {mutant.smallest_case}.\n{output}"
    )


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_expected_property_alone_kills_mutant(name, tmp_path):
    mutant = MUTANTS[name]
    _require_expected_property(name)
    if name.startswith("triton_"):
        _require_builtin("triton")
    code, report, output = run_conformance(f"mutant:{name}", tmp_path, stop_at_first_failure=True,
                                           only_property=mutant.expected_property)
    ran = {r["property"] for r in report["results"]}
    assert ran == {mutant.expected_property}, f"-k selected {sorted(ran)}"
    failed = [r for r in report["results"] if r["outcome"] == "failed"]
    assert code != 0 and failed, (
        f"{mutant.expected_property} alone does not kill mutant {name} under ci (exit code "
        f"{code}): {mutant.bug}. Its smallest case is {mutant.smallest_case}.\n{output}"
    )


def _require_builtin(name: str) -> None:
    """Skip, with the reason, where the built-in cannot run (the runner would skip it)."""
    if name == "triton":
        found = importlib.util.find_spec("triton")
        if found is None or found.origin is None:  # no origin: a folder named triton, not the package
            pytest.skip("triton is not installed (pip install -e '.[triton]')")
    from implementations.registry import resolve

    impl = resolve(name)
    if not impl.available:
        pytest.skip(f"{name} unavailable: {impl.unavailable_reason}")


@pytest.mark.parametrize("impl", CORRECT)
def test_correct_implementation_passes(impl, tmp_path):
    if impl in ("triton", "jax"):
        _require_builtin(impl)
    code, report, output = run_conformance(impl, tmp_path, stop_at_first_failure=False)
    bad = [
        f"{r['property']}[{r['level']}-{r['dtype']}]: {r['outcome']} {r.get('message', '')[:300]}"
        for r in report["results"] if r["outcome"] in ("failed", "error", "stale-xfail")
    ]
    assert code == 0 and not bad, f"{impl} should pass (exit code {code}):\n" + "\n".join(bad) + f"\n{output}"
    diagnosed = [f"{r['property']}[{r['level']}-{r['dtype']}]: {r['causes']}" for r in report["results"] if r.get("causes")]
    assert report["causes"] == [] and not diagnosed, f"{impl} was given a diagnosis:\n" + "\n".join(diagnosed)
