"""Accuracy of the failure diagnosis on the bug zoo.

For every mutant whose record names an ``expected_cause`` (the ``spec.variants``
variant that models its bug), runs, as a subprocess,
``pytest conformance --impl=mutant:NAME --hypothesis-profile=PROFILE -x
--conformance-report PATH`` and reads the failing result's ``causes`` in ``PATH.json``:
the cause named first against the expected one. A mutant counts as right when the
expected cause is named first and confirmed under the naming rule (docs/DIAGNOSIS.md);
an "unknown — closest, not confirmed" verdict counts as not named. The second check: no mutant gets a wrong cause ranked
first with a strictly better fit than the right one (a wrong first with an equal fit is
a tie the failing case alone cannot break, listed but not counted here). Where several
causes were named, a ``tie`` line says why the first one leads: the other cases it also
fits (its note: the failing case before shrinking, discriminating cases), or only fit
and table order.

    python benchmarks/diagnosis_accuracy.py --jobs 1
    python benchmarks/diagnosis_accuracy.py --only causal_lower_right,gqa_tile
    python benchmarks/diagnosis_accuracy.py --json accuracy.json

Exit status: 0 when at least ``--target`` (default 0.9) of the mutants are right and
no wrong cause beats the right one on fit, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from implementations.mutants import MUTANTS, Mutant  # noqa: E402

__all__ = ["Diagnosis", "diagnose_mutant", "main"]


@dataclass
class Diagnosis:
    """What the diagnosis named for one mutant's first failure."""

    name: str
    expected: str
    failing_property: str | None = None
    dtype: str | None = None
    named: list[str] = field(default_factory=list)
    fits: list[float | None] = field(default_factory=list)
    #: Each named cause's note: the other cases it also fits, where a tie was broken.
    cause_notes: list[str] = field(default_factory=list)
    #: Whether the first cause was named under the naming rule (else: unknown, closest listed).
    confirmed: bool = False
    wall_seconds: float = 0.0
    note: str = ""

    @property
    def first(self) -> str | None:
        return self.named[0] if self.named and self.confirmed else None

    @property
    def right(self) -> bool:
        return self.first == self.expected

    @property
    def beaten(self) -> bool:
        """A wrong cause first with a strictly better fit than the expected one."""
        if self.right or self.expected not in self.named:
            return False
        first, mine = self.fits[0], self.fits[self.named.index(self.expected)]
        return first is not None and mine is not None and first < mine


def diagnose_mutant(mutant: Mutant, profile: str, timeout_s: float) -> Diagnosis:
    """Run the suite on one mutant with ``-x`` and read the causes of its failure."""
    result = Diagnosis(mutant.name, mutant.expected_cause or "")
    with tempfile.TemporaryDirectory(prefix=f"diagnosis-{mutant.name}-") as workdir:
        report = Path(workdir) / mutant.name
        cmd = [sys.executable, "-m", "pytest", str(ROOT / "conformance"), f"--impl=mutant:{mutant.name}",
               f"--hypothesis-profile={profile}", "-x", "-q", "-p", "no:cacheprovider",
               "--conformance-report", str(report)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
        start = time.perf_counter()
        try:
            subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            result.note = f"timed out after {timeout_s:.0f}s"
        result.wall_seconds = time.perf_counter() - start
        json_path = report.with_suffix(".json")
        if not json_path.exists():
            result.note = result.note or "no report written"
            return result
        data = json.loads(json_path.read_text())
    failed = [r for r in data.get("results", []) if r.get("outcome") == "failed"]
    if not failed:
        result.note = "survived: nothing failed"
        return result
    first: dict[str, Any] = failed[0]
    result.failing_property, result.dtype = first.get("property"), first.get("dtype")
    causes = first.get("causes") or []
    result.named = [c["variant"] for c in causes]
    result.fits = [c.get("fit") for c in causes]
    result.cause_notes = [c.get("note") or "" for c in causes]
    result.confirmed = bool(causes) and causes[0].get("confirmed", True) is not False
    if causes and not result.confirmed:
        result.note = result.note or "unknown; candidates, none confirmed: " + ", ".join(result.named[:3])
    return result


def _fit(x: float | None) -> str:
    return "-" if x is None else f"{x:.2g}"


def print_table(results: list[Diagnosis]) -> None:
    header = ("mutant", "expected cause", "named first", "fit", "right", "failing property", "also named")
    rows = []
    for d in results:
        rows.append((d.name, d.expected, d.first or "unknown", _fit(d.fits[0] if d.fits and d.first else None),
                     "yes" if d.right else "NO", f"{d.failing_property or '-'}[{d.dtype or '-'}]",
                     ", ".join(f"{n} {_fit(f)}" for n, f in zip(d.named[1:], d.fits[1:], strict=True)) or "-"))
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    for d in results:
        if d.note:
            print(f"note {d.name}: {d.note}")
    for d in results:
        if len(d.named) > 1 and d.first:
            why = d.cause_notes[0] if d.cause_notes else ""
            print(f"tie {d.name}: {d.first} first" + (f", {why}" if why else ", by fit and table order"))


def summary(results: list[Diagnosis]) -> str:
    right = [d for d in results if d.right]
    beaten = [d.name for d in results if d.beaten]
    wrong = [f"{d.name} (named {d.first or 'unknown'})" for d in results if not d.right]
    honest = [d.name for d in results if not d.right and not d.first and d.expected in d.named]
    text = (f"expected cause named first: {len(right)}/{len(results)} "
            f"({100 * len(right) / max(1, len(results)):.0f}%); "
            f"wrong cause first with a better fit than the right one: {len(beaten)}"
            + (f" ({', '.join(beaten)})" if beaten else ""))
    if honest:
        text += (f"; unknown with the expected cause among the candidates, none confirmed: {len(honest)} "
                 f"({', '.join(honest)})")
    if wrong:
        text += f"\nnot named first: {'; '.join(wrong)}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at a time (default 1)")
    parser.add_argument("--only", default="", help="comma-separated mutant names (default: every one "
                        "with an expected_cause)")
    parser.add_argument("--profile", default="ci", help="Hypothesis profile (default ci)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per mutant run")
    parser.add_argument("--target", type=float, default=0.9, help="accuracy required for exit status 0")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    with_cause = sorted(name for name, m in MUTANTS.items() if m.expected_cause)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or with_cause
    unknown = [n for n in names if n not in with_cause]
    if unknown:
        parser.error(f"--only names mutants without an expected_cause {unknown}; choose from "
                     f"{', '.join(with_cause)}")
    if args.jobs < 1:
        parser.error(f"--jobs={args.jobs} must be >= 1")

    def run(name: str) -> Diagnosis:
        d = diagnose_mutant(MUTANTS[name], args.profile, args.timeout)
        print(f"  {name}: {d.first or 'unknown'} ({'right' if d.right else 'expected ' + d.expected}, "
              f"{d.wall_seconds:.1f}s)", file=sys.stderr, flush=True)
        return d

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(run, names))
    print_table(results)
    print(summary(results))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(d) for d in results], indent=2))
    accuracy = sum(d.right for d in results) / max(1, len(results))
    return 0 if accuracy >= args.target and not any(d.beaten for d in results) else 1


if __name__ == "__main__":
    sys.exit(main())
