"""What the context-parallel built-ins share: positions, one block of attention with its
LSE, the merge of two partial results, and rank translation.

Written from ``spec/sharding.py`` (positions), ``spec/flash.py`` (LSE, ``merge_partials``).
Layout: SDPA's heads-first q (B, N, Ls, E), k (B, K, Ls, E), v (B, K, Ls, Ev).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from spec import sharding

__all__ = ["positions", "block_attention", "merge", "global_rank", "scale_of", "sharded_capabilities"]


def positions(length: int, world_size: int, rank: int, layout: str, device: Any) -> torch.Tensor:
    """Global positions (int64) rank ``rank`` holds (``spec.sharding.positions``)."""
    return torch.as_tensor(sharding.positions(length, world_size, rank, layout), device=device)


def scale_of(softmax_scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, K, S, D) -> (B, N, S, D): query head h reads kv head h // (N // K)."""
    group = heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def fold_kv(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, N, S, D) -> (B, K, S, D): the sum over each GQA group (the gradient of repeat_kv)."""
    B, N, S, D = x.shape
    return x if N == kv_heads else x.reshape(B, kv_heads, N // kv_heads, S, D).sum(2)


def allowed(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool, window: tuple[int, int] = (-1, -1),
            seq_len: int | None = None) -> torch.Tensor | None:
    """(Lq, Lk) bool, True = may attend, over global positions (``spec.sharding.allowed``):
    causal ``k <= q``; window ``q - left <= k <= q + right`` (-1 unbounded, causal sets
    right = 0); keys at positions ``>= seq_len`` are padding. None: every key."""
    left, right = (int(window[0]), int(window[1])) if window is not None else (-1, -1)
    if causal:
        right = 0
    q, k = qpos[:, None], kpos[None, :]
    mask = None
    for bound in ((k >= q - left) if left >= 0 else None, (k <= q + right) if right >= 0 else None,
                  (k < seq_len).expand(q.shape[0], -1) if seq_len is not None else None):
        if bound is not None:
            mask = bound if mask is None else mask & bound
    return mask


def scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    s = scale * (q @ repeat_kv(k, q.shape[1]).transpose(-1, -2))
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one block of keys: (output (B, N, Lq, Ev), lse (B, N, Lq));
    a row that attends no key of the block gives output 0 and lse -inf."""
    s = scores(q, k, scale, mask)
    top = s.amax(-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    p = torch.exp(s - top)
    total = p.sum(-1, keepdim=True)
    out = (p @ repeat_kv(v, q.shape[1])) / torch.where(total == 0, torch.ones_like(total), total)
    lse = torch.where(total == 0, torch.full_like(total, float("-inf")), top + torch.log(total))
    return out, lse[..., 0]


def merge(out: torch.Tensor, lse: torch.Tensor, bout: torch.Tensor, blse: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial results over disjoint keys merged through their LSE, shifted by the
    running max so exp never overflows (``spec.merge_partials``)."""
    top = torch.maximum(lse, blse)
    empty = torch.isneginf(top)
    shift = torch.where(empty, torch.zeros_like(top), top)
    a, b = torch.exp(lse - shift), torch.exp(blse - shift)
    total = a + b
    safe = torch.where(total == 0, torch.ones_like(total), total)
    merged = (a[..., None] * out + b[..., None] * bout) / safe[..., None]
    return merged, torch.where(empty, torch.full_like(top, float("-inf")), shift + torch.log(safe))


def global_rank(group: Any, rank: int) -> int:
    """The global rank of ``rank`` in ``group`` (send/recv take global ranks)."""
    if group is None or dist.get_world_size() == dist.get_world_size(group):
        return rank
    return dist.get_global_rank(group, rank)


def sharded_capabilities(**changes: Any) -> Any:
    """The context-parallel built-ins' declaration. They give it as ``capabilities`` only
    (no ``sharded_capabilities``): the sharded level then reads it, and ``--impl-option``
    overrides (applied to ``capabilities``) reach the level."""
    from implementations.base import Capabilities

    base = Capabilities(devices=("cpu", "cuda"), dtypes=("float64", "float32"), causal="upper_left",
                        fully_masked="zero", different_v_dim=True, gqa=True, dropout=False,
                        custom_scale=True, autograd=True, mask_grad=False, mask_kinds=frozenset({"none"}),
                        sharded_layouts=frozenset({"contiguous", "zigzag"}), sharded_lse=True,
                        sharded_features=frozenset({"window", "padding"}))
    return base.replace(**changes)
