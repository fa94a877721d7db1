"""The target and the guarded call: what every layer above needs to call an implementation.

A :class:`Target` is one certification target (an implementation at a level, dtype and
device); every call into the implementation goes through :func:`call_guarded` (and so
through ``implementations.guard``, the one guarded path: timeout, exceptions captured,
global state restored), which turns an exception or a hang into
:class:`ImplementationRaised` or :class:`ImplementationHung`; an isolated worker that
ends during a call is :class:`ImplementationCrashed`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

from conformance.core import devices
from conformance.core.compare import PropertyFailure
from implementations import guard
from implementations.base import Capabilities, Implementation

__all__ = [
    "Target",
    "ImplementationRaised",
    "ImplementationHung",
    "ImplementationCrashed",
    "call_guarded",
    "subject_of",
]


class ImplementationRaised(PropertyFailure):
    """The implementation raised on a case it claims to support."""


class ImplementationHung(PropertyFailure):
    """The implementation did not return within the per-example timeout."""


class ImplementationCrashed(PropertyFailure):
    """The implementation ended its (isolated worker) process during a call."""


@dataclass(frozen=True)
class Target:
    """One certification target: an implementation at a level, dtype and device."""

    impl: Implementation
    level: str
    dtype: str
    device: str
    timeout: float = 60.0
    #: At most this many distinct shapes per property (``--shape-budget``); None: no budget.
    shape_budget: int | None = None
    #: The calls the current example made (``calls.sdpa.run_sdpa``/``calls.mha.run_mha``
    #: append to it); the runner hands each example a copy of the target with a fresh log.
    log: Any = field(default=None, compare=False, repr=False)
    #: Inside an isolated worker: a context manager around each call into the
    #: implementation that tells the pytest process, which enforces ``timeout``.
    watch: Callable[[], ContextManager[Any]] | None = field(default=None, compare=False, repr=False)
    #: In a run of several implementations, its implementation's label (``Session.subjects``);
    #: "" in a run of one.
    label: str = ""

    @property
    def caps(self) -> Capabilities:
        """The implementation's capabilities at this level, in this dtype (``by_dtype``)."""
        return self.impl.caps(self.level).for_dtype(self.dtype)

    @property
    def id(self) -> str:
        return f"{self.level}-{self.dtype}-{self.device}"

    @property
    def test_id(self) -> str:
        """The test's parameter id: :attr:`id`, after the implementation's label if any."""
        return f"{self.label}-{self.id}" if self.label else self.id

    @property
    def tf32(self) -> bool:
        return self.device == "cuda" and self.dtype == "float32" and self.caps.tf32


def call_guarded(target: Target, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call into the implementation: exceptions and hangs become property failures.

    Goes through :func:`implementations.guard.guarded_call`: the call runs in a
    daemon call thread (reused from call to call) so that a hang fails the property
    after ``target.timeout`` seconds (that thread cannot be killed and is left
    behind, counted on the certificate), every exception is captured, and the global
    NumPy and torch settings the suite computes under are restored afterwards. In an
    isolated worker (``target.watch``) the pytest process also watches the call, and
    kills the worker when it hangs. (The call runs in a call thread there too: with a
    new thread a call, torch's intra-op threads ran 2-3x faster on a busy 2-core
    machine than reused by the worker's main thread; the reused call thread is
    faster than both: ``--isolate=always`` sdpa under ci, float64 and float16,
    9.3 s against 10.1 s.)
    """
    # The first call of each implementation, dtype and device may compile (guard.COMPILE_FACTOR).
    warm_key = (id(target.impl), target.dtype, target.device)
    if target.device.startswith("cuda"):
        fn = _synchronized(fn, target.device)
    try:
        if target.watch is not None:
            with target.watch():
                return guard.guarded_call(fn, *args, timeout=target.timeout, warm_key=warm_key, **kwargs)
        return guard.guarded_call(fn, *args, timeout=target.timeout, warm_key=warm_key, **kwargs)
    except guard.CallTimedOut as exc:
        raise ImplementationHung(
            f"{target.impl.name} {exc} "
            "(per-example timeout, --example-timeout); the call's thread cannot be stopped and "
            "keeps running (--isolate=always runs the implementation in a worker process that is "
            "killed instead)"
        ) from None
    except guard.CallRaised as exc:
        fault = devices.context_breaking_error(exc.error)
        if fault is not None:
            raise ImplementationCrashed(broke_context_message(target.impl.name, fault)) from exc.error
        raise ImplementationRaised(
            f"{target.impl.name} raised on a case it claims to support: {guard.summarise(exc.error)}"
        ) from exc.error


def _synchronized(fn: Callable[..., Any], device: str) -> Callable[..., Any]:
    """``fn`` followed by a wait for the device: CUDA reports a kernel's fault
    asynchronously, and without the wait the suite's next copy of a tensor would raise
    it, outside the guarded call."""
    def call(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        devices.synchronize(device)
        return result
    return call


def broke_context_message(name: str, fault: str) -> str:
    """The failure of the call whose fault broke the process's CUDA context."""
    return (f"{name} broke the CUDA context of this process on a case it claims to support: {fault}. "
            "No later CUDA call of the process can succeed, so this process checks nothing more on "
            "cuda; run again, and --isolate=auto runs the implementation in a worker process that "
            "restarts after such a fault (this crash is recorded), or pass --isolate=always")


def subject_of(session: Any, target: Target) -> Any:
    """What the run keeps for ``target``'s implementation (``impl_spec``, ``options``,
    ``isolation``, ``broken_cases``...): its ``Session.subject`` in a run of several
    implementations, the session itself (the same fields) in a run of one."""
    return session.subject(target.label) if target.label else session
