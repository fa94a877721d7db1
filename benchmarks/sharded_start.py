"""What the sharded level's rank processes cost to start: forked from the run's fork server
(the CPU default) against spawned as ``python -m conformance.sharded.worker`` each
(``ATTENTION_CONFORMANCE_SHARDED_FORK=0``), alternating, median of several runs.

Two measurements per mode: starting the four groups of an implementation (world sizes 1-4:
10 rank processes) in a fresh process, and the whole ``pytest conformance/test_sharded.py
--impl=IMPL --hypothesis-profile=ci`` (wall seconds, and the certificate's own figure of
seconds spent starting groups).

    python benchmarks/sharded_start.py --runs 3 --impl ring
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_START_GROUPS = """
import time
from conformance.sharded import group
from implementations import registry
impl = registry.resolve({impl!r})
began = time.monotonic()
for world in (1, 2, 3, 4):
    group.group_for(impl, "cpu", world).start()
print(time.monotonic() - began)
group.close_all()
"""


def _env(fork: str) -> dict[str, str]:
    return dict(os.environ, ATTENTION_CONFORMANCE_SHARDED_FORK=fork, PYTHONPATH=str(ROOT))


def start_groups(impl: str, fork: str) -> float:
    out = subprocess.run([sys.executable, "-c", _START_GROUPS.format(impl=impl)], cwd=ROOT, env=_env(fork),
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def certify(impl: str, fork: str) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "cert"
        began = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pytest", "conformance/test_sharded.py", f"--impl={impl}",
                        "--hypothesis-profile=ci", "-q", "-p", "no:cacheprovider", f"--conformance-report={report}"],
                       cwd=ROOT, env=_env(fork), capture_output=True, text=True)
        wall = time.perf_counter() - began
        found = re.search(r"([0-9.]+) s starting", Path(f"{report}.md").read_text())
        return wall, float(found.group(1)) if found else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", default="ring")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    starts: dict[str, list[float]] = {"1": [], "0": []}
    walls: dict[str, list[float]] = {"1": [], "0": []}
    starting: dict[str, list[float]] = {"1": [], "0": []}
    for _ in range(args.runs):
        for fork in ("1", "0"):  # alternating, so a change of load falls on both
            starts[fork].append(start_groups(args.impl, fork))
            wall, seconds = certify(args.impl, fork)
            walls[fork].append(wall)
            starting[fork].append(seconds)
    med = {k: {name: statistics.median(v[k]) for name, v in (("start", starts), ("wall", walls),
                                                             ("starting", starting))} for k in ("1", "0")}
    print(f"# python benchmarks/sharded_start.py --runs {args.runs} --impl {args.impl}")
    for fork, label in (("1", "forked"), ("0", "spawned")):
        m = med[fork]
        print(f"{label:8s} start 4 groups median {m['start']:.1f} s {[round(x, 1) for x in starts[fork]]}; "
              f"test_sharded.py under ci median {m['wall']:.1f} s wall {[round(x, 1) for x in walls[fork]]}, "
              f"of which starting groups {m['starting']:.1f} s")
    print(f"ratio forked/spawned: start {med['1']['start'] / med['0']['start']:.2f}, "
          f"whole run {med['1']['wall'] / med['0']['wall']:.2f}")


if __name__ == "__main__":
    main()
