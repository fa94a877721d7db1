"""``--NAME VALUE`` and ``--NAME=VALUE`` give the same run (rootdir, test ids, everything).

pytest picks its rootdir from the command line's paths before it loads the suite's
plugin; ``conformance.activation`` takes the values of the suite's options out of
those paths (``conformance.core.options.VALUE_OPTIONS``) and picks the rootdir again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _pytest.config.argparsing import Parser

from conformance import activation
from conformance.core import options

ROOT = Path(__file__).resolve().parents[2]


def test_value_options_are_every_option_of_the_suite_that_takes_a_value():
    parser = Parser(_ispytest=True)
    options.pytest_addoption(parser)
    taking = {name for group in parser._groups for option in group.options
              if option.attrs().get("action") in (None, "store", "append") for name in option.names()}
    flags = {name for group in parser._groups for option in group.options
             if option.attrs().get("action") not in (None, "store", "append") for name in option.names()}
    assert taking <= set(options.VALUE_OPTIONS), taking - set(options.VALUE_OPTIONS)
    assert not flags & set(options.VALUE_OPTIONS)


def test_option_values_are_read_as_the_suite_reads_them():
    args = ["conformance", "--impl", "sdpa", "--xfail-file=a.toml", "--dtype", "float32",
            "--impl-exitfirst", "x.py", "--", "--replay", "b.npz"]
    assert activation.option_values(args) == ["sdpa", "float32"]


def _collect(cwd: Path, *args: str) -> tuple[str, list[str]]:
    """The rootdir line and the collected test ids of ``pytest --co`` run in ``cwd``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "conformance.test_sdpa_agreement",
         "-p", "no:cacheprovider", "--co", "-k", "forward_agreement", *args],
        cwd=cwd, capture_output=True, text=True, timeout=240, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    [rootdir] = [line for line in lines if line.startswith("rootdir:")]
    ids = [line.strip() for line in lines if line.strip().startswith("<")]
    return rootdir, ids


def test_a_value_after_a_space_gives_the_same_rootdir_and_test_ids(tmp_path):
    """An --xfail-file outside the rootdir, given after a space (the README's form),
    once moved the rootdir to a common ancestor of it and the invocation directory."""
    run, other = tmp_path / "run", tmp_path / "other"
    run.mkdir()
    other.mkdir()
    (other / "mine.toml").write_text((ROOT / "implementations" / "xfail" / "sdpa.toml").read_text())
    spaced = _collect(run, "--impl", "sdpa", "--xfail-file", "../other/mine.toml",
                      "--dtype", "float32", "--impl-option", "causal=lower_right")
    joined = _collect(run, "--impl=sdpa", "--xfail-file=../other/mine.toml",
                      "--dtype=float32", "--impl-option=causal=lower_right")
    assert spaced == joined
    assert spaced[0] == f"rootdir: {run}"
    assert spaced[1] and all("float32" in i for i in spaced[1] if "Function" in i)


def test_a_path_value_after_a_space_loads_no_conftest_beside_it(tmp_path):
    """pytest loads the conftest.py files of its initial test paths: a value taken for
    one loaded the conftest.py beside the --xfail-file."""
    run, other = tmp_path / "run", tmp_path / "other"
    run.mkdir()
    other.mkdir()
    (other / "mine.toml").write_text((ROOT / "implementations" / "xfail" / "sdpa.toml").read_text())
    (other / "conftest.py").write_text("raise SystemExit('this conftest.py must not be loaded')\n")
    rootdir, ids = _collect(run, "--impl", "sdpa", "--xfail-file", "../other/mine.toml")
    assert rootdir == f"rootdir: {run}" and ids
