"""The isolated worker process: ``python -m conformance.isolation.worker REQUEST_FD REPLY_FD CLOCK_FD``.

It resolves ``--impl`` itself (probing included) when asked to, then runs each
example's whole check on the case it is sent (answering with the calls it made), and,
for a failure, the diagnosis and the choice of the reproducer's call (``annotate``), with every call into the
implementation on the call clock (:func:`_on_the_clock`), and answers each request
with one frame (:mod:`conformance.isolation.protocol`). :class:`~conformance.isolation.supervisor.Worker`
starts it and reads its answers.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from contextlib import contextmanager
from functools import partial
from typing import Any, Iterator

from conformance.isolation.protocol import (
    CALL_CLOCK,
    decode_case,
    describe_implementation,
    encode_attrs,
    encode_calls,
    read_frame,
    unprefixed,
    write_frame,
)
from implementations.base import Implementation, ImplementationError

__all__ = ["main"]


@contextmanager
def _on_the_clock(clock_fd: int) -> Iterator[None]:
    """Around each call into the implementation in the worker: its start on the call clock."""
    os.pwrite(clock_fd, CALL_CLOCK.pack(time.monotonic()), 0)
    try:
        yield
    finally:
        os.pwrite(clock_fd, CALL_CLOCK.pack(0.0), 0)


def _serve(request_fd: int, reply_fd: int, clock_fd: int) -> int:
    import functools

    from conformance.calls.call_specs import CallLog
    from conformance.core.compare import PropertyFailure
    from conformance.core.registry import registered_checks
    from conformance.core import devices
    from conformance.core.target import Target, broke_context_message
    from implementations import registry

    checks = registered_checks()
    impl: Implementation | None = None
    watch = functools.partial(_on_the_clock, clock_fd)
    while True:
        try:
            header, arrays = read_frame(request_fd)
        except EOFError:
            return 0
        if header["op"] == "resolve":
            try:
                impl = registry.resolve(header["spec"], header["options"] or None, timeout=header["timeout"])
            except ImplementationError as exc:
                write_frame(reply_fd, {"error": str(exc)})
                continue
            write_frame(reply_fd, {"implementation": describe_implementation(impl)})
        elif header["op"] == "check":
            assert impl is not None, "check before resolve"
            log = CallLog()
            target = Target(impl, header["level"], header["dtype"], header["device"],
                                   header["timeout"], watch=watch, log=log)
            fault = None  # a CUDA fault: "restart" asks the pytest process to replace this worker
            try:
                case = decode_case(header["case"], arrays)
                ratio = checks[header["property"]](target, case)
            except PropertyFailure as exc:
                # The calls as made: expected failures match them, the reproducer makes one.
                calls, call_arrays = encode_calls(log.calls)
                fault = devices.context_breaking_error(exc)
                write_frame(reply_fd, {"failure": type(exc).__name__, "message": str(exc),
                                       "calls": calls, "restart": fault is not None}, call_arrays)
            except Exception as exc:  # noqa: BLE001 - the suite's own error, reported as such
                fault = devices.context_breaking_error(exc)
                if fault is None:
                    write_frame(reply_fd, _suite_error(exc))
                else:  # the suite's own code met the implementation's fault first
                    calls, call_arrays = encode_calls(log.calls)
                    write_frame(reply_fd, {"failure": "ImplementationCrashed", "calls": calls, "restart": True,
                                           "message": broke_context_message(impl.name, fault)}, call_arrays)
            else:
                # The calls' attributes, when an expected failure of the property could match them.
                called = [encode_attrs(call.attrs()) for call in log.calls] if header.get("attrs") else []
                write_frame(reply_fd, {"ratio": None if ratio is None else float(ratio), "called": called})
        elif header["op"] == "annotate":
            assert impl is not None, "annotate before resolve"
            try:
                write_frame(reply_fd, *_annotate(impl, checks, header, arrays, watch))
            except Exception as exc:  # noqa: BLE001 - the suite's own error, reported as such
                write_frame(reply_fd, _suite_error(exc))


def _suite_error(exc: BaseException) -> dict[str, Any]:
    """The answer for an error of the suite's own code in the worker (its traceback)."""
    return {"error": "".join(traceback.format_exception(exc))[-4000:]}


def _annotate(impl: Implementation, checks: Any, header: dict[str, Any], arrays: dict[str, Any],
              watch: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the pytest process cannot work out without calling the implementation, for
    a failure: the property's check made again on the shrunk case (and first on the
    failing case before shrinking, whose calls break ties) with the calls observed, the
    diagnosis of those calls (``diagnosis.diagnose``), and which call alone shows the
    failure (``replay.first_failing_call``, for the reproducer)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from conformance.calls.call_specs import CallLog
    from conformance.calls.replay import first_failing_call
    from conformance.core.compare import PropertyFailure
    from conformance.core.target import (
        ImplementationHung,
        ImplementationRaised,
        Target,
        call_guarded,
    )
    from conformance.diagnosis import diagnose as diagnosis

    check = checks[header["property"]]
    target = Target(impl, header["level"], header["dtype"], header["device"],
                           header["timeout"], watch=watch)

    case = decode_case(header["case"], unprefixed(arrays, "case/"))
    first = decode_case(header["first"], unprefixed(arrays, "first/")) if header.get("first") else None
    record = SimpleNamespace(failing_case=first if first is not None else case, property=header["property"])
    if first is not None:
        diagnosis.start_example(first, record)
        try:
            check(replace(target, log=CallLog()), first)
        except PropertyFailure:
            pass
    diagnosis.start_example(case, record)  # keeps the one before as the first failure
    record.failing_case = case
    log = CallLog()
    failure: PropertyFailure | None = None
    try:
        check(replace(target, log=log), case)
    except PropertyFailure as exc:
        failure = exc
    record.failing_calls = tuple(log.calls)  # matched against the built-ins' known deviations
    try:
        verdict = diagnosis.diagnose(target, record, failure)
        causes, line = verdict.causes, verdict.line
    except Exception as err:  # noqa: BLE001 - a diagnosis must never mask the failure
        causes, line = [], f"probable cause: (diagnosis failed: {type(err).__name__}: {err})"
    picked = shows = None
    if log.calls and failure is not None and not isinstance(
            failure, (ImplementationHung, ImplementationRaised)):
        found = first_failing_call(impl, log.calls, invoke=partial(call_guarded, target))
        picked, shows = (log.calls.index(found[0]), True) if found is not None else (len(log.calls) - 1, False)
    calls, call_arrays = encode_calls(log.calls)
    return ({"causes": causes, "line": line, "calls": calls, "picked": picked, "shows": shows,
             "failed_again": failure is not None}, call_arrays)


def main(argv: list[str]) -> int:
    """``python -m conformance.isolation.worker REQUEST_FD REPLY_FD CLOCK_FD``: serve one pytest process."""
    import faulthandler
    import signal

    faulthandler.enable()  # a segfault leaves its traceback in the log quoted on a crash
    # A Ctrl-C in the terminal reaches the whole process group: it is the pytest process's
    # to handle (it ends the run and kills this worker), not a death of this worker that
    # the pytest process could take for a crash of the implementation.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return _serve(int(argv[0]), int(argv[1]), int(argv[2]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
