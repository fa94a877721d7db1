"""One zoo mutant certified in a subprocess, as a user's run would: the tests that check
what a report says (a shrunk case, where it started) share it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[1]


def certify_mutant(tmp_path: Path, mutant: str, test_file: str, selector: str) -> tuple[dict, str]:
    """``pytest TEST_FILE --impl=mutant:MUTANT -k SELECTOR -x`` under ``ci`` in float64, its
    failures and state under ``tmp_path``: the JSON certificate and the run's output."""
    env = dict(os.environ, ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "failures"),
               ATTENTION_CONFORMANCE_STATE=str(tmp_path / "state"))
    env = {k: v for k, v in env.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    proc = pytest_process.run(
        [sys.executable, "-m", "pytest", test_file, "-p", "no:cacheprovider", "-q", "--hypothesis-profile=ci",
         f"--impl=mutant:{mutant}", "--dtype=float64", "-k", selector, "-x", f"--conformance-report={tmp_path}/cert"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env, check=False)
    output = proc.stdout + proc.stderr
    assert (tmp_path / "cert.json").exists(), output[-3000:]
    return json.loads((tmp_path / "cert.json").read_text()), output
