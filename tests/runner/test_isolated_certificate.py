"""An isolated implementation (``--isolate=always``; ``auto`` after a crash) gets the
certificate an in-process run gives: the same outcomes, expected failures matched on
the calls as made, the same diagnosis, called case and reproducer. Only the worker
process may call it, so it answers each check with the calls it made and, for a
failure, diagnoses it and picks the reproducer's call (``isolation.supervisor.Worker.annotate``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]


def certify(impl: str, mode: str, tmp_path: Path, *args: str) -> dict:
    env = dict(os.environ, ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "failures"),
               ATTENTION_CONFORMANCE_STATE=str(tmp_path / "state"))
    report = tmp_path / f"cert-{mode}"
    proc = pytest_process.run(
        [sys.executable, "-m", "pytest", "conformance", "-p", "no:cacheprovider", "-q",
         "--hypothesis-profile=ci", f"--impl={impl}", f"--isolate={mode}",
         f"--conformance-report={report}", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    return {(r["property"], r["level"], r["dtype"]): r
            for r in json.loads(report.with_suffix(".json").read_text())["results"]}


def test_expected_failures_matched_on_the_calls_made_in_the_worker(tmp_path):
    """torch-mha's expected failures name call attributes (is_causal with
    need_weights=False, ...) that only the calls made show: isolated, it still passes
    with the same expected failures, no false alarm."""
    here = certify("torch-mha", "never", tmp_path, "--dtype=float64")
    there = certify("torch-mha", "always", tmp_path, "--dtype=float64")
    assert {k: r["outcome"] for k, r in there.items()} == {k: r["outcome"] for k, r in here.items()}
    assert "xfailed" in {r["outcome"] for r in there.values()}
    assert "failed" not in {r["outcome"] for r in there.values()}


@pytest.mark.parametrize("mutant, named", [
    ("causal_lower_right", True),
    ("mha_scale_sqrt_embed_dim", True),
    ("mha_query_projection_detached", False),  # a backward call: not the drawn case's plain call
])
def test_an_isolated_failure_reads_as_an_in_process_one(mutant, named, tmp_path):
    here = certify(f"mutant:{mutant}", "never", tmp_path, "-x")
    there = certify(f"mutant:{mutant}", "always", tmp_path, "-x")
    [failed] = [k for k, r in here.items() if r["outcome"] == "failed"]
    assert there[failed]["outcome"] == "failed"
    for field in ("counterexample", "called", "causes", "reproducer"):
        assert there[failed][field] == here[failed][field], field
    assert bool(there[failed]["causes"]) == named
    if not named:
        assert there[failed]["called"] is not None  # the reproducer makes the backward call
    assert "diagnosis failed" not in there[failed]["message"]
    assert "only in its isolated worker" not in there[failed]["message"]


def test_call_attributes_cross_to_the_pytest_process_with_their_types():
    """Expected failures compare call attributes: a flash call's window (a tuple) and
    features (a set) must not come back as lists."""
    from conformance.isolation.protocol import CalledAttrs, encode_attrs, read_frame, write_frame

    attrs = {"level": "flash", "window": (7, 0), "flash_features": {"window", "alibi"}, "L": np.int64(3),
             "scale": None, "causal": "lower_right", "nested": ((1, 2), 3)}
    r, w = os.pipe()
    try:
        write_frame(w, {"called": [encode_attrs(attrs)]})
        header, _ = read_frame(r)
    finally:
        os.close(r)
        os.close(w)
    got = CalledAttrs(header["called"][0]).attrs()
    assert got == attrs and {k: type(v) for k, v in got.items()} == {
        **{k: type(v) for k, v in attrs.items()}, "L": int}
