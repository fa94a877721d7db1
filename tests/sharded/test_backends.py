"""The sharded level's backends: gloo on the CPU, NCCL on CUDA with one process per GPU (the
world capped by the GPUs), and on a machine without what CUDA needs, a skip that says why.
Pure functions and group bookkeeping: nothing here starts a process."""

from __future__ import annotations

import pytest

import conformance.test_sharded as properties
from conformance.core.target import Target
from conformance.reporting.certificate import ran_lines
from conformance.sharded import backends
from conformance.sharded import group as groups
from conformance.sharded.cases import ShardedCallSpec
from conformance.sharded.strategies import make_case, top_world
from implementations.builtins.distributed._sharded_common import sharded_capabilities
from implementations.registry import resolve


def test_the_backend_follows_the_device():
    assert backends.backend_for("cpu") == "gloo" and backends.backend_for("cuda") == "nccl"
    with pytest.raises(ValueError, match="device='mps'.*'cpu' \\(gloo\\) or 'cuda' \\(NCCL\\)"):
        backends.backend_for("mps")


@pytest.mark.parametrize("n_gpus, ranks", [(0, 0), (1, 1), (2, 2), (3, 3), (8, 4)])
def test_cuda_runs_one_rank_per_gpu_at_most_four(n_gpus, ranks):
    assert backends.world_limit("cuda", n_gpus) == ranks
    assert backends.world_limit("cpu", n_gpus) == backends.MAX_RANKS == 4
    with pytest.raises(ValueError, match="n_gpus=-1"):
        backends.world_limit("cuda", -1)


def test_the_ranks_of_a_group_are_the_declared_world_capped_by_the_gpus():
    caps = sharded_capabilities()
    assert backends.ranks_for(caps, "cpu") == 4
    assert backends.ranks_for(caps, "cuda", n_gpus=2) == 2
    assert backends.ranks_for(caps, "cuda", n_gpus=0) == 1                # never below 1 (then skipped)
    assert backends.ranks_for(caps.replace(max_world_size=3), "cuda", n_gpus=8) == 3
    assert backends.ranks_for(caps.replace(max_world_size=2), "cpu") == 2


def test_why_cuda_cannot_run_here():
    assert backends.unavailable_reason("cpu", 0, False) is None
    assert "no CUDA device" in backends.unavailable_reason("cuda", 0, True)
    assert "is_nccl_available() is False" in backends.unavailable_reason("cuda", 2, False)
    assert backends.unavailable_reason("cuda", 2, True) is None


def test_one_group_per_device_with_its_backend_and_ranks(monkeypatch):
    monkeypatch.setattr(groups, "_GROUPS", {})
    monkeypatch.setattr(backends, "local_gpus", lambda: 2)
    impl = resolve("ring")
    cpu, cuda = groups.group_for(impl, "cpu"), groups.group_for(impl, "cuda")
    assert cpu is not cuda and cpu is groups.group_for(impl, "cpu")
    assert (cpu.backend, cpu.world, cuda.backend, cuda.world) == ("gloo", 4, "nccl", 2)
    assert not cpu.running and not cuda.running                          # created, not started


def test_properties_on_cuda_skip_with_the_reason_when_it_cannot_run(monkeypatch):
    impl = resolve("ring")
    target = Target(impl, "sharded", "float32", "cuda")
    monkeypatch.setattr(backends, "local_gpus", lambda: 0)
    assert "no CUDA device" in properties._runs_here(target)
    monkeypatch.setattr(backends, "local_gpus", lambda: 1)
    monkeypatch.setattr(backends, "nccl_available", lambda: False)
    assert "NCCL, which this torch build lacks" in properties._runs_here(target)
    monkeypatch.setattr(backends, "nccl_available", lambda: True)
    assert properties._runs_here(target) is None
    assert top_world(target.caps, "cuda") == 1                            # one GPU: one rank
    assert properties._multi_rank(target) == "world size 1 only (one GPU here (NCCL runs one process per GPU))"
    assert properties._runs_here(Target(impl, "sharded", "float32", "cpu")) is None


def test_a_call_says_how_it_ran_and_the_certificate_lists_it():
    call = ShardedCallSpec(make_case(world_size=3, layout="contiguous", device="cpu"))
    assert call.ran() == {"backend": {"gloo"}, "world_sizes": {3}}
    assert call.case.attrs()["backend"] == "gloo"
    results = [{"level": "sharded", "device": "cpu", "ran": {"backend": ["gloo"], "world_sizes": [1, 3]}},
               {"level": "sharded", "device": "cpu", "ran": {"backend": ["gloo"], "world_sizes": [2]}},
               {"level": "sharded", "device": "cuda", "ran": {"backend": ["nccl"], "world_sizes": [1]}},
               {"level": "sdpa", "device": "cpu"}]
    assert ran_lines(results) == ["sharded level on cpu ran with backend gloo, world sizes 1, 2, 3",
                                  "sharded level on cuda ran with backend nccl, world sizes 1"]
