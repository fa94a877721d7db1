"""The diagnosis groups the many failures of one precision bug into one cause.

The test runs the runner as a subprocess under the ``ci`` profile with
``--conformance-report PATH`` in its own folder (parallel-safe: ``-n 2``) and reads
``PATH.json``: ~10 s. That the diagnosis names the bug of every bug-zoo mutant a variant
models is asked of the zoo's own runs, in ``tests/test_mutants.py`` (one run per chunk of
mutants kills them and reads their causes), as is the correct built-ins' certificates
having no causes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_mutants import level_options, run_conformance

pytestmark = pytest.mark.slow

IMPLS = Path(__file__).resolve().parent / "impls_for_diagnosis.py"


def test_a_float32_softmax_is_one_cause_covering_every_property_it_fails(tmp_path):
    _, report, output = run_conformance([f"{IMPLS}:softmax_float32_impl"], tmp_path, stop_at_first_failure=False,
                                        dtype="float64", options=level_options(family=False))
    failed = sorted(r["property"] for r in report["results"] if r["outcome"] == "failed")
    assert len(failed) >= 3, output[-4000:]  # several properties see float32 rounding
    assert [g["variant"] for g in report["causes"]] == ["softmax_float32"], report["causes"]
    group = report["causes"][0]
    assert group["count"] == len(failed) and group["properties"] == failed
    assert group["dtypes"] == ["float64"] and group["devices"] == ["cpu"]
    low, high = group["relative_error"]
    assert 1e-10 < low <= high < 1e-5                          # float32 rounding, not a wrong convention
    assert "softmax_float32: " in output and "(float64 only; relative error" in output
