"""The harness every property runs in.

A property is a function ``check(target, case) -> ratio | None`` plus a strategy
factory ``cases(target)`` and, optionally, ``directed(target)``: a short list of
explicit cases (``conformance.directed.examples``) run first. :func:`conformance_property`
turns it into a pytest test parametrized over targets (level × dtype × device),
which runs the directed cases, then draws cases with Hypothesis, counts examples,
tracks the worst error ratio (headroom), treats known deviations (expected-failures
files, matched against the calls each example made: ``Target.log``) as such without
stopping the search for real failures, saves the shrunk failing case and its failing
call as ``.npz`` with a reproducer, and records everything for the certificate on the session
(``conformance.harness.session``: on ``config.stash``, reached through the
``conformance_session`` fixture).

Every call into the implementation goes through :func:`conformance.core.target.call_guarded` (and so
through ``implementations.guard``, the one guarded path: timeout, exceptions
captured, global state restored). A hang or a crash ends the property's search at
once, with the case that did it (no shrinking: each step would cost a timeout or a
new worker process), and the case is remembered for the session: another property
handed the very same case fails fast instead of waiting again. With ``--isolate``
the whole check of each example runs in a worker process (``conformance.isolation.supervisor``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import FlakyFailure, FlakyReplay

from conformance.calls.replay import CallLog
from conformance.core.compare import PropertyFailure
from conformance.core.expectations import ExpectedFailureLedger
from conformance.core.registry import (
    _CHECKS,
    _PROPERTIES,
    PropertyInfo,
    Record,
    skip_reasons,
)
from conformance.core.requirements import known_requirements
from conformance.core.target import (
    ImplementationCrashed,
    ImplementationHung,
    Target,
    subject_of,
)
from conformance.harness.checking import called_attrs as _called_attrs
from conformance.harness.checking import check_example as _check_example
from conformance.harness.session import Session
from conformance.harness.suite_errors import SuiteError, suite_error
from conformance.reporting.failure_choice import (
    beside_directed,
    drop_hypothesis_notes,
    first_failure,
    group_message,
    larger,
    long_tracebacks,
)
from implementations import guard

__all__ = ["conformance_property"]


class _StopSearch(BaseException):
    """Ends Hypothesis' search at once (a BaseException, so it neither shrinks nor
    replays): the implementation hung or crashed on ``failure``'s case."""

    def __init__(self, failure: PropertyFailure) -> None:
        super().__init__(str(failure))
        self.failure = failure


def _examples_setting(factor: float) -> settings:
    base = settings.default.max_examples
    return settings(
        settings.default,
        max_examples=max(1, int(round(base * factor))),
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )


def conformance_property(
    property_id: str,
    *,
    level: str,
    section: str,
    cases: Callable[[Target], Any],
    skip_reason: Callable[[Target], str | None] | None = None,
    examples_factor: float = 1.0,
    directed: Callable[[Target], list[Any]] | None = None,
    requires: tuple[str, ...] = (),
) -> Callable[[Callable[[Target, Any], float | None]], Callable[..., None]]:
    """Register ``check`` as property ``property_id`` and return its pytest test.

    ``section`` names what the property checks as ``spec.<name> (detail)``;
    ``requires`` names what the property needs of the target's capabilities
    (``conformance.core.requirements.REQUIREMENTS``: ``("autograd",)``, ``("flash:window",)``),
    so the registry knows which properties each field gates; ``skip_reason(target)`` returns
    a skip reason for a condition that is more than a field's value (see ``helpers.skip_unless``);
    ``examples_factor`` scales the profile's ``max_examples``; ``cases(target)`` returns the
    Hypothesis strategy of cases; ``directed(target)`` returns explicit cases
    run in order before the search, through the same check, expected failures and record
    (a failing one is shrunk on a budget of examples, ``conformance.harness.directed_shrink``,
    and then, unless the run stops at its first failure, the search looks for a smaller one);
    ``check(target, case)`` raises :class:`PropertyFailure` or returns the worst
    error ratio (None if the property is exact or not ratio-based).
    """

    requires = known_requirements(property_id, requires)

    def decorate(check: Callable[[Target, Any], float | None]) -> Callable[..., None]:
        _PROPERTIES[property_id] = PropertyInfo(
            property_id, level, section, (check.__doc__ or "").strip(), examples_factor,
            cases=cases, directed=directed, skip_reason=skip_reason, requires=requires,
        )
        _CHECKS[property_id] = check

        def test(target: Target, conformance_session: Session, request: pytest.FixtureRequest) -> None:
            from conformance.diagnosis import diagnose as diagnosis
            from conformance.harness import directed_first, directed_shrink
            from conformance.reporting import failures

            record = Record(property_id, target.level, target.dtype, target.device)
            conformance_session.current = record
            if target.level != level:
                record.outcome = "skipped"
                pytest.skip(f"{property_id} is an {level}-level property")
            reasons = skip_reasons(_PROPERTIES[property_id], target)
            if reasons:
                record.outcome = "skipped"
                record.reason = "; ".join(reasons)
                pytest.skip(record.reason)

            start = time.perf_counter()
            # Expected failures of this property, matched against the cases it
            # called: how often one covering an example failed (a hit) or passed.
            ledger = ExpectedFailureLedger(target.impl.expected_failures, property_id)
            failing_ratio: list[float | None] = [None]

            def one_example(case: Any, passed: tuple[float | None, tuple[Any, ...]] | None = None) -> None:
                if record.first_failure_seconds is None:
                    record.examples += 1
                else:
                    record.shrink_examples += 1
                log = CallLog()
                diagnosis.start_example(case, record)
                try:
                    if passed is not None:  # checked already, and passed (directed_first)
                        ratio = passed[0]
                        log.calls.extend(passed[1])
                    else:
                        try:
                            ratio = _check_example(conformance_session, property_id, check,
                                                   dataclasses.replace(target, log=log), case)
                        except Exception as raised:  # the suite's own error: reported as such
                            own = suite_error(raised, target.impl.name)
                            if own is None:
                                raise
                            raise own from raised
                except PropertyFailure as exc:
                    exc.conformance_own_notes = len(getattr(exc, "__notes__", ()))  # type: ignore[attr-defined]
                    record.note_ran(log.calls)
                    entry = ledger.excuse(_called_attrs(log, case)) if ledger and not isinstance(
                        exc, SuiteError) else None
                    if entry is not None:
                        record.xfail_hits += 1
                        record.xfail_reason = entry.reason + (
                            f" ({entry.reference})" if entry.reference else ""
                        )
                        return
                    record.failing_case = exc.conformance_case = case  # type: ignore[attr-defined]
                    record.failing_calls = exc.conformance_calls = tuple(log.calls)  # type: ignore[attr-defined]
                    failing_ratio[0] = exc.ratio
                    if record.first_failure_seconds is None:
                        record.first_failure_seconds = time.perf_counter() - start
                    if isinstance(exc, (ImplementationHung, ImplementationCrashed)):
                        raise _StopSearch(exc) from None
                    raise
                record.note_ran(log.calls)
                if ledger:
                    ledger.passed(_called_attrs(log, case))
                if ratio is not None and (record.worst_ratio is None or ratio > record.worst_ratio):
                    record.worst_ratio = float(ratio)

            replay = conformance_session.replay
            owner = subject_of(conformance_session, target)
            record.isolated = owner.isolation is not None
            try:
                if replay is not None:
                    if replay.property != property_id or replay.target_id != target.id:
                        record.outcome = "skipped"
                        pytest.skip(f"--replay runs {replay.property}[{replay.target_id}] only")
                    one_example(replay.case)
                else:
                    directed_failure = None
                    for case, passed in directed_first.cases(conformance_session, property_id, target):
                        try:
                            one_example(case, passed)
                        except PropertyFailure as failed:  # shrunk, then (unless -x) the search
                            exc = directed_shrink.shrink_failure(failed, case, target, record, one_example,
                                                                 failing_ratio, _StopSearch,
                                                                 diagnosed=owner.isolation is None)
                            if conformance_session.stops_early:  # (-x: the first failure, at once)
                                raise exc from None
                            directed_failure = (exc, (record.failing_case, record.failing_calls,
                                                      failing_ratio[0], record.first_failure_seconds))
                            break
                    strategy = cases(target)

                    @_examples_setting(examples_factor)
                    @given(data=st.data())
                    def search(data: st.DataObject) -> None:
                        one_example(data.draw(strategy, label="case"))

                    search._hypothesis_internal_database_key = _database_key(  # type: ignore[attr-defined]
                        conformance_session, property_id, target)
                    searched: BaseException | None = None
                    try:
                        search()
                    except (PropertyFailure, FlakyFailure, FlakyReplay, ExceptionGroup) as found:
                        if directed_failure is None or not larger(first_failure(found)[1], directed_failure[0]):
                            record.directed_origin = None  # the search's own case is reported
                            raise
                        searched = found
                    if directed_failure is not None:  # the search found none smaller: report it
                        exc, (record.failing_case, record.failing_calls, failing_ratio[0],
                              record.first_failure_seconds) = directed_failure
                        raise beside_directed(exc, searched)
            except (PropertyFailure, FlakyFailure, FlakyReplay, ExceptionGroup, _StopSearch, Exception) as caught:
                exc = caught.failure if isinstance(caught, _StopSearch) else caught
                if not isinstance(exc, (PropertyFailure, BaseExceptionGroup)):  # escaped the check (a draw)
                    exc = suite_error(exc, target.impl.name)
                    exc.__cause__ = caught
                record.seconds = time.perf_counter() - start
                record.outcome = "failed"
                first, first_case = first_failure(exc)
                record.failing_case = first_case if first_case is not None else record.failing_case
                # one failure, one story: the reported failure's own calls (the call, saved case and
                # reproducer), not those of whichever failing example Hypothesis replayed last
                record.failing_calls = getattr(first, "conformance_calls", record.failing_calls)
                # the cell's ratio is the reported failure's (the first of a group), as its message says
                record.worst_ratio = first.ratio if isinstance(first, PropertyFailure) else failing_ratio[0]
                record.expected_failures = ledger.summary()
                if not long_tracebacks(request):
                    drop_hypothesis_notes(exc)  # its dump of the draws: --tb=long only
                if isinstance(first, SuiteError):
                    record.outcome = "error"  # the suite broke, not the implementation
                    if hasattr(exc, "add_note"):
                        exc.add_note("probable cause: the suite's own error (above), not the implementation")
                else:
                    with np.errstate(all="ignore"):  # the variants' own float warnings stay out of the output
                        diagnosis.annotate(exc, target, record, property_id=property_id, isolation=owner.isolation)
                failures.annotate(exc, property_id, target, record,
                                  impl_spec=owner.impl_spec, options=owner.options)
                if first is not exc:  # several failures, or a flaky one: say what each was
                    record.message = group_message(exc)[:4000]
                if exc is not caught:
                    raise exc from None
                raise
            finally:
                record.leftover_threads = guard.leftover_threads()
            record.seconds = time.perf_counter() - start
            record.expected_failures = ledger.summary()
            # An entry is stale when cases it covers were called and all passed;
            # one whose cases were never called is only "not exercised".
            stale = ledger.stale()
            if record.xfail_hits:
                record.outcome = "xfailed"
            elif stale:
                record.outcome = "stale-xfail"
            if stale:
                record.reason = "expected failure no longer fails on the cases it covers: " + "; ".join(
                    f"{e.reason} ({n} covered case(s) passed)" for e, n in stale
                )

        test.__name__ = f"test_{property_id}"
        test.__qualname__ = test.__name__
        test.__doc__ = check.__doc__
        test.conformance_property = property_id  # type: ignore[attr-defined]
        test.conformance_level = level  # type: ignore[attr-defined]
        return test

    return decorate


def _database_key(session: Session, property_id: str, target: Target) -> bytes:
    """The Hypothesis database key of one property × implementation × level ×
    dtype × device: a stable digest, the same in every process.

    Set as the search's ``_hypothesis_internal_database_key``, it files each
    failure under its own key, so the next run retries it first (without it
    every property shares the digest of the one ``search`` function). The
    derandomized (ci) seed comes from that function digest, which the key
    leaves alone: ci draws do not depend on it.
    """
    owner = subject_of(session, target)
    impl = owner.impl_spec or target.impl.name
    options = ",".join(f"{k}={v}" for k, v in sorted(owner.options.items()))
    text = f"attention-conformance|{impl}|{options}|{property_id}|{target.id}"
    return hashlib.sha384(text.encode()).digest()


