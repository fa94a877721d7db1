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

Every call into the implementation goes through :func:`call_guarded` (and so
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
import importlib
import pkgutil
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, ContextManager, Mapping

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import FlakyFailure, FlakyReplay

from conformance.core.compare import PropertyFailure
from conformance.reporting.failure_choice import first_failure, group_message, larger
from conformance.core.expectations import ExpectedFailureLedger
from conformance.calls.replay import CallLog
from conformance.harness.session import Session
from implementations import guard
from implementations.base import Capabilities, Implementation

__all__ = [
    "PropertyInfo",
    "Record",
    "Target",
    "ImplementationRaised",
    "ImplementationHung",
    "ImplementationCrashed",
    "conformance_property",
    "registered_properties",
    "registered_checks",
    "call_guarded",
    "subject_of",
]


class ImplementationRaised(PropertyFailure):
    """The implementation raised on a case it claims to support."""


class ImplementationHung(PropertyFailure):
    """The implementation did not return within the per-example timeout."""


class ImplementationCrashed(PropertyFailure):
    """The implementation ended its (isolated worker) process during a call."""


class _StopSearch(BaseException):
    """Ends Hypothesis' search at once (a BaseException, so it neither shrinks nor
    replays): the implementation hung or crashed on ``failure``'s case."""

    def __init__(self, failure: PropertyFailure) -> None:
        super().__init__(str(failure))
        self.failure = failure


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
    #: The calls the current example made (``calls.run_sdpa``/``mha_calls.run_mha``
    #: append to it); the runner hands each example a copy of the target with a fresh log.
    log: CallLog | None = field(default=None, compare=False, repr=False)
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


@dataclass(frozen=True)
class PropertyInfo:
    """A registered property: its id, level ("sdpa", "mha", "varlen", "kvcache"), the spec section
    it checks (``spec.<name> (...)``), its docstring, its share of the
    profile's examples, and its case sources: ``cases(target)`` (the Hypothesis
    strategy) and ``directed(target)`` (the explicit cases run first); ``skip_reason``
    as given to :func:`conformance_property`; ``sweep``: a sweep property's run."""

    id: str
    level: str
    section: str
    doc: str
    examples_factor: float
    cases: Callable[[Target], Any] | None = field(default=None, compare=False, repr=False)
    directed: Callable[[Target], list[Any]] | None = field(default=None, compare=False, repr=False)
    skip_reason: Callable[[Target], str | None] | None = field(default=None, compare=False, repr=False)
    #: A sweep's whole run (``conformance.harness.sweep``): ``sweep(target, session, record)`` -> its Sweep.
    sweep: Callable[[Target, Session, Record], Any] | None = field(default=None, compare=False, repr=False)


#: Every property, filled by :func:`conformance_property` as the
#: ``conformance/test_*.py`` modules are imported; read it through
#: :func:`registered_properties`. Definitions only: the same in every session.
_PROPERTIES: dict[str, PropertyInfo] = {}
#: Each property's ``check(target, case)`` by id (what an isolated worker runs).
_CHECKS: dict[str, Callable[[Any, Any], float | None]] = {}


def registered_properties() -> Mapping[str, PropertyInfo]:
    """Every property of the suite by id (imports each ``conformance/test_*.py``).

    The one list of properties: the README's table, docs/CONTRACTS.md and the
    bug zoo's records are tested against it.
    """
    import conformance

    for module in pkgutil.iter_modules(conformance.__path__):
        if module.name.startswith("test_"):
            importlib.import_module(f"conformance.{module.name}")
    return MappingProxyType(_PROPERTIES)


def registered_checks() -> Mapping[str, Callable[[Target, Any], float | None]]:
    """Each property's ``check(target, case)`` by id (imports every property module)."""
    registered_properties()
    return MappingProxyType(_CHECKS)


@dataclass
class Record:
    """What one property test on one target measured (for the certificate)."""

    property: str
    level: str
    dtype: str
    device: str
    outcome: str = "passed"
    examples: int = 0
    worst_ratio: float | None = None
    seconds: float = 0.0
    reason: str = ""
    counterexample: dict[str, Any] | None = None
    message: str = ""
    failure_file: str = ""
    reproducer: str = ""
    xfail_hits: int = 0
    xfail_reason: str = ""
    failing_case: Any = field(default=None, repr=False)
    #: The calls the failing example made, in order (replay call specs).
    failing_calls: tuple[Any, ...] = field(default=(), repr=False)
    first_failure_seconds: float | None = None
    causes: list[dict[str, Any]] = field(default_factory=list)  # conformance.diagnosis.diagnose, best first
    #: Examples run after the first failure (shrinking); ``examples`` stops counting there.
    shrink_examples: int = 0
    #: The call the reproducer makes, as a dict (set when it is not the drawn case as is).
    called: dict[str, Any] | None = None
    #: Per expected-failure entry of this property: index, hits, covered passes.
    expected_failures: list[dict[str, Any]] = field(default_factory=list)
    #: The call the reproducer makes and whether it alone shows the failure, when the
    #: isolated worker picked it (``isolation.Worker.annotate``); None: picked here.
    picked_call: tuple[Any, bool | None] | None = field(default=None, repr=False)
    #: Timed-out calls whose threads were still running when the test ended (thread mode).
    leftover_threads: int = 0
    isolated: bool = False

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(dataclasses.replace(self, failing_case=None, failing_calls=(), picked_call=None))
        del d["failing_case"], d["failing_calls"], d["picked_call"]
        return d


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
        raise ImplementationRaised(
            f"{target.impl.name} raised on a case it claims to support: {guard.summarise(exc.error)}"
        ) from exc.error


def subject_of(session: Any, target: Target) -> Any:
    """What the run keeps for ``target``'s implementation (``impl_spec``, ``options``,
    ``isolation``, ``broken_cases``...): its ``Session.subject`` in a run of several
    implementations, the session itself (the same fields) in a run of one."""
    return session.subject(target.label) if target.label else session


def _check_example(session: Session, property_id: str, check: Callable[[Target, Any], float | None],
                   target: Target, case: Any) -> float | None:
    """``check(target, case)``, in the isolated worker when there is one; a case that
    already hung or crashed fails fast; a hang or crash ends the search."""
    from conformance.isolation import supervisor as isolation

    owner = subject_of(session, target)
    digest = isolation.case_digest(case) if owner.broken_cases else None
    if digest in owner.broken_cases:
        cls, where, message = owner.broken_cases[digest]
        raise cls(f"{message}\n(this case was not run again: it already failed so in {where}; "
                  "a case that hangs or crashes is tried once per session)")
    try:
        if owner.isolation is not None:
            return owner.isolation.check(property_id, target, case)
        return check(target, case)
    except (ImplementationHung, ImplementationCrashed) as exc:
        owner.broken_cases[digest or isolation.case_digest(case)] = (
            type(exc), f"{property_id}[{target.id}]", str(exc))
        raise


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
) -> Callable[[Callable[[Target, Any], float | None]], Callable[..., None]]:
    """Register ``check`` as property ``property_id`` and return its pytest test.

    ``section`` names what the property checks as ``spec.<name> (detail)``;
    ``skip_reason(target)`` returns a skip reason when the target cannot have the
    property checked (e.g. no autograd declared, see ``helpers.skip_unless``);
    ``examples_factor`` scales the profile's ``max_examples``; ``cases(target)`` returns the
    Hypothesis strategy of cases; ``directed(target)`` returns explicit cases
    (already minimal) run in order before the search, through the same check,
    expected failures and record (a failing one is reported as it is, unshrunk);
    ``check(target, case)`` raises :class:`PropertyFailure` or returns the worst
    error ratio (None if the property is exact or not ratio-based).
    """

    def decorate(check: Callable[[Target, Any], float | None]) -> Callable[..., None]:
        _PROPERTIES[property_id] = PropertyInfo(
            property_id, level, section, (check.__doc__ or "").strip(), examples_factor,
            cases=cases, directed=directed, skip_reason=skip_reason,
        )
        _CHECKS[property_id] = check

        def test(target: Target, conformance_session: Session) -> None:
            from conformance.diagnosis import diagnose as diagnosis
            from conformance.harness import directed_first
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
                        ratio = _check_example(conformance_session, property_id, check,
                                               dataclasses.replace(target, log=log), case)
                except PropertyFailure as exc:
                    entry = ledger.excuse(_called_attrs(log, case)) if ledger else None
                    if entry is not None:
                        record.xfail_hits += 1
                        record.xfail_reason = entry.reason + (
                            f" ({entry.reference})" if entry.reference else ""
                        )
                        return
                    record.failing_case = exc.conformance_case = case  # type: ignore[attr-defined]
                    record.failing_calls = tuple(log.calls)
                    failing_ratio[0] = exc.ratio
                    if record.first_failure_seconds is None:
                        record.first_failure_seconds = time.perf_counter() - start
                    if isinstance(exc, (ImplementationHung, ImplementationCrashed)):
                        raise _StopSearch(exc) from None
                    raise
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
                        except PropertyFailure as exc:  # a directed case is not shrunk: search on
                            if conformance_session.stops_early:  # (-x: the first failure, at once)
                                raise
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
                    try:
                        search()
                    except (PropertyFailure, FlakyFailure, FlakyReplay, ExceptionGroup) as found:
                        if directed_failure is None or not larger(first_failure(found)[1], directed_failure[0]):
                            raise
                    if directed_failure is not None:  # the search found none smaller: report it
                        exc, (record.failing_case, record.failing_calls, failing_ratio[0],
                              record.first_failure_seconds) = directed_failure
                        raise exc
            except (PropertyFailure, FlakyFailure, FlakyReplay, ExceptionGroup, _StopSearch) as caught:
                exc = caught.failure if isinstance(caught, _StopSearch) else caught
                record.seconds = time.perf_counter() - start
                record.outcome = "failed"
                first, first_case = first_failure(exc)
                record.failing_case = first_case if first_case is not None else record.failing_case
                record.worst_ratio = failing_ratio[0]
                record.expected_failures = ledger.summary()
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


def _called_attrs(log: CallLog, case: Any) -> list[dict[str, Any]]:
    """Attributes of the cases an example called (the drawn case's when it made no
    call): what expected failures are matched against."""
    return [call.attrs() for call in log.calls] or [case.attrs()]


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


def skip_reasons(info: PropertyInfo, target: Target) -> list[str]:
    """Why ``target`` (at the property's level) cannot have property ``info`` checked:
    what the implementation does not support, then the property's own ``skip_reason``."""
    reasons = _target_skip_reasons(target, info.level)
    if info.skip_reason is not None and not reasons:
        reason = info.skip_reason(target)
        reasons = [reason] if reason else []
    return reasons


def _target_skip_reasons(target: Target, level: str) -> list[str]:
    reasons = target.impl.not_supported_reasons(
        {"level": level, "device": target.device, "dtype": target.dtype}
    )
    if not reasons and target.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return ["no CUDA device on this machine (torch.cuda.is_available() is False)"]
    return reasons
