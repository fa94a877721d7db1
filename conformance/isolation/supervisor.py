"""Process isolation: run an untrusted or crashing implementation in a worker process.

With ``--isolate=always`` (or ``auto`` choosing it, see :func:`choose`) the pytest
process never runs the implementation's code. A worker process
(``python -m conformance.isolation.worker``) resolves ``--impl`` itself, probing included, and
runs each example's whole check (``check(target, case)`` of the property: the calls,
the backward passes, the comparison with the oracle) on the case it is sent. The
pytest process keeps drawing and shrinking cases with Hypothesis, and certifies the
:class:`IsolatedImplementation` the worker described (capabilities, expected
failures, skip reasons) without ever importing the implementation.

Protocol, over two pipes of the worker's own (never its stdout): each message is a
frame ``<u32 header length><u32 payload length><JSON header><.npz payload>``; cases
travel as NumPy arrays (loaded with ``allow_pickle=False``) plus JSON, so nothing is
ever unpickled. Requests: ``resolve`` (spec, options, timeout), ``check``
(property id, target, case; the answer carries the calls the check made, so that
expected failures are matched on them and a failure's reproducer makes the call that
failed) and ``annotate`` (for a failure: the shrunk case checked again, diagnosed, and
the call that alone shows the failure picked, :meth:`Worker.annotate`; the diagnosis
calls the implementation, which only the worker may do). While a check runs, the worker writes the time each call
into the implementation started (0 when none runs) into a small shared file, the
*call clock*; the pytest process reads it between waits, so it enforces the per-call
timeout itself without being woken by every call: a call that does not return in time,
or a worker that dies (``os._exit``, ``abort``, a segfault), kills the worker, fails
the property with the case saved (:class:`~conformance.harness.ImplementationHung`,
:class:`~conformance.harness.ImplementationCrashed`), and the next check starts a
fresh worker. The worker's stdout and stderr go to a log file whose last lines are
quoted in a crash message.

Cost, measured on this project's shared (heavily loaded) 2-core CPU machine: the
plumbing of one example (the case as ``.npz``, two pipe transfers) is about 1 ms, and
3-8 ms end to end under load; starting a worker (interpreter, torch, the suite,
resolution) about 5 s, once per session and again after each crash. A bare SDPA
function given as ``file.py:attr``, ``--hypothesis-profile=ci --dtype=float32``, every
property: 12 s in-process, 19-20 s isolated. That is not small, so ``auto`` isolates
only an implementation an earlier run in this checkout saw crash; pass
``--isolate=always`` for untrusted code. In-process, every call still goes through
``implementations.guard`` (timeouts, exceptions, global state): only the death of the
process itself needs a worker.

Crash markers (``.conformance/``, or ``$ATTENTION_CONFORMANCE_STATE``): every pytest
process that runs property tests keeps ``running-<pid>.json`` (implementation and
current test) and removes it when it finishes cleanly. A later run that finds one
whose process is gone records a crash of that implementation in ``crashes.json``; so
does a worker that dies in isolated mode and an xdist worker that crashes. ``auto``
isolates every implementation recorded there (delete the file to forget). An
interrupted run is no crash (``conformance.isolation.crash_markers.catch_interrupts``): the
worker ignores SIGINT (the pytest process stops the run and kills it), and a worker
ended by SIGINT, SIGTERM or SIGHUP stops the run as an interrupt, recording nothing.

Modules: this one holds the pytest side (:class:`Worker`) and re-exports the rest:
:mod:`conformance.isolation.protocol` (frames, cases and the implementation as
data), :mod:`conformance.isolation.crash_markers` (markers and the ``--isolate`` choice) and
:mod:`conformance.isolation.worker` (the worker process).
"""

from __future__ import annotations

import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from conformance.core.expectations import ExpectedFailureLedger
from conformance.isolation.crash_markers import (
    INTERRUPT_SIGNALS,
    ISOLATE_MODES,
    Interrupted,
    choose,
    crash_seen,
    forget_running,
    mark_running,
    record_crash,
    state_dir,
)
from conformance.isolation.protocol import (
    CALL_CLOCK,
    CalledAttrs,
    IsolatedImplementation,
    case_digest,
    decode_calls,
    decode_case,
    encode_case,
    prefixed,
)
from conformance.isolation.protocol import read_frame as _read_frame
from conformance.isolation.protocol import write_frame as _write_frame
from implementations.base import ImplementationError
from implementations.guard import COMPILE_FACTOR, CallTimedOut, CpuWait, judge

__all__ = [
    "ISOLATE_MODES",
    "IsolatedImplementation",
    "Worker",
    "WorkerDied",
    "WorkerTimedOut",
    "case_digest",
    "choose",
    "crash_seen",
    "decode_case",
    "encode_case",
    "forget_running",
    "mark_running",
    "record_crash",
    "state_dir",
]


class WorkerDied(Exception):
    """The worker process ended (``how``: exit code or signal, ``log``: its last output lines)."""

    def __init__(self, how: str, log: str, during_call: bool) -> None:
        self.how, self.log, self.during_call = how, log, during_call
        super().__init__(how)


class WorkerTimedOut(Exception):
    """A call in the worker did not return within its limit; the worker was killed.
    ``timed_out``: the limit, how it was stretched (``guard.CallTimedOut``)."""

    def __init__(self, timed_out: CallTimedOut | None = None) -> None:
        self.timed_out = timed_out
        super().__init__(str(timed_out or "did not return"))


def _how_it_ended(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}" + (" (abort)" if name == "SIGABRT" else
                                      " (segmentation fault)" if name == "SIGSEGV" else "")
    return f"exit code {returncode} (os._exit in the implementation?)"


class Worker:
    """One worker process certifying ``spec`` (``options``: ``--impl-option`` pairs;
    ``timeout``: ``--example-timeout``). Started on first use and again after it dies."""

    #: Seconds the suite's own code in the worker may take between two calls.
    SUITE_LIMIT = 900.0

    def __init__(self, spec: str, options: dict[str, str], timeout: float) -> None:
        self.spec, self.options, self.timeout = spec, dict(options), timeout
        self.process: subprocess.Popen | None = None
        self.description: dict[str, Any] | None = None
        self.starts = 0
        self._to_worker = self._from_worker = -1
        self._log: Any = None
        self._clock: Any = None  # the call clock: 8 bytes, a float64 time.monotonic() or 0
        #: (dtype, device) this worker process has called the implementation with: the first
        #: call of each may compile (guard.COMPILE_FACTOR x the timeout), as in the worker.
        self._warm: set[tuple[str, str]] = set()

    # -- life cycle

    def start(self) -> IsolatedImplementation:
        """Start the worker and resolve the implementation there (raises
        ImplementationError, WorkerDied or WorkerTimedOut)."""
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        self._log = tempfile.NamedTemporaryFile(prefix="conformance-worker-", suffix=".log", delete=False)
        self._clock = tempfile.TemporaryFile()
        os.pwrite(self._clock.fileno(), CALL_CLOCK.pack(0.0), 0)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "conformance.isolation.worker", str(request_r), str(reply_w),
             str(self._clock.fileno())],
            pass_fds=(request_r, reply_w, self._clock.fileno()), stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=os.getcwd(),
        )
        os.close(request_r)
        os.close(reply_w)
        self._to_worker, self._from_worker = request_w, reply_r
        self.starts += 1
        self._warm = set()
        # Resolution probes with ~20 calls, each limited by the worker's own guard (the
        # first one may compile: COMPILE_FACTOR x the timeout).
        limit = None if not self.timeout else (30 + COMPILE_FACTOR) * self.timeout + 120
        reply, _ = self._request({"op": "resolve", "spec": self.spec, "options": self.options,
                                  "timeout": self.timeout}, limit=limit)
        if "error" in reply:
            self.close()
            raise ImplementationError(reply["error"])
        self.description = reply["implementation"]
        return IsolatedImplementation.from_description(self.description)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def close(self) -> None:
        """Stop the worker (killed: it may be stuck in the implementation)."""
        for fd in (self._to_worker, self._from_worker):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._to_worker = self._from_worker = -1
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
        if self._clock is not None:
            self._clock.close()
            self._clock = None
        if self._log is not None:
            self._log.close()
            try:
                os.unlink(self._log.name)
            except OSError:
                pass
            self._log = None

    def _log_tail(self, lines: int = 6) -> str:
        if self._log is None:
            return ""
        try:
            text = Path(self._log.name).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    # -- requests

    def _request(self, header: dict[str, Any], arrays: dict[str, np.ndarray] | None = None, *,
                 limit: float | None, first_call: bool = False) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """Send a request; read replies until the answer. ``limit``: seconds the whole
        request may take (None: only the per-call timeout applies); ``first_call``: the
        request's first call is the worker's first of its dtype and device, and may
        compile. Each call is judged as ``guard.guarded_call`` judges one: the time the
        worker's threads waited for a CPU other processes held is not counted
        (``guard.CpuWait``), up to ``guard.MAX_STRETCH`` x the limit."""
        try:
            _write_frame(self._to_worker, header, arrays)
        except OSError:
            pass  # it died: the read below says how
        start = last_call_end = time.monotonic()
        # Between waits, read the call clock: how long the current call has run.
        poll = min(max(self.timeout / 10, 0.02), 1.0) if self.timeout else 1.0
        seen, call_limit, first, wait = 0.0, self.timeout, False, None
        while True:
            ready, _, _ = select.select([self._from_worker], [], [], poll)
            if ready:
                try:
                    return _read_frame(self._from_worker)
                except (EOFError, OSError, struct.error, ValueError):
                    raise self._died(self._call_started() > 0) from None
            now, call_started = time.monotonic(), self._call_started()
            if call_started:
                last_call_end = now
                if call_started != seen:  # a new call
                    seen, first, first_call = call_started, first_call, False
                    call_limit = COMPILE_FACTOR * self.timeout if first else self.timeout
                    wait = None
                elapsed = now - call_started
                if self.timeout and elapsed > call_limit:
                    if wait is None:  # overdue: measure how long the machine keeps it waiting
                        wait = CpuWait(pid=self.process.pid if self.process is not None else None,
                                       since=call_started)
                        continue
                    waited = wait.waited()
                    if judge(call_limit, elapsed, waited) <= 0:
                        self._kill()
                        raise WorkerTimedOut(CallTimedOut(self.timeout, limit=call_limit, first=first,
                                                          waited=waited, seconds=elapsed))
            elif (limit is not None and now - start > limit) or now - last_call_end > self.SUITE_LIMIT:
                self._kill()
                raise RuntimeError(
                    f"the isolated worker did not answer {header['op']!r} within "
                    f"{limit if limit is not None else self.SUITE_LIMIT:g}s (the suite's own code, "
                    "or resolution); it was killed"
                )

    def _call_started(self) -> float:
        """When the call into the implementation now running started (0: none runs)."""
        try:
            return CALL_CLOCK.unpack(os.pread(self._clock.fileno(), CALL_CLOCK.size, 0))[0]
        except (OSError, struct.error, AttributeError):
            return 0.0

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def _died(self, during_call: bool) -> WorkerDied:
        """What ended the worker. A worker ended by a user's signal (SIGTERM sent to the
        process group, SIGINT, SIGHUP) did not crash: the run is being stopped, so this
        raises :class:`~conformance.isolation.crash_markers.Interrupted` instead (nothing recorded)."""
        assert self.process is not None
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._kill()
        returncode = self.process.returncode
        if returncode is not None and -returncode in INTERRUPT_SIGNALS:
            self.close()
            raise Interrupted(-returncode)
        return WorkerDied(_how_it_ended(returncode), self._log_tail(), during_call)

    def check(self, property_id: str, target: Any, case: Any) -> float | None:
        """Run property ``property_id``'s check on ``case`` in the worker; returns its
        ratio or raises what it raised (a PropertyFailure subclass, or RuntimeError
        for an error of the suite itself). A hang or a crash kills the worker (a fresh
        one is started on the next call) and raises ImplementationHung /
        ImplementationCrashed."""
        from conformance.core import target as guarded
        from conformance.core.compare import PropertyFailure
        from conformance.core.target import ImplementationCrashed, ImplementationHung

        if not self.alive:
            self.close()
            try:
                self.start()
            except WorkerDied as died:
                record_crash(self.spec, f"{died.how} while resolving it again")
                raise ImplementationCrashed(
                    f"{self.spec} ended a fresh isolated worker process while it was resolved "
                    f"again, before {property_id}[{target.id}] could run: {died.how}"
                ) from None
            except (ImplementationError, RuntimeError) as err:
                raise PropertyFailure(
                    f"a fresh isolated worker could not resolve {self.spec} again (it had the first "
                    f"time): {err}"
                ) from None
        meta, arrays = encode_case(case)
        # Passing calls' attributes only matter to expected failures of this property
        # (--xfail-file's included: they are added here, not in the worker).
        attrs = bool(ExpectedFailureLedger(target.impl.expected_failures, property_id))
        header = {"op": "check", "property": property_id, "level": target.level, "dtype": target.dtype,
                  "device": target.device, "timeout": target.timeout, "case": meta, "attrs": attrs}
        name = target.impl.name
        hung = (f"{name} did not return within {target.timeout:g}s (per-example timeout, "
                "--example-timeout); its isolated worker process was killed and a fresh one continues")
        first = (target.dtype, target.device) not in self._warm
        self._warm.add((target.dtype, target.device))
        try:
            reply, reply_arrays = self._request(header, arrays, limit=None, first_call=first)
        except WorkerTimedOut as timed_out:
            self.close()
            raise ImplementationHung(
                f"{name} {timed_out} (per-example timeout, --example-timeout); its isolated worker "
                "process was killed and a fresh one continues") from None
        except WorkerDied as died:
            self.close()
            record_crash(self.spec, f"{died.how} during {property_id}[{target.id}]")
            where = "during a call into it" if died.during_call else "between calls (in the suite's code)"
            log = f"\nlast output of the worker:\n{died.log}" if died.log else ""
            raise ImplementationCrashed(
                f"{name} ended its isolated worker process {where}: {died.how}; "
                f"a fresh worker continues{log}"
            ) from None
        if "ratio" in reply:
            if target.log is not None:
                target.log.calls.extend(CalledAttrs(attrs) for attrs in reply.get("called", ()))
            return reply["ratio"]
        if target.log is not None and reply.get("calls"):
            target.log.calls.extend(decode_calls(reply["calls"], reply_arrays, case))
        if reply.get("failure") == "ImplementationHung":  # the worker's own guard saw it first
            self.close()  # its call thread is still running
            # Its message says the limit it applied (a first call's allowance, a stretch).
            said = str(reply.get("message", "")).split(" (per-example timeout", 1)[0]
            raise ImplementationHung(
                f"{said} (per-example timeout, --example-timeout); its isolated worker process was "
                "killed and a fresh one continues" if said.startswith(f"{name} did not return") else hung)
        if reply.get("restart"):  # a CUDA fault broke the worker's context: no call of it can succeed
            self.close()
            record_crash(self.spec, f"broke the CUDA context during {property_id}[{target.id}]")
        if "failure" in reply:
            cls = getattr(guarded, reply["failure"], None)  # its failure classes by name
            if not (isinstance(cls, type) and issubclass(cls, PropertyFailure)):
                cls = PropertyFailure
            raise cls(reply["message"])
        raise RuntimeError(f"the suite raised in the isolated worker: {reply.get('error')}")

    def annotate(self, property_id: str, target: Any, record: Any, first_case: Any = None) -> str:
        """For a failure of ``record`` (its ``failing_case`` is the shrunk case): the
        worker checks the case again (after ``first_case``, the failing case before
        shrinking, when given), diagnoses it and picks the call that alone shows the
        failure. Sets ``record.causes``, ``record.failing_calls`` and
        ``record.picked_call`` (the call and whether it alone shows the failure) and
        returns the diagnosis line. Never raises: a worker that cannot answer gives a
        ``diagnosis failed`` line and leaves the record as it was."""
        case = record.failing_case
        if not self.alive:
            return "probable cause: (diagnosis failed: the isolated worker process is not running)"
        meta, arrays = encode_case(case)
        arrays = prefixed(arrays, "case/")
        header = {"op": "annotate", "property": property_id, "level": target.level, "dtype": target.dtype,
                  "device": target.device, "timeout": target.timeout, "case": meta, "first": None}
        if first_case is not None:
            header["first"], first_arrays = encode_case(first_case)
            arrays.update(prefixed(first_arrays, "first/"))
        try:
            reply, reply_arrays = self._request(header, arrays, limit=self.SUITE_LIMIT)
        except (WorkerTimedOut, WorkerDied, RuntimeError) as err:
            self.close()
            return (f"probable cause: (diagnosis failed: the isolated worker process ended while "
                    f"diagnosing: {type(err).__name__} {err}; a fresh worker continues)")
        if "error" in reply:
            return f"probable cause: (diagnosis failed in the isolated worker: {reply['error'].strip().splitlines()[-1]})"
        calls = decode_calls(reply["calls"], reply_arrays, case)
        record.causes = reply["causes"]
        if calls:
            record.failing_calls = tuple(calls)
        if reply["picked"] is not None:
            record.picked_call = (calls[reply["picked"]], reply["shows"])
        line = reply["line"]
        if not reply["failed_again"]:
            line += " (the case passed when checked again in the worker: the implementation is not deterministic)"
        return line
