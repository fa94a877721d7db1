"""How fast the conformance runner is: time and examples per second per property,
and the oracle's share of the time.

Runs ``pytest conformance --impl=IMPL --hypothesis-profile=PROFILE`` in this
process ``--repeat`` times (median reported) for each implementation, with the
spec's public functions wrapped by timers (re-entrant calls counted once), and
prints one table per implementation plus the total wall time of each against the
first implementation named (the baseline of this run).

    python benchmarks/runner_speed.py --impl sdpa --impl handwritten --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class OracleTimer:
    """Wraps spec's entry points; time inside nested spec calls is counted once."""

    NAMES = ("sdpa", "sdpa_vjp", "emulate_sdpa", "mha_forward")

    def __init__(self) -> None:
        import spec

        self.spec = spec
        self.total = 0.0
        self.depth = 0
        self.originals = {n: getattr(spec, n) for n in self.NAMES}

    def __enter__(self) -> "OracleTimer":
        for name, fn in self.originals.items():
            setattr(self.spec, name, self._wrap(fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self.originals.items():
            setattr(self.spec, name, fn)

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - start
                self.depth -= 1

        return timed


def run_once(impl: str, profile: str, extra: list[str]) -> dict:
    import pytest

    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "cert"
        args = ["conformance", f"--impl={impl}", f"--hypothesis-profile={profile}", "-q",
                "-p", "no:cacheprovider", f"--conformance-report={report}", *extra]
        with OracleTimer() as timer:
            start = time.perf_counter()
            code = pytest.main(args)
            wall = time.perf_counter() - start
        cert = json.loads(Path(str(report) + ".json").read_text())
    return {"wall": wall, "oracle": timer.total, "exit": int(code), "results": cert["results"]}


def summarize(impl: str, runs: list[dict]) -> str:
    per: dict[tuple[str, str, str], list[tuple[float, int]]] = {}
    for run in runs:
        for r in run["results"]:
            if r["outcome"] in ("passed", "failed", "xfailed", "stale-xfail"):
                per.setdefault((r["property"], r["level"], r["dtype"]), []).append((r["seconds"], r["examples"]))
    lines = [f"{'property':30} {'level':5} {'dtype':9} {'seconds':>8} {'examples':>8} {'ex/s':>8}"]
    for (prop, level, dtype), values in sorted(per.items(), key=lambda kv: -statistics.median(v[0] for v in kv[1])):
        sec = statistics.median(v[0] for v in values)
        ex = statistics.median(v[1] for v in values)
        lines.append(f"{prop:30} {level:5} {dtype:9} {sec:8.2f} {ex:8.0f} {ex / sec if sec else 0:8.0f}")
    wall = statistics.median(r["wall"] for r in runs)
    oracle = statistics.median(r["oracle"] / r["wall"] for r in runs)
    lines.append(f"{impl}: median wall {wall:.1f}s over {len(runs)} run(s); oracle share {100 * oracle:.0f}%; "
                 f"exit codes {[r['exit'] for r in runs]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", action="append", help="implementation(s); the first is the baseline")
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    impls = args.impl or ["sdpa"]
    walls = {}
    for impl in impls:
        runs = [run_once(impl, args.profile, args.pytest_args) for _ in range(args.repeat)]
        print(summarize(impl, runs), flush=True)
        walls[impl] = statistics.median(r["wall"] for r in runs)
    base = impls[0]
    for impl in impls:
        print(f"wall {impl}: {walls[impl]:.1f}s = {walls[impl] / walls[base]:.2f}x {base}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
