"""Bugs that live past the first block of a real GPU kernel.

GPU attention kernels tile queries and keys in blocks of 64, 128 or 256. A bug in how a
later block is offset or merged shows only when a sequence is longer than one block:
L or S of 129 for blocks of 128. Random draws stop at 65, so only ``long_sizes_sweep``
(L, S in 1, 129, 257, 128, ...) catches these.
"""

from __future__ import annotations

import torch

from implementations.mutants._base import (
    SDPA_CAPABILITIES,
    NaiveSDPA,
    TiledSDPA,
    sdpa_implementation,
)
from implementations.mutants.record import Mutant

__all__ = ["LONG_BLOCK_MUTANTS"]

ONE = {"B": 1, "N": 1, "K": 1, "L": 1, "S": 1, "E": 1, "Ev": 1}
#: The block of the kernels modelled here.
BLOCK_128 = 128


class Tiled128NoRescale(TiledSDPA):
    """Key blocks of 128; the accumulator is not rescaled when a later block raises the max."""

    def key_blocks(self, S):
        return [(start, min(start + BLOCK_128, S)) for start in range(0, S, BLOCK_128)]

    def rescale(self, acc, alpha):
        return acc


class QueryBlock128CausalOffset(NaiveSDPA):
    """Queries in blocks of 128; each block's causal diagonal starts at its own first row,
    as if the block were the first: row i sees keys j <= i mod 128."""

    def causal_attend(self, L, S, device):
        rows = torch.arange(L, device=device) % BLOCK_128
        return torch.arange(S, device=device)[None, :] <= rows[:, None]


def _mutant(name, cls, capabilities, *, bug, origin, smallest_case, safe_case):
    return Mutant(
        name=name, bug=bug, origin=origin, smallest_case=smallest_case,
        expected_property="long_sizes_sweep", level="sdpa", safe_case=safe_case,
        build=lambda: sdpa_implementation(f"mutant:{name}", cls(), capabilities, bug),
    )


LONG_BLOCK_MUTANTS = [
    _mutant(
        "tiled128_no_rescale", Tiled128NoRescale, SDPA_CAPABILITIES.replace(dropout=False),
        bug="online softmax over key blocks of 128 that forgets to rescale the accumulator "
            "when a later block raises the running max: wrong only for S > 128",
        origin="kernel bug (the FlashAttention rescale mistake in a kernel whose key block is 128)",
        smallest_case={**ONE, "S": 257},
        safe_case={**ONE, "S": 128},
    ),
    _mutant(
        "query_block128_causal_offset", QueryBlock128CausalOffset, SDPA_CAPABILITIES,
        bug="causal masking per query block of 128 computed from the row inside the block, not "
            "the absolute row: rows from 128 on see too few keys",
        origin="kernel bug (a causal mask built from the block-local row index, offs_m without "
               "the program's start_m * BLOCK_M)",
        smallest_case={**ONE, "L": 129, "S": 129, "causal": "upper_left"},
        safe_case={**ONE, "L": 128, "S": 128, "causal": "upper_left"},
    ),
]
