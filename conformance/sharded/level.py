"""The sharded level's entry of ``conformance.core.levels``: what the shared machinery
(saved failures, reproducers, expected failures) reads, from ``cases`` and ``checks``."""

from __future__ import annotations

from typing import Any

from conformance.calls.call_reports import CallReport
from conformance.core.compare import PropertyFailure
from conformance.core.target import Target
from conformance.sharded import checks
from conformance.sharded.cases import (ATTRIBUTES, ShardedCallSpec, ShardedCase, case_from_meta, case_meta,
                                       run_call, validate)

__all__ = ["ATTRIBUTES", "SHOW", "CallSpec", "Case", "case_from_meta", "case_meta", "report_call",
           "show_sharded_call", "validate"]


def report_sharded_call(impl: Any, call: ShardedCallSpec, *, invoke: Any = None) -> CallReport:
    """Make ``call`` on a worker group and compare the output with the spec."""
    case = call.case
    target = Target(impl, "sharded", case.dtype, case.device)
    report = CallReport(call, [f"call on every rank r: impl.sharded(q_r, k_r, v_r, rank=r, {call.arguments()})",
                               f"case as called: {case.describe()}"])
    try:
        validate(case)
        result = run_call(impl, call, timeout=60.0, lse_declared=target.caps.sharded_lse)
        checks.check_forward(target, case, result)
        if call.grad_output is not None:
            checks.check_backward(target, case, call.grad_output, result)
    except PropertyFailure as exc:
        report.finding(str(exc))
    except ValueError as exc:
        report.finding(f"the spec calls this case invalid: {exc}")
    return report


def show_sharded_call(impl: Any, call: ShardedCallSpec) -> CallReport:
    """Make ``call`` (a worker group of this interpreter) and print how it differs from the spec."""
    report = report_sharded_call(impl, call)
    print(report.text())
    return report


# The level's entries of conformance.core.levels (what the shared machinery reads).
Case = ShardedCase
CallSpec = ShardedCallSpec
report_call = report_sharded_call
SHOW = "show_sharded_call"
