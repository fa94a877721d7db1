"""Kernel-style mutants of the tiled online-softmax base (key blocks of 16).

Each class overrides one step of :class:`~implementations.mutants._base.TiledSDPA`,
reproducing a classic FlashAttention-kernel mistake in pure torch.
"""

from __future__ import annotations

import torch

from implementations.mutants._base import (
    BLOCK,
    SDPA_CAPABILITIES,
    TiledSDPA,
    read_as_contiguous,
    sdpa_implementation,
)
from implementations.mutants.record import Mutant

__all__ = ["TILED_MUTANTS", "TILED_CAPABILITIES"]

#: The tiled kernel has no dropout; everything else is claimed.
TILED_CAPABILITIES = SDPA_CAPABILITIES.replace(dropout=False)

ONE = {"B": 1, "N": 1, "K": 1, "L": 1, "S": 1, "E": 1, "Ev": 1}


def _case(**changes):
    return {**ONE, **changes}


class RaggedTailDropped(TiledSDPA):
    """Loops over S // BLOCK full blocks only: keys past the last full block are never seen."""

    def key_blocks(self, S):
        return [(start, start + BLOCK) for start in range(0, S - S % BLOCK, BLOCK)]


class NoRescale(TiledSDPA):
    """Forgets acc *= exp(m_old - m_new) when the running max grows (l is rescaled)."""

    def rescale(self, acc, alpha):
        return acc


class AssumesContiguous(TiledSDPA):
    """Reads q, k, v through their data pointers as if they were contiguous."""

    def load_inputs(self, q, k, v):
        return read_as_contiguous(q), read_as_contiguous(k), read_as_contiguous(v)


class BF16Accumulator(TiledSDPA):
    """Output accumulator and row sum are bfloat16 whatever the input dtype."""

    def accumulator_dtype(self, compute_dtype):
        return torch.bfloat16


class KVBatchOffsetMissing(TiledSDPA):
    """The K/V pointer misses the batch offset: every batch item reads batch 0's K and V."""

    def kv_batch_view(self, x):
        return x[:1].expand_as(x)


class GlobalMax(TiledSDPA):
    """Shifts by the max over the whole tile (all rows) instead of each row's max."""

    def block_max(self, s):
        return s.detach().amax().expand(*s.shape[:-1], 1)


class TailLoadAssumesContiguous(TiledSDPA):
    """The one-key ragged tail (S ≡ 1 mod 16) is loaded with dense-layout address arithmetic."""

    def load_block(self, x, start, stop):
        if stop - start == 1:
            return read_as_contiguous(x)[..., start:stop, :]
        return super().load_block(x, start, stop)


def _mutant(name, cls, *, bug, origin, smallest_case, expected_property, safe_case, expected_cause=None):
    def build():
        return sdpa_implementation(f"mutant:{name}", cls(), TILED_CAPABILITIES, bug)

    return Mutant(
        name=name,
        bug=bug,
        origin=origin,
        smallest_case=smallest_case,
        expected_property=expected_property,
        build=build,
        level="sdpa",
        safe_case=safe_case,
        expected_cause=expected_cause,
    )


TILED_MUTANTS = [
    _mutant(
        "tiled_ragged_tail_dropped", RaggedTailDropped,
        bug="the tiled kernel iterates S // 16 full key blocks and drops the ragged last block",
        origin="kernel bug (grid of S // BLOCK_N instead of cdiv(S, BLOCK_N))",
        smallest_case=_case(S=1),
        expected_property="forward_agreement",
        expected_cause="ragged_tail_dropped",
        safe_case=_case(S=16),
    ),
    _mutant(
        "tiled_no_rescale", NoRescale,
        bug="the accumulator is not rescaled by exp(m_old - m_new) when a later key block raises "
            "the running max",
        origin="kernel bug (online softmax without the accumulator correction)",
        smallest_case=_case(S=17, values="ascending_keys"),
        expected_property="large_logits",
        expected_cause="online_softmax_no_rescale",
        safe_case=_case(S=16, values="ascending_keys"),
    ),
    _mutant(
        "tiled_assumes_contiguous", AssumesContiguous,
        bug="q, k, v are read from raw storage with contiguous strides, so transposed or "
            "stride-0 inputs give wrong values (or an out-of-bounds error)",
        origin="kernel bug (strides not passed to the kernel)",
        smallest_case=_case(B=2, layout="stride0"),
        expected_property="layout_independence",
        safe_case=_case(N=2, K=2, L=2, S=2),
    ),
    _mutant(
        "tiled_bf16_accumulator", BF16Accumulator,
        bug="the output accumulator and row sum are kept in bfloat16, losing precision for "
            "float32/float64 inputs",
        origin="kernel bug (low-precision accumulator)",
        smallest_case=_case(dtype="float32"),
        expected_property="forward_agreement",
        expected_cause="bfloat16_accumulator",
        safe_case=_case(dtype="bfloat16"),
    ),
    _mutant(
        "tiled_kv_batch_offset", KVBatchOffsetMissing,
        bug="the K/V offset omits the batch index, so every batch item attends to batch item 0's "
            "keys and values",
        origin="kernel bug (missing off_b * stride_kb; batch items mixed)",
        smallest_case=_case(B=2),
        expected_property="batch_independence",
        expected_cause="kv_batch_offset",
        safe_case=_case(B=1, N=2, K=2, S=2),
    ),
    _mutant(
        "tiled_global_max", GlobalMax,
        bug="the softmax shift is the max over all rows of the tile instead of each row's max, "
            "so a row far below the others underflows to 0",
        origin="kernel bug (global instead of per-row max)",
        smallest_case=_case(L=2, dtype="float32", values="wide_rows"),
        expected_property="forward_agreement",
        expected_cause="global_max",
        safe_case=_case(L=2, S=2, dtype="float32"),
    ),
    _mutant(
        "tiled_tail_assumes_contiguous", TailLoadAssumesContiguous,
        bug="only the one-key ragged tail (S ≡ 1 mod 16: S = 1, 17, 33, ...) is loaded with "
            "dense-layout addressing, so stride-0 or transposed K/V give wrong answers there",
        origin="docs/KNOWN_BUGS.md #9 (stride-0 K/V with kv_len ≡ 1 mod 32 wrong, pytorch#191937)",
        smallest_case=_case(B=2, layout="stride0"),
        expected_property="layout_independence",
        safe_case=_case(N=2, K=2, S=16, layout="transposed"),
    ),
]
