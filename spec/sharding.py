"""Sequence sharding for context-parallel attention: which global positions each rank holds.

Context-parallel ("sharded") attention splits one sequence of length L over ``world_size``
ranks along the sequence axis. A **layout** maps global positions to ranks:

* ``"contiguous"``: rank r holds positions ``r*Ls .. (r+1)*Ls - 1`` with ``Ls = L / W``
  (L divisible by W);
* ``"zigzag"`` (load-balanced causal): the sequence is cut into ``2W`` equal chunks of
  ``C = L / (2W)`` positions; rank r holds chunk r followed by chunk ``2W - 1 - r``
  (L divisible by 2W), so every rank gets the same amount of causal work.

**Padding** (declared ``sharded_features`` ``padding``): a length L that is not a multiple
of the layout's divisor is padded at the end with zeros to ``padded_length(L, W, layout)``
(the next multiple); the layout applies to the padded sequence, positions ``>= L`` are
padding, no query attends them, and the output, LSE and gradients there are not part of
the result (``unshard(..., length=L)`` drops them).

**Window** (declared ``sharded_features`` ``window``): ``window=(left, right)`` as in
FlashAttention's ``window_size``, over global positions: query i attends key j iff
``i - left <= j <= i + right`` (-1 leaves that side unbounded); ``causal=True`` sets
``right = 0``. :func:`allowed` is the whole rule (causal, window, padding) on the
positions two ranks hold.

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

from . import _flash_checks as flash_checks
from .errors import fail

__all__ = ["LAYOUTS", "allowed", "attend_mask", "divisor", "padded_length", "positions", "rank_of", "shard",
           "unshard"]

#: The layouts this module knows.
LAYOUTS = ("contiguous", "zigzag")


def divisor(layout: str, world_size: int) -> int:
    """The number L must be a multiple of under ``layout`` (W contiguous, 2W zigzag)."""
    _check_layout(layout)
    return world_size if layout == "contiguous" else 2 * world_size


def padded_length(length: int, world_size: int, layout: str = "contiguous") -> int:
    """``length`` rounded up to a multiple of ``divisor(layout, world_size)``: the length of
    the padded sequence the ranks shard (``length`` itself when it divides)."""
    d = divisor(layout, world_size)
    if not flash_checks.is_int(length) or length < 0:
        fail("length", length, "must be an int >= 0", "pass the sequence length")
    return -(-int(length) // d) * d


def allowed(qpos: Any, kpos: Any, *, causal: bool = False, window: tuple[int, int] = (-1, -1),
            length: int | None = None) -> np.ndarray:
    """Bool (len(qpos), len(kpos)), **True = may attend**: the query at global position
    ``qpos[a]`` may attend the key at ``kpos[b]`` (causal: ``k <= q``; window
    ``(left, right)``: ``q - left <= k <= q + right``, -1 unbounded, causal sets right = 0;
    ``length``: keys at positions ``>= length`` are padding and never attended)."""
    left, right = flash_checks.window_pair(window)
    if causal:
        right = 0
    q = np.asarray(qpos, dtype=np.int64)[:, None]
    k = np.asarray(kpos, dtype=np.int64)[None, :]
    mask = np.ones((q.shape[0], k.shape[1]), dtype=bool)
    if left >= 0:
        mask &= k >= q - left
    if right >= 0:
        mask &= k <= q + right
    if length is not None:
        mask &= k < length
    return mask


def attend_mask(length: int, *, causal: bool = False, window: tuple[int, int] = (-1, -1)) -> np.ndarray:
    """Bool (L, L), True = may attend: :func:`allowed` over the whole (unpadded) sequence."""
    positions_ = np.arange(length)
    return allowed(positions_, positions_, causal=causal, window=window)


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


def shard(array: Any, world_size: int, rank: int, layout: str = "contiguous", *, axis: int = -2,
          pad: bool = False) -> np.ndarray:
    """Rank ``rank``'s shard of ``array`` along ``axis`` (the sequence axis; -2 for
    (B, N, L, E)). ``pad``: a length that does not divide is first padded at the end with
    zeros to :func:`padded_length`."""
    array = np.asarray(array)
    length = array.shape[axis]
    if pad:
        extra = padded_length(length, world_size, layout) - length
        if extra:
            widths = [(0, 0)] * array.ndim
            widths[axis % array.ndim] = (0, extra)
            array = np.pad(array, widths)
    return np.take(array, positions(array.shape[axis], world_size, rank, layout), axis=axis)


def unshard(shards: list[Any], layout: str = "contiguous", *, axis: int = -2,
            length: int | None = None) -> np.ndarray:
    """The full array from every rank's shard (rank order), each row back at its position;
    ``length``: the unpadded length (the padding rows at positions ``>= length`` dropped)."""
    shards = [np.asarray(s) for s in shards]
    world_size = len(shards)
    if world_size == 0:
        fail("shards", shards, "must hold one shard per rank (got none)", "pass every rank's shard")
    per = shards[0].shape[axis]
    if any(s.shape != shards[0].shape for s in shards):
        fail("shards", [s.shape for s in shards], "must all have the same shape",
             "pass the shards of one sharded array")
    total = per * world_size
    out = np.empty(shards[0].shape[:axis % shards[0].ndim] + (total,) + shards[0].shape[axis % shards[0].ndim + 1:],
                   dtype=shards[0].dtype)
    moved = np.moveaxis(out, axis, 0)
    for r, s in enumerate(shards):
        moved[positions(total, world_size, r, layout)] = np.moveaxis(s, axis, 0)
    if length is not None:
        if not flash_checks.is_int(length) or not 0 <= length <= total or \
                padded_length(length, world_size, layout) != total:
            fail("length", length, f"must be the unpadded length of the {total} padded positions "
                 f"(padded_length(length, {world_size}, {layout!r}) == {total})",
                 "pass the sequence length the shards were padded from")
        out = np.take(out, np.arange(length), axis=axis)
    return out
