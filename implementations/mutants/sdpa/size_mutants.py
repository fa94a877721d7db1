"""Bugs that live at one size.

A kernel specialised by shape (a lookup table of launch configurations, a
size-keyed cache) can be wrong for exactly one (L, S) pair and right everywhere
else; random sizes rarely land on it. These mutants are for the
``small_sizes_sweep`` property, which runs every small (L, S) pair; until that
property is in the suite nothing is expected to catch them.
"""

from __future__ import annotations

from implementations.mutants._base import (
    SDPA_CAPABILITIES,
    NaiveSDPA,
    sdpa_implementation,
)
from implementations.mutants.record import Mutant

__all__ = ["SIZE_MUTANTS"]

ONE = {"B": 1, "N": 1, "K": 1, "L": 1, "S": 1, "E": 1, "Ev": 1}


def _case(**changes):
    return {**ONE, **changes}


class NaNAtOneSize(NaiveSDPA):
    """Returns NaN for L = 3, S = 4 only (a broken entry in a size-keyed kernel table)."""

    def attend(self, q, k, v, mask, is_causal, scale, dropout_p, in_dtype):
        out = super().attend(q, k, v, mask, is_causal, scale, dropout_p, in_dtype)
        if (q.shape[-2], k.shape[-2]) == (3, 4):
            return out * float("nan")
        return out


class OffByOnePercentAtOneSize(NaiveSDPA):
    """Scales the output by 1.01 for L = 7, S = 13 only."""

    def attend(self, q, k, v, mask, is_causal, scale, dropout_p, in_dtype):
        out = super().attend(q, k, v, mask, is_causal, scale, dropout_p, in_dtype)
        if (q.shape[-2], k.shape[-2]) == (7, 13):
            return out * 1.01
        return out


def _mutant(name, cls, *, bug, smallest_case, safe_case):
    def build():
        return sdpa_implementation(f"mutant:{name}", cls(), SDPA_CAPABILITIES, bug)

    return Mutant(name=name, bug=bug,
                  origin="kernel bug (one wrong entry in a shape-specialised launch table)",
                  smallest_case=smallest_case, expected_property="small_sizes_sweep",
                  build=build, level="sdpa", safe_case=safe_case)


SIZE_MUTANTS = [
    _mutant(
        "nan_at_l3_s4", NaNAtOneSize,
        bug="the output is NaN for L = 3, S = 4 and right for every other size",
        smallest_case=_case(L=3, S=4),
        safe_case=_case(L=3, S=5),
    ),
    _mutant(
        "scaled_at_l7_s13", OffByOnePercentAtOneSize,
        bug="the output is scaled by 1.01 for L = 7, S = 13 and right for every other size",
        smallest_case=_case(L=7, S=13),
        safe_case=_case(L=7, S=12),
    ),
]
