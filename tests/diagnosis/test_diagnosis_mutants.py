"""The diagnosis names the bug of every bug-zoo mutant that a variant models, and groups
the many failures of one precision bug into one cause.

Each test runs the runner as a subprocess under the ``ci`` profile with
``--conformance-report PATH`` in its own folder (parallel-safe: ``-n 2``) and reads
``PATH.json``. The mutants run side by side in a few processes
(``--impl=mutant:a,mutant:b,... --impl-exitfirst``), a minute or two each; ~10 s for
the float32-softmax run. The flash, varlen and kvcache mutants run in two chunks of their
own with those levels' files collected (~40 s each), the Triton window mutant apart. The correct built-ins' certificates having no causes
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
#: The FlashAttention levels, whose certificates run the flash and varlen test files.
_FAMILY_LEVELS = ("flash", "varlen", "kvcache")
#: The mutants with a cause in a few pytest processes (start-up paid once each; ``-n 2``
#: shares them out): the Triton ones, under the interpreter, apart; the flash, varlen and
#: kvcache ones apart, their level's files collected.
_PLAIN = [name for name in WITH_CAUSE if not name.startswith("triton_") and MUTANTS[name].level not in _FAMILY_LEVELS]
_FAMILY = [name for name in WITH_CAUSE if not name.startswith("triton_") and MUTANTS[name].level in _FAMILY_LEVELS]
_TRITON = [name for name in WITH_CAUSE if name.startswith("triton_")]
CHUNKS = {"plain0": _PLAIN[0::2], "plain1": _PLAIN[1::2], "family0": _FAMILY[0::2], "family1": _FAMILY[1::2],
          "triton": [name for name in _TRITON if MUTANTS[name].level not in _FAMILY_LEVELS],
          "triton_flash": [name for name in _TRITON if MUTANTS[name].level in _FAMILY_LEVELS]}
TIMEOUT_S = 1800
#: Mutants whose bug two variants explain equally on every case the diagnosis can
#: gather: the honest verdict is "unknown — closest, not confirmed" listing both.
#: logits_in_input_dtype computes q·kᵀ in float16; low_precision_accumulation does that
#: too (and sums in float16, which the tolerance rule cannot see on these cases).
HONEST_TIES = {"logits_in_input_dtype": {"float16_overflow", "low_precision_accumulation"}}


def certify(impl: str, workdir: Path, *args: str, family: bool = False) -> tuple[dict, str]:
    """Run the suite on ``impl`` in ``workdir``; (JSON report, the whole output)."""
    report = workdir / "report"
    # An SDPA mutant's flash level (derived from it, or the Triton kernel's own), collected
    # first, would fail first on a bug that is the SDPA level's (its variant is an SDPA
    # one): for those the flash, varlen and kvcache files are left out. The mutants of
    # those levels (``family``) run them.
    ignored = [] if family else ["--ignore", str(ROOT / "conformance" / "test_flash.py"),
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


def certificates_by_mutant(report: dict, names: list[str]) -> dict[str, dict]:
    """Each mutant's certificate in a side-by-side report (or the one certificate)."""
    certificates = report["certificates"] if "comparison" in report else [report]
    found = {c["implementation"]["spec"].removeprefix("mutant:"): c for c in certificates}
    assert set(names) <= set(found), f"no certificate for {sorted(set(names) - set(found))}"
    return found


@pytest.mark.parametrize("chunk", sorted(CHUNKS))
def test_the_diagnosis_names_the_mutants_bug_first(chunk, tmp_path):
    """Each mutant of the chunk, certified side by side in one process and each stopped at
    its own first failure (as ``-x`` stops a run of one), gets its record's cause first."""
    names = CHUNKS[chunk]
    if chunk.startswith("triton"):
        from implementations.builtins.kernels.triton_attention import make_implementation

        reason = make_implementation().unavailable_reason
        if reason:
            pytest.skip(f"triton unavailable: {reason}")
    report, output = certify(",".join(f"mutant:{n}" for n in names), tmp_path, "--impl-exitfirst",
                             family=chunk.startswith(("family", "triton_flash")))
    problems = []
    for name, cert in certificates_by_mutant(report, names).items():
        mutant = MUTANTS[name]
        failed = [r for r in cert["results"] if r["outcome"] == "failed"]
        if not failed:
            problems.append(f"mutant {name} survived")
            continue
        causes = failed[0]["causes"]
        named = [c["variant"] for c in causes]
        if name in HONEST_TIES:
            closest = {c["variant"] for c in causes if not c.get("confirmed", True)}
            if any(c.get("confirmed", True) for c in causes) or not HONEST_TIES[name] <= closest:
                problems.append(f"{name}: expected unknown with {sorted(HONEST_TIES[name])} closest, got {causes}")
            continue
        if not named or named[0] != mutant.expected_cause or causes[0].get("confirmed") is False:
            problems.append(f"{name} ({mutant.bug}) failed {failed[0]['property']}[{failed[0]['dtype']}]; the "
                            f"diagnosis named {named or 'nothing'}, expected {mutant.expected_cause} first")
        elif not cert["causes"] or cert["causes"][0]["variant"] != mutant.expected_cause:
            problems.append(f"{name}: the certificate's causes {cert['causes']} do not start with "
                            f"{mutant.expected_cause}")
        elif f"probable cause: {mutant.expected_cause} — " not in output:
            problems.append(f"{name}: no 'probable cause: {mutant.expected_cause} — ' line in the output")
    assert not problems, "\n".join(problems) + "\n" + output[-4000:]


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
