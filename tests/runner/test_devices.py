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
