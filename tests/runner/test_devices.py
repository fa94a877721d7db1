"""conformance.core.devices.device_for_worker: pytest-xdist workers pinned to GPUs (no GPU needed)."""

from __future__ import annotations

import pytest

from conformance.core.devices import device_for_worker


@pytest.mark.parametrize("worker, n_gpus, expected", [
    ("gw0", 4, "cuda:0"),
    ("gw3", 4, "cuda:3"),
    ("gw4", 4, "cuda:0"),  # more workers than GPUs: wraps around
    ("gw7", 4, "cuda:3"),
    ("gw12", 1, "cuda:0"),
    (None, 4, "cuda"),  # no xdist
    ("master", 4, "cuda"),
    ("gw2", 0, "cuda"),  # no GPU: nothing to pin (CUDA targets are skipped)
])
def test_cuda_targets_are_pinned_per_worker(worker, n_gpus, expected):
    assert device_for_worker(worker, "cuda", n_gpus) == expected


def test_every_gpu_gets_a_worker_when_workers_match_gpus():
    assert {device_for_worker(f"gw{k}", "cuda", 8) for k in range(8)} == {f"cuda:{i}" for i in range(8)}


@pytest.mark.parametrize("device", ["cpu", "cuda:1"])
def test_other_devices_are_left_alone(device):
    assert device_for_worker("gw3", device, 4) == device


@pytest.mark.parametrize("worker", ["worker3", "gw", "gw-1", "3"])
def test_unknown_worker_ids_raise(worker):
    with pytest.raises(ValueError, match="not a pytest-xdist worker id"):
        device_for_worker(worker, "cuda", 4)


@pytest.mark.parametrize("n_gpus", [-1, 1.0, True])
def test_gpu_count_must_be_a_count(n_gpus):
    with pytest.raises(ValueError, match="n_gpus="):
        device_for_worker("gw0", "cuda", n_gpus)


def test_pin_sets_the_workers_gpu_as_current(monkeypatch):
    import torch

    from conformance.core.devices import pin_cuda_device

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert pin_cuda_device("gw6") == "cuda:2" and chosen == ["cuda:2"]
    assert pin_cuda_device(None) == "cuda" and chosen == ["cuda:2"]  # no xdist: untouched


def test_pin_without_cuda_changes_nothing(monkeypatch):
    import torch

    from conformance.core.devices import pin_cuda_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device called"))
    assert pin_cuda_device("gw1") == "cuda"


# --- A fault that breaks the process's CUDA context (no GPU needed: the errors are raised
# by hand, as torch raises them; measured on an H200, benchmarks/results/gpu-2026-12-04) ---

import json  # noqa: E402
import time  # noqa: E402

from conformance.core import devices  # noqa: E402
from conformance.core.target import (  # noqa: E402
    ImplementationCrashed,
    ImplementationRaised,
    Target,
    call_guarded,
)
from conformance.harness.checking import check_example  # noqa: E402
from conformance.harness.session import Session  # noqa: E402
from implementations import registry  # noqa: E402

def _case(seed: int):
    """A real SDPA case (the checks below never look at it; crashed cases are digested)."""
    import numpy as np

    from conformance.core.cases import SDPACase
    rng = np.random.default_rng(seed)
    return SDPACase(rng.normal(size=(1, 1, 2, 4)), rng.normal(size=(1, 1, 3, 4)), rng.normal(size=(1, 1, 3, 4)))


ILLEGAL = "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported"


@pytest.mark.parametrize("error, expected", [
    (RuntimeError(ILLEGAL), "CUDA error: an illegal memory access was encountered"),
    (RuntimeError("CUDA error: misaligned address"), "CUDA error: misaligned address"),
    (RuntimeError("CUDA error: device-side assert triggered"), "CUDA error: device-side assert triggered"),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), None),  # not sticky
    (RuntimeError("CUDA error: invalid configuration argument"), None),      # a bad launch only
    (RuntimeError("No available kernel. Aborting execution."), None),
    (ValueError("illegal memory access"), None),  # not a CUDA error
])
def test_context_breaking_errors_are_told_from_others(error, expected):
    assert devices.context_breaking_error(error) == expected


def test_a_context_breaking_cause_is_found_through_the_chain():
    try:
        try:
            raise RuntimeError("CUDA error: misaligned address")
        except RuntimeError as inner:
            raise ValueError("while copying the output") from inner
    except ValueError as outer:
        assert devices.context_breaking_error(outer) == "CUDA error: misaligned address"


@pytest.fixture
def fresh_context(monkeypatch, tmp_path):
    monkeypatch.setattr(devices, "_BROKEN", [])
    monkeypatch.setenv("ATTENTION_CONFORMANCE_STATE", str(tmp_path))
    return tmp_path


def test_a_call_that_breaks_the_context_is_a_crash_not_a_raise(fresh_context):
    target = Target(registry.resolve("spec"), "sdpa", "float32", "cuda")

    def faulting():
        raise RuntimeError(ILLEGAL)

    with pytest.raises(ImplementationCrashed, match="broke the CUDA context of this process"):
        call_guarded(target, faulting)
    with pytest.raises(ImplementationRaised, match="raised on a case it claims to support"):
        call_guarded(target, lambda: 1 / 0)


def test_after_the_fault_cuda_checks_fail_without_running_and_cpu_ones_run(fresh_context):
    impl = registry.resolve("spec")
    session = Session(profile="ci", started=time.time(), impl=impl, impl_spec="spec")
    cuda, cpu = Target(impl, "sdpa", "float32", "cuda"), Target(impl, "sdpa", "float32", "cpu")
    ran = []

    def copy_meets_the_fault(target, case):  # the suite's own copy of the output raises it
        ran.append(target.device)
        raise RuntimeError(ILLEGAL)

    with pytest.raises(ImplementationCrashed, match="broke the CUDA context"):
        check_example(session, "forward_agreement", copy_meets_the_fault, cuda, _case(1))
    assert devices.broken_context().where == "forward_agreement[sdpa-float32-cuda]"
    with pytest.raises(ImplementationCrashed, match="^not run: the CUDA context of this process was broken"):
        check_example(session, "gradient_agreement", lambda t, c: ran.append(t.device), cuda, _case(2))
    assert check_example(session, "gradient_agreement", lambda t, c: ran.append(t.device) or 0.5, cpu,
                         _case(3)) == 0.5
    assert ran == ["cuda", "cpu"]
    crashes = json.loads((fresh_context / "crashes.json").read_text())
    assert "broke the CUDA context in forward_agreement" in crashes["spec"]["what"]  # --isolate=auto next time


def test_a_cpu_error_that_reads_like_a_cuda_fault_is_left_alone(fresh_context):
    impl = registry.resolve("spec")
    session = Session(profile="ci", started=time.time(), impl=impl, impl_spec="spec")

    def suite_error(target, case):
        raise RuntimeError(ILLEGAL)

    with pytest.raises(RuntimeError, match="illegal memory access"):
        check_example(session, "forward_agreement", suite_error, Target(impl, "sdpa", "float32", "cpu"), _case(4))
    assert devices.broken_context() is None
