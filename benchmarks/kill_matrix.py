"""Which property kills which mutant, and at what cost: the data behind the property order.

Certifies every selected mutant of the bug zoo with every property (no ``-x``, no
``--impl-exitfirst``) under a copy of the ``ci`` profile without Hypothesis' shrink phase
(a kill is decided by the first failing example; shrinking only makes it smaller), in
``--jobs`` pytest processes. Then certifies the correct built-ins (``--correct``) under
``ci`` to measure what each property costs when it passes: the seconds a run stopping
at its first failure (``-x``) pays for every property ordered before the failing one.

From the two it orders each level's properties greedily by kill power per second: next
comes (after ``--first``, the agreement properties: see :data:`FIRST`) the property that kills the most mutants not yet killed by an earlier property (or
an earlier level) per second of its cost (the greedy rule for the least total time to
each mutant's first failure); once every mutant is killed, the rest follow by all the
mutants they kill per second (the best guess for bugs outside the zoo, and for
implementations on which an earlier property is skipped). The order is written to ``conformance/harness/property_order.json``, which
``pytest_collection_modifyitems`` reads (``conformance/harness/ordering.py``); the kill matrix
and the order, with each property's kills and seconds, are printed.

    python benchmarks/kill_matrix.py --jobs 2 --write --raw kill-matrix.json
    python benchmarks/kill_matrix.py --only gqa_tile,scale_ignored     # print only
    python benchmarks/kill_matrix.py --from kill-matrix.json --write   # order again, no run
    python benchmarks/kill_matrix.py --only NEW,MUTANTS --correct flash-ref,ring \
        --merge benchmarks/results/kill-matrix-OLD.json --raw kill-matrix.json --write
        # measure some mutants and built-ins again, keep the rest of an earlier matrix

The Triton mutants are left out by default (``--with-triton``): the interpreter makes
their runs long, and the Triton kernel's properties are the same as every SDPA
implementation's.

Exit status: 0 when every selected mutant is killed by some property, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from conformance.harness.ordering import ORDER_FILE  # noqa: E402
from conformance.plugin import LEVEL_ORDER, PROFILES  # noqa: E402
from implementations.mutants import MUTANTS  # noqa: E402
from mutation_score import certify_in_process  # noqa: E402

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
#: Placed first in their level whatever their kill power: the first failure is the one a
#: user reads and the diagnosis explains, and the diagnosis reads an agreement property's
#: failure best (the whole output on the failing case, compared with spec.variants).
#: Measured: with dropout_expectation and fully_masked_rows first (the plain greedy
#: order, ``--first ""``), the diagnosis named 9 of the 29 mutants of
#: the zoo's diagnosis runs (then tests/diagnosis/test_diagnosis_mutants.py) wrongly or not at all (6 of them MHA
#: mutants first failing mha_dropout_expectation: "named nothing"). The same holds at the
#: FlashAttention and sharded levels: their dropout and FP8 calls are not fitted by the
#: diagnosis, so a bug first failing there would read "unknown" (flash_dropout_expectation
#: also checks the LSE: an LSE bug must meet lse_agreement first).
FIRST = ("forward_agreement", "mha_agreement", "flash_agreement", "lse_agreement", "varlen_agreement",
         "kvcache_agreement", "sharded_forward")


def _certify(impls: list[str], profile: str, workdir: Path, timeout_s: float) -> tuple[dict, float]:
    """One pytest process over ``impls``; (spec -> certificate, wall seconds)."""
    extra, env = [], {}
    if profile == PROFILE:
        (workdir / "kill_matrix_profile.py").write_text(_PROFILE_PLUGIN)
        extra = ["-p", "kill_matrix_profile"]
        env["PYTHONPATH"] = str(workdir) + (":" + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    certificates, wall, code, output = certify_in_process(impls, profile, workdir, timeout_s, extra, env)
    if not certificates:
        raise SystemExit(f"no report from --impl={','.join(impls)} (exit code {code}):\n{output}")
    return certificates, wall


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
                 properties: dict[str, set[str]], first: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Each level's properties: those named in ``first`` (in that order), then most new
    kills per second (levels in LEVEL_ORDER, a mutant killed at an earlier level or by an
    earlier property no longer counted), then the rest by all their kills per second
    (cheapest first among equals)."""
    floor = 0.01  # seconds: a property that measured 0 s still costs its set-up
    alive = set(kills)
    order: dict[str, list[str]] = {}

    def cost(level: str, prop: str) -> float:
        return max(costs.get((level, prop), 0.0), floor)

    def total(level: str, prop: str) -> int:
        return sum(1 for m in kills if (level, prop) in kills[m])

    for level in sorted(properties, key=lambda lv: LEVEL_ORDER.get(lv, len(LEVEL_ORDER))):
        chosen = [p for p in first if p in properties[level]]
        left = set(properties[level]) - set(chosen)
        for prop in chosen:
            alive -= {m for m in alive if (level, prop) in kills[m]}
        while left:
            powers = {p: _power(kills, alive, level, p, cost(level, p)) for p in left}
            best = max(powers, key=powers.__getitem__)
            if powers[best][0] == 0:
                chosen += sorted(left, key=lambda p: (-total(level, p) / cost(level, p), cost(level, p), p))
                break
            chosen.append(best)
            left.remove(best)
            alive -= {m for m in alive if (level, best) in kills[m]}
        order[level] = chosen
    return order


def _power(kills: dict[str, set[tuple[str, str]]], alive: set[str] | frozenset[str], level: str,
           prop: str, cost: float) -> tuple[float, float, str]:
    """New kills per second of ``prop`` (then cheaper, then by name, for a stable order)."""
    new = sum(1 for m in alive if (level, prop) in kills[m])
    return (new / cost, -cost, prop)


def save_raw(path: Path, kills: dict[str, set[tuple[str, str]]], costs: dict[tuple[str, str], float],
             properties: dict[str, set[str]], correct: list[str]) -> None:
    """The measurement itself, so that an order can be derived again without a run."""
    path.write_text(json.dumps({
        "kills": {m: sorted(f"{lv}:{p}" for lv, p in ks) for m, ks in sorted(kills.items())},
        "costs": {f"{lv}:{p}": round(c, 4) for (lv, p), c in sorted(costs.items())},
        "properties": {lv: sorted(ps) for lv, ps in properties.items()},
        "costs_from": correct,
    }, indent=1) + "\n")


def load_raw(path: Path) -> tuple[dict[str, set[tuple[str, str]]], dict[tuple[str, str], float],
                                  dict[str, set[str]], list[str]]:
    data = json.loads(path.read_text())

    def pair(key: str) -> tuple[str, str]:
        level, prop = key.split(":", 1)
        return level, prop

    return ({m: {pair(k) for k in ks} for m, ks in data["kills"].items()},
            {pair(k): float(c) for k, c in data["costs"].items()},
            {lv: set(ps) for lv, ps in data["properties"].items()}, list(data.get("costs_from", [])))


def merge_raw(path: Path, kills: dict[str, set[tuple[str, str]]], costs: dict[tuple[str, str], float],
              properties: dict[str, set[str]], correct: list[str]
              ) -> tuple[dict[str, set[tuple[str, str]]], dict[tuple[str, str], float], dict[str, set[str]],
                         list[str]]:
    """An earlier kill matrix with this run's measurements in it: a mutant measured now has
    its kills replaced whole, a property costed now its cost; the rest is kept as measured
    then (a mutant no longer in the zoo is dropped)."""
    old_kills, old_costs, old_properties, old_correct = load_raw(path)
    merged_kills = {m: ks for m, ks in old_kills.items() if m in MUTANTS}
    merged_kills.update(kills)
    merged_costs = {**old_costs, **costs}
    merged_properties = {lv: set(ps) for lv, ps in old_properties.items()}
    for level, props in properties.items():
        merged_properties.setdefault(level, set()).update(props)
    return merged_kills, merged_costs, merged_properties, [*old_correct, *(c for c in correct if c not in old_correct)]


def _measure(names: list[str], correct: list[str], jobs_at_once: int, timeout_s: float,
             walls: dict[str, float]) -> tuple[dict[str, set[tuple[str, str]]],
                                               dict[tuple[str, str], float], dict[str, set[str]]]:
    """Run the mutants (every property, no shrinking) and the correct built-ins (``ci``);
    (kills per mutant, cost per property, each level's properties)."""
    with tempfile.TemporaryDirectory(prefix="kill-matrix-") as tmp:
        jobs = [(f"mutants{i}", [f"mutant:{n}" for n in chunk], PROFILE)
                for i, chunk in enumerate(_chunks(names, jobs_at_once))]
        jobs += [(f"correct-{c}", [c], "ci") for c in correct]

        def run(job: tuple[str, list[str], str]) -> tuple[dict, float]:
            workdir = Path(tmp) / job[0]
            workdir.mkdir()
            return _certify(job[1], job[2], workdir, timeout_s)

        with ThreadPoolExecutor(max_workers=max(1, jobs_at_once)) as pool:
            results = list(pool.map(run, jobs))
    certificates: dict[str, dict] = {}
    for job, (certs, wall) in zip(jobs, results, strict=True):
        certificates.update(certs)
        walls[job[0]] = wall
    kills = {n: kills_of(certificates[f"mutant:{n}"]) for n in names if f"mutant:{n}" in certificates}
    correct_certs = [certificates[c] for c in correct if c in certificates]
    bad = [f"{c}: {r['property']}[{r['level']}-{r['dtype']}] {r['outcome']}" for c in correct
           for r in certificates.get(c, {}).get("results", []) if r.get("outcome") in FAILED]
    if bad:
        raise SystemExit("a correct built-in failed, its costs are not a passing run's: " + "; ".join(bad))
    properties: dict[str, set[str]] = {}
    for cert in [*correct_certs, *(certificates[f"mutant:{n}"] for n in kills)]:
        for r in cert["results"]:
            properties.setdefault(r["level"], set()).add(r["property"])
    return kills, costs_of(correct_certs), properties


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated mutant names (default: all)")
    parser.add_argument("--with-triton", action="store_true", help="also the Triton mutants")
    parser.add_argument("--correct", default="sdpa,handwritten,torch-mha,flash-ref,varlen-reference",
                        help="the correct built-ins whose certificates give the costs")
    parser.add_argument("--first", default=",".join(FIRST),
                        help="properties placed first in their level, before the greedy order")
    parser.add_argument("--jobs", type=int, default=1, help="pytest processes at a time")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per pytest process")
    parser.add_argument("--write", action="store_true", help=f"write the order to {ORDER_FILE.relative_to(ROOT)}")
    parser.add_argument("--output", default=None, metavar="PATH", help="also write the report to PATH")
    parser.add_argument("--raw", default=None, metavar="PATH", help="also write the kill matrix and costs (JSON)")
    parser.add_argument("--merge", default=None, metavar="PATH",
                        help="an earlier kill matrix (--raw) to keep, with the mutants and the "
                             "properties' costs measured by this run replacing its entries")
    parser.add_argument("--from", dest="from_raw", default=None, metavar="PATH",
                        help="order from a kill matrix written by --raw instead of running")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or sorted(
        n for n in MUTANTS if args.with_triton or not n.startswith("triton_"))
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        parser.error(f"--only names unknown mutants {unknown}; known: {', '.join(sorted(MUTANTS))}")
    correct = [c.strip() for c in args.correct.split(",") if c.strip()]

    walls: dict[str, float] = {}
    if args.from_raw:
        kills, costs, properties, correct = load_raw(Path(args.from_raw))
        kills = {n: kills[n] for n in names if n in kills}
    else:
        kills, costs, properties = _measure(names, correct, args.jobs, args.timeout, walls)
        if args.merge:
            kills, costs, properties, correct = merge_raw(Path(args.merge), kills, costs, properties, correct)
            names = sorted(kills)
    if args.raw:
        save_raw(Path(args.raw), kills, costs, properties, correct)
    first = tuple(p.strip() for p in args.first.split(",") if p.strip())
    order = greedy_order(kills, costs, properties, first)

    lines = [f"$ python benchmarks/kill_matrix.py {' '.join(argv if argv is not None else sys.argv[1:])}",
             f"{len(kills)} mutants, every property, profile ci without shrinking; costs: "
             f"{', '.join(correct)} under ci (seconds of a passing property, all dtypes)",
             ("wall: " + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items())) if walls
             else f"from {args.from_raw}", ""]
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
