"""All-to-all ("Ulysses") attention over ``torch.distributed`` (the sharded level).

Every rank holds its sequence shard of q, k, v with every head. An all-to-all re-shards
from sequence to heads: rank j gets heads ``j*N/W .. (j+1)*N/W - 1`` (kv heads likewise,
so N and K must be multiples of W: ``sharded_heads_divisible``) over the whole sequence,
in rank order of the shards, whose global positions ``spec.sharding`` gives; it attends
them with the causal rule, the window and the padding over those positions
(``spec.sharding.allowed``), and a second all-to-all re-shards the output back from
heads to sequence.

Each all-to-all is ``dist.all_to_all`` (gloo has it on the CPU, NCCL on CUDA): rank r
sends its j-th slice to rank j and receives rank i's slice for it. Backward is autograd:
each all-to-all is a ``torch.autograd.Function`` whose backward is the inverse all-to-all.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from implementations.base import Implementation
from implementations.builtins.distributed import _sharded_common as common

__all__ = ["UlyssesAttention", "make_implementation"]


def _all_to_all(parts: list[torch.Tensor], ctx: dict[str, Any]) -> list[torch.Tensor]:
    """Send ``parts[j]`` to rank j; the parts every rank sent here, in rank order."""
    if ctx["world_size"] == 1:
        return parts
    parts = [p.contiguous() for p in parts]
    received = [torch.empty_like(parts[0]) for _ in parts]
    dist.all_to_all(received, parts, group=ctx["group"])
    return received


def seq_to_heads(x: torch.Tensor, ctx: dict[str, Any], order: list[int]) -> torch.Tensor:
    """(B, H, Ls, D) sequence shard, all heads -> (B, H/W, L, D): this rank's head group over
    the shards of every rank, concatenated in rank order."""
    W = ctx["world_size"]
    per = x.shape[1] // W
    parts = _all_to_all([x[:, j * per:(j + 1) * per] for j in range(W)], ctx)
    return torch.cat([parts[i] for i in order], dim=2)


def heads_to_seq(x: torch.Tensor, ctx: dict[str, Any], order: list[int]) -> torch.Tensor:
    """(B, H/W, L, D) head group over the whole sequence -> (B, H, Ls, D): this rank's
    sequence shard with every head; ``order[j]`` is the rank whose head group goes j-th."""
    W = ctx["world_size"]
    Ls = x.shape[2] // W
    parts = _all_to_all([x[:, :, j * Ls:(j + 1) * Ls] for j in range(W)], ctx)
    return torch.cat([parts[j] for j in order], dim=1)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, ctx, order):
        fctx.ctx, fctx.order = ctx, order
        return seq_to_heads(x, ctx, order)

    @staticmethod
    def backward(fctx, grad):
        return heads_to_seq(grad.contiguous(), fctx.ctx, fctx.order), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, ctx, order):
        fctx.ctx, fctx.order = ctx, order
        return heads_to_seq(x, ctx, order)

    @staticmethod
    def backward(fctx, grad):
        return seq_to_heads(grad.contiguous(), fctx.ctx, fctx.order), None, None


class UlyssesAttention:
    """``sharded(q, k, v, *, group, rank, world_size, causal, softmax_scale, layout)`` ->
    ``(output shard, lse shard)``."""

    def head_order(self, world_size: int) -> list[int]:
        """The order in which the returning all-to-all stacks the head groups: by rank."""
        return list(range(world_size))

    def __call__(self, q, k, v, *, group=None, rank=None, world_size=None, causal=False,
                 softmax_scale=None, layout="contiguous", window_size=(-1, -1), seq_len=None):
        rank = dist.get_rank(group) if rank is None else int(rank)
        W = dist.get_world_size(group) if world_size is None else int(world_size)
        for name, t in (("q", q), ("k", k)):
            if t.shape[1] % W:
                raise ValueError(f"{name} has {t.shape[1]} heads, but all-to-all attention needs a multiple "
                                 f"of world_size={W}; use ring attention or a world size dividing the heads")
        ctx = {"group": group, "rank": rank, "world_size": W}
        L = q.shape[-2] * W
        pos = torch.cat([common.positions(L, W, i, layout, q.device) for i in range(W)])
        order = list(range(W))
        qh, kh, vh = (_SeqToHeads.apply(t, ctx, order) for t in (q, k, v))
        scale = common.scale_of(softmax_scale, q.shape[-1])
        mask = common.allowed(pos, pos, bool(causal), tuple(window_size), seq_len if seq_len is not None and
                              int(seq_len) < L else None)
        out, lse = common.block_attention(qh, kh, vh, scale, mask)
        out = _HeadsToSeq.apply(out, ctx, self.head_order(W))
        with torch.no_grad():
            lse = heads_to_seq(lse[..., None], ctx, self.head_order(W))[..., 0]
        return out, lse


def make_implementation(*, name: str = "ulysses", ulysses: UlyssesAttention | None = None,
                        description: str = "") -> Implementation:
    """The built-in all-to-all attention (or, with ``ulysses`` given, a bug zoo variant)."""
    caps = common.sharded_capabilities(sharded_heads_divisible=True)
    return Implementation(
        name=name, capabilities=caps, sharded=ulysses or UlyssesAttention(),
        version=torch.__version__, listed=not name.startswith("mutant:"),
        description=description or "all-to-all (Ulysses) attention: sequence to heads and back with "
        "dist.all_to_all, window and padding, autograd backward "
        "(implementations/builtins/distributed/ulysses_attention.py)",
    )
