"""A misbehaving implementation never breaks the run, the certificate or the suite's arithmetic.

Each test certifies one hostile implementation of ``tests/runner/hostile_impls.py`` (it
hangs, crashes, returns garbage, pollutes global state, or is flaky) with short
timeouts, and checks that the run ends in bounded time with a truthful certificate.
Sections follow the issue's items: 1 guarded calls and probing, 2-3 crashes and hangs,
6 output paths, 7 wrong results, 8 flaky results, 9 option and import nits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from conformance.harness.session import Session
from conformance.isolation import supervisor as isolation
from conformance.plugin import _ResultCollector
from conformance.reporting import certificate
from conformance.strategies import mha_cases, sdpa_cases
from implementations import guard, registry
from implementations.base import Capabilities, ImplementationError
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]
HOSTILE = "tests/runner/hostile_impls.py"


def run(*args: str, tmp_path: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """``pytest conformance`` under ci, failures and crash markers kept under ``tmp_path``;
    the wall time is ``.seconds``."""
    env = dict(os.environ, ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "failures"),
               ATTENTION_CONFORMANCE_STATE=str(tmp_path / "state"))
    start = time.monotonic()
    proc = pytest_process.run(
        [sys.executable, "-m", "pytest", "conformance", "-p", "no:cacheprovider", "-q",
         "--hypothesis-profile=ci", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, check=False,
    )
    proc.seconds = time.monotonic() - start  # type: ignore[attr-defined]
    return proc


def results(tmp_path: Path) -> dict[str, dict]:
    """The certificate's SDPA-level results by property (one dtype per run here; the
    hostile implementations have no MHA level, so those tests skip)."""
    cert = json.loads((tmp_path / "cert.json").read_text())
    return {r["property"]: r for r in cert["results"] if r["level"] == "sdpa"}


def certify(attr: str, tmp_path: Path, *args: str, keyword: str = "forward_agreement",
            timeout: float = 240) -> subprocess.CompletedProcess:
    # The SDPA level alone: a derived flash level would call the same hostile code again.
    return run(f"--impl={HOSTILE}:{attr}", "--dtype=float64", "-k", keyword, "--impl-option", "derived_flash=false",
               f"--conformance-report={tmp_path}/cert", *args, tmp_path=tmp_path, timeout=timeout)


# --------------------------------------------------------------------------- 1. one guarded path


def test_guarded_call_restores_the_state_the_suite_computes_under():
    def pollute():
        np.seterr(all="raise")
        np.set_printoptions(precision=2)
        torch.set_grad_enabled(False)
        torch.set_default_dtype(torch.float64)
        torch.use_deterministic_algorithms(True)
        torch.manual_seed(123)
        return "value"

    rng = torch.get_rng_state()
    for timeout in (0, 5):  # in the caller's thread, and in a call thread
        assert guard.guarded_call(pollute, timeout=timeout, rng=True) == "value"
        assert np.geterr()["invalid"] == "warn" and np.get_printoptions()["precision"] == 8
        assert torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32
        assert not torch.are_deterministic_algorithms_enabled()
        assert torch.equal(torch.get_rng_state(), rng)


def test_guarded_call_times_out_and_captures_every_exception():
    start = time.monotonic()
    with pytest.raises(guard.CallTimedOut, match="did not return within 0.2s"):
        guard.guarded_call(time.sleep, 5, timeout=0.2)
    assert time.monotonic() - start < 2
    with pytest.raises(guard.CallRaised, match="SystemExit: 3") as raised:
        guard.guarded_call(sys.exit, 3, timeout=1)
    assert isinstance(raised.value.error, SystemExit)


def test_the_call_thread_is_reused_and_starts_each_call_as_a_new_thread():
    """One thread serves call after call (a new thread a call cost 100-250 us of torch
    thread set-up); each call still sees what a new thread would: the caller's grad mode,
    no inference mode, autocast or torch mode left by an earlier call."""
    def where():
        return threading.current_thread(), torch.is_grad_enabled(), torch.is_inference_mode_enabled(), \
            torch.is_autocast_enabled("cpu")

    # Thread objects, not idents: a new thread may reuse an ended one's ident.
    first, grad, inference, autocast = guard.guarded_call(where, timeout=5)
    assert first is not threading.current_thread() and grad and not inference and not autocast
    assert guard.guarded_call(where, timeout=5)[0] is first
    with torch.no_grad():
        assert guard.guarded_call(where, timeout=5) == (first, False, False, False)
    assert guard.guarded_call(where, timeout=5) == (first, True, False, False)

    def leaves(mode):
        mode.__enter__()  # and never leaves it: only a new thread is clean again

    for mode in (torch.inference_mode(), torch.autocast("cpu")):
        guard.guarded_call(leaves, mode, timeout=5)
        ident, grad, inference, autocast = guard.guarded_call(where, timeout=5)
        assert ident is not first and grad and not inference and not autocast
        first = ident
    assert not first.busy  # an idle call thread is not a leftover (guard.leftover_threads)


def test_a_timed_out_call_keeps_its_thread_and_the_next_call_gets_another():
    release, hung = threading.Event(), []

    def hangs():
        hung.append(threading.current_thread())
        release.wait(30)

    with pytest.raises(guard.CallTimedOut):
        guard.guarded_call(hangs, timeout=0.1)
    [thread] = hung
    running = guard.leftover_threads()
    assert thread.is_alive() and running >= 1
    assert guard.guarded_call(threading.current_thread, timeout=5) is not thread
    release.set()
    deadline = time.monotonic() + 5
    while thread.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    # Done now, and idle: no longer counted (other tests' leftovers may end meanwhile).
    assert not thread.busy and guard.leftover_threads() <= running - 1


def test_a_keyboard_interrupt_the_call_raises_stops_the_caller():
    def interrupt():
        raise KeyboardInterrupt

    for timeout in (0, 5):
        with pytest.raises(KeyboardInterrupt):
            guard.guarded_call(interrupt, timeout=timeout)
    assert guard.guarded_call(lambda: "still serving", timeout=5) == "still serving"


def test_probe_that_hangs_fails_resolution_within_the_timeout(tmp_path):
    """The first probe call is the implementation's first: it gets the compile allowance
    (guard.COMPILE_FACTOR x the timeout), and the message says so."""
    proc = certify("hangs", tmp_path, "--example-timeout=1", timeout=120)
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"probing a plain call did not return within {guard.COMPILE_FACTOR:g}s (its first call: " in proc.stderr
    assert "allowed for compilation" in proc.stderr


@pytest.mark.parametrize("attr, shown", [
    ("returns_none", "returned None"),
    ("returns_numpy", "returned a numpy.ndarray"),
    ("returns_list", "returned a builtins.list"),
    ("returns_squeezed", "returned a cpu tensor of shape (2, 2, 4)"),
    ("returns_meta", "returned a meta tensor"),
])
def test_probe_of_a_wrong_return_is_a_one_paragraph_error(attr, shown):
    with pytest.raises(ImplementationError) as err:
        registry.resolve(f"{HOSTILE}:{attr}", timeout=30)
    message = str(err.value)
    assert shown in message and "must return a torch.Tensor of shape (1, 2, 2, 4)" in message
    assert "\n" not in message


def test_a_wrong_return_at_probing_is_a_usage_error_not_an_internal_error(tmp_path):
    proc = certify("returns_meta", tmp_path)
    assert proc.returncode == 4
    assert "INTERNALERROR" not in proc.stdout + proc.stderr
    assert "returned a meta tensor" in proc.stderr


def test_numpy_error_state_set_by_the_implementation_leaves_the_suite_exact(tmp_path):
    """The implementation calls np.seterr(all="raise") on every call, probing included:
    the oracle and the tolerance arithmetic still run under the suite's settings."""
    proc = certify("sets_numpy_raise", tmp_path, "--isolate=never",
                   keyword="forward_agreement or fully_masked_rows or temperature")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert {r["outcome"] for r in results(tmp_path).values()} == {"passed"}


def test_grad_mode_switched_off_during_probing_does_not_hide_autograd():
    impl = registry.resolve(f"{HOSTILE}:disables_grad", timeout=30)
    assert impl.capabilities.autograd
    assert torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize("attr, said", [
    ("ignores_causal", "is_causal=True has no effect"),
    ("odd_causal", "is_causal=True matches neither alignment"),
])
def test_a_causal_flag_that_is_not_the_contracts_keeps_the_contract_with_a_note(attr, said):
    """The contract's upper-left is declared (so the causal properties run and fail), the
    note says what the probe saw; no probed value turns it into "no causal flag"."""
    impl = registry.resolve(f"{HOSTILE}:{attr}", timeout=30)
    caps = impl.capabilities
    assert caps.causal == "upper_left" and caps.source("causal") == "contract"
    note = caps.probe_note("causal")
    assert note.startswith("causal: " + said) and "upper-left, which is tested and fails" in note
    entry = certificate.implementation_entry(impl, attr, {})
    cert = certificate.certificate(implementation=entry, environment={"torch": "x", "devices": ["cpu"]},
                                   profile="ci", seconds=1.0, results=[])
    lines = certificate.details(cert)
    assert f"causal flag=upper_left [contract] (probe: {said}" in lines[0]
    assert lines[1].startswith("semantics: contract (") and "causal flag=upper_left" in lines[1]
    # A value the user sets is no longer the probe's: its note goes, its source is declared.
    overridden = registry.resolve(f"{HOSTILE}:{attr}", {"causal": "upper_left"}, timeout=30).capabilities
    assert overridden.causal == "upper_left" and overridden.source("causal") == "declared"
    assert not any(n.startswith("causal:") for n in overridden.probe_notes)


def test_a_causal_flag_without_effect_fails_and_the_failure_says_what_the_probe_saw(tmp_path):
    proc = certify("ignores_causal", tmp_path, keyword="causal_flag_equivalence or forward_agreement")
    assert proc.returncode == 1, proc.stdout[-3000:]
    got = results(tmp_path)
    assert got["causal_flag_equivalence"]["outcome"] == "failed"
    assert got["forward_agreement"]["outcome"] == "failed"
    assert "probe: causal: is_causal=True has no effect" in got["forward_agreement"]["message"]


def test_mha_causal_flag_skip_reason_names_the_missing_feature():
    from conformance.core.target import Target
    from conformance.test_mha import _causal_hint_missing

    impl = registry.resolve("torch-mha")
    caps = impl.caps("mha")
    no_mask = dataclasses.replace(impl, mha_capabilities=caps.replace(mha_features=caps.mha_features - {"attn_mask"}))
    reason = _causal_hint_missing(Target(no_mask, "mha", "float32", "cpu"))
    assert reason.startswith("attn_mask not declared") and "is_causal and" not in reason
    assert _causal_hint_missing(Target(impl, "mha", "float32", "cpu")) is None


# --------------------------------------------------------------------------- 2-3. crashes and hangs


@pytest.mark.parametrize("attr, how", [("exits", "exit code 3"), ("aborts", "SIGABRT")])
def test_crash_in_isolated_mode_fails_the_property_with_the_case_saved(tmp_path, attr, how):
    proc = certify(attr, tmp_path, "--isolate=always", keyword="forward_agreement or temperature")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    for r in results(tmp_path).values():
        assert r["outcome"] == "failed" and r["isolated"]
        assert "ended its isolated worker process during a call into it" in r["message"] and how in r["message"]
        assert Path(r["failure_file"]).exists() and r["counterexample"]["L"] >= 2
    # Nothing to diagnose, and nothing called to find out (only the worker may call it).
    assert "raised, hung or crashed, so there is no output" in proc.stdout
    assert "diagnosis failed" not in proc.stdout
    assert attr in (tmp_path / "state" / "crashes.json").read_text()
    # Bounded by run()'s subprocess timeout, not by a wall-clock figure a busy machine breaks.


def test_a_cuda_fault_in_isolated_mode_restarts_the_worker_for_the_next_property(tmp_path):
    """A fault that breaks the CUDA context (measured on an H200: one faulting launch made
    every later property of the process fail) is a crash of its property only: the
    worker that met it is replaced, so the next property runs in a fresh one."""
    proc = certify("faults_cuda", tmp_path, "--isolate=always", keyword="forward_agreement or temperature")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    got = results(tmp_path)
    assert set(got) == {"forward_agreement", "temperature"}
    for r in got.values():
        assert r["outcome"] == "failed" and r["isolated"]
        assert r["message"].startswith("faults_cuda broke the CUDA context of this process"), r["message"]
        assert r["counterexample"]["L"] >= 2  # it ran: not a "not run" of a broken worker
    assert "broke the CUDA context" in (tmp_path / "state" / "crashes.json").read_text()


def test_crash_in_process_makes_the_next_auto_run_isolated(tmp_path):
    dead = certify("exits", tmp_path, "--isolate=never")
    assert dead.returncode == 3 and not (tmp_path / "cert.json").exists()  # os._exit(3): nothing left
    proc = certify("exits", tmp_path, "-v")
    assert proc.returncode == 1
    assert "implementation runs in a worker process (--isolate=auto: an earlier run" in proc.stdout
    [r] = results(tmp_path).values()
    assert r["outcome"] == "failed" and Path(r["failure_file"]).exists()


def test_a_crash_in_the_directed_pass_is_recorded_for_the_implementation_that_crashed(tmp_path):
    # --impl-exitfirst: a directed pass first, the crashing implementation's first, while the
    # run's marker still names the implementation resolved last (sdpa-math).
    dead = run(f"--impl={HOSTILE}:exits,sdpa-math", "--impl-exitfirst", "--isolate=never", "--dtype=float64",
               "-k", "forward_agreement", "--impl-option", "derived_flash=false", tmp_path=tmp_path)
    assert dead.returncode == 3, dead.stdout[-3000:] + dead.stderr[-2000:]
    crashes = json.loads((tmp_path / "state" / "crashes.json").read_text()) if (
        tmp_path / "state" / "crashes.json").exists() else {}
    if not crashes:  # recorded by the next run, from the dead run's marker
        run("--impl=sdpa-math", "--co", tmp_path=tmp_path)
        crashes = json.loads((tmp_path / "state" / "crashes.json").read_text())
    assert list(crashes) == [f"{HOSTILE}:exits"], crashes
    assert "(directed pass)" in crashes[f"{HOSTILE}:exits"]["what"]


def test_crash_under_xdist_is_counted_on_the_certificate(tmp_path):
    proc = certify("exits", tmp_path, "--isolate=never", "-n", "2",
                   keyword="forward_agreement or temperature")
    assert proc.returncode == 1
    assert re.search(r"\b2 failed\b", proc.stdout)
    got = results(tmp_path)
    assert {got[p]["outcome"] for p in ("forward_agreement", "temperature")} == {"failed"}
    assert "rerun with --isolate=always" in got["forward_agreement"]["message"]
    assert "summary: 2 failed" in proc.stdout


def test_a_report_without_a_record_still_gets_a_result(tmp_path, monkeypatch):
    """What the xdist controller sees of a crashed test: a report and no record."""
    monkeypatch.setenv("ATTENTION_CONFORMANCE_STATE", str(tmp_path))
    session = Session(profile="ci", started=0.0, impl_spec="x.py:f")
    report = type("Report", (), dict(
        nodeid="conformance/test_sdpa_agreement.py::test_forward_agreement[sdpa-float32-cpu]",
        when="???", failed=True, skipped=False, user_properties=[],
        longreprtext="worker 'gw0' crashed while running 'conformance/...'"))()
    collector = _ResultCollector(session)
    collector.pytest_runtest_logreport(report)
    collector.pytest_runtest_logreport(report)  # counted once
    [r] = session.results
    assert (r["property"], r["dtype"], r["outcome"]) == ("forward_agreement", "float32", "failed")
    assert isolation.crash_seen("x.py:f")  # the next auto run isolates it


def test_hang_is_tried_once_per_case_and_ends_the_search(tmp_path):
    """A 0.5 s timeout costs about 0.5 s a property, not one timeout per shrink step;
    the same case drawn by the next property fails at once."""
    keyword = "forward_agreement or temperature or value_linearity or output_contract"
    proc = certify("sleeps", tmp_path, "--isolate=never", "--example-timeout=0.5", keyword=keyword)
    assert proc.returncode == 1
    got = results(tmp_path)
    assert len(got) == 4 and all(r["outcome"] == "failed" and r["examples"] == 1 for r in got.values())
    assert all(Path(r["failure_file"]).exists() for r in got.values())
    assert sum("not run again" in r["message"] for r in got.values()) >= 2
    # One call timed out per case that hung, never one per shrink step: each timed-out
    # call leaves its (sleeping) thread behind, counted on the certificate.
    timed_out = sum("not run again" not in r["message"] for r in got.values())
    assert max(r["leftover_threads"] for r in got.values()) == timed_out <= 2


def test_hang_costs_one_timeout_per_property(tmp_path):
    proc = certify("sleeps", tmp_path, "--isolate=always", "--example-timeout=2")
    assert proc.returncode == 1
    [r] = results(tmp_path).values()
    # The property's first call is the worker's first of its dtype: 5 x 2 s (compile allowance).
    assert f"did not return within {guard.COMPILE_FACTOR * 2:g}s (its first call" in r["message"], r["message"]
    assert "worker process was killed" in r["message"]
    assert r["examples"] == 1 and r["seconds"] >= guard.COMPILE_FACTOR * 2  # one timeout, not one a shrink


@pytest.mark.parametrize("mode", ["never", "always"])
def test_a_spinning_call_is_counted_in_thread_mode_and_killed_in_isolated_mode(tmp_path, mode):
    proc = certify("spins", tmp_path, f"--isolate={mode}", "--example-timeout=0.3")
    assert proc.returncode == 1
    [r] = results(tmp_path).values()
    assert r["outcome"] == "failed"
    if mode == "never":
        assert r["leftover_threads"] >= 1 and "still running in threads at the end" in proc.stdout
    else:
        assert r["leftover_threads"] == 0 and "still running in threads at the end" not in proc.stdout


def test_cases_travel_to_the_worker_as_arrays_and_json():
    seen = []

    @settings(max_examples=15, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(sdpa=sdpa_cases(dtype="float16"), mha=mha_cases(dtype="float32", self_attention=True))
    def roundtrip(sdpa, mha):
        for case in (sdpa, mha):
            meta, arrays = isolation.encode_case(case)
            json.dumps(meta)  # plain JSON
            back = isolation.decode_case(json.loads(json.dumps(meta)), arrays)
            assert isolation.case_digest(back) == isolation.case_digest(case)
            assert back.describe() == case.describe()
        back_mha = isolation.decode_case(*isolation.encode_case(mha))
        assert back_mha.key is back_mha.query  # self-attention survives
        seen.append(back_mha.attrs()["self_attention"])

    roundtrip()
    assert all(seen)


def test_frames_never_unpickle():
    read_fd, write_fd = os.pipe()
    try:
        isolation._write_frame(write_fd, {"op": "x"}, {"a": np.array([object()], dtype=object)})
        with pytest.raises(ValueError, match="pickle"):
            isolation._read_frame(read_fd)
    finally:
        os.close(read_fd)
        os.close(write_fd)


# --------------------------------------------------------------------------- 6. output paths


def test_unwritable_report_path_is_a_usage_error_before_any_test(tmp_path):
    (tmp_path / "a-file").write_text("")
    proc = run("--impl=sdpa", "--dtype=float32", f"--conformance-report={tmp_path}/a-file/cert",
               tmp_path=tmp_path)
    assert proc.returncode == 4
    assert f"--conformance-report={tmp_path}/a-file/cert: cannot write" in proc.stderr
    assert "passed" not in proc.stdout and "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- 7. wrong results


@pytest.mark.parametrize("attr, mismatch", [
    ("wrong_device", "output device=meta, but should be cpu"),
    ("wrong_type", "output type=ndarray, but should be torch.Tensor"),
])
def test_a_wrong_device_or_type_fails_with_the_case_saved(tmp_path, attr, mismatch):
    proc = certify(attr, tmp_path, "--isolate=never")
    assert proc.returncode == 1
    [r] = results(tmp_path).values()
    assert r["outcome"] == "failed" and r["message"].startswith(mismatch)
    assert Path(r["failure_file"]).exists() and r["counterexample"] is not None
    assert f"saved {r['failure_file']}" in proc.stdout


def test_details_name_no_file_when_none_was_saved():
    caps = Capabilities()
    entry = {"name": "x", "spec": "x", "version": "0", "options": {}, "expected_failures": [],
             "capabilities": {"fully_masked": caps.fully_masked, "causal": caps.causal, "tf32": False}}
    bad = {"property": "p", "level": "sdpa", "dtype": "float32", "device": "cpu", "outcome": "error",
           "examples": 0, "counterexample": None, "failure_file": "", "message": "setup failed"}
    cert = certificate.certificate(implementation=entry, environment={}, profile="ci", seconds=0,
                                   results=[bad])
    line = certificate.details(cert)[1]
    assert line == "ERROR p[sdpa-float32-cpu]: after 0 examples; no case"


# --------------------------------------------------------------------------- 8. flaky results


@pytest.mark.parametrize("attr, said", [
    ("first_time_wrong", "the implementation gave different results for the same case"),
    ("two_bugs", "2 distinct failures; the first:"),
])
def test_flaky_or_several_failures_keep_the_first_case_and_its_message(tmp_path, attr, said):
    proc = certify(attr, tmp_path, "--isolate=never")
    assert proc.returncode == 1
    [r] = results(tmp_path).values()
    # Directed examples run before Hypothesis: a wrong first call fails there, as a plain
    # mismatch; a wrong call found by the search carries Hypothesis' headline first.
    assert r["message"].startswith((said, "output values mismatch"))
    assert "values mismatch" in r["message"]  # the mismatch itself, not only Hypothesis' headline
    assert Path(r["failure_file"]).exists() and r["counterexample"] is not None


# --------------------------------------------------------------------------- 9. nits


@pytest.mark.parametrize("args, said", [
    (("--example-timeout=-5",), "--example-timeout=-5 must be >= 0 seconds (0 means no limit)"),
    (("--dtype", ","), "--dtype=',' names no dtype"),
])
def test_bad_option_values_are_usage_errors(tmp_path, args, said):
    proc = run("--impl=sdpa", *args, tmp_path=tmp_path)
    assert proc.returncode == 4 and said in proc.stderr


def test_system_exit_at_import_is_a_usage_error(tmp_path):
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(3)\n")
    proc = run(f"--impl={tmp_path}/exits_at_import.py:f", tmp_path=tmp_path)
    assert proc.returncode == 4 and "INTERNALERROR" not in proc.stdout + proc.stderr
    assert "raised SystemExit: 3" in proc.stderr


def test_os_exit_at_import_is_reported(tmp_path):
    (tmp_path / "dies_at_import.py").write_text("import os\nos._exit(5)\n")
    spec = f"--impl={tmp_path}/dies_at_import.py:f"
    proc = run(spec, "--isolate=always", tmp_path=tmp_path)
    assert proc.returncode == 4
    assert "the isolated worker process died while importing and probing" in proc.stderr
    assert "exit code 5" in proc.stderr
    # In-process the run can only die; the next run says so and isolates it.
    (tmp_path / "state" / "crashes.json").unlink()
    assert run(spec, "--isolate=never", tmp_path=tmp_path).returncode == 5
    proc = run(spec, tmp_path=tmp_path)
    assert proc.returncode == 4 and "died while importing" in proc.stderr
