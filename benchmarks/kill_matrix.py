"""Which property kills which mutant, and at what cost: the data behind the property order.

Certifies every selected mutant of the bug zoo with every property (no ``-x``, no
``--impl-exitfirst``) under a copy of the ``ci`` profile without Hypothesis' shrink phase
(a kill is decided by the first failing example; shrinking only makes it smaller), in
``--jobs`` pytest processes. Then certifies the correct built-ins (``--correct``) under
``ci`` to measure what each property costs when it passes: the seconds a run stopping
at its first failure (``-x``) pays for every property ordered before the failing one.

From the two it orders each level's properties greedily by kill power per second: next
comes the property that kills the most mutants not yet killed by an earlier property (or
an earlier level) per second of its cost; once every mutant is killed, the rest follow
cheapest first. The order is written to ``conformance/property_order.json``, which
``pytest_collection_modifyitems`` reads (``conformance/ordering.py``); the kill matrix
and the order, with each property's kills and seconds, are printed.

    python benchmarks/kill_matrix.py --jobs 2 --write
    python benchmarks/kill_matrix.py --only gqa_tile,scale_ignored     # print only

The Triton mutants are left out by default (``--with-triton``): the interpreter makes
their runs long, and the Triton kernel's properties are the same as every SDPA
implementation's.

Exit status: 0 when every selected mutant is killed by some property, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from conformance.ordering import ORDER_FILE  # noqa: E402
from conformance.plugin import LEVEL_ORDER, PROFILES  # noqa: E402
from implementations.mutants import MUTANTS  # noqa: E402
from mutation_score import _clean_env  # noqa: E402

__all__ = ["greedy_order", "main"]

PROFILE = "kill-matrix"
#: A module handed to pytest with ``-p``: the ``ci`` profile without the shrink phase.
_PROFILE_PLUGIN = f"""\
from hypothesis import HealthCheck, Phase, settings
settings.register_profile(
    {PROFILE!r}, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much],
    phases=[Phase.explicit, Phase.reuse, Phase.generate], **{PROFILES["ci"]!r})
"""
FAILED = ("failed", "error")


def _certify(impls: list[str], profile: str, workdir: Path, timeout_s: float) -> tuple[dict, float]:
    """One pytest process over ``impls``; (spec -> certificate, wall seconds)."""
    report = workdir / "report"
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "conformance"), "--impl=" + ",".join(impls),
           f"--hypothesis-profile={profile}", "-q", "-p", "no:cacheprovider",
           "--conformance-report", str(report)]
    env = dict(_clean_env(), ATTENTION_CONFORMANCE_FAILURES=str(workdir / "failures"))
    if profile == PROFILE:
        (workdir / "kill_matrix_profile.py").write_text(_PROFILE_PLUGIN)
        cmd += ["-p", "kill_matrix_profile"]
        env["PYTHONPATH"] = str(workdir) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - start
    json_path = report.with_suffix(".json")
    if not json_path.exists():
        raise SystemExit(f"no report from {' '.join(cmd)} (exit code {proc.returncode}):\n"
                         f"{(proc.stdout + proc.stderr)[-3000:]}")
    data = json.loads(json_path.read_text())
    certificates = data["certificates"] if "comparison" in data else [data]
    return {c["implementation"]["spec"]: c for c in certificates}, wall


def _chunks(items: list[str], n: int) -> list[list[str]]:
    return [chunk for chunk in (items[i::n] for i in range(n)) if chunk]


def kills_of(certificate: dict) -> set[tuple[str, str]]:
    """The (level, property) pairs that failed on some dtype."""
    return {(r["level"], r["property"]) for r in certificate["results"] if r.get("outcome") in FAILED}


def costs_of(certificates: list[dict]) -> dict[tuple[str, str], float]:
    """Per (level, property): its seconds summed over dtypes, median over the certificates
    that ran it (a property skipped everywhere costs nothing)."""
    per: dict[tuple[str, str], list[float]] = {}
    for cert in certificates:
        sums: dict[tuple[str, str], float] = {}
        for r in cert["results"]:
            if r.get("outcome") == "skipped":
                continue
            key = (r["level"], r["property"])
            sums[key] = sums.get(key, 0.0) + float(r.get("seconds") or 0.0)
        for key, seconds in sums.items():
            per.setdefault(key, []).append(seconds)
    return {key: statistics.median(values) for key, values in per.items()}


def greedy_order(kills: dict[str, set[tuple[str, str]]], costs: dict[tuple[str, str], float],
                 properties: dict[str, set[str]]) -> dict[str, list[str]]:
    """Each level's properties, most new kills per second first (levels in LEVEL_ORDER,
    a mutant killed at an earlier level no longer counted), then the rest cheapest first."""
    floor = 0.01  # seconds: a property that measured 0 s still costs its set-up
    alive = set(kills)
    order: dict[str, list[str]] = {}
    for level in sorted(properties, key=lambda lv: LEVEL_ORDER.get(lv, len(LEVEL_ORDER))):
        left = set(properties[level])
        chosen: list[str] = []
        while left:
            def power(prop: str) -> tuple[float, float, str]:
                new = sum(1 for m in alive if (level, prop) in kills[m])
                cost = max(costs.get((level, prop), 0.0), floor)
                return (new / cost, -cost, prop)
            best = max(left, key=power)
            if power(best)[0] == 0:
                chosen += sorted(left, key=lambda p: (max(costs.get((level, p), 0.0), floor), p))
                break
            chosen.append(best)
            left.remove(best)
            alive -= {m for m in alive if (level, best) in kills[m]}
        order[level] = chosen
    return order


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated mutant names (default: all)")
    parser.add_argument("--with-triton", action="store_true", help="also the Triton mutants")
    parser.add_argument("--correct", default="sdpa,handwritten,torch-mha",
                        help="the correct built-ins whose certificates give the costs")
    parser.add_argument("--jobs", type=int, default=1, help="pytest processes at a time")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per pytest process")
    parser.add_argument("--write", action="store_true", help=f"write the order to {ORDER_FILE.relative_to(ROOT)}")
    parser.add_argument("--output", default=None, metavar="PATH", help="also write the report to PATH")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or sorted(
        n for n in MUTANTS if args.with_triton or not n.startswith("triton_"))
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        parser.error(f"--only names unknown mutants {unknown}; known: {', '.join(sorted(MUTANTS))}")
    correct = [c.strip() for c in args.correct.split(",") if c.strip()]

    with tempfile.TemporaryDirectory(prefix="kill-matrix-") as tmp:
        jobs = [(f"mutants{i}", [f"mutant:{n}" for n in chunk], PROFILE)
                for i, chunk in enumerate(_chunks(names, args.jobs))]
        jobs += [(f"correct-{c}", [c], "ci") for c in correct]

        def run(job: tuple[str, list[str], str]) -> tuple[dict, float]:
            workdir = Path(tmp) / job[0]
            workdir.mkdir()
            return _certify(job[1], job[2], workdir, args.timeout)

        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            results = list(pool.map(run, jobs))
    certificates: dict[str, dict] = {}
    walls = {}
    for job, (certs, wall) in zip(jobs, results, strict=True):
        certificates.update(certs)
        walls[job[0]] = wall

    kills = {n: kills_of(certificates[f"mutant:{n}"]) for n in names if f"mutant:{n}" in certificates}
    correct_certs = [certificates[c] for c in correct if c in certificates]
    bad = [f"{c}: {r['property']}[{r['level']}-{r['dtype']}] {r['outcome']}" for c in correct
           for r in certificates.get(c, {}).get("results", []) if r.get("outcome") in FAILED]
    if bad:
        raise SystemExit("a correct built-in failed, its costs are not a passing run's: " + "; ".join(bad))
    costs = costs_of(correct_certs)
    properties: dict[str, set[str]] = {}
    for cert in [*correct_certs, *(certificates[f"mutant:{n}"] for n in kills)]:
        for r in cert["results"]:
            properties.setdefault(r["level"], set()).add(r["property"])
    order = greedy_order(kills, costs, properties)

    lines = [f"$ python benchmarks/kill_matrix.py {' '.join(argv if argv is not None else sys.argv[1:])}",
             f"{len(kills)} mutants, every property, profile ci without shrinking; costs: "
             f"{', '.join(correct)} under ci (seconds of a passing property, all dtypes)",
             "wall: " + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items()), ""]
    survivors = sorted(n for n in names if not kills.get(n))
    for level, props in order.items():
        lines.append(f"level {level}: {'property':32} {'kills':>5} {'new':>4} {'cost s':>7}")
        alive_before = {n for n in kills if all(LEVEL_ORDER.get(k[0], 9) >= LEVEL_ORDER.get(level, 9)
                                                 for k in kills[n])}
        for prop in props:
            killed = {n for n in kills if (level, prop) in kills[n]}
            new = killed & alive_before
            alive_before -= new
            lines.append(f"  {'':6} {prop:32} {len(killed):5} {len(new):4} "
                         f"{costs.get((level, prop), 0.0):7.2f}")
    lines += ["", "mutant -> properties that kill it:"]
    for n in sorted(kills):
        lines.append(f"  {n}: " + ", ".join(f"{p}[{lv}]" for lv, p in sorted(kills[n])))
    lines.append("survived every property: " + (", ".join(survivors) or "none"))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
    if args.write:
        data = {
            "about": "Each level's properties in the order a run certifies them: most bug-zoo "
                     "mutants killed per second first. Written by benchmarks/kill_matrix.py --write.",
            "mutants": len(kills),
            "costs_from": correct,
            "levels": order,
            "kills": {f"{lv}:{p}": sum(1 for n in kills if (lv, p) in kills[n])
                      for lv, props in order.items() for p in props},
            "seconds": {f"{lv}:{p}": round(costs.get((lv, p), 0.0), 3)
                        for lv, props in order.items() for p in props},
        }
        ORDER_FILE.write_text(json.dumps(data, indent=1) + "\n")
    return 0 if not survivors else 1


if __name__ == "__main__":
    sys.exit(main())
