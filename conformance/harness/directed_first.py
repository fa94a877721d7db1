"""Every property's directed cases before any random search, in a run that stops early.

Each property test runs its directed cases (``conformance.directed.examples``: the smallest
cases of the known bug classes) and then its Hypothesis search. A run that stops at its
first failure (``-x``, ``--maxfail``, ``--impl-exitfirst``) would pay, on a wrong
implementation caught by a directed case of a later property, for the searches of every
property before it. So such a run starts with a *directed pass*: before the first test,
each property test's directed cases are checked in the tests' order (the measured kill
order, ``conformance.harness.ordering``), for one implementation after another; at an
implementation's first failure that no expected failure excuses, its pass stops and
that test moves to the front of the implementation's tests. The test then fails on the
same case first, and the run stops there. After every directed case, the sweeps
(``conformance.harness.sweep``: every small size in turn, deterministic like the directed cases
but seconds long) run whole, the same way.

Nothing is checked twice: a directed case that passed in the pass is not called again
by its test, which counts it (examples, headroom, expected failures' covered passes)
from what the pass kept (:func:`cases`); a failing or excused one is checked again by
its test, which reports it at once, as written (elsewhere a failing directed case is
followed by the search, to report a smaller shrunk case if it finds one: a second or so
that a run stopping early does not spend); a sweep that passed is reported by its test
from the pass's count (:func:`swept`). A correct implementation pays nothing for the
pass, and gets the same certificate. Under xdist (its own scheduling) and ``--replay``
there is no pass.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest

from conformance.core.compare import PropertyFailure
from conformance.harness.session import Session, session_of

__all__ = ["enabled", "run", "cases", "swept", "NO_DIRECTED"]

#: Set (to anything), no property runs its directed cases: a measurement of what the plain
#: Hypothesis search finds alone (docs/ZOO.md's shrunk-case sizes), not a way to certify.
NO_DIRECTED = "ATTENTION_CONFORMANCE_NO_DIRECTED"


def enabled(config: pytest.Config) -> bool:
    """Whether this run stops early enough for the directed pass to pay off."""
    session = session_of(config)
    if session is None or not session.subjects or session.replay is not None:
        return False
    if hasattr(config, "workerinput") or getattr(config.option, "numprocesses", None):
        return False  # xdist schedules the tests itself
    return bool(getattr(config.option, "maxfail", 0)) or session.exitfirst


def run(items: list[pytest.Item], config: pytest.Config) -> None:
    """The directed pass over ``items`` (pytest's list, reordered in place)."""
    session = session_of(config)
    assert session is not None
    session.stops_early = True
    for label, subject in session.subjects.items():
        mine = [i for i, item in enumerate(items) if _property_of(item) and _target(item).label == label]
        failing = next((i for i in mine if _directed_fails(session, items[i])), None)
        if failing is None:  # the sweeps (seconds each, not milliseconds) after every directed case
            failing = next((i for i in mine if _sweep_fails(session, items[i])), None)
        if failing is not None:
            items.insert(mine[0], items.pop(failing))
        if session.compares and subject.isolation is not None:
            subject.isolation.close()  # started again on its first check: one worker at a time


def cases(session: Session, property_id: str, target: Any) -> list[tuple[Any, Any]]:
    """The directed cases of ``property_id`` on ``target``, in order, each with
    ``(ratio, calls)`` when the directed pass checked it and it passed, else None."""
    from conformance.core.registry import registered_properties

    kept = session.directed.pop((property_id, target.test_id), None)
    if kept is not None:
        return kept
    if os.environ.get(NO_DIRECTED):
        return []
    directed = registered_properties()[property_id].directed
    return [(case, None) for case in directed(target)] if directed is not None else []


def swept(session: Session, property_id: str, target: Any) -> Any:
    """The Sweep (``conformance.harness.sweep``) the directed pass ran whole for sweep property
    ``property_id`` on ``target`` and that passed; None if it did not run it."""
    return session.directed.pop((property_id, target.test_id), None)


def _property_of(item: pytest.Item) -> str | None:
    return getattr(getattr(item, "function", None), "conformance_property", None)


def _target(item: pytest.Item) -> Any:
    return item.callspec.params["target"]  # type: ignore[attr-defined]


def _mark_running(session: Session, item: pytest.Item) -> None:
    """Point this process's crash marker at ``item``'s implementation before calling it:
    a crash here is that implementation's (``conformance.isolation.crash_markers``)."""
    from conformance.isolation import supervisor as isolation

    isolation.mark_running(session.subject(_target(item).label).impl_spec, f"{item.nodeid} (directed pass)")


def _runs(info: Any, target: Any) -> bool:
    """Whether property ``info``'s test runs on ``target`` (does not skip)."""
    from conformance.core.registry import skip_reasons

    return target.level == info.level and not skip_reasons(info, target)


def _sweep_fails(session: Session, item: pytest.Item) -> bool:
    """Run ``item``'s sweep whole, if it is a sweep property's test: True when it fails;
    a sweep that passes is kept for its test (:func:`swept`)."""
    from conformance.core.registry import Record, registered_properties

    property_id, target = _property_of(item), _target(item)
    info = registered_properties()[property_id]
    try:
        if info.sweep is None or not _runs(info, target):
            return False
        _mark_running(session, item)
        record = Record(property_id, target.level, target.dtype, target.device)
        session.directed[(property_id, target.test_id)] = info.sweep(target, session, record)
    except Exception:  # a failure (PropertyFailure), or the suite's own error: the test shows it, first
        return True
    return False


def _directed_fails(session: Session, item: pytest.Item) -> bool:
    """Check ``item``'s directed cases until one fails unexcused (True); the passing
    ones are kept for the test (:func:`cases`)."""
    from conformance.diagnosis import diagnose as diagnosis
    from conformance.core.expectations import ExpectedFailureLedger
    from conformance.calls.replay import CallLog
    from conformance.core.registry import registered_checks, registered_properties
    from conformance.harness.checking import called_attrs, check_example

    property_id, target = _property_of(item), _target(item)
    info = registered_properties()[property_id]
    try:
        if info.directed is None or not _runs(info, target) or os.environ.get(NO_DIRECTED):
            return False
        kept: list[tuple[Any, Any]] = [(case, None) for case in info.directed(target)]
    except Exception:  # the suite's own error: the test shows it, first
        return True
    session.directed[(property_id, target.test_id)] = kept
    _mark_running(session, item)
    check = registered_checks()[property_id]
    ledger = ExpectedFailureLedger(target.impl.expected_failures, property_id)
    for index, (case, _) in enumerate(kept):
        log = CallLog()
        diagnosis.start_example(case)
        try:
            ratio = check_example(session, property_id, check, dataclasses.replace(target, log=log), case)
        except PropertyFailure:
            if ledger and ledger.excuse(called_attrs(log, case)) is not None:
                continue  # an expected failure: its test checks it again and counts it
            return True
        except Exception:  # the suite's own error: the test shows it, first
            return True
        kept[index] = (case, (ratio, tuple(log.calls)))
    return False
