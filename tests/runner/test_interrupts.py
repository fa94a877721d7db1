"""Only a crash is a crash: a run the user stops (Ctrl-C, SIGTERM) leaves no crash record.

Each test starts ``pytest conformance`` on an implementation that sleeps in every
call, waits until the run is inside a property test (its ``running-<pid>.json``
marker names the test), sends the signal, and checks that the next run would not
isolate the implementation "because an earlier run crashed". A process that
``os._exit()``s is still recorded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conformance.isolation import crash_markers

ROOT = Path(__file__).resolve().parents[2]
HOSTILE = "tests/runner/hostile_impls.py"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a background parent may have ignored it


def _start(attr: str, tmp_path: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "failures"),
               ATTENTION_CONFORMANCE_STATE=str(tmp_path / "state"))
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "conformance", "-p", "no:cacheprovider", "-q",
         "--hypothesis-profile=ci", f"--impl={HOSTILE}:{attr}", "--dtype=float64",
         "-k", "forward_agreement", "--impl-option", "derived_flash=false", *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, preexec_fn=_default_sigint,
    )


def _wait_in_a_test(proc: subprocess.Popen, state: Path, limit: float = 180) -> None:
    """Until the run's marker names a property test (it is inside one)."""
    deadline = time.monotonic() + limit
    marker = state / f"running-{proc.pid}.json"
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        try:
            if "test_forward_agreement" in json.loads(marker.read_text()).get("test", ""):
                time.sleep(1.0)  # inside the call that sleeps
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"the run never reached a property test: {proc.communicate()[0][-3000:]}")


def _crash_seen(state: Path, spec: str, monkeypatch: pytest.MonkeyPatch) -> str | None:
    monkeypatch.setenv("ATTENTION_CONFORMANCE_STATE", str(state))
    return crash_markers.crash_seen(spec)


@pytest.mark.parametrize("signum, isolate, timeout, group", [
    (signal.SIGINT, "never", "0", False),      # the call sleeps in pytest's main thread
    (signal.SIGTERM, "never", "600", False),   # the main thread waits for the call thread
    (signal.SIGINT, "always", "600", True),    # Ctrl-C in a terminal: the worker gets it too
    (signal.SIGTERM, "always", "600", True),   # `timeout`, a CI runner: the whole group
], ids=["sigint", "sigterm", "sigint-isolated", "sigterm-isolated"])
def test_an_interrupted_run_leaves_no_crash_record(tmp_path, monkeypatch, signum, isolate, timeout, group):
    state = tmp_path / "state"
    proc = _start("sleeps", tmp_path, f"--isolate={isolate}", f"--example-timeout={timeout}")
    _wait_in_a_test(proc, state)
    if group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the interrupted run did not end within 60 s")
    assert proc.returncode == 2, out[-3000:]  # pytest's "interrupted"
    assert not list(state.glob("running-*.json")), out[-3000:]
    assert not (state / "crashes.json").exists(), (state / "crashes.json").read_text()
    assert _crash_seen(state, f"{HOSTILE}:sleeps", monkeypatch) is None


def test_an_interrupted_marker_left_behind_is_not_counted(tmp_path, monkeypatch):
    """A process killed outright after the signal (a second SIGKILL) keeps its marker, marked."""
    state = tmp_path / "state"
    state.mkdir()
    gone = 2 ** 22 + 12345  # above the default pid_max: never a live process
    (state / f"running-{gone}.json").write_text(json.dumps(
        {"pid": gone, "spec": "x.py:f", "test": "t", "interrupted": "SIGTERM"}))
    assert _crash_seen(state, "x.py:f", monkeypatch) is None
    assert not list(state.glob("running-*.json"))
    (state / f"running-{gone}.json").write_text(json.dumps({"pid": gone, "spec": "x.py:f", "test": "t"}))
    assert "ended without finishing" in _crash_seen(state, "x.py:f", monkeypatch)


def test_a_run_that_os_exits_is_still_recorded_as_a_crash(tmp_path, monkeypatch):
    state = tmp_path / "state"
    proc = _start("exits", tmp_path, "--isolate=never")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 3, out[-3000:]
    assert "ended without finishing" in (_crash_seen(state, f"{HOSTILE}:exits", monkeypatch) or "")


def test_catch_interrupts_restores_the_handlers_it_replaced():
    before = {s: signal.getsignal(s) for s in crash_markers.INTERRUPT_SIGNALS}
    restore = crash_markers.catch_interrupts()
    try:
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
        with pytest.raises(crash_markers.Interrupted, match="SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs in this (main) thread
        assert crash_markers.interrupted_by() == "SIGTERM"
    finally:
        restore()
    assert {s: signal.getsignal(s) for s in crash_markers.INTERRUPT_SIGNALS} == before
    assert crash_markers.interrupted_by() is None  # the next run in this process starts afresh
