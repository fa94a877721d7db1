"""Sharded implementations whose rank 1 misbehaves on causal calls over two ranks with
one position per rank (the group tests resolve them by path, in every rank): it hangs,
its process dies, it raises, or it waits in a barrier (on the default group) that rank 0
never reaches. Other calls are the ring built-in's (layout invariance
never shards to one position per rank: zigzag has two chunks a rank)."""

from __future__ import annotations

import os
import time

from implementations.builtins.distributed.ring_attention import (
    RingAttention,
    make_implementation,
)


class _Broken(RingAttention):
    def misbehave(self) -> None:
        raise NotImplementedError

    def __call__(self, q, k, v, *, group=None, rank=None, world_size=None, causal=False, **kwargs):
        if causal and world_size and world_size >= 2 and rank == 1 and q.shape[-2] == 1:
            self.misbehave()
        return super().__call__(q, k, v, group=group, rank=rank, world_size=world_size, causal=causal, **kwargs)


class _Hangs(_Broken):
    def misbehave(self) -> None:
        time.sleep(3600)


class _Dies(_Broken):
    def misbehave(self) -> None:
        os._exit(3)


class _ExtraBarrier(_Broken):
    def misbehave(self) -> None:  # a collective on the default group that rank 0 never makes
        import torch.distributed as dist

        dist.barrier()


class _Raises(_Broken):
    def misbehave(self) -> None:
        raise RuntimeError("rank 1 refuses causal calls")


class _RaisesUnevenly(RingAttention):
    """Every rank raises on a causal call, rank 0 five seconds after rank 1 (as a slow
    first import would make it): no rank waits for another, the group stays in step."""

    def __call__(self, q, k, v, *, group=None, rank=None, world_size=None, causal=False, **kwargs):
        if causal:
            if rank == 0:
                time.sleep(5)
            raise RuntimeError(f"rank {rank} refuses causal calls")
        return super().__call__(q, k, v, group=group, rank=rank, world_size=world_size, causal=causal, **kwargs)


class _TwoStories(RingAttention):
    """Two distinct failures: it raises on one rank alone (world size 1) and returns twice
    the output on more (a value mismatch)."""

    def __call__(self, q, k, v, *, group=None, rank=None, world_size=None, causal=False, **kwargs):
        if world_size == 1:
            raise RuntimeError("refuses to run on one rank")
        out, lse = super().__call__(q, k, v, group=group, rank=rank, world_size=world_size, causal=causal, **kwargs)
        return 2 * out, lse


def _build(name, ring):
    impl = make_implementation(name=name, ring=ring)
    caps = impl.capabilities.replace(max_world_size=2)
    return impl.__class__(**{**{f: getattr(impl, f) for f in impl.__dataclass_fields__},
                             "capabilities": caps, "sharded_capabilities": caps})


hangs = _build("hangs-on-rank-1", _Hangs())
dies = _build("dies-on-rank-1", _Dies())
raises = _build("raises-on-rank-1", _Raises())
barrier = _build("extra-barrier-on-rank-1", _ExtraBarrier())
raises_unevenly = _build("raises-unevenly", _RaisesUnevenly())
two_stories = _build("two-stories", _TwoStories())
