"""How often each value regime reaches each SDPA property under a Hypothesis profile.

Runs ``pytest conformance --impl=IMPL --hypothesis-profile=PROFILE`` in this
process and counts, per property and value regime (``conformance.strategies.REGIMES``),
the SDPA cases the property checked: its directed examples (``conformance.directed.examples``)
and the cases Hypothesis drew (seen through Hypothesis's observability callbacks),
summed over the targets that ran. A cell is ``-`` where the property's strategy
cannot produce the regime (its ``sdpa_cases`` arguments rule it out; for another
strategy: absent from ``--draws`` draws per target) and ``0`` where it can but
the run never reached it; ``tests/runner/test_regime_coverage.py`` requires
no ``0`` under ``ci``.

    python benchmarks/regime_coverage.py --impl spec
    python benchmarks/regime_coverage.py --impl sdpa --dtype float32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: The regime in a drawn case's representation (``regime=normal`` or ``'regime': "'normal'"``).
_REGIME = re.compile(r"\bregime\W+(\w+)")


def producible(info: Any, target: Any, draws: int) -> set[str]:
    """Regimes the property's strategy can produce for ``target``: those its
    ``sdpa_cases`` arguments accept (``directed.examples.producible_regimes``), or, for a
    strategy built otherwise, those among ``draws`` of its cases."""
    from hypothesis import HealthCheck, given, settings

    from conformance.directed import examples as directed

    strategy = info.cases(target)
    arguments = getattr(strategy, "case_arguments", None)
    if arguments is not None:
        return set(directed.producible_regimes(target, **arguments))
    seen: set[str] = set()

    @settings(max_examples=draws, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def draw(case: Any) -> None:
        if hasattr(case, "regime"):
            seen.add(case.regime)

    draw()
    return seen


class RegimeCounter:
    """pytest plugin: per (property, regime) the cases checked, and per property
    the regimes its strategy can produce for the targets that ran."""

    def __init__(self, draws: int) -> None:
        self.draws = draws
        self.current: str | None = None
        self.counts: Counter[tuple[str, str]] = Counter()
        self.drawn: Counter[tuple[str, str]] = Counter()  # by Hypothesis alone
        self.producible: dict[str, set[str]] = {}

    def observe(self, observation: Any) -> None:
        if self.current is None or getattr(observation, "type", None) != "test_case":
            return
        if observation.status not in ("passed", "failed"):
            return
        match = _REGIME.search(observation.representation)
        if match:
            self.counts[(self.current, match.group(1))] += 1
            self.drawn[(self.current, match.group(1))] += 1

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: Any):  # noqa: ANN201 - a hookwrapper
        from conformance.core.registry import registered_properties

        prop = getattr(getattr(item, "function", None), "conformance_property", None)
        info = registered_properties().get(prop) if prop else None
        self.current = prop if info is not None and info.cases is not None else None
        outcome = yield
        self.current = None
        excinfo = outcome.excinfo
        skipped = excinfo is not None and issubclass(excinfo[0], pytest.skip.Exception)
        if info is None or info.cases is None or skipped:
            return
        target = item.callspec.params["target"]
        for case in info.directed(target) if info.directed is not None else ():
            if hasattr(case, "regime"):
                self.counts[(prop, case.regime)] += 1
        regimes = producible(info, target, self.draws)
        if regimes:
            self.producible.setdefault(prop, set()).update(regimes)


def coverage(impl: str, profile: str = "ci", extra: list[str] | None = None,
             draws: int = 100) -> dict[str, Any]:
    """Run the suite and return ``{"counts": {prop: {regime: n}}, "producible": {prop: [regimes]},
    "exit": code}`` (only SDPA properties whose cases carry a regime)."""
    from hypothesis.internal import observability

    # Observations without line coverage: tracing every line would slow the run
    # severalfold (the environment variable that says so would also write them to files).
    observability.OBSERVABILITY_COLLECT_COVERAGE = False
    counter = RegimeCounter(draws)
    observability.add_observability_callback(counter.observe)
    try:
        code = pytest.main(["conformance", f"--impl={impl}", f"--hypothesis-profile={profile}", "-q",
                            "-p", "no:cacheprovider", *(extra or [])], plugins=[counter])
    finally:
        observability.remove_observability_callback(counter.observe)
    counts: dict[str, dict[str, int]] = {}
    drawn: dict[str, dict[str, int]] = {}
    for (prop, regime), n in counter.counts.items():
        counts.setdefault(prop, {})[regime] = n
    for (prop, regime), n in counter.drawn.items():
        drawn.setdefault(prop, {})[regime] = n
    return {"counts": counts, "drawn": drawn, "exit": int(code),
            "producible": {p: sorted(r) for p, r in counter.producible.items()}}


def table(result: dict[str, Any]) -> str:
    from conformance.strategies import REGIMES

    props = sorted(result["producible"])
    width = max([len(p) for p in props] + [8])
    lines = [f"{'property':{width}} " + " ".join(f"{r:>13}" for r in REGIMES)]
    for prop in props:
        cells = []
        for regime in REGIMES:
            n = result["counts"].get(prop, {}).get(regime, 0)
            cells.append(f"{n if regime in result['producible'][prop] else '-':>13}")
        lines.append(f"{prop:{width}} " + " ".join(cells))
    unreached = unreached_pairs(result)
    lines.append(f"unreached (property, regime) pairs the strategies produce: {len(unreached)}"
                 + (f" {unreached}" if unreached else ""))
    by_drawing = unreached_pairs(result, "drawn")
    lines.append(f"of {sum(len(r) for r in result['producible'].values())} pairs, unreached by the "
                 f"drawn cases alone (without the directed examples): {len(by_drawing)}")
    return "\n".join(lines)


def unreached_pairs(result: dict[str, Any], source: str = "counts") -> list[tuple[str, str]]:
    """(property, regime) pairs the strategy can produce that no case of ``source``
    ("counts": all checked cases; "drawn": Hypothesis's alone) carried."""
    return [(prop, regime) for prop, regimes in sorted(result["producible"].items())
            for regime in regimes if not result[source].get(prop, {}).get(regime)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", default="spec")
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--dtype", default=None, help="comma-separated dtypes (default: declared)")
    parser.add_argument("--draws", type=int, default=100, help="draws per target to tell what a strategy produces")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the counts as JSON")
    args = parser.parse_args(argv)
    extra = ["-k", "not mha_ and not small_sizes_sweep"]
    if args.dtype:
        extra.append(f"--dtype={args.dtype}")
    result = coverage(args.impl, args.profile, extra, args.draws)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
