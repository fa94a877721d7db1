"""One example's check, as the runner, the directed-first pass and the sweeps make it:
in the isolated worker when there is one; a case that already hung or crashed fails
fast; and the attributes of the calls it made (what expected failures are matched
against)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np

from conformance.core import devices
from conformance.core.target import (
    ImplementationCrashed,
    ImplementationHung,
    Target,
    broke_context_message,
    subject_of,
)
from conformance.harness.session import Session
from conformance.isolation import supervisor as isolation

__all__ = ["check_example", "called_attrs", "cuda_context_guard"]


def check_example(session: Session, property_id: str, check: Callable[[Target, Any], float | None],
                   target: Target, case: Any) -> float | None:
    """``check(target, case)``, in the isolated worker when there is one; a case that
    already hung or crashed fails fast; a hang or crash ends the search."""
    owner = subject_of(session, target)
    digest = isolation.case_digest(case) if owner.broken_cases else None
    if digest in owner.broken_cases:
        cls, where, message = owner.broken_cases[digest]
        raise cls(f"{message}\n(this case was not run again: it already failed so in {where}; "
                  "a case that hangs or crashes is tried once per session)")
    try:
        # numpy's float warnings (overflow in a float16 cast, inf - inf) are the comparison's
        # business, not the user's: they never reach the output
        with cuda_context_guard(owner, property_id, target), np.errstate(all="ignore"):
            if owner.isolation is not None:
                return owner.isolation.check(property_id, target, case)
            return check(target, case)
    except (ImplementationHung, ImplementationCrashed) as exc:
        owner.broken_cases[digest or isolation.case_digest(case)] = (
            type(exc), f"{property_id}[{target.id}]", str(exc))
        raise


def called_attrs(log: Any, case: Any) -> list[dict[str, Any]]:
    """Attributes of the cases an example called (the drawn case's when it made no
    call): what expected failures are matched against."""
    return [call.attrs() for call in log.calls] or [case.attrs()]


@contextmanager
def cuda_context_guard(owner: Any, property_id: str, target: Target) -> Iterator[None]:
    """In-process on CUDA (a no-op elsewhere and when isolated): refuse to run once a
    fault broke this process's CUDA context (every CUDA call fails since, the suite's own
    copies included), and turn such a fault into the crash of the implementation where
    the suite's code met it first. The first fault is recorded for ``--isolate=auto``."""
    if owner.isolation is not None or not target.device.startswith("cuda"):
        yield
        return
    broken = devices.broken_context()
    if broken is not None:
        raise ImplementationCrashed(
            f"not run: the CUDA context of this process was broken by {target.impl.name} in "
            f"{broken.where} ({broken.error}), and every CUDA call of the process fails since. Run "
            "again: --isolate=auto now runs it in a worker process that restarts after such a "
            "fault (the crash is recorded), or pass --isolate=always")
    try:
        yield
    except Exception as exc:
        fault = devices.context_breaking_error(exc)
        if fault is None:
            raise
        if devices.broken_context() is None:
            devices.note_broken_context(fault, f"{property_id}[{target.id}]")
            isolation.record_crash(owner.impl_spec, f"broke the CUDA context in {property_id}[{target.id}]: {fault}")
        if isinstance(exc, ImplementationCrashed):
            raise
        # the suite's own code met the fault first (a copy of the output)
        raise ImplementationCrashed(broke_context_message(target.impl.name, fault)) from exc
