"""How long killing a mutant takes, and how much of it is starting Python and torch.

For each mutant of the bug zoo, runs ``pytest conformance --impl=mutant:NAME
--hypothesis-profile=ci -x --conformance-report PATH`` as its own process (as
``benchmarks/mutation_score.py`` does) and records the whole process's wall seconds and
the seconds inside the failing property (its certificate's ``seconds``); right after
each, it times a plain ``python -c "import torch"``, so both see the same load. Prints
per mutant and then median and worst of each, as ratios to the torch import.
With ``--in-process`` it then certifies the same mutants in one pytest process
(``--impl=mutant:a,mutant:b,... --impl-exitfirst``) and compares the zoo's wall
seconds both ways.

    python benchmarks/time_to_kill.py                          # every mutant
    python benchmarks/time_to_kill.py --only gqa_tile,scale_ignored --in-process
    python benchmarks/time_to_kill.py --in-process --output benchmarks/results/time-to-kill.txt

Exit status: 0 when every selected mutant is killed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from implementations.mutants import MUTANTS  # noqa: E402
from mutation_score import _clean_env, score_mutant, score_zoo_in_process  # noqa: E402

__all__ = ["Timing", "time_import_torch", "main"]

TORCH_IMPORT = 'python -c "import torch"'


@dataclass
class Timing:
    """One mutant's kill, timed, and the torch import timed right after it."""

    name: str
    killed: bool
    property: str | None
    process_seconds: float
    property_seconds: float | None
    import_torch_seconds: float


def time_import_torch() -> float:
    """Wall seconds of a fresh ``python -c "import torch"``."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], env=_clean_env(), check=True,
                   capture_output=True)
    return time.perf_counter() - start


def project_bytecode() -> str:
    """How many of the project's modules (conformance, implementations, spec) have
    current bytecode: ``pip install`` compiles every one, while an editable checkout
    under PYTHONDONTWRITEBYTECODE=1 has none (Python then compiles each from source in
    every process: 0.25 s of start-up for the whole project on two cores)."""
    import importlib.util

    sources = [p for d in ("conformance", "implementations", "spec") for p in (ROOT / d).rglob("*.py")]
    current = 0
    for source in sources:
        cached = Path(importlib.util.cache_from_source(str(source)))
        current += cached.exists() and cached.stat().st_mtime >= source.stat().st_mtime
    return (f"project bytecode: {current} of {len(sources)} modules compiled"
            f" (PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r})")


def _stats(values: list[float]) -> tuple[float, float]:
    return statistics.median(values), max(values)


def report_lines(timings: list[Timing]) -> list[str]:
    """The per-mutant table and the median / worst summary with ratios."""
    lines = [f"{'mutant':32} {'killed by':28} {'process s':>9} {'property s':>10} {'import torch s':>14}"]
    for t in timings:
        prop = "-" if t.property_seconds is None else f"{t.property_seconds:.2f}"
        lines.append(f"{t.name:32} {(t.property or 'SURVIVED'):28} {t.process_seconds:9.2f} {prop:>10} "
                     f"{t.import_torch_seconds:14.2f}")
    process = _stats([t.process_seconds for t in timings])
    inside = _stats([t.property_seconds for t in timings if t.property_seconds is not None] or [0.0])
    torch = _stats([t.import_torch_seconds for t in timings])
    lines += [
        "",
        f"{'':32} {'median':>9} {'worst':>9}",
        f"{'whole process (s)':32} {process[0]:9.2f} {process[1]:9.2f}",
        f"{'inside the failing property (s)':32} {inside[0]:9.2f} {inside[1]:9.2f}",
        f"{TORCH_IMPORT + ' (s)':32} {torch[0]:9.2f} {torch[1]:9.2f}",
        f"{'process / import torch':32} {process[0] / torch[0]:9.2f} {process[1] / torch[1]:9.2f}",
        f"{'property / import torch':32} {inside[0] / torch[0]:9.2f} {inside[1] / torch[1]:9.2f}",
        f"{'property / process':32} {inside[0] / process[0]:9.2f} {inside[1] / process[1]:9.2f}",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated mutant names (default: all)")
    parser.add_argument("--profile", default="ci", help="Hypothesis profile (default ci)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per pytest process")
    parser.add_argument("--in-process", action="store_true",
                        help="also certify the same mutants in one pytest process and compare")
    parser.add_argument("--output", default=None, metavar="PATH", help="also write the report to PATH")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or sorted(MUTANTS)
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        parser.error(f"--only names unknown mutants {unknown}; known: {', '.join(sorted(MUTANTS))}")

    timings = []
    separate_start = time.perf_counter()
    for name in names:
        score = score_mutant(MUTANTS[name], args.profile, args.timeout)
        timings.append(Timing(name, score.killed, score.property, score.wall_seconds,
                              score.property_seconds, time_import_torch()))
        print(f"  {name}: {score.wall_seconds:.1f}s", file=sys.stderr, flush=True)
    separate = time.perf_counter() - separate_start
    lines = [f"$ python benchmarks/time_to_kill.py {' '.join(argv if argv is not None else sys.argv[1:])}",
             f"profile {args.profile}; {len(names)} mutants, one pytest process each, then "
             "python -c 'import torch'", project_bytecode(), "", *report_lines(timings), "",
             f"zoo, a process per mutant: {separate:.1f} s wall (imports of torch included: "
             f"{sum(t.import_torch_seconds for t in timings):.1f} s of it)"]
    if args.in_process:
        scores, wall, code = score_zoo_in_process([MUTANTS[n] for n in names], args.profile, args.timeout)
        killed = sum(s.killed for s in scores)
        lines.append(f"zoo, one process (--impl=mutant:a,... --impl-exitfirst): {wall:.1f} s wall, "
                     f"exit code {code}, killed {killed}/{len(scores)}")
        separate_processes = sum(t.process_seconds for t in timings)
        lines.append(f"one process / separate processes: {wall:.1f} / {separate_processes:.1f} s = "
                     f"{wall / separate_processes:.2f}")
        differ = [f"{s.name}: {s.property} vs {t.property}" for s, t in zip(scores, timings, strict=True)
                  if s.property != t.property]
        lines.append("killing property the same both ways" if not differ
                     else "killing property differs: " + "; ".join(differ))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
    return 0 if all(t.killed for t in timings) else 1


if __name__ == "__main__":
    sys.exit(main())
