"""Kernel bugs planted in the Triton flash-attention kernel itself.

The tiled mutants in :mod:`.tiled_mutants` show the classic kernel bugs in pure
PyTorch; these plant four of them in the real Triton kernel
(``implementations/builtins/kernels/triton_attention.py``, ``planted_bug=``) so the suite is shown
to catch them where a kernel author would make them. They need triton installed
(on the CPU the kernel runs under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import dataclasses

from implementations.base import Implementation
from implementations.mutants.record import Mutant

__all__ = ["TRITON_MUTANTS"]


def _builder(bug: str, name: str, level: str = "sdpa"):
    def build() -> Implementation:
        from implementations.builtins.kernels.triton_attention import make_implementation

        impl = make_implementation(planted_bug=bug)
        if level == "flash":  # a flash-level mutant exposes the flash callable only
            impl = dataclasses.replace(impl, sdpa=None)
        return dataclasses.replace(impl, name=f"mutant:{name}", listed=False)

    return build


TRITON_MUTANTS = (
    Mutant(
        name="triton_drop_ragged_block",
        bug="the Triton kernel's key loop stops at S // BLOCK_N, skipping the last, partial key block",
        origin="kernel bug (docs/KNOWN_BUGS.md #9: lengths around block sizes), planted in the Triton kernel",
        smallest_case={"B": 1, "N": 1, "K": 1, "L": 1, "S": 1, "E": 1, "Ev": 1},
        expected_property="forward_agreement",
        expected_cause="ragged_tail_dropped",
        build=_builder("drop_ragged_block", "triton_drop_ragged_block"),
        safe_case={"B": 1, "N": 1, "K": 1, "L": 1, "S": 16, "E": 1, "Ev": 1},
    ),
    Mutant(
        name="triton_no_rescale",
        bug="the Triton kernel does not rescale its accumulator when the running row max grows",
        origin="kernel bug (online softmax), planted in the Triton kernel",
        smallest_case={"B": 1, "N": 1, "K": 1, "L": 1, "S": 17, "E": 1, "Ev": 1, "values": "ascending_keys"},
        expected_property="large_logits",
        expected_cause="online_softmax_no_rescale",
        build=_builder("no_rescale", "triton_no_rescale"),
        safe_case={"B": 1, "N": 1, "K": 1, "L": 1, "S": 16, "E": 1, "Ev": 1},
    ),
    Mutant(
        name="triton_ignore_strides",
        bug="the Triton launcher passes contiguous strides, so a transposed view is read as if contiguous",
        origin="kernel bug (docs/KNOWN_BUGS.md #9: layout-dependent answers), planted in the Triton kernel",
        smallest_case={"B": 1, "N": 2, "K": 2, "L": 1, "S": 2, "E": 1, "Ev": 1, "layout": "transposed"},
        expected_property="layout_independence",
        build=_builder("ignore_strides", "triton_ignore_strides"),
        safe_case={"B": 1, "N": 1, "K": 1, "L": 1, "S": 1, "E": 1, "Ev": 1},
    ),
    Mutant(
        name="triton_window_left_off_by_one",
        bug="the Triton kernel's sliding window keeps keys j > p_i - left instead of j >= p_i - left",
        origin="kernel bug (an off-by-one at the window's left edge), planted in the Triton kernel",
        smallest_case={"B": 1, "N": 1, "K": 1, "L": 2, "S": 2, "E": 1, "Ev": 1, "window": [1, 0]},
        expected_property="window_equivalence",
        expected_cause="flash_window_left_off_by_one",
        build=_builder("window_left_off_by_one", "triton_window_left_off_by_one", level="flash"),
        level="flash",
        safe_case={"B": 1, "N": 1, "K": 1, "L": 2, "S": 2, "E": 1, "Ev": 1, "window": [-1, 0]},
    ),
)
