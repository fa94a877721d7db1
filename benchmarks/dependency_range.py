"""Are the declared dependency ranges true? Install the oldest and the newest allowed
pytest, Hypothesis and NumPy into fresh virtual environments and run the quick tier.

    python benchmarks/dependency_range.py                 # both ends, the quick tier
    python benchmarks/dependency_range.py --ends oldest   # one end
    python benchmarks/dependency_range.py --pytest-args "tests/runner -x"

The oldest end pins each package to the lower bound pyproject.toml declares (``pytest>=9.0``
gives ``pytest==9.0.0``); the newest end pins nothing, so pip takes the newest releases.
torch is the CPU build the project's CI installs (``torch==2.13.0``); the quick tier
needs none of the optional frameworks, so only ``.[test]`` is installed. Each run
prints the versions it tested and pytest's closing line; the exit status is non-zero
when an end fails. Run it before a release and after changing a range (docs/SPEED.md
says what the quick tier covers); results go to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The dependencies whose ranges are checked at both ends.
CHECKED = ("pytest", "hypothesis", "numpy")
TORCH = "torch==2.13.0"


def lower_bounds(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """``{"pytest": "8.0", ...}``: the ``>=`` bound of each of :data:`CHECKED`."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    bounds = {}
    for dep in deps:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)(,.*)?", dep.strip())
        if m and m.group(1).lower() in CHECKED:
            bounds[m.group(1).lower()] = m.group(2)
    missing = set(CHECKED) - set(bounds)
    if missing:
        raise SystemExit(f"pyproject.toml declares no '>=' bound for {sorted(missing)}")
    return bounds


def run_end(end: str, pytest_args: list[str], workdir: Path) -> tuple[bool, str]:
    venv = workdir / f"venv-{end}"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, TORCH], check=True)
    pins = [f"{name}=={version}" for name, version in lower_bounds().items()] if end == "oldest" else []
    subprocess.run([*pip, "-e", f"{ROOT}[test]", *pins], check=True)
    versions = subprocess.run([py, "-c", "import importlib.metadata as m; print(' '.join("
                               f"f'{{n}}=={{m.version(n)}}' for n in {CHECKED!r}))"],
                              capture_output=True, text=True, check=True).stdout.strip()
    start = time.perf_counter()
    proc = subprocess.run([py, "-m", "pytest", *pytest_args], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    closing = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    ok = proc.returncode == 0
    if not ok:
        print(proc.stdout[-6000:], proc.stderr[-3000:], sep="\n")
    return ok, f"{end}: {versions}: {closing} ({seconds:.0f} s)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ends", default="oldest,newest", help="oldest, newest or both (comma-separated)")
    parser.add_argument("--pytest-args", default='-m "not slow" -q -p no:cacheprovider',
                        help="the tests to run at each end (default: the quick tier)")
    args = parser.parse_args()
    ends = [e.strip() for e in args.ends.split(",") if e.strip()]
    bad = set(ends) - {"oldest", "newest"}
    if bad:
        parser.error(f"--ends={args.ends!r}: each end is 'oldest' or 'newest', not {sorted(bad)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="dependency-range-") as tmp:
        for end in ends:
            ok, line = run_end(end, shlex.split(args.pytest_args), Path(tmp))
            print(line, flush=True)
            results.append(ok)
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
