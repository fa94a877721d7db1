"""Sequence sharding for context-parallel attention: which global positions each rank holds.

Context-parallel ("sharded") attention splits one sequence of length L over ``world_size``
ranks along the sequence axis. A **layout** maps global positions to ranks:

* ``"contiguous"``: rank r holds positions ``r*Ls .. (r+1)*Ls - 1`` with ``Ls = L / W``
  (L divisible by W);
* ``"zigzag"`` (load-balanced causal): the sequence is cut into ``2W`` equal chunks of
  ``C = L / (2W)`` positions; rank r holds chunk r followed by chunk ``2W - 1 - r``
  (L divisible by 2W), so every rank gets the same amount of causal work.

Within a rank its positions are kept in the order listed (ascending for contiguous,
chunk r then chunk 2W-1-r for zigzag). A rank's shard of an array is the array indexed
by its positions along the sequence axis; unsharding puts each shard's rows back at
their positions. Causal attention over the sharded sequence is causal over the **global**
positions: query at position i attends key at position j iff j <= i (L == S, so upper-left
and lower-right alignment coincide). These are pure functions of positions: the oracle
of a sharded call is the full-sequence attention (``spec.sdpa`` / ``spec.flash_attention``
with LSE) on the unsharded arrays, sharded again.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import fail

__all__ = ["LAYOUTS", "divisor", "positions", "rank_of", "shard", "unshard"]

#: The layouts this module knows.
LAYOUTS = ("contiguous", "zigzag")


def divisor(layout: str, world_size: int) -> int:
    """The number L must be a multiple of under ``layout`` (W contiguous, 2W zigzag)."""
    _check_layout(layout)
    return world_size if layout == "contiguous" else 2 * world_size


def _check_layout(layout: Any) -> None:
    if layout not in LAYOUTS:
        fail("layout", layout, f"must be one of {LAYOUTS}", "pass layout='contiguous' or layout='zigzag'")


def _check(length: int, world_size: int, layout: str) -> None:
    _check_layout(layout)
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        fail("world_size", world_size, "must be an integer >= 1", "pass the number of ranks")
    if length < 0 or length % divisor(layout, world_size):
        fail("length", length, f"must be a multiple of {divisor(layout, world_size)} under the "
             f"{layout!r} layout with world_size={world_size}",
             "pad the sequence to a multiple, or use a world size that divides it")


def positions(length: int, world_size: int, rank: int, layout: str = "contiguous") -> np.ndarray:
    """The global positions (int64, in the rank's order) rank ``rank`` holds of a
    sequence of ``length`` positions under ``layout``."""
    _check(length, world_size, layout)
    if not 0 <= rank < world_size:
        fail("rank", rank, f"must be in 0..{world_size - 1}", "pass a rank of the group")
    if layout == "contiguous":
        per = length // world_size
        return np.arange(rank * per, (rank + 1) * per, dtype=np.int64)
    chunk = length // (2 * world_size)
    first = np.arange(rank * chunk, (rank + 1) * chunk, dtype=np.int64)
    other = 2 * world_size - 1 - rank
    second = np.arange(other * chunk, (other + 1) * chunk, dtype=np.int64)
    return np.concatenate([first, second])


def rank_of(length: int, world_size: int, layout: str = "contiguous") -> np.ndarray:
    """(length,) int64: the rank that holds each global position."""
    owner = np.empty(length, dtype=np.int64)
    for r in range(world_size):
        owner[positions(length, world_size, r, layout)] = r
    return owner


def shard(array: Any, world_size: int, rank: int, layout: str = "contiguous", *, axis: int = -2) -> np.ndarray:
    """Rank ``rank``'s shard of ``array`` along ``axis`` (the sequence axis; -2 for
    (B, N, L, E))."""
    array = np.asarray(array)
    return np.take(array, positions(array.shape[axis], world_size, rank, layout), axis=axis)


def unshard(shards: list[Any], layout: str = "contiguous", *, axis: int = -2) -> np.ndarray:
    """The full array from every rank's shard (rank order), each row back at its position."""
    shards = [np.asarray(s) for s in shards]
    world_size = len(shards)
    if world_size == 0:
        fail("shards", shards, "must hold one shard per rank (got none)", "pass every rank's shard")
    per = shards[0].shape[axis]
    if any(s.shape != shards[0].shape for s in shards):
        fail("shards", [s.shape for s in shards], "must all have the same shape",
             "pass the shards of one sharded array")
    length = per * world_size
    out = np.empty(shards[0].shape[:axis % shards[0].ndim] + (length,) + shards[0].shape[axis % shards[0].ndim + 1:],
                   dtype=shards[0].dtype)
    moved = np.moveaxis(out, axis, 0)
    for r, s in enumerate(shards):
        moved[positions(length, world_size, r, layout)] = np.moveaxis(s, axis, 0)
    return out
