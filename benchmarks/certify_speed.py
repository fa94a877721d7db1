"""Seconds to a certificate, as a ratio to ``python -c "import torch"`` in the same run.

For each repeat, in turn: a plain ``import torch``, then one whole-process
``pytest conformance --impl=IMPL --hypothesis-profile=ci`` per ``--torch-threads``
setting asked for (``1``, the runner's default, and ``0``, torch's own thread pool), so
every measurement sees the same load. Prints each run, then the median of each and its
ratio to the median torch import.

    python benchmarks/certify_speed.py --impl sdpa --repeat 3
    python benchmarks/certify_speed.py --impl sdpa --threads 1 --threads 0 --output benchmarks/results/certify-speed.txt
    python benchmarks/certify_speed.py --impl jax --threads 1 --workers 2 --repeat 3

``--workers N`` runs each certification with ``-n N`` (pytest-xdist; 0, the default: one
process).

``--max-examples N`` (repeatable) also times the run with the profile's random examples
cut to ``N`` per test (the profile ``PROFILE-maxN`` of ``benchmarks/derived_profiles.py``;
the directed examples and the sweeps are unchanged): ``--max-examples 1`` measures the
floor of a certificate that keeps every directed example and sweep, which no cut of the
random search can go below.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from derived_profiles import derived_profile, plugin_args  # benchmarks/, the script's directory

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
    parser.add_argument("--max-examples", type=int, action="append", default=[], metavar="N",
                        help="also time the run with max_examples=N (repeatable; N >= 1)")
    parser.add_argument("--workers", type=int, default=0, metavar="N",
                        help="pytest-xdist workers for each certification (-n N; 0: one process)")
    parser.add_argument("--output", default=None, metavar="PATH", help="also write the report to PATH")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.max_examples):
        parser.error("--max-examples must be >= 1 (Hypothesis needs one example to run a test)")
    settings = args.threads or [1, 0]
    # (label, --torch-threads, profile): every thread setting at the profile, then each cut
    # at the first thread setting.
    variants = [(f"--torch-threads={t}", t, args.profile) for t in settings]
    variants += [(f"--torch-threads={settings[0]} max_examples={n}", settings[0], derived_profile(args.profile, n))
                 for n in args.max_examples]
    lines: list[str] = [f"$ python benchmarks/certify_speed.py --impl {args.impl} --repeat {args.repeat} "
                        + " ".join(f"--threads {t}" for t in settings)
                        + "".join(f" --max-examples {n}" for n in args.max_examples)
                        + (f" --workers {args.workers}" if args.workers else "")]

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    imports: list[float] = []
    runs: dict[str, list[float]] = {label: [] for label, _, _ in variants}
    codes: set[int] = set()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            seconds, _ = _seconds([sys.executable, "-c", "import torch"], tmp)
            imports.append(seconds)
            say(f"repeat {i + 1}: import torch {seconds:.2f} s")
            for label, threads, profile in variants:
                seconds, code = _seconds(
                    [sys.executable, "-m", "pytest", str(ROOT / "conformance"), f"--rootdir={ROOT}",
                     f"--impl={args.impl}", f"--hypothesis-profile={profile}", "-q",
                     "-p", "no:cacheprovider", *plugin_args(tmp, profile), f"--torch-threads={threads}",
                     *(["-n", str(args.workers)] if args.workers else [])], tmp)
                runs[label].append(seconds)
                codes.add(code)
                say(f"repeat {i + 1}: {label} {seconds:.1f} s (exit {code})")
    base = statistics.median(imports)
    say(f"median import torch: {base:.2f} s")
    for label, values in runs.items():
        median = statistics.median(values)
        say(f"median --impl={args.impl} --hypothesis-profile={args.profile} {label}: "
            f"{median:.1f} s = {median / base:.1f} x import torch")
    if args.output:
        Path(args.output).write_text("\n".join(lines) + "\n")
    return 0 if codes <= {0} else 1


if __name__ == "__main__":
    raise SystemExit(main())
