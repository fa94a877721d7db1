"""The reproducer's report of one varlen or kvcache call: the call made on its own, and
how its result differs from the spec's (``report_varlen_call``, ``report_kvcache_call``)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from conformance.calls.call_reports import CallReport
from conformance.core.compare import PropertyFailure

__all__ = ["called_invalid", "difference", "report_against_oracle"]


def called_invalid(report: CallReport, err: Exception, run: Any) -> CallReport:
    """The spec calls the input invalid: the call must raise."""
    report.lines.append(f"the spec calls this input invalid: {str(err).strip().splitlines()[0]}")
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - raising is right here
        report.lines.append(f"raised, as it should: {type(exc).__name__}: {exc}")
    else:
        report.finding("returned a result, but should raise an error (the input is invalid per the spec)")
    return report


def difference(report: CallReport, actual: np.ndarray, expected: np.ndarray) -> None:
    with np.errstate(invalid="ignore"):
        diff = np.abs(actual - expected)[np.isfinite(actual) & np.isfinite(expected)]
    report.max_difference = float(diff.max()) if diff.size else 0.0
    report.lines.append(f"max |out - oracle| = {report.max_difference:.6g}")


def report_against_oracle(report: CallReport, *, validate: Callable[[], Any], run_unchecked: Callable[[], Any],
                          run: Callable[[], Any], oracle: Callable[[Any], str],
                          checks: Callable[[Any], list[Callable[[], Any]]],
                          output: Callable[[Any], np.ndarray], expected: Callable[[], np.ndarray]) -> CallReport:
    """Fill ``report``: when ``validate`` raises (the spec calls the case invalid),
    ``run_unchecked`` must raise too; else ``run`` makes the call, ``oracle(result)`` is the
    line naming the oracle, each of ``checks(result)`` that fails is a finding, and the
    largest difference of ``output(result)`` from ``expected()`` closes the report."""
    try:
        validate()
    except ValueError as err:  # spec.SpecError included
        return called_invalid(report, err, run_unchecked)
    try:
        result = run()
        out = output(result)
    except PropertyFailure as exc:
        report.finding(str(exc))
        return report
    except Exception as exc:  # noqa: BLE001 - the implementation's own error, called directly
        report.finding(f"raised on a case it claims to support: {type(exc).__name__}: {exc}")
        return report
    report.lines.append(oracle(result))
    for check in checks(result):
        try:
            check()
        except PropertyFailure as exc:
            report.finding(str(exc))
    difference(report, out, expected())
    return report
