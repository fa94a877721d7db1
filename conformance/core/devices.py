"""Devices: which GPU each pytest-xdist worker certifies on, and the CUDA faults that
break a process's context (below).

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
import sys
from dataclasses import dataclass

__all__ = ["device_for_worker", "pin_cuda_device", "context_breaking_error", "BrokenContext",
           "broken_context", "note_broken_context", "synchronize"]

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


# --- A fault that breaks the process's CUDA context -------------------------------------
#
# An illegal address, a misaligned access or a device-side assert in a kernel leaves the
# CUDA context of the whole process unusable: every later CUDA call, the suite's own
# tensor copies included, fails with the same error. Measured on an H200 (torch 2.11,
# benchmarks/results/gpu-2026-12-04): one faulting triton launch in a property's search
# turned the 76 properties after it into failures of that one fault. So the first such
# error is noted per process (:func:`note_broken_context`); in-process, the checks after it
# on a CUDA device fail at once, saying they did not run (conformance.harness.checking),
# and an isolated worker's reply asks to be replaced (``restart``), so that a fresh one runs
# the next check (conformance.isolation.supervisor).

#: What such an error says (CUDA's own messages; torch raises AcceleratorError or
#: RuntimeError "CUDA error: ..."). Out of memory and a bad launch configuration are not
#: sticky and are not here.
_CONTEXT_BREAKING = (
    "illegal memory access", "misaligned address", "device-side assert", "unspecified launch failure",
    "illegal instruction", "an illegal", "hardware stack error", "uncorrectable ecc",
    "operation not permitted when stream is capturing", "context is destroyed",
)


def context_breaking_error(exc: BaseException | None) -> str | None:
    """The first line of a CUDA error in ``exc`` or its causes that leaves the process's
    CUDA context unusable, or None.

    >>> context_breaking_error(RuntimeError("CUDA error: an illegal memory access was encountered\\nmore"))
    'CUDA error: an illegal memory access was encountered'
    >>> context_breaking_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")) is None
    True
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        lowered = text.lower()
        if ("cuda error" in lowered or type(exc).__name__ == "AcceleratorError") and any(
                marker in lowered for marker in _CONTEXT_BREAKING):
            return text.strip().splitlines()[0]
        exc = exc.__cause__ or exc.__context__
    return None


@dataclass(frozen=True)
class BrokenContext:
    """The fault that broke this process's CUDA context, and where it happened."""

    error: str  # the first line of the CUDA error
    where: str  # "property[target id]" of the check that met it


_BROKEN: list[BrokenContext] = []


def note_broken_context(error: str, where: str) -> BrokenContext:
    """Record the first fault that broke this process's CUDA context; returns it."""
    if not _BROKEN:
        _BROKEN.append(BrokenContext(error, where))
    return _BROKEN[0]


def broken_context() -> BrokenContext | None:
    """The fault that broke this process's CUDA context, or None while it is usable."""
    return _BROKEN[0] if _BROKEN else None


def synchronize(device: str) -> None:
    """Wait for the work queued on ``device`` (a no-op off CUDA): a kernel's fault is then
    raised by the call that launched it, not by the suite's next copy of a tensor."""
    if not device.startswith("cuda"):
        return
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
