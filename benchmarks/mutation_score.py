"""Mutation score of the conformance suite against the bug zoo.

For every mutant in ``implementations.mutants.MUTANTS`` runs, as a subprocess,
``pytest conformance --impl=mutant:NAME --hypothesis-profile=PROFILE -x
--conformance-report PATH`` and reads ``PATH.json``: whether the mutant was killed,
by which property (``=`` when it is the documented ``expected_property``), after how
many examples, the property's seconds (JSON ``seconds``) and the process wall time,
and the shrunk counterexample's sizes next to the documented smallest case. The
``minimal`` column is ``yes`` when every size is within 1 of the documented one
(equal, for shape-free bugs whose documented sizes are all 1).

    python benchmarks/mutation_score.py                  # all mutants, one at a time
    python benchmarks/mutation_score.py --jobs 2 --only gqa_tile,tiled_no_rescale
    python benchmarks/mutation_score.py --json score.json
    python benchmarks/mutation_score.py --expected-only  # only each mutant's expected property
    python benchmarks/mutation_score.py --in-process     # the whole zoo in one pytest process
    python benchmarks/mutation_score.py --in-process --profile ci-max5  # ci, 5 random examples a test

``--in-process`` certifies every selected mutant in one pytest process
(``--impl=mutant:a,mutant:b,... --impl-exitfirst``, with ``--expected-only`` a ``-k``
term per mutant for its expected property) and reads each one's certificate from the
comparison JSON: start-up is paid once; ``wall s`` is then the seconds inside the
mutant's own tests, and the last line gives the process's wall time.

Exit status: 0 when every selected mutant is killed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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

from derived_profiles import plugin_args  # noqa: E402
from implementations.mutants import MUTANTS, Mutant  # noqa: E402

__all__ = ["Score", "certify_in_process", "score_mutant", "score_zoo_in_process", "main"]

SIZES = ("B", "N", "K", "L", "S", "E", "Ev")
#: pytest's exit status when nothing was selected.
NO_TESTS_COLLECTED = 5


@dataclass
class Score:
    """What the suite did to one mutant."""

    name: str
    expected_property: str
    documented: dict[str, int]
    killed: bool = False
    property: str | None = None
    level: str | None = None
    dtype: str | None = None
    examples: int | None = None
    property_seconds: float | None = None
    wall_seconds: float = 0.0
    counterexample: dict[str, Any] | None = None
    minimal: bool | None = None
    exit_code: int | None = None
    note: str = ""
    results: list[dict[str, Any]] = field(default_factory=list)


def documented_sizes(mutant: Mutant) -> dict[str, int]:
    return {d: mutant.smallest_case[d] for d in SIZES if d in mutant.smallest_case}


def is_minimal(documented: dict[str, int], found: dict[str, Any] | None) -> bool | None:
    """Each shared size within 1 of the documented one (equal when all documented are 1)."""
    if not found:
        return None
    shared = [d for d in SIZES if d in documented and isinstance(found.get(d), int)]
    if not shared:
        return None
    slack = 0 if all(documented[d] == 1 for d in documented) else 1
    return all(abs(found[d] - documented[d]) <= slack for d in shared)


def score_mutant(mutant: Mutant, profile: str, timeout_s: float, *, expected_only: bool = False) -> Score:
    """Run the suite on one mutant (``expected_only``: only its expected property)."""
    score = Score(mutant.name, mutant.expected_property, documented_sizes(mutant))
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as workdir:
        report = Path(workdir) / mutant.name
        cmd = [
            sys.executable, "-m", "pytest", str(ROOT / "conformance"),
            f"--impl=mutant:{mutant.name}", f"--hypothesis-profile={profile}",
            "-x", "-q", "-p", "no:cacheprovider", "--conformance-report", str(report),
            *plugin_args(workdir, profile),
        ]
        if expected_only:
            cmd += ["-k", f"test_{mutant.expected_property}"]
        env = _clean_env()
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True,
                                  timeout=timeout_s)
            score.exit_code = proc.returncode
        except subprocess.TimeoutExpired:
            score.note = f"timed out after {timeout_s:.0f}s"
        score.wall_seconds = time.perf_counter() - start
        json_path = report.with_suffix(".json")
        if not json_path.exists():
            if expected_only and score.exit_code == NO_TESTS_COLLECTED:
                score.note = (f"expected property {mutant.expected_property} is not in the suite "
                              "(-k selected no test)")
            score.note = score.note or f"no report (exit code {score.exit_code})"
            return score
        data = json.loads(json_path.read_text())
    _read_results(score, data.get("results", []), killed_by_exit=score.exit_code != 0)
    return score


def _clean_env() -> dict[str, str]:
    """The environment without the outer pytest's or Hypothesis' settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}


def expected_keyword(mutants: list[Mutant]) -> str:
    """A ``-k`` expression selecting each mutant's expected property for that mutant
    alone (test ids of a run of several implementations start with ``mutant:NAME-``)."""
    return " or ".join(f"test_{m.expected_property}[mutant:{m.name}-" for m in mutants)


def certify_in_process(impls: list[str], profile: str, workdir: Path, timeout_s: float,
                       extra: list[str] | tuple[str, ...] = (), env: dict[str, str] | None = None,
                       ) -> tuple[dict[str, dict], float, int | None, str]:
    """``pytest conformance --impl=a,b,...`` in one process in ``workdir``: (each
    implementation's certificate by its spec, wall seconds, exit code (None: timed out),
    the output's tail). ``extra``: more pytest arguments; ``env``: more variables."""
    report = workdir / "report"
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "conformance"), "--impl=" + ",".join(impls),
           f"--hypothesis-profile={profile}", "-q", "-p", "no:cacheprovider",
           "--conformance-report", str(report), *plugin_args(workdir, profile), *extra]
    full_env = dict(_clean_env(), ATTENTION_CONFORMANCE_FAILURES=str(workdir / "failures"), **(env or {}))
    start = time.perf_counter()
    code, output = None, ""
    try:
        proc = subprocess.run(cmd, cwd=workdir, env=full_env, capture_output=True, text=True, timeout=timeout_s)
        code, output = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        output = f"timed out after {timeout_s:.0f} s"
    wall = time.perf_counter() - start
    json_path = report.with_suffix(".json")
    data = json.loads(json_path.read_text()) if json_path.exists() else {"certificates": [], "comparison": None}
    certificates = data["certificates"] if "comparison" in data else [data]
    return {c["implementation"]["spec"]: c for c in certificates}, wall, code, output


def score_zoo_in_process(mutants: list[Mutant], profile: str, timeout_s: float, *,
                         expected_only: bool = False) -> tuple[list[Score], float, int | None]:
    """Run the suite on every mutant in one pytest process; (scores, process wall
    seconds, exit code). A mutant's ``wall_seconds`` is the time inside its tests."""
    extra = ["--impl-exitfirst"] + (["-k", expected_keyword(mutants)] if expected_only else [])
    with tempfile.TemporaryDirectory(prefix="mutant-zoo-") as workdir:
        certificates, wall, code, _ = certify_in_process([f"mutant:{m.name}" for m in mutants], profile,
                                                         Path(workdir), timeout_s, extra)
    scores = []
    for mutant in mutants:
        score = Score(mutant.name, mutant.expected_property, documented_sizes(mutant), exit_code=code)
        cert = certificates.get(f"mutant:{mutant.name}")
        if cert is None:
            score.note = f"no certificate (exit code {code}{', timed out' if code is None else ''})"
        else:
            _read_results(score, cert["results"], killed_by_exit=code != 0)
            score.wall_seconds = sum(r.get("seconds") or 0.0 for r in cert["results"])
        scores.append(score)
    return scores, wall, code


def _read_results(score: Score, results: list[dict[str, Any]], *, killed_by_exit: bool) -> None:
    """Fill ``score`` from a certificate's results: the first failure is the kill."""
    score.results = [{k: r.get(k) for k in ("property", "level", "dtype", "outcome", "examples", "seconds")}
                     for r in results]
    failed = [r for r in results if r.get("outcome") == "failed"]
    if failed:
        first = failed[0]
        score.killed = killed_by_exit
        score.property = first.get("property")
        score.level, score.dtype = first.get("level"), first.get("dtype")
        score.examples = first.get("examples")
        score.property_seconds = first.get("seconds")
        score.counterexample = first.get("counterexample")
        score.minimal = is_minimal(score.documented, score.counterexample)
    else:
        errors = [r for r in results if r.get("outcome") == "error"]
        if errors:
            score.note = f"error in {errors[0].get('property')}: {str(errors[0].get('message', ''))[:80]}"


def _sizes(sizes: dict[str, Any] | None) -> str:
    if not sizes:
        return "-"
    return " ".join(f"{d}{sizes[d]}" for d in SIZES if d in sizes)


def print_table(scores: list[Score]) -> None:
    header = ("mutant", "killed", "by property", "ex", "prop s", "wall s", "counterexample",
              "documented", "minimal")
    rows = []
    for s in scores:
        by = "-"
        if s.property:
            by = s.property + (" (=)" if s.property == s.expected_property else f" (exp {s.expected_property})")
        rows.append((
            s.name,
            "yes" if s.killed else "NO",
            by,
            "-" if s.examples is None else str(s.examples),
            "-" if s.property_seconds is None else f"{s.property_seconds:.1f}",
            f"{s.wall_seconds:.1f}",
            _sizes(s.counterexample),
            _sizes(s.documented),
            {True: "yes", False: "no", None: "-"}[s.minimal],
        ))
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    for s in scores:
        if s.note:
            print(f"note {s.name}: {s.note}")


def summary(scores: list[Score]) -> str:
    killed = [s for s in scores if s.killed]
    times = [s.property_seconds for s in killed if s.property_seconds is not None]
    walls = [s.wall_seconds for s in killed]
    text = f"killed {len(killed)}/{len(scores)}"
    if times:
        text += (f"; seconds-to-kill (failing property) median {statistics.median(times):.1f}, "
                 f"worst {max(times):.1f}")
    if walls:
        text += f"; process wall median {statistics.median(walls):.1f}, worst {max(walls):.1f}"
    minimal = [s for s in killed if s.minimal]
    text += f"; minimal counterexamples {len(minimal)}/{len(killed)}"
    survivors = [s.name for s in scores if not s.killed]
    if survivors:
        text += f"; survivors: {', '.join(survivors)}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at a time (default 1)")
    parser.add_argument("--only", default="", help="comma-separated mutant names (default: all)")
    parser.add_argument("--profile", default="ci", help="Hypothesis profile (default ci); PROFILE-maxN: "
                        "PROFILE with at most N random examples per test (benchmarks/derived_profiles.py)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per mutant run")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the scores as JSON")
    parser.add_argument("--expected-only", action="store_true",
                        help="run only each mutant's expected_property (does that property alone kill it?)")
    parser.add_argument("--in-process", action="store_true",
                        help="certify every selected mutant in one pytest process (start-up paid once)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or sorted(MUTANTS)
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        parser.error(f"--only names unknown mutants {unknown}; known: {', '.join(sorted(MUTANTS))}")
    if args.jobs < 1:
        parser.error(f"--jobs={args.jobs} must be >= 1")

    def run(name: str) -> Score:
        score = score_mutant(MUTANTS[name], args.profile, args.timeout, expected_only=args.expected_only)
        print(f"  {name}: {'killed by ' + str(score.property) if score.killed else 'SURVIVED'} "
              f"({score.wall_seconds:.1f}s)", file=sys.stderr, flush=True)
        return score

    start = time.perf_counter()
    if args.in_process:
        scores, wall, code = score_zoo_in_process([MUTANTS[n] for n in names], args.profile, args.timeout,
                                                  expected_only=args.expected_only)
    else:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            scores = list(pool.map(run, names))
        wall, code = time.perf_counter() - start, None
    print_table(scores)
    print(summary(scores))
    how = ("one pytest process" + (f", exit code {code}" if code is not None else ", timed out")
           if args.in_process else f"a pytest process per mutant, {args.jobs} at a time")
    print(f"zoo wall seconds: {wall:.1f} ({len(names)} mutants, {how})")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(s) for s in scores], indent=2))
    return 0 if all(s.killed for s in scores) else 1


if __name__ == "__main__":
    sys.exit(main())
