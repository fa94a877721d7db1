"""Which ``torch.distributed`` backend and how many ranks the sharded level runs on a device.

On the CPU the worker group is gloo, up to :data:`MAX_RANKS` processes on one machine. On
CUDA it is NCCL with **one process per GPU** (rank r on ``cuda:r``): as many ranks as
there are GPUs, at most :data:`MAX_RANKS`, so a machine with one GPU runs world size 1
only and the properties that need two ranks skip there with the reason. Pure functions
of the device, the GPU count and whether NCCL is built in (tested on machines without a
GPU); :func:`local_gpus` and :func:`nccl_available` ask torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_RANKS", "backend_for", "local_gpus", "nccl_available", "ranks_for", "unavailable_reason",
           "world_limit"]

#: The largest world size (one worker group per world size 1..MAX_RANKS, its default group the call's ranks).
MAX_RANKS = 4


def backend_for(device: str) -> str:
    """``"nccl"`` for CUDA (one process per GPU), ``"gloo"`` for the CPU."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: the sharded level runs on 'cpu' (gloo) or 'cuda' (NCCL)")
    return "nccl" if device == "cuda" else "gloo"


def world_limit(device: str, n_gpus: int) -> int:
    """The most ranks a group on ``device`` may have: :data:`MAX_RANKS` on the CPU, the
    number of GPUs (at most :data:`MAX_RANKS`) on CUDA; 0 when there is no GPU."""
    if isinstance(n_gpus, bool) or not isinstance(n_gpus, int) or n_gpus < 0:
        raise ValueError(f"n_gpus={n_gpus!r} must be an int >= 0 (torch.cuda.device_count())")
    return MAX_RANKS if backend_for(device) == "gloo" else min(MAX_RANKS, n_gpus)


def ranks_for(caps: Any, device: str = "cpu", n_gpus: int | None = None) -> int:
    """The ranks of a worker group for capabilities ``caps`` on ``device`` (the largest world
    size drawn): ``caps.max_world_size`` capped by :func:`world_limit` (``n_gpus``; None:
    the GPUs torch sees), at least 1."""
    if n_gpus is None:
        n_gpus = local_gpus() if device == "cuda" else 0
    return max(1, min(world_limit(device, n_gpus), caps.max_world_size))


def unavailable_reason(device: str, n_gpus: int, nccl: bool) -> str | None:
    """Why the sharded level cannot run on ``device`` here (None: it can)."""
    if backend_for(device) == "gloo":
        return None
    if n_gpus == 0:
        return ("the sharded level on CUDA runs NCCL with one process per GPU, and this machine has "
                "no CUDA device (torch.cuda.device_count() is 0)")
    if not nccl:
        return ("the sharded level on CUDA runs NCCL, which this torch build lacks "
                "(torch.distributed.is_nccl_available() is False)")
    return None


def local_gpus() -> int:
    """The GPUs torch sees here (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nccl_available() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_nccl_available())
