"""What one pytest session of the conformance runner holds.

One :class:`Session` per ``pytest.Config``, stored in ``config.stash`` under
:data:`SESSION_KEY` and never in a module global, so that two sessions in one
process (``pytester``, an IDE running tests twice) share nothing. Hooks reach it
with :func:`session_of`; the property tests through the session-scoped
``conformance_session`` fixture of ``conformance.plugin``.

A run may certify several implementations (``--impl=sdpa,sdpa-math``): each is a
:class:`Subject` in ``Session.subjects``, keyed by its label, the prefix of its test
ids (``test_forward_agreement[sdpa-math-sdpa-float32-cpu]``). A run of one
implementation has the one label ``""`` and keeps the plain ids. A subject has the
fields of the same names as the session's ``impl``, ``impl_spec``, ``options``,
``isolation``, ``isolate_reason``, ``shape_budget`` and ``broken_cases``, which are the
first subject's (the only one's, in a run of one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conformance.core.registry import Record
    from conformance.isolation.supervisor import Worker
    from conformance.reporting.failures import Replay
    from implementations.base import Implementation

__all__ = ["Session", "SESSION_KEY", "Subject", "session_of"]


@dataclass(eq=False)
class Subject:
    """One implementation a run certifies, and what the run keeps for it alone."""

    impl_spec: str  # its --impl entry as given (a glob expanded)
    impl: Implementation
    label: str = ""  # prefix of its test ids; "" when the run certifies one implementation
    options: dict[str, str] = field(default_factory=dict)  # --impl-option pairs (every subject's)
    shape_budget: int | None = None  # --shape-budget (or the jit default), None: no budget
    isolation: Worker | None = None  # --isolate: the worker process running the implementation
    isolate_reason: str = ""  # why it is (or is not) isolated, for the report header
    #: case digest -> (failure class, property[target], message): cases the implementation
    #: hung or crashed on, failed at once when drawn again (conformance.harness.checking.check_example)
    broken_cases: dict[str, tuple[type, str, str]] = field(default_factory=dict)
    #: --impl-exitfirst: the node id of its first failed test, after which the rest skip
    stopped_by: str = ""


@dataclass(eq=False)
class Session:
    """The options of one run and what its property tests have recorded so far."""

    profile: str  # Hypothesis profile name (--hypothesis-profile, default "dev")
    started: float  # time.time() when the session was configured
    impl: Implementation | None = None  # None when no --impl was given
    impl_spec: str = ""  # --impl exactly as given
    options: dict[str, str] = field(default_factory=dict)  # --impl-option pairs
    dtypes: list[str] | None = None  # --dtype, None: what the implementation declares
    shape_budget: int | None = None  # --shape-budget (or the jit default), None: no budget
    replay: Replay | None = None  # --replay: the one saved case to re-run
    current: Record | None = None  # record of the property test running now
    results: list[dict[str, Any]] = field(default_factory=list)  # finished records, every worker's
    isolation: Worker | None = None  # --isolate: the worker process running the implementation
    isolate_reason: str = ""  # why it is (or is not) isolated, for the report header
    #: case digest -> (failure class, property[target], message): cases the implementation
    #: hung or crashed on, failed at once when drawn again (conformance.harness.checking.check_example)
    broken_cases: dict[str, tuple[type, str, str]] = field(default_factory=dict)
    recorded: set[str] = field(default_factory=set)  # node ids whose record has been collected
    #: Every implementation of the run by label, in --impl order (see the module docstring).
    subjects: dict[str, Subject] = field(default_factory=dict)
    exitfirst: bool = False  # --impl-exitfirst: stop certifying an implementation at its first failure
    torch_threads: int = 0  # torch's intra-op threads while certifying (--torch-threads)
    #: The run stops at its first failure, and ran the directed pass (``directed_first``):
    #: a failing directed case ends its test at once (no search to shrink a smaller one)
    stops_early: bool = False
    #: (property, test id) -> what the directed pass (``conformance.harness.directed_first``) kept
    #: for the test: its directed cases, each with (ratio, calls) when it passed there,
    #: or a sweep property's passed Sweep
    directed: dict[tuple[str, str], Any] = field(default_factory=dict)

    @property
    def compares(self) -> bool:
        """Whether the run certifies several implementations side by side."""
        return len(self.subjects) > 1

    def subject(self, label: str = "") -> Subject:
        """The implementation whose tests carry ``label`` (a run of one: ``""``).

        A session configured without subjects (a test building one by hand) answers
        with its own fields."""
        if label in self.subjects:
            return self.subjects[label]
        if not self.subjects and label == "" and self.impl is not None:
            return Subject(self.impl_spec, self.impl, "", self.options, self.shape_budget,
                           self.isolation, self.isolate_reason, self.broken_cases)
        raise KeyError(f"no implementation labelled {label!r} in this run "
                       f"(labels: {sorted(self.subjects)})")

    def add(self, subject: Subject) -> None:
        """Add ``subject``; the first one added also fills the session's own fields."""
        if not self.subjects:
            self.impl, self.impl_spec, self.options = subject.impl, subject.impl_spec, subject.options
            self.shape_budget, self.isolation = subject.shape_budget, subject.isolation
            self.isolate_reason, self.broken_cases = subject.isolate_reason, subject.broken_cases
        self.subjects[subject.label] = subject


SESSION_KEY = pytest.StashKey[Session]()


def session_of(config: pytest.Config) -> Session | None:
    """The session configured on ``config`` (None before ``pytest_configure``)."""
    return config.stash.get(SESSION_KEY, None)
