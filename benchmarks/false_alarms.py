"""No false alarms: the correct built-ins pass many runs in a row under ``dev``.

Each run is ``pytest conformance --impl=IMPL --hypothesis-profile=dev
--hypothesis-seed=SEED`` in a fresh working directory (so no example database
carries failures between runs), with a different seed per run. Prints, per
implementation, how many runs passed and every property that ever failed (with
the saved case), then a summary line.

    python benchmarks/false_alarms.py --runs 20 --impl spec --impl handwritten --impl sdpa --impl sdpa-math

Options the certification itself needs (an expected-failures file, an implementation
option) go through ``--pytest-arg``, once per argument, in the ``--name=value`` form; a
path in them, like the ``--impl`` path of a file, must be absolute, since each run starts
in its own empty folder:

    KERAS_BACKEND=torch python benchmarks/false_alarms.py --impl keras.layers:MultiHeadAttention \
        --pytest-arg=--xfail-file=keras-mha   # a shipped file by its short name

Exit status: 0 without a false alarm, 1 with one, 2 when a run could not start (no
certificate written: the measurement stops there).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(impl: str, seed: int, profile: str, extra: list[str] = ()) -> tuple[int, list[str], float]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "cert"
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", str(ROOT / "conformance"), f"--impl={impl}",
             f"--hypothesis-profile={profile}", f"--hypothesis-seed={seed}", "-q",
             "-p", "no:cacheprovider", f"--conformance-report={report}", f"--rootdir={ROOT}", *extra],
            cwd=tmp, capture_output=True, text=True,
        )
        wall = time.perf_counter() - start
        failed = []
        cert_path = Path(str(report) + ".json")
        if cert_path.exists():
            for r in json.loads(cert_path.read_text())["results"]:
                if r["outcome"] in ("failed", "error"):
                    failed.append(f"{r['property']}[{r['dtype']}] {r.get('counterexample')} "
                                  f"{(r.get('message') or '').splitlines()[:1]}")
        elif proc.returncode:
            raise RunError(f"pytest exited with {proc.returncode} and wrote no certificate "
                           f"(the run did not start: not a false alarm):\n{proc.stdout[-800:]}{proc.stderr[-800:]}")
    return proc.returncode, failed, wall


class RunError(RuntimeError):
    """A run that could not certify at all (bad install, usage error): the measurement
    stops, since every further run would fail the same way."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", action="append")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--profile", default="dev")
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--pytest-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for every run's pytest (repeatable; write it as "
                             "--pytest-arg=--option=value)")
    args = parser.parse_args(argv)
    impls = args.impl or ["spec", "handwritten", "sdpa", "sdpa-math"]
    alarms = 0
    for impl in impls:
        passed = 0
        walls = []
        for i in range(args.runs):
            seed = args.first_seed + i
            try:
                code, failed, wall = one_run(impl, seed, args.profile, args.pytest_arg)
            except RunError as err:
                print(f"{impl} seed={seed}: {err}", flush=True)
                return 2
            walls.append(wall)
            if code == 0:
                passed += 1
            else:
                alarms += 1
                for line in failed:
                    print(f"  {impl} seed={seed}: {line}", flush=True)
        walls.sort()
        print(f"{impl}: {passed}/{args.runs} runs passed under {args.profile} "
              f"(median {walls[len(walls) // 2]:.0f}s a run)", flush=True)
    print(f"false alarms: {alarms} run(s) failed out of {args.runs * len(impls)}")
    return 1 if alarms else 0


if __name__ == "__main__":
    raise SystemExit(main())
