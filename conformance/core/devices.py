"""Which GPU each pytest-xdist worker certifies on.

``pytest -n N --device cuda`` starts N workers (``gw0`` ... ``gwN-1``); without
pinning, every one of them would run on ``cuda:0``. :func:`device_for_worker` gives
worker ``gwK`` the GPU ``K mod n_gpus``: four workers on four GPUs get one each,
eight workers on four GPUs share them two by two. It is a pure function (tested on
machines without a GPU); the plugin calls it with the worker id pytest-xdist sets
(``config.workerinput["workerid"]``, absent without xdist) and
``torch.cuda.device_count()``, through :func:`pin_cuda_device`, which makes that GPU
the worker's current CUDA device: targets, test ids and certificates keep saying
``cuda``, and every ``device="cuda"`` tensor lands on the worker's GPU.
"""

from __future__ import annotations

import re

__all__ = ["device_for_worker", "pin_cuda_device"]

_WORKER_ID = re.compile(r"gw(\d+)")


def device_for_worker(worker_id: str | None, device: str, n_gpus: int) -> str:
    """The device a worker runs ``device`` targets on.

    ``worker_id``: pytest-xdist's ``"gw<K>"``, or None / ``"master"`` without xdist.
    ``device``: a target's device, ``"cpu"``, ``"cuda"`` or an explicit
    ``"cuda:<index>"``. Only a bare ``"cuda"`` under a worker is pinned, to
    ``cuda:<K mod n_gpus>``; everything else comes back unchanged (an explicit index
    is the user's choice, and with ``n_gpus`` 0 there is nothing to pin: CUDA
    targets are then skipped with a reason).

    >>> device_for_worker("gw3", "cuda", 4), device_for_worker("gw5", "cuda", 4)
    ('cuda:3', 'cuda:1')
    >>> device_for_worker(None, "cuda", 4), device_for_worker("gw1", "cpu", 4)
    ('cuda', 'cpu')
    """
    if isinstance(n_gpus, bool) or not isinstance(n_gpus, int) or n_gpus < 0:
        raise ValueError(f"n_gpus={n_gpus!r} must be an int >= 0 (torch.cuda.device_count())")
    if worker_id in (None, "master") or device != "cuda" or n_gpus == 0:
        return device
    match = _WORKER_ID.fullmatch(str(worker_id))
    if match is None:
        raise ValueError(
            f"worker_id={worker_id!r} is not a pytest-xdist worker id; expected 'gw<K>' "
            "(config.workerinput['workerid']) or None without xdist"
        )
    return f"cuda:{int(match.group(1)) % n_gpus}"


def pin_cuda_device(worker_id: str | None) -> str:
    """Make ``worker_id``'s GPU the current CUDA device (``torch.cuda.set_device``) and
    return it; ``"cuda"`` (nothing changed) without xdist or without CUDA."""
    import torch

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = device_for_worker(worker_id, "cuda", n_gpus)
    if device != "cuda":
        torch.cuda.set_device(device)
    return device
