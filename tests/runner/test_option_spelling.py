"""``--NAME VALUE`` and ``--NAME=VALUE`` give the same run (rootdir, test ids, everything).

pytest picks its rootdir from the command line's paths before it loads the suite's
plugin; ``conformance.activation`` takes the values of the suite's options out of
those paths (``conformance.core.options.VALUE_OPTIONS``) and picks the rootdir again.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from conformance import activation
from conformance.core import options
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]


class _Recorder:
    """Stands in for pytest's parser: records what ``options.pytest_addoption`` adds
    (its public calls, ``getgroup`` and ``addoption``), so the suite's options are read
    from the suite's own table, not from pytest's private parser state."""

    def __init__(self) -> None:
        self.options: list[tuple[tuple[str, ...], dict]] = []

    def getgroup(self, *args, **kwargs) -> _Recorder:
        return self

    def addoption(self, *names: str, **attrs) -> None:
        self.options.append((names, attrs))


def _suite_options() -> list[tuple[tuple[str, ...], dict]]:
    recorder = _Recorder()
    options.pytest_addoption(recorder)
    return recorder.options


def _takes_value(attrs: dict) -> bool:
    return attrs.get("action") in (None, "store", "append")


def _a_value(attrs: dict) -> str:
    if attrs.get("choices"):
        return attrs["choices"][-1]
    return "3" if attrs.get("type") in (int, float) else "value.toml"


def test_value_options_are_every_option_of_the_suite_that_takes_a_value():
    taking = {name for names, attrs in _suite_options() if _takes_value(attrs) for name in names}
    flags = {name for names, attrs in _suite_options() if not _takes_value(attrs) for name in names}
    assert taking and flags
    assert taking == set(options.VALUE_OPTIONS), taking ^ set(options.VALUE_OPTIONS)
    assert not flags & set(options.VALUE_OPTIONS)


def test_the_installed_pytest_reads_each_option_as_the_table_says(pytester):
    """On the pytest installed, ``--NAME VALUE`` gives VALUE to a value-taking option and
    leaves it a test path after a flag (public API only: ``pytester.parseconfig``)."""
    for names, attrs in _suite_options():
        value = _a_value(attrs)
        config = pytester.parseconfig("-p", "no:attention_conformance", "-p", "conformance.core.options",
                                      names[0], value)
        got = config.getoption(attrs.get("dest") or names[0][2:].replace("-", "_"))
        if _takes_value(attrs):
            got = got[-1] if attrs.get("action") == "append" else got
            assert got == attrs.get("type", str)(value), names
            assert value not in config.args, names
        else:
            assert got is not attrs.get("default"), names
            assert value in config.args, names


def test_option_values_are_read_as_the_suite_reads_them():
    args = ["conformance", "--impl", "sdpa", "--xfail-file=a.toml", "--dtype", "float32",
            "--impl-exitfirst", "x.py", "--", "--replay", "b.npz"]
    assert activation.option_values(args) == ["sdpa", "float32"]


def _collect(cwd: Path, *args: str) -> tuple[str, list[str]]:
    """The rootdir line and the collected test ids of ``pytest --co`` run in ``cwd``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = pytest_process.run(
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
