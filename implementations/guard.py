"""The one guarded path for every call into an implementation's own code.

Everything that runs code the suite did not write goes through :func:`guarded_call`:
importing a user's module or file, building an implementation, capability probing
(``implementations.registry``), and every call the property tests make
(``conformance.core.target.call_guarded``, which turns the two exceptions below into
property failures). A guarded call

* runs under a **timeout** (``timeout`` seconds, ``0`` or ``None``: no limit): the
  call runs in a daemon thread named ``implementation-call``; one that does not return
  in time raises :class:`CallTimedOut`. A thread cannot be killed, so it is left behind
  (:func:`leftover_threads` counts those still running: a pure-Python spin slows
  everything after it; ``pytest --isolate=always`` runs the implementation in a worker
  process that is killed instead, see ``conformance.isolation.supervisor``). The thread is reused
  from call to call (a new thread for every call cost 100-250 us a call, most of a
  tiny case's time: torch sets up its thread-local state afresh in each thread), and
  it starts each call as a new thread would: the caller's grad mode, and no inference
  mode, autocast or torch function/dispatch mode left over from an earlier call (a
  call that leaves one of those on retires its thread, and the next call gets a new
  one), see :class:`_CallThread`;
* judges a hang by **what the machine gave the call**, not by the wall clock alone
  (see :func:`guarded_call`, "Timeouts" in docs/DESIGN.md): the first call with a
  ``warm_key`` (the first call into an implementation, of a dtype, on a device: it may
  compile, autotune or initialise lazily) may take :data:`COMPILE_FACTOR` times the
  timeout, and the time the call's thread spent waiting for a CPU that other processes
  held (the run-queue wait the kernel reports in ``/proc/self/task/<tid>/schedstat``;
  elsewhere, the load average above the CPU count) does not count against it, up to
  :data:`MAX_STRETCH` times the limit in wall-clock time. A call that sleeps forever
  times out after the limit; one that spins on a loaded machine after at most
  ``MAX_STRETCH`` times the limit;
* **captures every exception** the call raises, ``SystemExit`` included, as
  :class:`CallRaised` (``KeyboardInterrupt`` still stops the run);
* **restores the global state the suite's own arithmetic depends on** when the call
  returns (see :class:`GlobalState`): NumPy's floating-point error handling and print
  options, torch's grad mode, default dtype, deterministic-algorithms flag, float32
  matmul precision and anomaly mode, and, with ``rng=True``, the random number
  generators of ``random``, NumPy and torch. The call itself sees the caller's state:
  thread-local settings (grad mode, the NumPy error state) are carried into the call's
  thread.

Random generators are restored only where asked (resolution and probing do): the
property tests' dropout checks need successive calls to draw fresh randomness, and
Hypothesis seeds the global generators itself for every example.

This module lives in ``implementations`` because the registry's probing needs it and
``implementations`` never imports ``conformance``; it imports nothing but the standard
library, NumPy, and torch when torch is already imported.
"""

from __future__ import annotations

import contextvars
import os
import queue
import random
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

__all__ = [
    "CALL_THREAD_NAME",
    "COMPILE_FACTOR",
    "MAX_STRETCH",
    "CpuWait",
    "overdue_wait",
    "CallRaised",
    "CallTimedOut",
    "GlobalState",
    "GuardedCallFailed",
    "guarded_call",
    "first_call_limit",
    "judge",
    "leftover_threads",
    "slow_first_calls",
    "summarise",
]

#: Name of the threads guarded calls run in (how :func:`leftover_threads` finds them).
CALL_THREAD_NAME = "implementation-call"


class GuardedCallFailed(Exception):
    """A guarded call did not return a value."""


class CallRaised(GuardedCallFailed):
    """The call raised ``error`` (any exception, ``SystemExit`` included)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        super().__init__(summarise(error))


#: The first call with a ``warm_key`` may take this many times the timeout: it may
#: compile (JIT, autotuning, lazy initialisation); 5 x the default 60 s is 300 s, the
#: time an import or a build may take (``implementations.registry.probing.BUILD_TIMEOUT``).
COMPILE_FACTOR = 5.0
#: A loaded machine may stretch a call's limit to at most this many times in wall-clock
#: time (the CPU time other processes took from the call is not counted against it).
MAX_STRETCH = 4.0
#: Seconds above its timeout a first call took, by ``warm_key`` (see :func:`slow_first_calls`).
_slow_first: dict[Any, float] = {}
_warm: set[Any] = set()


class CallTimedOut(GuardedCallFailed):
    """The call did not return within its limit (its thread is left running).

    ``timeout``: the timeout asked for; ``limit``: the seconds it was given (a first
    call's compile allowance, ``COMPILE_FACTOR`` x ``timeout``); ``waited``: seconds its
    thread waited for a CPU held by other processes, not counted; ``seconds``: the
    wall-clock time it ran. The message says each of these that applied."""

    def __init__(self, timeout: float, *, limit: float | None = None, first: bool = False,
                 waited: float = 0.0, seconds: float | None = None) -> None:
        self.timeout, self.first, self.waited = timeout, first, waited
        self.limit = timeout if limit is None else limit
        self.seconds = self.limit + waited if seconds is None else seconds
        notes = []
        if first:
            notes.append(f"its first call: {COMPILE_FACTOR:g} x the {timeout:g}s timeout allowed "
                         "for compilation and lazy initialisation")
        if waited >= 0.05 * self.limit:
            notes.append(f"{self.seconds:.1f}s of wall-clock time, {waited:.1f}s of it waiting for a "
                         "CPU that other processes held, not counted")
        detail = f" ({'; '.join(notes)})" if notes else ""
        super().__init__(f"did not return within {self.limit:g}s{detail}")


class CpuWait:
    """Seconds a call's threads have waited, runnable, for a CPU other processes held,
    since ``since`` (the call's start): the kernel's run-queue wait
    (``/proc/<pid>/task/<tid>/schedstat``, its second field), the largest over the
    threads watched (``tid``: that one thread; None: every thread of ``pid``), observed
    from when this is made, and before that extrapolated at the rate observed since.
    Made only once a call is overdue, so a call that returns in time costs no read of
    ``/proc`` (26 us, a third of a tiny guarded call). Where the kernel does not report
    it, an estimate from the load average: of the wall time, the share by which the
    load oversubscribes the CPUs this process may use."""

    def __init__(self, pid: int | None = None, tid: int | None = None,
                 since: float | None = None) -> None:
        self.pid, self.tid = pid or os.getpid(), tid
        self.started = time.monotonic()
        self.since = self.started if since is None else min(since, self.started)
        self.base = self._read()

    def _read(self) -> dict[int, int] | None:
        task = f"/proc/{self.pid}/task"
        try:
            tids = [self.tid] if self.tid is not None else [int(t) for t in os.listdir(task)]
            out = {}
            for tid in tids:
                try:
                    with open(f"{task}/{tid}/schedstat") as f:
                        out[tid] = int(f.read().split()[1])
                except (OSError, IndexError, ValueError):
                    continue
            return out or None
        except (OSError, ValueError):
            return None

    def waited(self) -> float:
        now, read = time.monotonic(), self._read()
        if self.base is not None and read is not None:
            observed = max([(ns - self.base.get(tid, ns)) / 1e9 for tid, ns in read.items()], default=0.0)
            span = now - self.started
            rate = min(1.0, observed / span) if span > 0 else 0.0
            return observed + rate * (self.started - self.since)
        try:  # no schedstat: the load average above the CPUs this process may use
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            oversubscribed = max(0.0, 1.0 - (cpus or 1) / max(os.getloadavg()[0], 1e-9))
        except (OSError, AttributeError):
            return 0.0
        return oversubscribed * (now - self.since)


def overdue_wait(limit: float) -> float:
    """Seconds an overdue call is watched before it is judged (how long the machine keeps
    it waiting is measured over them): a tenth of its limit, 20 ms at least."""
    return max(0.02, 0.1 * limit)


def judge(limit: float, elapsed: float, waited: float) -> float:
    """Seconds more a call that has run ``elapsed`` seconds, ``waited`` of them waiting
    for a CPU, may run under ``limit`` (0: it timed out): ``elapsed - waited`` may reach
    ``limit``, ``elapsed`` may reach ``MAX_STRETCH`` x ``limit``."""
    return max(0.0, min(limit - (elapsed - waited), MAX_STRETCH * limit - elapsed))


def slow_first_calls() -> dict[Any, float]:
    """``warm_key`` -> seconds, of every first call that took longer than its timeout
    (and passed only because of the compile allowance), in this process."""
    return dict(_slow_first)


def first_call_limit(timeout: float, warm_key: Any) -> tuple[float, bool]:
    """The limit of the next call with ``warm_key`` under ``timeout`` and whether it is
    a first call (then the key is warm from now on, whatever the call does)."""
    if warm_key is None or warm_key in _warm:
        return timeout, False
    _warm.add(warm_key)
    return COMPILE_FACTOR * timeout, True


def summarise(exc: BaseException) -> str:
    """``Type: message (at file:line)`` for the innermost frame, on one line."""
    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})"
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}" + where if message else f"{type(exc).__name__}{where}"


@dataclass(frozen=True)
class GlobalState:
    """The process-wide and thread-local settings an implementation may change and the
    suite depends on. :meth:`capture` reads them, :meth:`restore` writes them back (only
    the ones that changed); ``rng`` holds the random generators' states when captured
    with ``rng=True``."""

    numpy_err: dict[str, str]
    numpy_errcall: Any
    numpy_print: dict[str, Any]
    torch: tuple[Any, ...] | None
    rng: tuple[Any, ...] | None

    @classmethod
    def capture(cls, *, rng: bool = False) -> GlobalState:
        torch = sys.modules.get("torch")
        torch_state = None
        if torch is not None:
            torch_state = (
                torch.is_grad_enabled(),
                torch.get_default_dtype(),
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
                torch.get_float32_matmul_precision(),
                torch.is_anomaly_enabled(),
            )
        rng_state = None
        if rng:
            rng_state = (random.getstate(), np.random.get_state(),
                         torch.get_rng_state() if torch is not None else None)
        return cls(np.geterr(), np.geterrcall(), np.get_printoptions(), torch_state, rng_state)

    def restore(self) -> None:
        if np.geterr() != self.numpy_err:
            np.seterr(**self.numpy_err)
        if np.geterrcall() is not self.numpy_errcall:
            np.seterrcall(self.numpy_errcall)
        if np.get_printoptions() != self.numpy_print:
            np.set_printoptions(**self.numpy_print)
        torch = sys.modules.get("torch")
        if torch is not None and self.torch is not None:
            grad, default_dtype, deterministic, warn_only, matmul, anomaly = self.torch
            if torch.is_grad_enabled() != grad:
                torch.set_grad_enabled(grad)
            if torch.get_default_dtype() != default_dtype:
                torch.set_default_dtype(default_dtype)
            if (torch.are_deterministic_algorithms_enabled(),
                    torch.is_deterministic_algorithms_warn_only_enabled()) != (deterministic, warn_only):
                torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
            if torch.get_float32_matmul_precision() != matmul:
                torch.set_float32_matmul_precision(matmul)
            if torch.is_anomaly_enabled() != anomaly:
                torch.set_anomaly_enabled(anomaly)
        if self.rng is not None:
            py_state, np_state, torch_rng = self.rng
            random.setstate(py_state)
            np.random.set_state(np_state)
            if torch is not None and torch_rng is not None:
                torch.set_rng_state(torch_rng)

    def enter_thread(self) -> None:
        """Carry the caller's thread-local settings into a new thread (grad mode;
        NumPy's error state travels with the copied context)."""
        torch = sys.modules.get("torch")
        if torch is not None and self.torch is not None and torch.is_grad_enabled() != self.torch[0]:
            torch.set_grad_enabled(self.torch[0])


def _fresh_thread_state() -> bool:
    """Whether this thread's torch thread-local state is what a new thread starts with
    (grad mode aside: every call sets the caller's): no inference mode, no autocast,
    no torch function or dispatch mode on the stack. True without torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return True
    try:
        if torch.is_inference_mode_enabled():
            return False
        if any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda")):
            return False
        C = torch._C
        return C._len_torch_function_stack() == 0 and C._len_torch_dispatch_stack() == 0
    except Exception:  # noqa: BLE001 - a torch without one of these: trust nothing
        return False


class _CallThread(threading.Thread):
    """A daemon thread that runs guarded calls one after another.

    ``submit(job)`` hands it a job and returns a lock that is released when the job
    has run. After each job the thread checks that it is still as a new thread would
    be (:func:`_fresh_thread_state`): if not it retires (ends) instead of taking the
    next job. A job whose caller stopped waiting (a timeout) keeps the thread: it is
    never handed out again (``busy`` stays true while it runs, which is how
    :func:`leftover_threads` tells it from an idle one).
    """

    def __init__(self) -> None:
        super().__init__(name=CALL_THREAD_NAME, daemon=True)
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], threading.Lock]] = queue.SimpleQueue()
        self.busy = False
        self.retired = False
        self.tid: int | None = None  # the kernel's id of the thread (its schedstat)

    def submit(self, job: Callable[[], None]) -> threading.Lock:
        done = threading.Lock()
        done.acquire()
        self.busy = True
        self._jobs.put((job, done))
        return done

    def run(self) -> None:
        self.tid = threading.get_native_id()
        while True:
            job, done = self._jobs.get()
            clean = False
            try:
                job()  # guarded_call's job keeps every exception; should one escape, the
                clean = _fresh_thread_state()  # thread ends and is never handed out again
            finally:
                self.retired = not clean
                self.busy = False
                done.release()
            if self.retired:
                return


_idle_threads: list[_CallThread] = []
_idle_lock = threading.Lock()


def _take_call_thread() -> _CallThread:
    """An idle call thread, or a new one (a call made while another runs gets its own)."""
    with _idle_lock:
        while _idle_threads:
            thread = _idle_threads.pop()
            if thread.is_alive() and not thread.retired:
                return thread
    thread = _CallThread()
    thread.start()
    return thread


def _return_call_thread(thread: _CallThread) -> None:
    if not thread.retired:
        with _idle_lock:
            _idle_threads.append(thread)


def guarded_call(fn: Callable[..., Any], *args: Any, timeout: float | None, rng: bool = False,
                 warm_key: Any = None, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under the guard (see the module docstring).

    Returns what ``fn`` returns; raises :class:`CallRaised` (``.error`` is the
    exception, chained as the cause) or :class:`CallTimedOut`. ``timeout``: seconds,
    ``0``/``None`` for no limit (the call then runs in the caller's thread); ``rng``:
    restore the random generators afterwards too; ``warm_key``: what the call's first
    call is the first of (an implementation, a dtype, a device): the first call with a
    key gets ``COMPILE_FACTOR`` x ``timeout``. The time the call's thread waits for a
    CPU other processes hold is not counted, up to ``MAX_STRETCH`` x the limit in
    wall-clock time (:class:`CpuWait`, :func:`judge`). A ``KeyboardInterrupt`` the call
    raises is raised again in the caller.
    """
    state = GlobalState.capture(rng=rng)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except KeyboardInterrupt as exc:
            box["interrupt"] = exc
        except BaseException as exc:  # noqa: BLE001 - everything is the implementation's
            box["error"] = exc

    try:
        if timeout and timeout > 0:
            context = contextvars.copy_context()

            def in_thread() -> None:
                state.enter_thread()
                context.run(run)

            limit, first = first_call_limit(timeout, warm_key)
            worker = _take_call_thread()
            started = time.monotonic()
            done = worker.submit(in_thread)
            remaining, wait = limit, None
            while not done.acquire(timeout=remaining):
                elapsed = time.monotonic() - started
                if wait is None:  # overdue: measure how long the machine keeps it waiting
                    wait = CpuWait(tid=worker.tid, since=started)
                    remaining = min(overdue_wait(limit), max(0.0, MAX_STRETCH * limit - elapsed))
                    if remaining > 0:
                        continue
                waited = wait.waited()
                remaining = judge(limit, elapsed, waited)
                if remaining <= 0:
                    raise CallTimedOut(timeout, limit=limit, first=first, waited=waited, seconds=elapsed)
                remaining = max(remaining, 0.01)
            seconds = time.monotonic() - started
            if first and seconds > timeout:
                _slow_first[warm_key] = seconds
            _return_call_thread(worker)
        else:
            run()
    finally:
        state.restore()
    if "interrupt" in box:
        raise box["interrupt"]
    if "error" in box:
        raise CallRaised(box["error"]) from box["error"]
    return box["value"]


def leftover_threads() -> int:
    """How many guarded calls that timed out are still running in this process."""
    return sum(1 for t in threading.enumerate()
               if t.name == CALL_THREAD_NAME and t.is_alive() and getattr(t, "busy", True))
