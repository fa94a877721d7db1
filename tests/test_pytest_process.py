"""The tests' forked ``python -m pytest`` stands for a fresh one: the run's working
directory, environment, import path and arguments, its exit code and output, a timeout;
and a real process wherever a fork cannot stand for one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests import pytest_process

pytestmark = pytest.mark.skipif(not pytest_process.forked([sys.executable, "-m", "pytest"]),
                                reason="runs are not forked here (no fork, or ATTENTION_CONFORMANCE_TEST_FORK=0)")

PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q"]

RUN_STATE = """
    import json, os, sys

    def test_state():
        assert os.getcwd() == {cwd!r}
        assert sys.path[0] == {cwd!r}
        assert os.environ["FORKED_RUN_MARK"] == "here"
        assert "FORKED_RUN_GONE" not in os.environ
        import helper_on_pythonpath  # from the run's PYTHONPATH
        assert sys.argv[1:] == json.loads(os.environ["EXPECTED_ARGV"])
        assert sys.modules["__main__"].__spec__.name == "pytest.__main__"
        print("state seen")

    def test_fails():
        assert 1 == 2
"""


@pytest.fixture
def project(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helper_on_pythonpath.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "FORKED_RUN_GONE"}
    env.update(FORKED_RUN_MARK="here", PYTHONPATH=str(tmp_path / "lib"))
    return tmp_path, env


def test_a_forked_run_has_a_fresh_process_state_and_its_exit_code(project, monkeypatch):
    tmp_path, env = project
    monkeypatch.setenv("FORKED_RUN_GONE", "1")  # in the tests' process, not in the run's env
    args = ["-p", "no:cacheprovider", "-q", "-s", "test_state.py"]
    (tmp_path / "test_state.py").write_text(textwrap.dedent(RUN_STATE.format(cwd=str(tmp_path))))
    cmd = [sys.executable, "-m", "pytest", *args]
    env["EXPECTED_ARGV"] = json.dumps(args)
    assert pytest_process.forked(cmd, env=env, cwd=tmp_path, capture_output=True, text=True)
    proc = pytest_process.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "state seen" in proc.stdout and "1 failed, 1 passed" in proc.stdout, proc.stdout
    with pytest.raises(subprocess.CalledProcessError):
        pytest_process.run(cmd, cwd=tmp_path, env=env, capture_output=True, check=True)
    env["EXPECTED_ARGV"] = json.dumps([*args, "-k", "not fails"])
    passed = pytest_process.run([*cmd, "-k", "not fails"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
    assert passed.returncode == 0 and passed.stderr is None and b"1 passed" in passed.stdout


def test_a_forked_run_past_its_timeout_is_killed(tmp_path):
    (tmp_path / "test_sleep.py").write_text("import time\n\ndef test_sleep():\n    time.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        pytest_process.run([*PYTEST, "test_sleep.py"], cwd=tmp_path, capture_output=True, timeout=3)
    again = pytest_process.run([*PYTEST, "--co", "test_sleep.py"], cwd=tmp_path, capture_output=True, text=True)
    assert again.returncode == 0 and "1 test collected" in again.stdout  # the server goes on


@pytest.mark.parametrize("change", [
    {"OMP_NUM_THREADS": "3"}, {"ATEN_CPU_CAPABILITY": "default"}, {"PYTHONHASHSEED": "7"},
    {"ATTENTION_CONFORMANCE_TEST_FORK": "0"},
])
def test_an_environment_read_at_interpreter_start_gets_a_real_process(change):
    env = dict(os.environ, **change)
    assert not pytest_process.forked(PYTEST, env=env)
    assert pytest_process.forked(PYTEST, env=dict(os.environ, ATTENTION_CONFORMANCE_FAILURES="x"))


def test_what_a_fork_cannot_carry_gets_a_real_process():
    assert not pytest_process.forked([sys.executable, "-c", "pass"])
    assert not pytest_process.forked([sys.executable, "-X", "importtime", "-m", "pytest"])
    assert not pytest_process.forked(PYTEST, input="x")
    with open(os.devnull, "w") as devnull:
        assert not pytest_process.forked(PYTEST, stdout=devnull)
