"""A diagnosis' verdict and how its line reads: the matches, the named cause's line (with
its declaration hint) and the unknown line. Shared by ``diagnose`` (the verdict of a
failure), ``deviations`` (the built-ins' known deviations) and ``randomness`` (a random
output's sign)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conformance.diagnosis.causes import SHOWN, UNKNOWN
from spec import variants as V

__all__ = ["Verdict"]


@dataclass(frozen=True)
class Verdict:
    """What the diagnosis found: the matches (dicts as recorded) and the message line;
    ``call``: the observed call they were matched on (None when there is none)."""

    causes: list[dict[str, Any]]
    line: str
    call: Any = field(default=None, compare=False, repr=False)


def _hint(cause: dict[str, Any]) -> str:
    """What to do about a named variant that is a convention: its declaration, or why
    there is none."""
    variant = V.VARIANTS[cause["variant"]]
    if variant.declaration:
        return f"; if this is intended, declare {variant.declaration_for(cause.get('kind') or 'bool')}"
    if variant.undeclarable:
        return f"; {variant.undeclarable}"
    return ""


def _cause(variant_id: str, fit: float | None, relative: float | None, note: str = "") -> dict[str, Any]:
    return {"variant": variant_id, "summary": V.VARIANTS[variant_id].summary,
            "fit": None if fit is None else float(fit), "relative_error": relative, "note": note}


def _line(causes: list[dict[str, Any]]) -> str:
    """The line of a named cause (the first), with the candidates it was told apart from."""
    first = causes[0]
    line = (f"probable cause: {first['variant']} — {first['summary']}"
            + (f" ({first['note']})" if first["note"] else "") + _hint(first))
    rest = [c["variant"] for c in causes[1:]]
    if rest:
        shown = ", ".join(rest[:SHOWN]) + (f" and {len(rest) - SHOWN} more" if len(rest) > SHOWN else "")
        line += f" [also explained the failing call, fewer other cases: {shown}]"
    return line


def _unknown(why: str) -> Verdict:
    return Verdict([], f"probable cause: {UNKNOWN} — {why}")
