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


START_STATE = """
    import os, sys, torch

    def test_started_in_its_environment():
        seen = {"EXPECTED_HASH": str(hash("attention")), "EXPECTED_THREADS": str(torch.get_num_threads()),
                "EXPECTED_CAPABILITY": torch.backends.cpu.get_cpu_capability()}
        [(name, want)] = [(k, v) for k, v in os.environ.items() if k.startswith("EXPECTED_")]
        assert seen[name] == want, name
"""


def _fresh(env: dict[str, str]) -> dict[str, str]:
    """What a fresh interpreter in ``env`` sees: the hash of a string, torch's threads and
    CPU capability."""
    code = ("import torch; print(hash('attention'), torch.get_num_threads(), "
            "torch.backends.cpu.get_cpu_capability())")
    seen = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return dict(zip(("EXPECTED_HASH", "EXPECTED_THREADS", "EXPECTED_CAPABILITY"), seen.stdout.split(), strict=True))


@pytest.mark.parametrize("change, seen", [({"PYTHONHASHSEED": "7"}, "EXPECTED_HASH"),
                                          ({"OMP_NUM_THREADS": "1"}, "EXPECTED_THREADS"),
                                          ({"ATEN_CPU_CAPABILITY": "default"}, "EXPECTED_CAPABILITY")])
def test_a_run_in_another_start_environment_gets_a_server_started_in_it(change, seen, tmp_path):
    """Variables read at interpreter start or at torch's import: the forked run sees what a
    fresh interpreter in its environment sees (hash seed, torch's threads, CPU kernels),
    which is not what this process sees."""
    (tmp_path / "test_start.py").write_text(textwrap.dedent(START_STATE))
    env = dict(os.environ, **change)
    fresh, here = _fresh(env)[seen], _fresh(dict(os.environ, PYTHONHASHSEED="8"))[seen]
    if fresh == here:  # one core: OMP_NUM_THREADS=1 is torch's default
        pytest.skip(f"{seen}: a fresh interpreter sees {fresh} with and without {change}")
    env[seen] = fresh
    cmd = [*PYTEST, "test_start.py"]
    assert pytest_process.forked(cmd, env=env)
    proc = pytest_process.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_what_a_fork_cannot_carry_gets_a_real_process():
    assert not pytest_process.forked(PYTEST, env=dict(os.environ, ATTENTION_CONFORMANCE_TEST_FORK="0"))
    assert not pytest_process.forked([sys.executable, "-c", "pass"])
    assert not pytest_process.forked([sys.executable, "-X", "importtime", "-m", "pytest"])
    assert not pytest_process.forked(PYTEST, input="x")
    with open(os.devnull, "w") as devnull:
        assert not pytest_process.forked(PYTEST, stdout=devnull)
