"""Which failure a property test reports: the first one inside an exception group or a
flaky failure (with its case), what a group says, and whether the search's shrunk case
is larger than a failing directed case (``conformance.harness.runner``: a failing directed
case is shrunk on a budget of examples, the search goes on after it, and the smaller of the
two is reported, with the search's failures of other kinds beside it)."""

from __future__ import annotations

import re
from typing import Any

from hypothesis.errors import FlakyFailure

from conformance.core.compare import PropertyFailure

__all__ = ["beside_directed", "case_label", "first_failure", "group_message", "larger", "origin_line", "drop_hypothesis_notes", "long_tracebacks",
           "cell_disagreements"]

def first_failure(exc: BaseException) -> tuple[BaseException, Any]:
    """The first property failure inside ``exc`` (an exception group or Hypothesis'
    FlakyFailure) that carries its case, and that case; ``(exc, None)`` if none."""
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found, case = first_failure(sub)
            if case is not None:
                return found, case
    return exc, getattr(exc, "conformance_case", None)


#: The size letters of the cases of every level (MHA's D, kdim, vdim among them).
SIZES = ("B", "N", "K", "L", "S", "E", "Ev", "D", "kdim", "vdim")


def larger(case: Any, failure: PropertyFailure) -> bool:
    """Whether ``case`` (the search's shrunk failing case; None: it kept none) is larger
    than the case of ``failure`` (a directed case's): by the sum of their sizes."""
    if case is None:
        return True

    def size(c: Any) -> int:
        sizes = c.sizes() if hasattr(c, "sizes") else c.attrs()
        return sum(v for k, v in sizes.items() if k in SIZES and isinstance(v, int))

    try:
        return size(case) > size(getattr(failure, "conformance_case", case))
    except Exception:  # noqa: BLE001 - a case without sizes: keep the shrunk one
        return False


def beside_directed(directed: BaseException, searched: BaseException | None) -> BaseException:
    """The report of a directed failure smaller than the search's: the directed failure,
    then each failure of another kind the search found (several distinct failures stay
    several; the search's failures of the directed one's kind are larger cases of it)."""
    if not isinstance(searched, BaseExceptionGroup) or isinstance(searched, FlakyFailure):
        return directed
    others = [sub for sub in searched.exceptions if type(first_failure(sub)[0]) is not type(directed)]
    return ExceptionGroup(searched.message, [directed, *others]) if others else directed


def group_message(exc: BaseException) -> str:
    """What an exception group (several distinct failures, or a flaky one) says:
    each failure's first lines, not only Hypothesis' headline."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for sub in e.exceptions:
                walk(sub)
        else:
            leaves.append(e)

    walk(exc)
    if isinstance(exc, FlakyFailure) or "unreliable" in str(exc):
        head = ("the implementation gave different results for the same case (Hypothesis: "
                f"{str(exc).split(' (', 1)[0].split(': ', 1)[-1]}); the first failure:")
    else:
        head = f"{len(leaves)} distinct failures; the first:"
    parts = [head]
    for i, leaf in enumerate(leaves):
        lines = str(leaf).strip().splitlines() or [type(leaf).__name__]
        parts.append(("  " if i == 0 else f"  other failure {i}: ") + "\n    ".join(lines[: 12 if i == 0 else 2]))
    return "\n".join(parts)


def case_label(record: Any) -> str:
    """What the report calls the case it shows: "shrunk case", or "failing case" for a
    directed case reported as written (not shrunk: the label must not say it was)."""
    origin = getattr(record, "directed_origin", None)
    return "failing case" if origin and not origin["shrunk"] else "shrunk case"


def origin_line(record: Any) -> str:
    """The report's line on a directed failure's origin ("" for a failure the search found)."""
    origin = getattr(record, "directed_origin", None)
    if not origin:
        return ""
    example = f"the directed example \"{origin['example']}\"" if origin["example"] != "?" else "a directed case"
    if origin["shrunk"]:
        lost = origin.get("passed_over") or 0
        lost_text = (f"; {lost} smaller failing case{'s' if lost > 1 else ''} passed over: "
                     "they lose the evidence that names its cause") if lost else ""
        return f"  (shrunk in {origin['checked']} examples from {example}: {origin['case']}{lost_text})\n"
    if origin.get("why"):
        return f"  ({example} as written: {origin['why']})\n"
    return (f"  ({example} as written: no smaller case in {origin['checked']} examples "
            "failed the same way)\n")


#: How Hypothesis' own notes on a failure begin: its dump of the draws and how to
#: reproduce them, which the report replaces (shrunk case, saved case, replay line).
HYPOTHESIS_NOTES = ("Falsifying example", "Failing test case", "Falsifying explicit example",
                    "Failing explicit example", "Draw ", "Explanation:", "You can reproduce", "These lines were",
                    "You can add @seed", "Trying example", "Highest target score", "Unreliable test timings",
                    "Traceback (most recent call last)", "while generating", "@reproduce_failure")


def long_tracebacks(request: Any) -> bool:
    """Whether the run asked for whole tracebacks (``--tb=long`` or any style but the default)."""
    try:
        return request.config.getoption("tbstyle", "auto") not in ("auto", None)
    except Exception:  # noqa: BLE001 - no pytest request: the report's form
        return False


def drop_hypothesis_notes(exc: BaseException) -> None:
    """Remove Hypothesis' notes from ``exc`` and every failure inside it (kept under
    ``conformance_hypothesis_notes``): those after the notes the property itself added
    (``conformance_own_notes``, set by the runner), else those that read as Hypothesis'."""
    notes = getattr(exc, "__notes__", None)
    if notes:
        own = getattr(exc, "conformance_own_notes", None)  # the property's, before Hypothesis added its
        kept = notes[:own] if own is not None else [
            n for n in notes if not str(n).lstrip().startswith(HYPOTHESIS_NOTES)]
        if len(kept) != len(notes):
            exc.conformance_hypothesis_notes = [n for n in notes if n not in kept]  # type: ignore[attr-defined]
            notes[:] = kept
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            drop_hypothesis_notes(sub)


_STATED_RATIO = re.compile(r"worst error/allowed = ([-+0-9.eE]+|inf|nan)")


def cell_disagreements(results: list[dict[str, Any]]) -> list[str]:
    """The failed results (certificate entries) whose cell contradicts their message: the
    message states a worst error/allowed the cell's ratio does not show (the message
    prints three digits: within 1 %). Every cell must be computed from the record its
    message came from; this says where one was not."""
    wrong = []
    for r in results:
        if r.get("outcome") not in ("failed", "error"):
            continue
        stated = _STATED_RATIO.search(r.get("message") or "")
        if stated is None:
            continue
        said, cell = float(stated.group(1)), r.get("worst_ratio")
        if cell is None or not (abs(cell - said) <= 0.01 * abs(said) or cell == said):
            wrong.append(f"{r.get('property')}[{r.get('level')}-{r.get('dtype')}-{r.get('device')}]: "
                         f"cell {cell!r}, message worst error/allowed = {stated.group(1)}")
    return wrong

