"""One rank of the sharded level's worker group (a spawned process; ``group`` starts it).

It initialises ``torch.distributed`` for ``world`` ranks (a file rendezvous; gloo on the
CPU, NCCL on CUDA with this rank on GPU ``rank``): the **default** process group is
exactly the ranks of the call, as in a job launched with ``torchrun`` for that world
size, so code that takes no group argument (``dist.get_rank()``, ``dist.barrier()``,
``dist.all_gather(...)`` on the default group) runs unchanged, and code that takes one is
handed the same group (``dist.group.WORLD``). It resolves the implementation itself
(``implementations.registry``), says ready, then serves requests from its pipe until
told to stop: each ``run`` request holds
the case's full arrays; the rank takes its own shard (``spec.sharding``), calls
``impl.sharded`` on it, runs the backward when asked, and sends back its output shard,
LSE shard and gradient shards as NumPy arrays (or what it raised).

Nothing here imports pytest or the layers above; torch is imported in the process only.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import traceback
from datetime import timedelta
from typing import Any

import numpy as np

from spec import sharding

__all__ = ["main"]

_DTYPES = {"float64": "float64", "float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def _tensor(torch: Any, array: np.ndarray, dtype: str, device: str, grad: bool) -> Any:
    t = torch.tensor(np.ascontiguousarray(array), dtype=getattr(torch, _DTYPES[dtype]), device=device)
    return t.requires_grad_(grad)


def _numpy(t: Any) -> np.ndarray:
    return t.detach().to("cpu").double().numpy()


def _describe(x: Any) -> str:
    shape = getattr(x, "shape", None)
    return f"{type(x).__name__} of shape {tuple(shape)}" if shape is not None else type(x).__name__


def run_case(torch: Any, impl: Any, group: Any, rank: int, request: dict[str, Any]) -> dict[str, Any]:
    """This rank's part of one sharded call (see the module docstring)."""
    W, layout, dtype, device = request["world_size"], request["layout"], request["dtype"], request["device"]
    options = dict(request.get("options") or {})
    pad = "seq_len" in options  # a padded sequence: every array padded at the end with zeros
    grad = request.get("grad_output") is not None
    q, k, v = (_tensor(torch, sharding.shard(request[n], W, rank, layout, pad=pad), dtype, device, grad)
               for n in ("query", "key", "value"))
    if "window_size" in options:
        options["window_size"] = tuple(options["window_size"])
    result = impl.sharded(q, k, v, group=group, rank=rank, world_size=W, causal=request["causal"],
                          softmax_scale=request["scale"], layout=layout, **options)
    lse = None
    if isinstance(result, (tuple, list)):
        if len(result) < 1:
            return {"contract": "returned an empty tuple, but should return the output shard (and the LSE)"}
        out, lse = result[0], (result[1] if len(result) > 1 else None)
    else:
        out = result
    if not isinstance(out, torch.Tensor):
        return {"contract": f"returned {_describe(out)} as the output, but should return a tensor"}
    reply: dict[str, Any] = {"output": _numpy(out), "out_dtype": str(out.dtype).removeprefix("torch."),
                             "out_device": out.device.type,
                             "lse": None if not isinstance(lse, torch.Tensor) else _numpy(lse),
                             "returned_lse": lse is not None}
    if grad:
        g = _tensor(torch, sharding.shard(request["grad_output"], W, rank, layout, pad=pad), dtype, device, False)
        if not out.requires_grad:
            return {"contract": "the output does not require grad (no autograd graph), but autograd is declared"}
        out.backward(g)
        reply["grads"] = tuple(None if t.grad is None else _numpy(t.grad) for t in (q, k, v))
    return reply


def main(rank: int, config: dict[str, Any]) -> None:
    """The rank's life: connect, initialise the default group, resolve, serve (module docstring)."""
    from multiprocessing.connection import Client

    conn = Client(config["address"], family="AF_UNIX",
                  authkey=bytes.fromhex(os.environ.pop("CONFORMANCE_SHARDED_AUTHKEY")))
    conn.send(rank)
    world, init_file, timeout = config["world"], config["init_file"], config["timeout"]
    impl_spec, options = config["impl_spec"], config["options"]
    import torch
    import torch.distributed as dist

    from implementations import registry

    torch.set_num_threads(1)
    # On a hang the supervisor asks (SIGUSR1) where each rank is blocked: the Python stack
    # of every thread goes to this rank's log, which it reads to name the collective.
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    backend = config.get("backend", "gloo")
    try:
        if backend == "nccl":  # one process per GPU: rank r on cuda:r, every "cuda" tensor there
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        group = dist.group.WORLD
        impl = registry.resolve(impl_spec, options or None, timeout=None)
    except BaseException as exc:  # noqa: BLE001 - reported to the supervisor, which says why
        conn.send({"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        return
    conn.send({"ready": True, "rank": rank})
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request.get("op") == "stop":
            break
        if request["world_size"] != world:  # the supervisor's error: one group per world size
            conn.send({"raised": f"ValueError: this group has world size {world}, not {request['world_size']}"})
            continue
        try:
            reply = run_case(torch, impl, group, rank, request)
        except BaseException as exc:  # noqa: BLE001 - the implementation's own error
            reply = {"raised": f"{type(exc).__name__}: {exc}",
                     "traceback": "".join(traceback.format_exception(exc))[-3000:]}
        conn.send(reply)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - stopping anyway
        pass


if __name__ == "__main__":
    import json
    import sys

    main(int(sys.argv[1]), json.loads(sys.argv[2]))
