"""The certificate's view of diagnoses: each failed result's probable cause
(:func:`cause_line`), the failures of a run grouped by first-ranked cause
(:func:`cause_groups`) and that table as terminal and Markdown lines
(:func:`cause_lines`, :func:`cause_markdown`). ``conformance.diagnosis.diagnose`` re-exports
these names.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["UNKNOWN", "confirmed", "named_cause", "cause_line", "cause_groups", "cause_lines", "cause_markdown"]

#: The group id of failures that no variant explains.
UNKNOWN = "unknown"
#: Matches named on one failure line (the rest are in the record).
SHOWN = 3


def confirmed(cause: dict[str, Any]) -> bool:
    """Whether a recorded cause was named under the naming rule (docs/DIAGNOSIS.md);
    records written before the rule carry no flag and count as named."""
    return cause.get("confirmed", True) is not False


def named_cause(causes: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The cause a failure names: its first cause when confirmed, else None (unknown)."""
    first = (causes or [None])[0]
    return first if first is not None and confirmed(first) else None


def cause_line(result: dict[str, Any]) -> str | None:
    """The probable cause of one failed result, for the certificate's failure lines
    (None for results without a diagnosis)."""
    if result.get("outcome") != "failed" or "causes" not in result:
        return None
    causes = result["causes"] or []
    named = named_cause(causes)
    known = next((c["known_deviation"] for c in causes if c.get("known_deviation")), None)
    tail = f" (known deviation of the built-in `{known['name']}`: --xfail-file {known['path']})" if known else ""
    if named is not None:
        return f"probable cause: {named['variant']}" + tail
    if not causes:
        return f"probable cause: {UNKNOWN}" + tail
    return (f"probable cause: {UNKNOWN} (closest, not confirmed: "
            + ", ".join(c["variant"] for c in causes[:SHOWN]) + ")" + tail)


def cause_groups(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The failed results grouped by their first-ranked cause (``unknown`` for none),
    largest group first: variant id, summary, count, properties, dtypes, devices and
    the range of relative errors (None where the output was not finite)."""
    from implementations.base import ALL_DTYPES

    groups: dict[str, dict[str, Any]] = {}
    for r in results:
        if r.get("outcome") != "failed" or "causes" not in r:
            continue
        first = named_cause(r["causes"])
        variant = first["variant"] if first else UNKNOWN
        group = groups.setdefault(variant, {
            "variant": variant,
            "summary": first["summary"] if first else "no variant of spec.variants explains the output",
            "count": 0, "properties": set(), "dtypes": set(), "devices": set(), "errors": []})
        group["count"] += 1
        group["properties"].add(r["property"])
        group["dtypes"].add(r["dtype"])
        group["devices"].add(r["device"])
        if first and first.get("relative_error") is not None:
            group["errors"].append(first["relative_error"])
    out = []
    for g in groups.values():
        errors = g.pop("errors")
        g["properties"] = sorted(g["properties"])
        g["dtypes"] = sorted(g["dtypes"], key=lambda d: ALL_DTYPES.index(d) if d in ALL_DTYPES else 9)
        g["devices"] = sorted(g["devices"])
        g["relative_error"] = [min(errors), max(errors)] if errors else None
        out.append(g)
    return sorted(out, key=lambda g: (g["variant"] == UNKNOWN, -g["count"], g["variant"]))


def _order(x: float) -> str:
    """``1e-7``: the power of ten nearest to ``x``."""
    return "0" if x <= 0 else f"1e{round(math.log10(x))}"


def _spread(group: dict[str, Any]) -> str:
    dtypes = group["dtypes"]
    parts = [f"{dtypes[0]} only" if len(dtypes) == 1 else ", ".join(dtypes)]
    if len(group["devices"]) > 1:
        parts.append("/".join(group["devices"]))
    if group["relative_error"]:
        low, high = (_order(x) for x in group["relative_error"])
        parts.append(f"relative error ~{low}" if low == high else f"relative error {low} to {high}")
    return "; ".join(parts)


def cause_lines(cert: dict[str, Any]) -> list[str]:
    """The certificate's cause table, one entry per group (empty when nothing failed)::

        probable causes (spec.variants, docs/DIAGNOSIS.md):
          softmax_float32: 11 failures (float64 only; relative error ~1e-7) — float64 inputs ...
              forward_agreement, key_permutation, ...
    """
    groups = cert.get("causes") or []
    if not groups:
        return []
    lines = ["probable causes (spec.variants, docs/DIAGNOSIS.md):"]
    for g in groups:
        n = g["count"]
        lines.append(f"  {g['variant']}: {n} failure{'s' if n != 1 else ''} ({_spread(g)}) — {g['summary']}")
        lines.append("      " + ", ".join(g["properties"]))
    return lines


def cause_markdown(cert: dict[str, Any]) -> list[str]:
    """The cause table as Markdown lines (a heading and a table; empty when nothing failed)."""
    groups = cert.get("causes") or []
    if not groups:
        return []
    lines = ["", "## Probable causes", "",
             "Failures grouped by the variant of `spec.variants` their output matches "
             "(docs/DIAGNOSIS.md).", "",
             "| cause | failures | spread | properties | what the implementation does |", "|---|---|---|---|---|"]
    for g in groups:
        lines.append(f"| `{g['variant']}` | {g['count']} | {_spread(g)} | {', '.join(g['properties'])} | "
                     f"{g['summary']} |")
    return lines
