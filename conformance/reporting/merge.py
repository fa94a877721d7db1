"""Merge certificates from several machines, devices and implementations into one matrix.

    python -m conformance.reporting.merge cert1.json cert2.json ... [--output PATH]

Each input is a certificate JSON as ``--conformance-report`` writes it (a run of
several implementations, ``--impl=a,b``, writes a comparison: each of its
certificates is an input of its own). The result
is one table, a row per property (and level), a column per (implementation,
device, dtype), printed as Markdown, or written to ``PATH.md`` and ``PATH.json``
with ``--output PATH``.

Columns: the implementation is the certificate's ``implementation.spec`` (what
``--impl`` said; its ``name`` when absent); the device is the result's
(``cpu``, ``cuda``), followed by the GPU's name in brackets when the certificate's
environment records one (``cuda_device_name``), so that two GPU models never share
a column.

Two results for the same cell:

* the same outcome: merged (examples added, the worst ratio kept);
* a skip beside a result that ran: the one that ran (a skip says nothing about
  the property, only that this machine did not check it);
* different outcomes that both ran (``PASS`` on one machine, ``FAIL`` on another):
  a **conflict**, shown as ``CONFLICT`` in its cell and listed below the table with
  every certificate's result; never overwritten. The exit status is then 1.

Exit status: 0, 1 when there is any conflict, 2 when an input cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Cell",
    "CertificateError",
    "Merged",
    "Result",
    "check_certificate",
    "load_certificate",
    "load_certificates",
    "main",
    "merge",
    "render_markdown",
    "render_table",
    "to_json",
]

_DTYPE_ORDER = ("float64", "float32", "float16", "bfloat16")
_SYMBOL = {"passed": "PASS", "failed": "FAIL", "skipped": "skip", "xfailed": "xfail",
           "stale-xfail": "STALE", "error": "ERROR"}
_REQUIRED_RESULT_KEYS = ("property", "level", "dtype", "device", "outcome")

Column = tuple[str, str, str]  # (implementation, device, dtype)
Row = tuple[str, str]  # (level, property)


class CertificateError(ValueError):
    """A certificate cannot be read or lacks what a merge needs."""


@dataclass(frozen=True)
class Result:
    """One certificate's result for a cell."""

    certificate: int  # index into the merged certificates
    outcome: str
    worst_ratio: float | None
    examples: int


@dataclass
class Cell:
    """Every result for one (property, level) × (implementation, device, dtype)."""

    results: list[Result] = field(default_factory=list)

    @property
    def ran(self) -> list[Result]:
        """The results that checked the property (a skip checked nothing)."""
        return [r for r in self.results if r.outcome != "skipped"]

    @property
    def conflicting(self) -> bool:
        return len({r.outcome for r in self.ran}) > 1

    @property
    def outcome(self) -> str:
        """The agreed outcome, ``"skipped"`` when none ran, ``"conflict"`` otherwise."""
        outcomes = {r.outcome for r in self.ran}
        if not outcomes:
            return "skipped"
        return outcomes.pop() if len(outcomes) == 1 else "conflict"

    @property
    def examples(self) -> int:
        return sum(r.examples for r in self.ran)

    @property
    def worst_ratio(self) -> float | None:
        ratios = [r.worst_ratio for r in self.ran if r.worst_ratio is not None]
        return max(ratios) if ratios else None


@dataclass
class Merged:
    """Certificates merged into one matrix."""

    certificates: list[dict[str, Any]]  # per input: path, implementation, version, profile, environment
    columns: list[Column]
    rows: list[Row]
    cells: dict[tuple[Row, Column], Cell]

    @property
    def conflicts(self) -> list[tuple[Row, Column, Cell]]:
        return [(row, col, cell) for (row, col), cell in sorted(self.cells.items())
                if cell.conflicting]


# --------------------------------------------------------------------------- reading


def load_certificate(path: str | Path) -> dict[str, Any]:
    """A certificate JSON, checked for what a merge reads."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CertificateError(f"{path}: cannot read a certificate ({exc})") from None
    check_certificate(data, str(path))
    return data


def load_certificates(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """The certificates in a JSON file, each with a name for the report: the one
    certificate of a run of one implementation (named ``path``), or each of a
    comparison's (``--impl=a,b``: ``path[a]``, ``path[b]``)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CertificateError(f"{path}: cannot read a certificate ({exc})") from None
    if isinstance(data, Mapping) and isinstance(data.get("comparison"), list):
        inner = data.get("certificates")
        if not isinstance(inner, list):
            raise CertificateError(f"{path}: a comparison without a 'certificates' list")
        for index, cert in enumerate(inner):
            check_certificate(cert, f"{path}: certificates[{index}]")
        return [(f"{path}[{_implementation(cert)}]", cert) for cert in inner]
    check_certificate(data, str(path))
    return [(str(path), data)]


def check_certificate(data: Any, where: str) -> None:
    """Raise :class:`CertificateError` unless ``data`` looks like a certificate."""
    if not isinstance(data, Mapping) or not isinstance(data.get("results"), list):
        raise CertificateError(f"{where}: not a certificate (no 'results' list); give the "
                               "PATH.json that --conformance-report PATH writes")
    impl = data.get("implementation")
    if not isinstance(impl, Mapping) or not (impl.get("spec") or impl.get("name")):
        raise CertificateError(f"{where}: 'implementation' has neither 'spec' nor 'name'")
    for index, result in enumerate(data["results"]):
        missing = [k for k in _REQUIRED_RESULT_KEYS if not isinstance(result, Mapping) or k not in result]
        if missing:
            raise CertificateError(f"{where}: results[{index}] lacks {missing}")


def _implementation(cert: Mapping[str, Any]) -> str:
    impl = cert["implementation"]
    return str(impl.get("spec") or impl.get("name"))


def _device(cert: Mapping[str, Any], result: Mapping[str, Any]) -> str:
    device = str(result["device"])
    gpu = (cert.get("environment") or {}).get("cuda_device_name")
    return f"{device} ({gpu})" if gpu and device.startswith("cuda") else device


# --------------------------------------------------------------------------- merging


def merge(certificates: Sequence[Mapping[str, Any]], names: Sequence[str] | None = None, *,
          order: Sequence[str] | None = None) -> Merged:
    """Merge certificate dicts (``names``: where each came from, for the report).
    Columns go by implementation in alphabetical order, or in ``order`` (implementation
    specs; others after them), then device, then dtype."""
    names = list(names) if names is not None else [f"certificate {i + 1}" for i in range(len(certificates))]
    cells: dict[tuple[Row, Column], Cell] = {}
    for index, cert in enumerate(certificates):
        check_certificate(cert, names[index])
        impl = _implementation(cert)
        for result in cert["results"]:
            key = ((str(result["level"]), str(result["property"])),
                   (impl, _device(cert, result), str(result["dtype"])))
            _add(cells, key, index, result)
    ranks = {impl: rank for rank, impl in enumerate(order or ())}
    columns = sorted({col for _, col in cells},
                     key=lambda col: (ranks.get(col[0], len(ranks)), *_column_order(col)))
    rows = sorted({row for row, _ in cells})
    summaries = [_summary(cert, name) for cert, name in zip(certificates, names, strict=True)]
    return Merged(summaries, columns, rows, cells)


def _column_order(column: Column) -> tuple[Any, ...]:
    impl, device, dtype = column
    rank = _DTYPE_ORDER.index(dtype) if dtype in _DTYPE_ORDER else len(_DTYPE_ORDER)
    return impl, device, rank, dtype


def _add(cells: dict[tuple[Row, Column], Cell], key: tuple[Row, Column], index: int,
         result: Mapping[str, Any]) -> None:
    ratio = result.get("worst_ratio")
    cells.setdefault(key, Cell()).results.append(Result(
        index, str(result["outcome"]), None if ratio is None else float(ratio),
        int(result.get("examples") or 0)))


def _summary(cert: Mapping[str, Any], name: str) -> dict[str, Any]:
    impl = cert["implementation"]
    return {
        "path": name,
        "implementation": _implementation(cert),
        "version": impl.get("version", ""),
        "profile": cert.get("profile", ""),
        "environment": dict(cert.get("environment") or {}),
    }


# --------------------------------------------------------------------------- writing


def _cell_text(cell: Cell | None) -> str:
    if cell is None:
        return ""
    if cell.conflicting:
        return "CONFLICT"
    text = _SYMBOL.get(cell.outcome, cell.outcome)
    if cell.outcome != "skipped" and cell.examples:
        ratio = "-" if cell.worst_ratio is None else f"{cell.worst_ratio:.2g}"
        text += f" {ratio} ({cell.examples})"
    return text


def render_table(merged: Merged, *, markdown: bool = True) -> list[str]:
    """The matrix, a row per (property, level), a column per (implementation, device,
    dtype): a Markdown table, or (``markdown=False``) aligned text for a terminal, whose
    first header line names each implementation once, above its ``dtype/device`` columns."""
    body = [[row[1], row[0], *(_cell_text(merged.cells.get((row, col))) for col in merged.columns)]
            for row in merged.rows]
    if markdown:
        header = ["property", "level"] + [" / ".join(col) for col in merged.columns]
        return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                + ["| " + " | ".join(cells) + " |" for cells in body])
    names = ["", ""] + [impl if i == 0 or merged.columns[i - 1][0] != impl else ""
                        for i, (impl, _, _) in enumerate(merged.columns)]
    header = ["property", "level"] + [f"{dtype}/{device}" for _, device, dtype in merged.columns]
    widths = [max(len(x) for x in column) for column in zip(header, *body, strict=True)]
    # An implementation's name may be wider than its first column: it runs on over the next.
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in (header, *body)]
    return [_spread_names(names, widths), *lines]


def _spread_names(names: list[str], widths: list[int]) -> str:
    """The implementation header line: each name at its first column's start."""
    line = ""
    position = 0
    for name, width in zip(names, widths, strict=True):
        if name:
            line = line.ljust(position) + ("" if len(line) <= position else " ") + name
        position += width + 2
    return line.rstrip()


def render_markdown(merged: Merged) -> str:
    """The matrix, the conflicts and the certificates, as Markdown."""
    lines = ["# attention-conformance: merged certificates", "",
             "Cell: outcome, worst error/allowed ratio, examples (summed over certificates).", "",
             *render_table(merged)]
    conflicts = merged.conflicts
    lines += ["", f"## Conflicts ({len(conflicts)})", ""]
    if not conflicts:
        lines.append("None: every cell's certificates agree.")
    for (level, prop), column, cell in conflicts:
        said = "; ".join(
            f"{merged.certificates[r.certificate]['path']}: {_SYMBOL.get(r.outcome, r.outcome)}"
            + (f" {r.worst_ratio:.2g}" if r.worst_ratio is not None else "")
            + (f" ({r.examples})" if r.examples else "")
            for r in cell.results)
        lines.append(f"- {prop} [{level}] on {' / '.join(column)}: {said}")
    lines += ["", "## Certificates", ""]
    for index, cert in enumerate(merged.certificates, 1):
        env = cert["environment"]
        where = ", ".join(f"{k} {env[k]}" for k in ("platform", "torch", "cuda_device_name") if env.get(k))
        lines.append(f"{index}. `{cert['path']}`: {cert['implementation']} {cert['version']}, "
                     f"profile {cert['profile'] or '?'}" + (f"; {where}" if where else ""))
    return "\n".join(lines) + "\n"


def to_json(merged: Merged) -> dict[str, Any]:
    """The matrix as plain data: certificates, columns, rows with their cells, conflicts."""
    columns = [{"implementation": i, "device": d, "dtype": t} for i, d, t in merged.columns]
    rows = []
    for row in merged.rows:
        cells = []
        for col in merged.columns:
            cell = merged.cells.get((row, col))
            cells.append(None if cell is None else {
                "outcome": cell.outcome, "examples": cell.examples, "worst_ratio": cell.worst_ratio,
                "certificates": [r.certificate for r in cell.results]})
        rows.append({"level": row[0], "property": row[1], "cells": cells})
    conflicts = [
        {"level": level, "property": prop, "implementation": col[0], "device": col[1], "dtype": col[2],
         "results": [{"certificate": merged.certificates[r.certificate]["path"],
                      "outcome": r.outcome, "worst_ratio": r.worst_ratio, "examples": r.examples}
                     for r in cell.results]}
        for (level, prop), col, cell in merged.conflicts
    ]
    return {"certificates": merged.certificates, "columns": columns, "rows": rows,
            "conflicts": conflicts}


# --------------------------------------------------------------------------- command line


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conformance.reporting.merge",
        description="Merge attention-conformance certificates (JSON) into one matrix: a row "
                    "per property, a column per (implementation, device, dtype).")
    parser.add_argument("certificates", nargs="+", metavar="CERT.json",
                        help="certificates written by --conformance-report")
    parser.add_argument("--output", metavar="PATH",
                        help="write PATH.md and PATH.json (default: print the Markdown)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        named = [pair for p in args.certificates for pair in load_certificates(p)]
    except CertificateError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    certificates = [cert for _, cert in named]
    merged = merge(certificates, names=[name for name, _ in named])
    markdown = render_markdown(merged)
    if args.output:
        base = Path(args.output)
        base.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{base}.md").write_text(markdown, encoding="utf-8")
        Path(f"{base}.json").write_text(json.dumps(to_json(merged), indent=2), encoding="utf-8")
        print(f"merged {len(certificates)} certificates into {base}.md and {base}.json "
              f"({len(merged.rows)} properties x {len(merged.columns)} columns, "
              f"{len(merged.conflicts)} conflicts)")
    else:
        print(markdown, end="")
    return 1 if merged.conflicts else 0


if __name__ == "__main__":
    sys.exit(main())
