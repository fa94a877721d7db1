"""PyTorch's own context-parallel ring attention (``torch.distributed.tensor.experimental``),
at the sharded level, on the CPU with gloo.

``context_parallel(mesh, buffers=...)``, the public API, patches
``F.scaled_dot_product_attention`` and routes it through DTensor to the ring only for
the CUDA kernels (``aten._scaled_dot_product_flash_attention``, ``_efficient_``,
``_cudnn_``). On the CPU, SDPA dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``,
which has no context-parallel handler nor sharding rule: a causal call inside
``context_parallel`` raises ``NotImplementedError: Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered`` (torch 2.13); a non-causal one runs through DTensor's generic propagation
(the keys gathered whole), not the ring.

This built-in certifies the ring itself: the very functions the CUDA path calls,
``_templated_ring_attention`` and ``_templated_ring_attention_backward`` (torch's
rotation, load balancing, LSE merge and dK/dV ring), with the CPU flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``) as the block
attention, over the runner's process group. Each rank passes its shard as the CUDA path
would: torch's load balancer (``_HeadTailLoadBalancer``, used for causal calls) is the
``zigzag`` layout (rank r holds chunks r and 2W-1-r), and without it (a non-causal call,
or ``contiguous``) ``_cp_options.enable_load_balance`` is off, as torch sets it.

``torch-cp`` rotates the k/v blocks with all-gather (torch's default rotate method),
``torch-cp-alltoall`` with all-to-all (``set_rotate_method("alltoall")``); the dK/dV
accumulators always travel by all-to-all. Private API: written against torch 2.13
(``torch/distributed/tensor/experimental/_context_parallel/_attention.py``);
``unavailable_reason`` says so where those functions are missing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from implementations.base import Implementation
from implementations.builtins.distributed import _sharded_common as common

__all__ = ["TorchContextParallel", "make_implementation"]

#: Where torch keeps the ring (torch >= 2.9; earlier: ..._attention).
_MODULES = ("torch.distributed.tensor.experimental._context_parallel._attention",
            "torch.distributed.tensor.experimental._attention")


def _ring_module() -> Any:
    import importlib

    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if all(hasattr(module, f) for f in ("_templated_ring_attention", "_templated_ring_attention_backward",
                                            "_cp_options", "set_rotate_method")):
            return module
    return None


class TorchContextParallel:
    """``sharded(q, k, v, *, group, rank, world_size, causal, softmax_scale, layout)`` ->
    ``(output shard, lse shard)`` through torch's ring attention (module docstring)."""

    def __init__(self, rotate: str = "allgather") -> None:
        self.rotate = rotate

    def configure(self, ring: Any, causal: bool, layout: str) -> None:
        """torch's process-wide options for this call: its load balancer is the zigzag
        layout, and torch allows it for causal calls only (a non-causal call attends every
        block whole, whatever the layout)."""
        ring._cp_options.enable_load_balance = bool(causal) and layout == "zigzag"
        ring.set_rotate_method(self.rotate)

    def __call__(self, q, k, v, *, group=None, rank=None, world_size=None, causal=False,
                 softmax_scale=None, layout="contiguous"):
        group = dist.group.WORLD if group is None else group
        return _Ring.apply(q, k, v, self, group, bool(causal), layout, softmax_scale)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, cp, group, causal, layout, scale):
        ring = _ring_module()
        cp.configure(ring, causal, layout)
        with torch.no_grad():
            out, lse, *_ = ring._templated_ring_attention(
                group, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, q, k, v,
                is_causal=causal, dropout_p=0.0, scale=scale)
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.cp, fctx.group, fctx.causal, fctx.layout, fctx.scale = cp, group, causal, layout, scale
        fctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(fctx, grad_out, grad_lse):
        q, k, v, out, lse = fctx.saved_tensors
        ring = _ring_module()
        fctx.cp.configure(ring, fctx.causal, fctx.layout)
        with torch.no_grad():
            dq, dk, dv, *_ = ring._templated_ring_attention_backward(
                fctx.group, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                grad_out.contiguous(), "grad_out", q, k, v, out, lse, fctx.causal,
                dropout_p=0.0, scale=fctx.scale)
        return dq, dk, dv, None, None, None, None, None


def make_implementation(*, name: str = "torch-cp") -> Implementation:
    """``torch-cp`` (all-gather rotation) or ``torch-cp-alltoall`` (all-to-all)."""
    rotate = "alltoall" if name.endswith("alltoall") else "allgather"
    caps = common.sharded_capabilities(devices=("cpu",), gqa=False, different_v_dim=False,
                                       sharded_features=frozenset())
    missing = None if _ring_module() is not None else (
        f"torch {torch.__version__} has no torch.distributed.tensor.experimental ring attention "
        "(_templated_ring_attention; written against torch 2.13)")
    return Implementation(
        name=name, capabilities=caps, sharded=TorchContextParallel(rotate),
        version=torch.__version__, unavailable_reason=missing,
        description=f"PyTorch's context-parallel ring attention (_templated_ring_attention, {rotate} "
        "rotation) with the CPU flash kernel as block attention (implementations/builtins/distributed/torch_cp.py)",
    )
