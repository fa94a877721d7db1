"""The isolated worker process: ``python -m conformance.isolation_worker REQUEST_FD REPLY_FD CLOCK_FD``.

It resolves ``--impl`` itself (probing included) when asked to, then runs each
example's whole check on the case it is sent, with every call into the
implementation on the call clock (:func:`_on_the_clock`), and answers each request
with one frame (:mod:`conformance.isolation_protocol`). :class:`~conformance.isolation.Worker`
starts it and reads its answers.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from contextlib import contextmanager
from typing import Iterator

from conformance.isolation_protocol import (
    CALL_CLOCK,
    decode_case,
    describe_implementation,
    read_frame,
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

    from conformance import runner
    from implementations import registry

    checks = runner.registered_checks()
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
            target = runner.Target(impl, header["level"], header["dtype"], header["device"],
                                   header["timeout"], watch=watch)
            try:
                case = decode_case(header["case"], arrays)
                ratio = checks[header["property"]](target, case)
            except runner.PropertyFailure as exc:
                write_frame(reply_fd, {"failure": type(exc).__name__, "message": str(exc)})
            except Exception as exc:  # noqa: BLE001 - the suite's own error, reported as such
                write_frame(reply_fd, {"error": "".join(traceback.format_exception(exc))[-4000:]})
            else:
                write_frame(reply_fd, {"ratio": None if ratio is None else float(ratio)})


def main(argv: list[str]) -> int:
    """``python -m conformance.isolation_worker REQUEST_FD REPLY_FD CLOCK_FD``: serve one pytest process."""
    import faulthandler

    faulthandler.enable()  # a segfault leaves its traceback in the log quoted on a crash
    return _serve(int(argv[0]), int(argv[1]), int(argv[2]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
