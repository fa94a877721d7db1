"""The harness every property runs in.

A property is a function ``check(target, case) -> ratio | None`` plus a strategy
factory ``cases(target)`` and, optionally, ``directed(target)``: a short list of
explicit cases (``conformance.directed``) run first. :func:`conformance_property`
turns it into a pytest test parametrized over targets (level × dtype × device),
which runs the directed cases, then draws cases with Hypothesis, counts examples,
tracks the worst error ratio (headroom), treats known deviations (expected-failures
files, matched against the calls each example made: ``Target.log``) as such without
stopping the search for real failures, saves the shrunk failing case and its failing
call as ``.npz`` with a reproducer, and records everything for the certificate on the session
(``conformance.session``: on ``config.stash``, reached through the
``conformance_session`` fixture).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import pkgutil
import threading
import time
import traceback
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import FlakyFailure, FlakyReplay

from conformance.compare import PropertyFailure
from conformance.expectations import ExpectedFailureLedger
from conformance.replay import CallLog
from conformance.session import Session
from implementations.base import Capabilities, Implementation

__all__ = [
    "PropertyInfo",
    "Record",
    "Target",
    "ImplementationRaised",
    "ImplementationHung",
    "conformance_property",
    "registered_properties",
    "call_guarded",
]


class ImplementationRaised(PropertyFailure):
    """The implementation raised on a case it claims to support."""


class ImplementationHung(PropertyFailure):
    """The implementation did not return within the per-example timeout."""


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

    @property
    def caps(self) -> Capabilities:
        return self.impl.caps(self.level)

    @property
    def id(self) -> str:
        return f"{self.level}-{self.dtype}-{self.device}"

    @property
    def tf32(self) -> bool:
        return self.device == "cuda" and self.dtype == "float32" and self.caps.tf32


@dataclass(frozen=True)
class PropertyInfo:
    """A registered property: its id, level ("sdpa" or "mha"), the spec section
    it checks (``spec.<name> (...)``), its docstring, its share of the
    profile's examples, and its case sources: ``cases(target)`` (the Hypothesis
    strategy) and ``directed(target)`` (the explicit cases run first)."""

    id: str
    level: str
    section: str
    doc: str
    examples_factor: float
    cases: Callable[[Target], Any] | None = field(default=None, compare=False, repr=False)
    directed: Callable[[Target], list[Any]] | None = field(default=None, compare=False, repr=False)


#: Every property, filled by :func:`conformance_property` as the
#: ``conformance/test_*.py`` modules are imported; read it through
#: :func:`registered_properties`. Definitions only: the same in every session.
_PROPERTIES: dict[str, PropertyInfo] = {}


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
    causes: list[dict[str, Any]] = field(default_factory=list)  # conformance.diagnosis, best first
    #: Examples run after the first failure (shrinking); ``examples`` stops counting there.
    shrink_examples: int = 0
    #: The call the reproducer makes, as a dict (set when it is not the drawn case as is).
    called: dict[str, Any] | None = None
    #: Per expected-failure entry of this property: index, hits, covered passes.
    expected_failures: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(dataclasses.replace(self, failing_case=None, failing_calls=()))
        del d["failing_case"], d["failing_calls"]
        return d


def call_guarded(target: Target, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call into the implementation: exceptions and hangs become property failures.

    The call runs in a daemon thread so that a hang fails the property after
    ``target.timeout`` seconds instead of stalling the run (the thread itself
    cannot be killed and is left behind).
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - everything is the implementation's
            box["error"] = exc

    if target.timeout and target.timeout > 0:
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(target.timeout)
        if worker.is_alive():
            raise ImplementationHung(
                f"{target.impl.name} did not return within {target.timeout:g}s "
                "(per-example timeout, --example-timeout)"
            )
    else:
        run()
    if "error" in box:
        exc = box["error"]
        tb = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        raise ImplementationRaised(
            f"{target.impl.name} raised on a case it claims to support: {tb}"
        ) from exc
    return box["value"]


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
    requires: Callable[[Target], str | None] | None = None,
    examples_factor: float = 1.0,
    directed: Callable[[Target], list[Any]] | None = None,
) -> Callable[[Callable[[Target, Any], float | None]], Callable[..., None]]:
    """Register ``check`` as property ``property_id`` and return its pytest test.

    ``section`` names what the property checks as ``spec.<name> (detail)``;
    ``requires(target)`` returns a skip reason when the target cannot have the
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
            cases=cases, directed=directed,
        )

        def test(target: Target, conformance_session: Session) -> None:
            from conformance import diagnosis, failures

            record = Record(property_id, target.level, target.dtype, target.device)
            conformance_session.current = record
            if target.level != level:
                record.outcome = "skipped"
                pytest.skip(f"{property_id} is an {level}-level property")
            reasons = _target_skip_reasons(target, level)
            if requires is not None and not reasons:
                reason = requires(target)
                reasons = [reason] if reason else []
            if reasons:
                record.outcome = "skipped"
                record.reason = "; ".join(reasons)
                pytest.skip(record.reason)

            start = time.perf_counter()
            # Expected failures of this property, matched against the cases it
            # called: how often one covering an example failed (a hit) or passed.
            ledger = ExpectedFailureLedger(target.impl.expected_failures, property_id)
            failing_ratio: list[float | None] = [None]

            def one_example(case: Any) -> None:
                if record.first_failure_seconds is None:
                    record.examples += 1
                else:
                    record.shrink_examples += 1
                log = CallLog()
                diagnosis.start_example(case, record)
                try:
                    ratio = check(dataclasses.replace(target, log=log), case)
                except PropertyFailure as exc:
                    entry = ledger.excuse(_called_attrs(log, case)) if ledger else None
                    if entry is not None:
                        record.xfail_hits += 1
                        record.xfail_reason = entry.reason + (
                            f" ({entry.reference})" if entry.reference else ""
                        )
                        return
                    record.failing_case = case
                    record.failing_calls = tuple(log.calls)
                    failing_ratio[0] = exc.ratio
                    if record.first_failure_seconds is None:
                        record.first_failure_seconds = time.perf_counter() - start
                    raise
                if ledger:
                    ledger.passed(_called_attrs(log, case))
                if ratio is not None and (record.worst_ratio is None or ratio > record.worst_ratio):
                    record.worst_ratio = float(ratio)

            replay = conformance_session.replay
            try:
                if replay is not None:
                    if replay.property != property_id or replay.target_id != target.id:
                        record.outcome = "skipped"
                        pytest.skip(f"--replay runs {replay.property}[{replay.target_id}] only")
                    one_example(replay.case)
                else:
                    for case in directed(target) if directed is not None else ():
                        one_example(case)
                    strategy = cases(target)

                    @_examples_setting(examples_factor)
                    @given(data=st.data())
                    def search(data: st.DataObject) -> None:
                        one_example(data.draw(strategy, label="case"))

                    search._hypothesis_internal_database_key = _database_key(  # type: ignore[attr-defined]
                        conformance_session, property_id, target)
                    search()
            except (PropertyFailure, FlakyFailure, FlakyReplay, ExceptionGroup) as exc:
                record.seconds = time.perf_counter() - start
                record.outcome = "failed"
                record.worst_ratio = failing_ratio[0]
                record.expected_failures = ledger.summary()
                diagnosis.annotate(exc, target, record)
                failures.annotate(exc, property_id, target, record,
                                  impl_spec=conformance_session.impl_spec,
                                  options=conformance_session.options)
                raise
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
    impl = session.impl_spec or target.impl.name
    options = ",".join(f"{k}={v}" for k, v in sorted(session.options.items()))
    text = f"attention-conformance|{impl}|{options}|{property_id}|{target.id}"
    return hashlib.sha384(text.encode()).digest()


def _target_skip_reasons(target: Target, level: str) -> list[str]:
    reasons = target.impl.not_supported_reasons(
        {"level": level, "device": target.device, "dtype": target.dtype}
    )
    if not reasons and target.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return ["no CUDA device on this machine (torch.cuda.is_available() is False)"]
    return reasons
