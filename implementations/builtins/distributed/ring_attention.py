"""Ring attention over ``torch.distributed`` (the sharded level), written from the spec.

Every rank holds its shard of q, k, v (``spec.sharding``: contiguous or zigzag). The k/v
block travels around the ring (rank r sends to r+1 and receives from r-1, point to point:
``isend``/``recv``, which gloo and NCCL support); at step s rank r holds the block of rank
``(r - s) mod W``, attends it with the causal rule, the window and the padding over
**global** positions (``spec.sharding.allowed``), and merges
the partial result into its running one through the LSE with the running max
(``spec.merge_partials``). The backward is manual (``torch.autograd.Function``): the
block travels again with its dK/dV accumulators, each rank adds its contribution, and a
last send brings every accumulator home, to the rank that owns the block.

:class:`RingAttention`'s steps are methods so that the bug zoo can override one each
(``implementations/mutants/sharded/sharded_mutants.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from implementations.base import Implementation
from implementations.builtins.distributed import _sharded_common as common

__all__ = ["RingAttention", "make_implementation"]


class RingAttention:
    """``sharded(q, k, v, *, group, rank, world_size, causal, softmax_scale, layout)`` ->
    ``(output shard, lse shard)``."""

    # -- the steps (overridden one at a time by the bug zoo) -------------------------------

    def block_mask(self, qpos: torch.Tensor, kpos: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor | None:
        """Which keys of the block each query may attend (global positions: causal, window,
        padding)."""
        return common.allowed(qpos, kpos, ctx["causal"], ctx["window"], ctx["seq_len"])

    def merge(self, out, lse, bout, blse):
        return common.merge(out, lse, bout, blse)

    def steps(self, world_size: int) -> int:
        """How many k/v blocks each rank attends: all of them."""
        return world_size

    def home_sends(self) -> int:
        """How many sends of the dK/dV accumulators after the last backward step: one,
        which brings each block's accumulators back to its owner."""
        return 1

    def positions(self, length: int, world_size: int, rank: int, layout: str, device: Any) -> torch.Tensor:
        return common.positions(length, world_size, rank, layout, device)

    # -- the ring ------------------------------------------------------------------------------

    def exchange(self, tensor: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        """Send ``tensor`` to the next rank, receive the previous rank's."""
        W, r, group = ctx["world_size"], ctx["rank"], ctx["group"]
        if W == 1:
            return tensor
        received = torch.empty_like(tensor)
        nxt, prv = common.global_rank(group, (r + 1) % W), common.global_rank(group, (r - 1) % W)
        request = dist.isend(tensor.contiguous(), nxt, group=group)
        dist.recv(received, prv, group=group)
        request.wait()
        return received

    def forward(self, q, k, v, ctx):
        W, r, L = ctx["world_size"], ctx["rank"], ctx["length"]
        qpos = self.positions(L, W, r, ctx["layout"], q.device)
        E = k.shape[-1]
        block = torch.cat([k, v], dim=-1)
        out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        for s in range(self.steps(W)):
            src = (r - s) % W
            kpos = self.positions(L, W, src, ctx["layout"], q.device)
            bout, blse = common.block_attention(q, block[..., :E], block[..., E:], ctx["scale"],
                                                self.block_mask(qpos, kpos, ctx))
            out, lse = self.merge(out, lse, bout, blse)
            if s + 1 < W:
                block = self.exchange(block, ctx)
        return out, lse

    def backward(self, q, k, v, out, lse, grad_out, ctx):
        W, r, L, scale = ctx["world_size"], ctx["rank"], ctx["length"], ctx["scale"]
        N, K, E, Ev = q.shape[1], k.shape[1], k.shape[-1], v.shape[-1]
        qpos = self.positions(L, W, r, ctx["layout"], q.device)
        row_dot = (grad_out * out).sum(-1, keepdim=True)                       # (B, N, Ls, 1)
        safe_lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)[..., None]
        dq = torch.zeros_like(q)
        travelling = torch.cat([k, v, torch.zeros_like(k), torch.zeros_like(v)], dim=-1)
        for s in range(W):
            src = (r - s) % W
            kb, vb = travelling[..., :E], travelling[..., E:E + Ev]
            kpos = self.positions(L, W, src, ctx["layout"], q.device)
            logits = common.scores(q, kb, scale, self.block_mask(qpos, kpos, ctx))
            p = torch.where(torch.isneginf(lse)[..., None], torch.zeros_like(logits), torch.exp(logits - safe_lse))
            dv = common.fold_kv(p.transpose(-1, -2) @ grad_out, K)
            dp = grad_out @ common.repeat_kv(vb, N).transpose(-1, -2)
            ds = p * (dp - row_dot)
            dq = dq + scale * (ds @ common.repeat_kv(kb, N))
            dk = common.fold_kv(scale * (ds.transpose(-1, -2) @ q), K)
            travelling = torch.cat([kb, vb, travelling[..., E + Ev:2 * E + Ev] + dk,
                                    travelling[..., 2 * E + Ev:] + dv], dim=-1)
            if s + 1 < W:
                travelling = self.exchange(travelling, ctx)
        grads = travelling[..., E + Ev:]
        for _ in range(self.home_sends() if W > 1 else 0):
            grads = self.exchange(grads.contiguous(), ctx)
        return dq, grads[..., :E], grads[..., E:]

    def __call__(self, q, k, v, *, group=None, rank=None, world_size=None, causal=False,
                 softmax_scale=None, layout="contiguous", window_size=(-1, -1), seq_len=None):
        rank = dist.get_rank(group) if rank is None else int(rank)
        world_size = dist.get_world_size(group) if world_size is None else int(world_size)
        length = q.shape[-2] * world_size  # the padded length; seq_len: the real one
        ctx = {"group": group, "rank": rank, "world_size": world_size, "causal": bool(causal),
               "layout": layout, "length": length, "window": tuple(window_size),
               "seq_len": None if seq_len is None or int(seq_len) >= length else int(seq_len),
               "scale": common.scale_of(softmax_scale, q.shape[-1])}
        return _Ring.apply(q, k, v, self, ctx)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, ring, ctx):
        with torch.no_grad():
            out, lse = ring.forward(q, k, v, ctx)
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.ring, fctx.ctx = ring, ctx
        fctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(fctx, grad_out, grad_lse):
        q, k, v, out, lse = fctx.saved_tensors
        with torch.no_grad():
            dq, dk, dv = fctx.ring.backward(q, k, v, out, lse, grad_out.contiguous(), fctx.ctx)
        return dq, dk, dv, None, None


def make_implementation(*, name: str = "ring", ring: RingAttention | None = None,
                        description: str = "") -> Implementation:
    """The built-in ring attention (or, with ``ring`` given, one of the bug zoo's variants)."""
    caps = common.sharded_capabilities()
    return Implementation(
        name=name, capabilities=caps, sharded=ring or RingAttention(),
        version=torch.__version__, listed=not name.startswith("mutant:"),
        description=description or "ring attention over torch.distributed point-to-point (isend/recv), "
        "LSE merge with the running max, manual backward with dK/dV sent home, window and padding "
        "(implementations/builtins/distributed/ring_attention.py)",
    )
