"""What one pytest session of the conformance runner holds.

One :class:`Session` per ``pytest.Config``, stored in ``config.stash`` under
:data:`SESSION_KEY` and never in a module global, so that two sessions in one
process (``pytester``, an IDE running tests twice) share nothing. Hooks reach it
with :func:`session_of`; the property tests through the session-scoped
``conformance_session`` fixture of ``conformance.plugin``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conformance.failures import Replay
    from conformance.isolation import Worker
    from conformance.runner import Record
    from implementations.base import Implementation

__all__ = ["Session", "SESSION_KEY", "session_of"]


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
    #: hung or crashed on, failed at once when drawn again (conformance.runner._check_example)
    broken_cases: dict[str, tuple[type, str, str]] = field(default_factory=dict)
    recorded: set[str] = field(default_factory=set)  # node ids whose record has been collected


SESSION_KEY = pytest.StashKey[Session]()


def session_of(config: pytest.Config) -> Session | None:
    """The session configured on ``config`` (None before ``pytest_configure``)."""
    return config.stash.get(SESSION_KEY, None)
