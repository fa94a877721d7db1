"""A failing directed case, shrunk before it is reported (``conformance.directed.shrink``
proposes the smaller cases; this module checks them through the runner's own example
check, so each one counts, is matched against expected failures and is recorded as any
example is).

A proposal counts as failing the same way when its check raises a property failure of
the same kind (a mismatch stays a mismatch; a raise does not stand in for one); a
proposal that hangs or crashes the implementation ends the shrinking (each would cost a
timeout). The record (failing case, its calls, its ratio) and the diagnosis' view of the
current example are those of the smallest failing case at the end, so the message, the
certificate's cell, the saved case and the reproducer all come from one example.

A smaller case can lose what names the bug: a sliding window's left edge one key short
fails a one-key case as surely as a three-key one, but on one key the window's every
variant gives the same empty row, so no case tells the cause apart. Where the diagnosis
confirms a cause on the case as written, a smaller case is kept only if it confirms the
same one: a random bug's smaller output can happen to fit another variant. The diagnosis
runs on each smaller failing case in this process, so not for an isolated implementation
(its worker alone may call it). The report counts the smaller failing cases passed over.
"""

from __future__ import annotations

from typing import Any, Callable

from conformance.core import observe
from conformance.core.compare import PropertyFailure
from conformance.core.target import ImplementationCrashed, ImplementationHung
from conformance.directed import shrink as proposals
from conformance.directed.admission import admitted
from conformance.sharded import shrinking as sharded_shrinking
from conformance.sharded.cases import ShardedCase

__all__ = ["shrink_failure"]


def _name(case: Any) -> str:
    """The directed example's name, from the note its builder left on the case."""
    for note in getattr(case, "notes", ()):
        if note.startswith("directed: "):
            return note.removeprefix("directed: ")
    return "?"


def _named_cause(target: Any, record: Any, state: list[Any]) -> str | None:
    """The cause the diagnosis confirms for the failure ``state`` (the failure, its case,
    calls, ratio and observed example), as it would be reported; None: unknown."""
    from conformance.diagnosis.causes import named_cause
    from conformance.diagnosis.diagnose import diagnose

    exc, record.failing_case, record.failing_calls, _, example = state
    observe._EXAMPLE.set(example)
    try:
        named = named_cause(diagnose(target, record, exc).causes)
    except Exception:  # noqa: BLE001 - a diagnosis that breaks names nothing
        return None
    return None if named is None else named["variant"]


def shrink_failure(failure: PropertyFailure, case: Any, target: Any, record: Any,
                   one_example: Callable[[Any], None], failing_ratio: list[Any],
                   stop: type[BaseException], *, diagnosed: bool = True) -> PropertyFailure:
    """The failure of the smallest failing case found from directed ``case`` (``failure``
    itself when none is smaller); ``record.directed_origin`` says where it started.
    ``diagnosed``: the diagnosis runs in this process (not in an isolated worker), so a
    smaller case that loses the cause the case as written names is not kept (module doc)."""
    arguments = proposals.arguments_of(case)
    record.directed_origin = {"example": _name(case), "case": case.describe(), "checked": 0, "shrunk": False,
                              "why": None}
    sharded = isinstance(case, ShardedCase)  # the sharded level brings its own passes and admission
    passes_of = sharded_shrinking.passes if sharded else proposals.passes
    if not passes_of(case):
        record.directed_origin["why"] = f"directed cases of the {target.level} level are not shrunk"
        return failure
    if arguments is None:  # its builder did not leave the strategy arguments proposals are admitted by
        record.directed_origin["why"] = "this property's directed cases are not shrunk"
        return failure
    if isinstance(failure, (ImplementationHung, ImplementationCrashed)):
        record.directed_origin["why"] = "a case that hangs or crashes is not shrunk (each try would cost as much)"
        return failure
    best = [failure, record.failing_case, record.failing_calls, failing_ratio[0], observe._EXAMPLE.get()]
    stopped = [False]
    # the cause the case as written names (asked at the first smaller failing case)
    named: list[str | None] = []
    passed_over = [0]

    def fails(candidate: Any) -> bool:
        if stopped[0]:
            return False
        saved = (record.failing_case, record.failing_calls, failing_ratio[0])
        try:
            one_example(candidate)
        except PropertyFailure as found:
            if type(found) is type(failure):
                state = [found, record.failing_case, record.failing_calls, failing_ratio[0], observe._EXAMPLE.get()]
                if diagnosed and not named:
                    named.append(_named_cause(target, record, list(best)))
                if diagnosed and named[0] is not None and _named_cause(target, record, list(state)) != named[0]:
                    passed_over[0] += 1
                else:
                    best[:] = state
                    return True
        except stop:  # it hung or crashed: no more proposals (each would cost as much)
            stopped[0] = True
        except Exception:  # noqa: BLE001 - a proposal the suite cannot check is not a smaller failure
            pass
        record.failing_case, record.failing_calls, failing_ratio[0] = saved
        return False

    admission = sharded_shrinking.admitted if sharded else admitted

    def admit(candidate: Any) -> bool:
        try:
            return admission(target, candidate, **arguments)
        except Exception:  # noqa: BLE001 - not admitted: never checked
            return False

    smallest, checked = proposals.shrink(case, fails, admit=admit, passes_of=passes_of)
    record.directed_origin["passed_over"] = passed_over[0]
    if smallest is case and passed_over[0]:
        record.directed_origin["why"] = "its smaller failing cases lose the evidence that names its cause"
    exc, record.failing_case, record.failing_calls, failing_ratio[0], example = best
    observe._EXAMPLE.set(example)
    record.directed_origin.update(checked=checked, shrunk=smallest is not case)
    return exc
