"""Sweeps: properties that visit a fixed list of cases in order, without Hypothesis.

Some bugs live at one size (a kernel's ragged-block path, a tile-count formula):
a random search meets them by luck, an exhaustive loop over small sizes always.
:func:`sweep_property` registers such a loop as a property beside the
``conformance_property`` ones: the same registry, :class:`~conformance.core.registry.Record`
and certificate cell (examples = sizes visited), expected failures, saved
failing case with its reproducer, and ``--replay`` of that case.

A sweep is ``run(target, sweep)``: it calls the implementation through
``core.target.call_guarded`` (or, when the implementation runs in an isolated worker
process, ``sweep.isolated``, has each case checked whole there by :meth:`Sweep.check`:
only the worker may call it), reports each visited size with :meth:`Sweep.visited`, visits the first
:meth:`Sweep.budget` of its cases (a count per Hypothesis profile: a certificate never
depends on the machine's speed; a slow machine visits the same cases, in more time;
fewer under a compile budget, where each case is a compilation: :attr:`Sweep.compile_limit`),
asks :meth:`Sweep.out_of_time` (a generous wall-clock safety limit, a hang guard that
says so on the certificate when it stops a sweep) before each, and on a failure raises the
:class:`~conformance.core.compare.PropertyFailure` of the smallest failing case after
:meth:`Sweep.failing` (which saves that case; a case an expected failure covers is
counted by :meth:`Sweep.expected` and the sweep goes on). ``check(target, case)``
re-checks one saved case (``--replay``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

import pytest

from conformance.core.compare import PropertyFailure
from conformance.core.registry import (
    _CHECKS,  # each property's one-case check (registry.registered_checks; the isolated worker's)
    _PROPERTIES,  # the one property registry (registry.registered_properties)
    PropertyInfo,
    Record,
    skip_reasons,
)
from conformance.core.target import Target, subject_of
from conformance.harness.checking import check_example, cuda_context_guard
from conformance.harness.session import Session

__all__ = ["SAFETY_S", "SWEEP_SIZES_PER_CONFIGURATION", "Sweep", "sweep_property"]

#: Under a compile budget of n configurations a sweep visits at most this many cases
#: per configuration (2n: for n = 8, the 16 sizes of the square of the first four
#: block-edge lengths, 1, 2, 15 and 16), each of them a compilation per call layout.
SWEEP_SIZES_PER_CONFIGURATION = 2

#: Wall-clock seconds a sweep may run per target before it stops: a hang guard, never a
#: budget (the cases a sweep visits are its profile's count; each call has its own
#: timeout). A sweep it stops says so on the certificate.
SAFETY_S = 900.0


class Sweep:
    """What one sweep test reports into: sizes visited, headroom, expected failures,
    the failing case, and its budget: ``sizes``, the number of cases it visits per
    target (None: all), and ``safety_s``, the wall-clock hang guard.
    ``check(case)`` runs the property's one-case check on ``case`` where the
    implementation runs (in its isolated worker process when ``isolated``)."""

    def __init__(self, property_id: str, target: Target, record: Record, sizes: int | None,
                 check: Callable[[Target, Any], float | None] | None = None,
                 session: Session | None = None, safety_s: float = SAFETY_S,
                 profile: str = "") -> None:
        self.property_id = property_id
        self.target = target
        self.record = record
        self.sizes = sizes
        self.profile = profile or (session.profile if session is not None else "")
        self.safety_s = safety_s
        #: True once the safety limit stopped the sweep (:meth:`out_of_time`).
        self.stopped_by_safety = False
        self._check = check
        self._session = session
        self.isolated = session is not None and subject_of(session, target).isolation is not None
        self.started = time.perf_counter()
        #: Seconds the whole sweep took, once the directed pass has run it (``directed_first``).
        self.seconds: float | None = None
        self.entries = [e for e in target.impl.expected_failures
                        if e.property in ("*", property_id)]
        self.covered_passes = [0] * len(self.entries)
        self.hits = [0] * len(self.entries)

    def check(self, case: Any) -> float | None:
        """The property's check of one ``case`` (its ratio; raises its PropertyFailure),
        in the isolated worker when there is one; a case that hung or crashed before
        fails fast (``checking.check_example``)."""
        assert self._check is not None and self._session is not None, "a Sweep made without its check"
        return check_example(self._session, self.property_id, self._check, self.target, case)

    @property
    def compile_limit(self) -> int | None:
        """Under a compile budget (``Target.shape_budget``: the implementation compiles
        per configuration, and every size of a sweep is a configuration of its own), the
        most cases it visits: :data:`SWEEP_SIZES_PER_CONFIGURATION` per configuration of
        the budget; None without one."""
        budget = getattr(self.target, "shape_budget", None)
        return None if budget is None else SWEEP_SIZES_PER_CONFIGURATION * budget

    def budget(self, order: list[Any]) -> list[Any]:
        """The cases of ``order`` this sweep visits: its first ``sizes`` (fewer under a
        compile budget, :attr:`compile_limit`)."""
        counts = [n for n in (self.sizes, self.compile_limit) if n is not None]
        return list(order)[:min(counts)] if counts else list(order)

    def out_of_time(self) -> bool:
        """Whether the wall-clock safety limit has passed (a hang guard: then the
        sweep stops, and :meth:`describe` says so)."""
        if time.perf_counter() - self.started > self.safety_s:
            self.stopped_by_safety = True
        return self.stopped_by_safety

    def describe(self, total: int, what: str = "sizes") -> str:
        """How many of the ``total`` cases were visited and why no more, for the certificate."""
        visited = self.record.examples
        text = f"visited {visited} of {total} {what}"
        limit = self.compile_limit
        if limit is not None and limit < total and (self.sizes is None or limit < self.sizes):
            text += (f" (the compile budget's first {limit}, block edges first: "
                     f"{SWEEP_SIZES_PER_CONFIGURATION} sizes per configuration of "
                     f"--compile-budget={self.target.shape_budget})")
        elif self.sizes is not None and self.sizes < total:
            text += f" (the {self.profile or 'run'} profile's first {self.sizes}, block edges first)"
        if self.stopped_by_safety:
            text += (f"; stopped by the {self.safety_s:g} s safety limit (a hang guard, not a budget: "
                     "this machine was too slow to visit the profile's count)")
        return text
    def visited(self, ratio: float | None, cases: tuple[Any, ...] = ()) -> None:
        """One size done and passed, with worst error/allowed ``ratio``; ``cases``:
        the cases it called (only needed when expected failures could cover them)."""
        self.record.examples += 1
        if ratio is not None and (self.record.worst_ratio is None or ratio > self.record.worst_ratio):
            self.record.worst_ratio = float(ratio)
        for case in cases if self.entries else ():
            attrs = case.attrs()
            for i, entry in enumerate(self.entries):
                if entry.applies(self.property_id, attrs):
                    self.covered_passes[i] += 1

    def expected(self, case: Any) -> bool:
        """Whether an expected failure covers the failing ``case`` (counted as a hit)."""
        attrs = case.attrs()
        for i, entry in enumerate(self.entries):
            if entry.applies(self.property_id, attrs):
                self.hits[i] += 1
                self.record.xfail_hits += 1
                self.record.xfail_reason = entry.reason + (
                    f" ({entry.reference})" if entry.reference else "")
                return True
        return False

    def failing(self, case: Any) -> None:
        """``case`` is the failing case to save and report (call before raising)."""
        self.record.failing_case = case
        self.record.examples += 1  # the failing size is visited too, as a failing example is counted
        if self.record.first_failure_seconds is None:
            self.record.first_failure_seconds = time.perf_counter() - self.started

    def reported_into(self, record: Record) -> Sweep:
        """This finished sweep (run by the directed pass into a record of its own,
        ``conformance.harness.directed_first``), its counts moved into ``record``."""
        for name in ("examples", "worst_ratio", "xfail_hits", "xfail_reason"):
            setattr(record, name, getattr(self.record, name))
        self.record = record
        self.started = time.perf_counter() - (self.seconds or 0.0)  # its record.seconds: the sweep's own
        return self

    def stale_entries(self) -> list[str]:
        """Reasons of property-specific entries whose covered cases all passed (an
        intermittent entry's may)."""
        return [f"{e.reason} ({n} covered case(s) passed)"
                for e, n, hit in zip(self.entries, self.covered_passes, self.hits, strict=True)
                if n and not hit and e.property != "*" and not e.intermittent]


def failure_ratio(exc: BaseException) -> float | None:
    """The worst error/allowed of failure ``exc``; a failure re-raised with more words
    (``raise type(exc)(...) from exc``) carries its cause's."""
    while isinstance(exc, PropertyFailure):
        if exc.ratio is not None:
            return float(exc.ratio)
        exc = exc.__cause__  # type: ignore[assignment]
    return None


def sweep_property(
    property_id: str,
    *,
    level: str,
    section: str,
    check: Callable[[Target, Any], float | None],
    sizes: Mapping[str, int | None],
    safety_s: float = SAFETY_S,
    skip_reason: Callable[[Target], str | None] | None = None,
) -> Callable[[Callable[[Target, Sweep], None]], Callable[..., None]]:
    """Register ``run(target, sweep)`` as property ``property_id`` and return its pytest test.

    ``section``, ``skip_reason``: as for ``conformance_property``; ``check(target, case)``
    re-checks one case (``--replay``); ``sizes``: the number of cases a sweep visits per
    target, by Hypothesis profile (None: all; a profile not named gets ``dev``'s), so
    that a certificate never depends on the machine's speed; ``safety_s``: the
    wall-clock hang guard (the certificate says when it stopped a sweep).
    """
    bad = [(name, n) for name, n in sizes.items() if n is not None and (not isinstance(n, int) or n < 1)]
    if "dev" not in sizes or bad:
        raise ValueError(f"sweep_property({property_id!r}, sizes={dict(sizes)!r}): sizes must name "
                         "the dev profile and give each profile a count >= 1 (or None: all cases)")

    def budget(session: Session | None) -> int | None:
        profile = session.profile if session is not None else "dev"
        return sizes[profile] if profile in sizes else sizes["dev"]

    def decorate(run: Callable[[Target, Sweep], None]) -> Callable[..., None]:
        def sweep_whole(target: Target, session: Session, record: Record) -> Sweep:
            sweep = Sweep(property_id, target, record, budget(session), check, session, safety_s)
            run(target, sweep)
            sweep.seconds = time.perf_counter() - sweep.started
            return sweep

        _PROPERTIES[property_id] = PropertyInfo(property_id, level, section,
                                                (run.__doc__ or "").strip(), 1.0,
                                                skip_reason=skip_reason, sweep=sweep_whole)
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
            sweep = Sweep(property_id, target, record, budget(conformance_session), check,
                          conformance_session, safety_s)
            replay = conformance_session.replay
            try:
                if replay is not None:
                    if replay.property != property_id or replay.target_id != target.id:
                        record.outcome = "skipped"
                        pytest.skip(f"--replay runs {replay.property}[{replay.target_id}] only")
                    sweep.failing(replay.case)  # (counts the example)
                    ratio = sweep.check(replay.case)
                    record.worst_ratio = None if ratio is None else float(ratio)
                    record.failing_case = None
                elif (swept := directed_first.swept(conformance_session, property_id, target)) is not None:
                    sweep = swept.reported_into(record)  # the directed pass swept it, and it passed
                else:
                    with cuda_context_guard(subject_of(conformance_session, target), property_id, target):
                        run(target, sweep)
            except PropertyFailure as exc:
                record.seconds = time.perf_counter() - sweep.started
                record.outcome = "failed"
                record.worst_ratio = failure_ratio(exc)  # the cell's ratio is the failure's, as its message says
                owner = subject_of(conformance_session, target)
                diagnosis.annotate(exc, target, record, property_id=property_id, isolation=owner.isolation)
                failures.annotate(exc, property_id, target, record,
                                  impl_spec=owner.impl_spec, options=owner.options)
                raise
            record.seconds = time.perf_counter() - sweep.started
            stale = sweep.stale_entries()
            if record.xfail_hits:
                record.outcome = "xfailed"
            elif stale:
                record.outcome = "stale-xfail"
                record.reason = ("expected failure no longer fails on the cases it covers: "
                                 + "; ".join(stale))

        test.__name__ = f"test_{property_id}"
        test.__qualname__ = test.__name__
        test.__doc__ = run.__doc__
        test.conformance_property = property_id  # type: ignore[attr-defined]
        test.conformance_level = level  # type: ignore[attr-defined]
        return test

    return decorate
