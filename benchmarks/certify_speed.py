"""Seconds to a certificate, as a ratio to ``python -c "import torch"`` in the same run.

For each repeat, in turn: a plain ``import torch``, then one whole-process
``pytest conformance --impl=IMPL --hypothesis-profile=ci`` per ``--torch-threads``
setting asked for (``1``, the runner's default, and ``0``, torch's own thread pool), so
every measurement sees the same load. Prints each run, then the median of each and its
ratio to the median torch import.

    python benchmarks/certify_speed.py --impl sdpa --repeat 3
    python benchmarks/certify_speed.py --impl sdpa --threads 1 --threads 0 --output benchmarks/results/certify-speed.txt
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _seconds(cmd: list[str], cwd: str) -> tuple[float, int]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    return time.perf_counter() - start, proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", default="sdpa")
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, action="append",
                        help="--torch-threads values to compare (default: 1 and 0)")
    parser.add_argument("--output", default=None, metavar="PATH", help="also write the report to PATH")
    args = parser.parse_args(argv)
    settings = args.threads or [1, 0]
    lines: list[str] = [f"$ python benchmarks/certify_speed.py --impl {args.impl} --repeat {args.repeat} "
                        + " ".join(f"--threads {t}" for t in settings)]

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    imports: list[float] = []
    runs: dict[int, list[float]] = {t: [] for t in settings}
    codes: set[int] = set()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            seconds, _ = _seconds([sys.executable, "-c", "import torch"], tmp)
            imports.append(seconds)
            say(f"repeat {i + 1}: import torch {seconds:.2f} s")
            for threads in settings:
                seconds, code = _seconds(
                    [sys.executable, "-m", "pytest", str(ROOT / "conformance"), f"--rootdir={ROOT}",
                     f"--impl={args.impl}", f"--hypothesis-profile={args.profile}", "-q",
                     "-p", "no:cacheprovider", f"--torch-threads={threads}"], tmp)
                runs[threads].append(seconds)
                codes.add(code)
                say(f"repeat {i + 1}: --torch-threads={threads} {seconds:.1f} s (exit {code})")
    base = statistics.median(imports)
    say(f"median import torch: {base:.2f} s")
    for threads, values in runs.items():
        median = statistics.median(values)
        say(f"median --impl={args.impl} --hypothesis-profile={args.profile} --torch-threads={threads}: "
            f"{median:.1f} s = {median / base:.1f} x import torch")
    if args.output:
        Path(args.output).write_text("\n".join(lines) + "\n")
    return 0 if codes <= {0} else 1


if __name__ == "__main__":
    raise SystemExit(main())
