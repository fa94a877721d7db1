"""Bugs of context-parallel attention (the sharded level), each a real mistake of hand-written
ring and all-to-all attention.

Each mutant is the ``ring`` or ``ulysses`` built-in (``implementations/builtins/
ring_attention.py``, ``ulysses_attention.py``) with one step overridden; its capabilities
are the built-in's. ``smallest_case`` uses this level's vocabulary: ``world_size``,
``layout``, ``L`` (the whole sequence), ``N``, ``K``, ``E``, ``causal``, ``grad``
(the backward is compared), ``values`` (``"huge"``: every logit above 709), ``window``
(left, right), ``padded_to`` (the padded length the ranks shard). ``expected_cause``: the
``spec.variants`` sharded variant of the bug (all but the gradient-only dK/dV one).
"""

from __future__ import annotations

import torch

from implementations.builtins.distributed import _sharded_common as common
from implementations.builtins.distributed.ring_attention import RingAttention
from implementations.builtins.distributed.ring_attention import make_implementation as make_ring
from implementations.builtins.distributed.ulysses_attention import UlyssesAttention
from implementations.builtins.distributed.ulysses_attention import make_implementation as make_ulysses
from implementations.mutants.record import Mutant

__all__ = ["SHARDED_MUTANTS"]


class LocalCausalOffset(RingAttention):
    """Each k/v block is masked with the local triangle (key index <= query index within
    the shards, tril(ones)), as if every block sat on the diagonal: the rank's offset is lost."""

    def block_mask(self, qpos, kpos, ctx):
        if not ctx["causal"]:
            return super().block_mask(qpos, kpos, ctx)
        local = common.allowed(torch.arange(qpos.shape[0], device=qpos.device),
                               torch.arange(kpos.shape[0], device=kpos.device), True)
        rest = common.allowed(qpos, kpos, False, ctx["window"], ctx["seq_len"])
        return local if rest is None else local & rest


class LocalWindowOffset(RingAttention):
    """The sliding window is placed from the query's index within its rank's shard instead
    of its global position (the rank's offset lost): keys are compared with a query as
    if every shard started at position 0."""

    def block_mask(self, qpos, kpos, ctx):
        if ctx["window"] == (-1, -1):
            return super().block_mask(qpos, kpos, ctx)
        local = torch.arange(qpos.shape[0], device=qpos.device)
        window = common.allowed(local, kpos, False, ctx["window"] if not ctx["causal"] else (ctx["window"][0], -1))
        rest = common.allowed(qpos, kpos, ctx["causal"], (-1, -1), ctx["seq_len"])
        return window if rest is None else (rest if window is None else window & rest)


class PaddingAttended(RingAttention):
    """The sequence is padded to a multiple of the world size, but the padded keys are not
    masked: every query attends the zero keys (and values) at the padding positions."""

    def block_mask(self, qpos, kpos, ctx):
        return super().block_mask(qpos, kpos, dict(ctx, seq_len=None))


class MergeWithoutMax(RingAttention):
    """Partial results merged as ``(e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2)`` without
    shifting by the running max: exp overflows once an LSE passes 88 (float32) or 709."""

    def merge(self, out, lse, bout, blse):
        a, b = torch.exp(lse), torch.exp(blse)
        total = a + b
        safe = torch.where(total == 0, torch.ones_like(total), total)
        return (a[..., None] * out + b[..., None] * bout) / safe[..., None], torch.log(total)


class ZigzagChunksSwapped(RingAttention):
    """Under the zigzag layout the rank reads its two chunks in the wrong order (chunk
    2W-1-r first, then chunk r): every position of the shard is off by the other chunk's."""

    def positions(self, length, world_size, rank, layout, device):
        pos = common.positions(length, world_size, rank, layout, device)
        if layout != "zigzag":
            return pos
        half = pos.shape[0] // 2
        return torch.cat([pos[half:], pos[:half]])


class LastStepSkipped(RingAttention):
    """The ring loop runs W-1 steps: the last k/v block to arrive is never attended."""

    def steps(self, world_size):
        return world_size - 1


class DKDVNotSentHome(RingAttention):
    """The backward never sends the dK/dV accumulators home after the last step: each
    rank returns the accumulators of its next rank's block as its own."""

    def home_sends(self):
        return 0


class HeadsReturnedReversed(UlyssesAttention):
    """The returning all-to-all stacks the head groups in reverse rank order: head group j
    of the output comes from rank W-1-j."""

    def head_order(self, world_size):
        return list(reversed(range(world_size)))


def _ring(name: str, ring: RingAttention, bug: str):
    return lambda: make_ring(name=f"mutant:{name}", ring=ring, description=bug)


def _ulysses(name: str, ulysses: UlyssesAttention, bug: str):
    return lambda: make_ulysses(name=f"mutant:{name}", ulysses=ulysses, description=bug)


#: The spec.variants variant that models each mutant's bug (the diagnosis names it).
_CAUSES = {"sharded_causal_offset": "sharded_causal_local", "sharded_window_local": "sharded_window_local",
           "sharded_padding_attended": "sharded_padding_attended", "sharded_merge_no_max": "sharded_merge_no_max",
           "sharded_zigzag_swapped": "sharded_zigzag_swapped", "sharded_last_step_skipped": "sharded_last_step_skipped",
           "sharded_heads_reversed": "sharded_heads_reversed"}


def _mutant(name: str, bug: str, origin: str, smallest: dict, prop: str, build, safe: dict | None = None) -> Mutant:
    return Mutant(name=name, bug=bug, origin=origin, smallest_case=smallest, expected_property=prop,
                  build=build, level="sharded", safe_case=safe, expected_cause=_CAUSES.get(name))


SHARDED_MUTANTS = [
    _mutant("sharded_causal_offset", LocalCausalOffset.__doc__.split(":")[0],
            "hand-written pitfall: ring attention masking every block with tril(ones) (the block's own "
            "triangle) instead of comparing global positions",
            {"world_size": 2, "layout": "contiguous", "L": 2, "N": 1, "E": 2, "causal": True},
            "sharded_forward", _ring("sharded_causal_offset", LocalCausalOffset(), "local causal mask per block"),
            safe={"world_size": 1, "layout": "contiguous", "L": 2, "causal": True}),
    _mutant("sharded_window_local", LocalWindowOffset.__doc__.split(":")[0],
            "hand-written pitfall: a sliding window over a sharded sequence placed with the query's index "
            "in its shard (arange(L_shard)) where the key positions are global: the rank's offset "
            "r * L_shard is left out",
            {"world_size": 2, "layout": "contiguous", "L": 2, "N": 1, "E": 1, "window": (0, 0)},
            "sharded_forward", _ring("sharded_window_local", LocalWindowOffset(), "window from local query positions"),
            safe={"world_size": 1, "layout": "contiguous", "L": 2, "window": (0, 0)}),
    _mutant("sharded_padding_attended", PaddingAttended.__doc__.split(":")[0],
            "hand-written pitfall: a sequence zero-padded to a multiple of the world size (or of 2W for "
            "zigzag) with the padded keys left unmasked, as if the padding were part of the sequence",
            {"world_size": 1, "layout": "zigzag", "L": 1, "N": 1, "E": 1, "padded_to": 2},
            "sharded_forward", _ring("sharded_padding_attended", PaddingAttended(), "padded keys attended"),
            safe={"world_size": 1, "layout": "contiguous", "L": 1}),
    _mutant("sharded_merge_no_max", MergeWithoutMax.__doc__.split(":")[0],
            "hand-written pitfall: the LSE merge written from the formula without the running max "
            "(spec.merge_partials subtracts it first)",
            {"world_size": 1, "layout": "contiguous", "L": 1, "N": 1, "E": 1, "values": "huge"},
            "sharded_forward", _ring("sharded_merge_no_max", MergeWithoutMax(), "merge without the running max")),
    _mutant("sharded_zigzag_swapped", ZigzagChunksSwapped.__doc__.split(":")[0],
            "hand-written pitfall: the zigzag shard built as chunks (2W-1-r, r) on one side and read as "
            "(r, 2W-1-r) on the other",
            {"world_size": 1, "layout": "zigzag", "L": 2, "N": 1, "E": 2, "causal": True},
            "sharded_layout_invariance",
            _ring("sharded_zigzag_swapped", ZigzagChunksSwapped(), "zigzag chunks read in the wrong order"),
            safe={"world_size": 2, "layout": "contiguous", "L": 2, "causal": True}),
    _mutant("sharded_last_step_skipped", LastStepSkipped.__doc__.split(":")[0],
            "hand-written pitfall: the ring loop `for step in range(world_size - 1)` that sends after "
            "attending, so the last block received is dropped",
            {"world_size": 1, "layout": "contiguous", "L": 1, "N": 1, "E": 1},
            "sharded_forward", _ring("sharded_last_step_skipped", LastStepSkipped(), "last ring step skipped")),
    _mutant("sharded_dkdv_not_home", DKDVNotSentHome.__doc__.split(":")[0],
            "hand-written pitfall: the ring backward that accumulates dK/dV while they travel but "
            "returns them where the loop ends, one rank away from their owner",
            {"world_size": 2, "layout": "contiguous", "L": 2, "N": 1, "E": 1, "grad": True},
            "sharded_backward", _ring("sharded_dkdv_not_home", DKDVNotSentHome(), "dK/dV not sent home"),
            safe={"world_size": 1, "layout": "contiguous", "L": 2, "grad": True}),
    _mutant("sharded_heads_reversed", HeadsReturnedReversed.__doc__.split(":")[0],
            "hand-written pitfall: the output all-to-all of sequence-parallel (Ulysses) attention "
            "concatenating the received head groups in the wrong order",
            {"world_size": 2, "layout": "contiguous", "L": 2, "N": 2, "E": 1},
            "sharded_world_one",
            _ulysses("sharded_heads_reversed", HeadsReturnedReversed(), "head groups returned reversed"),
            safe={"world_size": 1, "layout": "contiguous", "L": 1, "N": 1}),
]
