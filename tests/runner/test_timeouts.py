"""Timeouts measure the implementation, not the machine (``implementations.guard``).

* the first call with a ``warm_key`` (an implementation's first call, of a dtype, on a
  device) may take ``COMPILE_FACTOR`` x the timeout, and says so when it times out;
* the time the call's thread waited for a CPU other processes held is not counted,
  up to ``MAX_STRETCH`` x the limit in wall-clock time;
* a call that sleeps forever still times out after the limit, and one that spins
  after at most ``MAX_STRETCH`` x the limit.

The waits are simulated (``CpuWait.waited`` monkeypatched), so these tests assert the
rule, not the speed of the machine they run on; the bounds are in multiples of the
timeout, which a loaded machine only lengthens (sleeping costs no CPU).
"""

from __future__ import annotations

import itertools
import time

import pytest

from implementations import guard
from implementations.base import ImplementationError
from implementations.registry import probing
from tests import pytest_process

_keys = itertools.count()


def _sleeps(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


def test_the_first_call_of_a_key_gets_the_compile_allowance_and_only_it():
    key = ("test", next(_keys))
    # 0.6 s under a 0.2 s timeout: within 5 x 0.2 s as the first call, not as the second.
    assert guard.guarded_call(_sleeps, 0.6, timeout=0.2, warm_key=key) == "done"
    assert key in guard.slow_first_calls() and guard.slow_first_calls()[key] >= 0.6
    with pytest.raises(guard.CallTimedOut) as timed_out:
        guard.guarded_call(_sleeps, 0.6, timeout=0.2, warm_key=key)
    assert not timed_out.value.first and "compilation" not in str(timed_out.value)
    with pytest.raises(guard.CallTimedOut):  # no key: no allowance
        guard.guarded_call(_sleeps, 0.6, timeout=0.2)


def test_a_first_call_that_hangs_says_it_was_given_the_allowance():
    key = ("test", next(_keys))
    start = time.monotonic()
    with pytest.raises(guard.CallTimedOut) as timed_out:
        guard.guarded_call(_sleeps, 30, timeout=0.1, warm_key=key)
    assert guard.COMPILE_FACTOR * 0.1 <= time.monotonic() - start
    assert timed_out.value.first and timed_out.value.limit == pytest.approx(guard.COMPILE_FACTOR * 0.1)
    assert f"did not return within {guard.COMPILE_FACTOR * 0.1:g}s (its first call: " in str(timed_out.value)
    assert "allowed for compilation" in str(timed_out.value)


def test_time_spent_waiting_for_a_cpu_is_not_counted(monkeypatch):
    """A call that got half the wall-clock time (the other half waiting for a CPU) passes
    where it would have timed out counted by the wall clock."""
    monkeypatch.setattr(guard.CpuWait, "waited", lambda self: 0.5 * (time.monotonic() - self.since))
    assert guard.guarded_call(_sleeps, 0.5, timeout=0.3) == "done"
    with pytest.raises(guard.CallTimedOut) as timed_out:  # 0.3 s of its own after 0.6 s
        guard.guarded_call(_sleeps, 2.0, timeout=0.3)
    assert 0.55 <= timed_out.value.seconds and timed_out.value.waited > 0
    assert "waiting for a CPU that other processes held, not counted" in str(timed_out.value)


def test_a_call_that_always_waits_still_times_out_at_the_stretch_cap(monkeypatch):
    monkeypatch.setattr(guard.CpuWait, "waited", lambda self: time.monotonic() - self.since)
    start = time.monotonic()
    with pytest.raises(guard.CallTimedOut) as timed_out:
        guard.guarded_call(_sleeps, 30, timeout=0.2)
    took = time.monotonic() - start
    assert guard.MAX_STRETCH * 0.2 <= took and timed_out.value.seconds >= guard.MAX_STRETCH * 0.2 - 0.01


def test_a_sleeping_hang_is_not_stretched():
    """Sleeping waits for no CPU: the limit is the timeout, on any machine."""
    with pytest.raises(guard.CallTimedOut) as timed_out:
        guard.guarded_call(_sleeps, 30, timeout=0.3)
    assert timed_out.value.waited < 0.05 and timed_out.value.limit == 0.3


def test_judge():
    assert guard.judge(1.0, 0.5, 0.0) == pytest.approx(0.5)
    assert guard.judge(1.0, 1.5, 1.0) == pytest.approx(0.5)  # half of it waited: 0.5 s more
    assert guard.judge(1.0, 1.0, 0.0) == 0.0
    assert guard.judge(1.0, guard.MAX_STRETCH, guard.MAX_STRETCH) == 0.0  # the cap


def test_cpu_wait_reads_the_kernels_run_queue_wait_of_the_thread():
    wait = guard.CpuWait(since=time.monotonic() - 1.0)
    time.sleep(0.05)
    assert 0.0 <= wait.waited() <= 1.2  # at most all the time since the call started


def test_a_call_that_returns_in_time_reads_nothing(monkeypatch):
    made = []
    monkeypatch.setattr(guard, "CpuWait", lambda *a, **k: made.append(1))
    for _ in range(50):
        assert guard.guarded_call(lambda: 1, timeout=5) == 1
    assert made == []


def test_a_slow_first_probe_call_passes_and_a_slow_later_one_fails():
    calls = []

    def slow_first():
        calls.append(1)
        time.sleep(0.5 if len(calls) == 1 else 0.0)
        return True

    prober = probing._Prober("test", timeout=0.2)
    assert prober.call("a first call", slow_first) is True
    assert "first call took" in prober.slow_first_call and "compile time allowed" in prober.slow_first_call
    assert prober.call("a second call", slow_first) is True
    with pytest.raises(ImplementationError, match=r"probing a slow call did not return within 0.2s"):
        prober.call("a slow call", lambda: time.sleep(1.0))


def test_a_slow_first_call_is_named_at_the_end_of_the_run():
    from types import SimpleNamespace

    from conformance.harness.session import Session
    from conformance.plugin import slow_first_calls

    impl = SimpleNamespace()
    session = Session(profile="ci", started=0.0, impl=impl, impl_spec="mine.py:f")
    guard.guarded_call(_sleeps, 0.4, timeout=0.2, warm_key=(id(impl), "float32", "cpu"))
    [line] = [x for x in slow_first_calls(session) if "mine.py:f" in x]
    assert line.startswith("the first float32 call on cpu of mine.py:f took 0.")
    assert line.endswith("s: compile time allowed (up to 5 x --example-timeout)")


def test_an_implementation_whose_first_call_compiles_passes(tmp_path):
    """Its first call takes 2.5 s under a 1 s timeout: within the compile allowance, the
    property passes and the run says why the call was allowed."""
    import json
    import os
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "failures"),
               ATTENTION_CONFORMANCE_STATE=str(tmp_path / "state"))
    proc = pytest_process.run(
        [sys.executable, "-m", "pytest", "conformance", "-p", "no:cacheprovider", "-q",
         "--hypothesis-profile=ci", "--impl=tests/runner/hostile_impls.py:slow_first", "--dtype=float64",
         "-k", "forward_agreement", "--impl-option", "derived_flash=false", "--example-timeout=1",
         f"--conformance-report={tmp_path}/cert"],
        cwd=root, capture_output=True, text=True, timeout=240, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    [r] = [r for r in json.loads((tmp_path / "cert.json").read_text())["results"] if r["level"] == "sdpa"]
    assert r["outcome"] == "passed"
    import re

    took = re.search(r"the first float64 call on cpu of tests/runner/hostile_impls.py:slow_first took "
                     r"([\d.]+) s: compile time allowed", proc.stdout)
    assert took and float(took[1]) >= 2.5, proc.stdout[-2000:]
