"""One call into an implementation, as data: what the runner calls, what a failure
saves, what its reproducer re-runs.

A property often calls the implementation on something other than the case
Hypothesis drew (V = identity, permuted keys, an invalid variant, large logits,
the case tiled into dropout samples, a module in train mode), and the runner hands
the case over in one particular way (causality as ``is_causal=True`` or folded
into ``attn_mask``, a memory layout, dropout, autograd). :class:`SDPACallSpec` and
:class:`MHACallSpec` hold exactly that: the case as called and every argument.

There is one path from a call spec to the implementation: ``calls.sdpa.run_sdpa`` and
``calls.mha.run_mha`` make every call of the properties through
:func:`run_sdpa_call` / :func:`run_mha_call`, and a failure's reproducer snippet
runs the same functions through :func:`show_sdpa_call` / :func:`show_mha_call`,
which also print how the result differs from the oracle for the case as called.

Every random draw of a call that is not Hypothesis' own (dropout masks, upstream
gradients) is seeded from the case's contents (:func:`content_seed`), never from
Python's salted ``hash()``: a replay, another process or an xdist worker draws the
same.

This module is the public face of two: :mod:`conformance.calls.call_specs` (the call as
data and the one path that makes it) and :mod:`conformance.calls.call_reports` (how a
call's result differs from the oracle), and it holds the SDPA and MHA report functions
(:func:`report_sdpa_call`, :func:`report_mha_call`, which need the level modules
``conformance.calls.sdpa`` and ``conformance.calls.mha``) and :func:`first_failing_call`:
it is the top of the call layer. Reproducer snippets import from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import spec
from conformance.calls.call_reports import (
    CallReport,
    _difference_line,
    _raised,
    _untouched,
)
from conformance.calls.call_specs import (
    CallLog,
    Invoke,
    MHACallSpec,
    MHAOutcome,
    SDPACallSpec,
    SDPAOutcome,
    build_module,
    call_directly,
    content_seed,
    fold_causal,
    mha_content_seed,
    mha_output_shape,
    run_mha_call,
    run_sdpa_call,
    tile_mha_case,
    tile_sdpa_case,
)
from conformance.core.compare import PropertyFailure, fail

__all__ = [
    "Invoke",
    "SDPACallSpec",
    "MHACallSpec",
    "CallLog",
    "SDPAOutcome",
    "MHAOutcome",
    "CallReport",
    "fold_causal",
    "tile_sdpa_case",
    "tile_mha_case",
    "mha_output_shape",
    "content_seed",
    "mha_content_seed",
    "run_sdpa_call",
    "build_module",
    "run_mha_call",
    "report_sdpa_call",
    "report_mha_call",
    "show_sdpa_call",
    "show_mha_call",
    "first_failing_call",
]


def report_sdpa_call(impl: Any, call: SDPACallSpec, *, invoke: Invoke = call_directly) -> CallReport:
    """Make ``call`` and compare its result with what the spec says: the oracle for
    the case as called (under the declared fully-masked-row policy and the
    tolerance rule), a raise for an input the spec calls invalid, the output
    contract, the gradients, the inputs left untouched, and for ``samples`` copies
    with dropout the mean against its Hoeffding bound."""
    from conformance.calls import sdpa as calls
    from conformance.core.target import ImplementationRaised, Target
    from conformance.core.tensors import sdpa_inputs, to_numpy

    case = call.case
    target = Target(impl, "sdpa", case.dtype, case.device)
    report = CallReport(call, [f"call: impl.sdpa(query, key, value, {call.arguments()})",
                               f"case as called: {case.describe()}"])
    try:
        ref = calls.oracle(case)
        invalid = None
    except (spec.SpecError, ValueError) as err:
        ref, invalid = None, str(err).strip().splitlines()[0]
        report.lines.append(f"the spec calls this input invalid: {invalid}")
    try:
        outcome = run_sdpa_call(impl, call, invoke=invoke, check_output=invalid is None)
    except ImplementationRaised as exc:
        if invalid is None:
            report.finding(str(exc))
        else:
            report.lines.append(f"raised, as it should: {exc}")
        return report
    except PropertyFailure as exc:
        report.finding(str(exc))
        return report
    except Exception as exc:  # noqa: BLE001 - the implementation's own error, called directly
        if invalid is None:
            report.finding(f"raised on a case it claims to support: {_raised(exc)}")
        else:
            report.lines.append(f"raised, as it should: {_raised(exc)}")
        return report
    if invalid is not None:
        shape = tuple(getattr(outcome.tensor, "shape", ()))
        report.finding(f"returned a result of shape {shape}, but should raise an error "
                       f"(the input is invalid per the spec: {invalid})")
        return report
    out = to_numpy(outcome.tensor)
    for check in (
        lambda: calls.assert_output_contract(target, call.called_case, calls.SDPACall(out, outcome.tensor)),
    ):
        try:
            check()
        except PropertyFailure as exc:
            report.finding(str(exc))
    if call.samples > 1 and call.dropout_p > 0:
        try:
            ratio = calls.check_dropout_mean(target, case, out, call.dropout_p, call.samples)
            report.lines.append(f"mean of {call.samples} dropout samples: worst error/allowed = {ratio:.3g}")
        except PropertyFailure as exc:
            report.finding(str(exc))
    elif call.dropout_p > 0:
        report.lines.append(f"dropout_p={call.dropout_p}: one random sample, not compared with the oracle")
    else:
        report.lines.append(f"oracle: spec.sdpa(causal={case.causal!r}, scale={case.scale!r}, "
                            f"fully_masked={calls.fully_masked_policy(target, case)!r})")
        for check in (lambda: calls.check_against_oracle(target, case, out),
                      lambda: calls.check_fully_masked_policy(target, case, out)):
            try:
                check()
            except PropertyFailure as exc:
                report.finding(str(exc))
        _difference_line(report, out, ref.output, calls.valid_rows(case))
    if call.grad:
        try:
            calls.compare_gradients(target, call, outcome.inputs)
        except PropertyFailure as exc:
            report.finding(str(exc))
    _untouched(report, outcome.inputs, sdpa_inputs(call.passed_case))
    return report


def report_mha_call(impl: Any, call: MHACallSpec, *, invoke: Invoke = call_directly) -> CallReport:
    """Like :func:`report_sdpa_call` for a module call: the oracle
    (``spec.mha_forward``) for output and weights, the output contract, parameter
    and input gradients, inputs untouched, dropout means."""
    from conformance.calls import mha as mha_calls
    from conformance.core.compare import assert_contract
    from conformance.core.target import ImplementationRaised, Target
    from conformance.core.tensors import dtype_of, mha_inputs, to_numpy

    case = call.case
    target = Target(impl, "mha", case.dtype, case.device)
    policy = mha_calls.fully_masked_policy(target, case)
    report = CallReport(call, [f"call: module(query, key, value, ...) with {call.arguments()}",
                               f"case as called: {case.describe()}"])
    try:
        mha_calls.oracle(case)
        invalid = None
    except (spec.SpecError, ValueError) as err:
        invalid = str(err).strip().splitlines()[0]
        report.lines.append(f"the spec calls this input invalid: {invalid}")
    try:
        outcome = run_mha_call(impl, call, invoke=invoke)
    except ImplementationRaised as exc:
        (report.finding(str(exc)) if invalid is None else report.lines.append(f"raised, as it should: {exc}"))
        return report
    except PropertyFailure as exc:
        report.finding(str(exc))
        return report
    except Exception as exc:  # noqa: BLE001 - the implementation's own error, called directly
        if invalid is None:
            report.finding(f"raised on a case it claims to support: {_raised(exc)}")
        else:
            report.lines.append(f"raised, as it should: {_raised(exc)}")
        return report
    if invalid is not None:
        report.finding("returned a result, but should raise an error (the input is invalid per the spec: "
                       f"{invalid})")
        return report
    called = call.called_case
    try:
        assert_contract("output", outcome.output, shape=mha_output_shape(called),
                        dtype=dtype_of(case.dtype), device=case.device)
        if not case.need_weights and outcome.weights is not None:
            fail("weights returned with need_weights=False, but should be None")
    except PropertyFailure as exc:
        report.finding(str(exc))
        return report
    result = mha_calls.MHACall(to_numpy(outcome.output),
                               None if outcome.weights is None else to_numpy(outcome.weights),
                               outcome.output, outcome.weights, outcome.inputs, outcome.module)
    if call.dropout and call.training:
        if call.samples > 1:
            try:
                ratio = mha_calls.check_dropout_mean(target, case, result.output, call.dropout, call.samples)
                report.lines.append(f"mean of {call.samples} train-mode samples: worst error/allowed = {ratio:.3g}")
            except PropertyFailure as exc:
                report.finding(str(exc))
        else:
            report.lines.append(f"train mode with dropout={call.dropout}: one random sample, not compared")
    else:
        fully_masked = "zero" if policy == "unspecified" else policy
        report.lines.append(f"oracle: spec.mha_forward(need_weights={case.need_weights}, "
                            f"is_causal={case.is_causal}, fully_masked={fully_masked!r})")
        try:
            mha_calls.check_mha(target, case, result, fully_masked=fully_masked,
                                include_dead=policy != "unspecified")
        except PropertyFailure as exc:
            report.finding(str(exc))
        _difference_line(report, result.output, mha_calls.oracle(case, fully_masked=fully_masked)[0])
    if call.grad_output is not None:
        try:
            mha_calls.check_parameter_grads(outcome.module)
            mha_calls.check_input_derivative(target, case, outcome.inputs, call.grad_output)
        except PropertyFailure as exc:
            report.finding(str(exc))
    _untouched(report, outcome.inputs, mha_inputs(called))
    return report


def show_sdpa_call(impl: Any, call: SDPACallSpec) -> CallReport:
    """Make ``call`` in this interpreter and print how it differs from the oracle."""
    report = report_sdpa_call(impl, call)
    print(report.text())
    return report


def show_mha_call(impl: Any, call: MHACallSpec) -> CallReport:
    """Make ``call`` in this interpreter and print how it differs from the oracle."""
    report = report_mha_call(impl, call)
    print(report.text())
    return report


def first_failing_call(impl: Any, calls: Sequence[Any], *, invoke: Invoke = call_directly
                       ) -> tuple[Any, CallReport] | None:
    """The first of ``calls`` (as a property made them) whose result alone shows a
    failure when made again, with its report; None when none does (the property
    compares calls with each other, or the implementation is not deterministic)."""
    from conformance.core import levels

    for call in calls:
        report_call = {"sdpa": report_sdpa_call, "mha": report_mha_call}.get(call.level)
        if report_call is None and call.level in levels.LEVEL_MODULES:
            report_call = levels.module(call.level).report_call
        if report_call is None:  # not a call spec of a known level
            continue
        report = report_call(impl, call, invoke=invoke)
        if report.shows_failure:
            return call, report
    return None


