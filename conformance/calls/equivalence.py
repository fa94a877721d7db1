"""Two calls that must agree, and which of them is wrong when they do not.

An equivalence property calls the implementation twice on two spellings of one problem
(``is_causal=True`` and the explicit causal mask; K kv heads and the heads repeated; a
sequence packed and alone) and compares the outputs. When they disagree, the pairwise
message alone ("output with is_causal=True vs the explicit causal mask has NaN where it
should be finite") reads as if the first call were wrong, even when the second one (the
*reference side*, the ``expected`` of the comparison) is. Each side's own answer is known
(the oracle on the case as that side called it), so :func:`compare_equivalent` judges
each side against it and says which is wrong: "the explicit-mask call (reference side)
disagrees with the spec ...; the is_causal=True call agrees: the implementation's masked
path is wrong, not its causal flag", or both, or neither.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from conformance.core.compare import Comparison, PropertyFailure, compare_values

__all__ = ["Side", "compare_equivalent", "sdpa_side", "verdict"]


@dataclass(frozen=True)
class Side:
    """One call of an equivalence: ``name`` ("the is_causal=True call"), its ``output``, the
    spec's output for the case as this call made it (``expected``) within ``allowed`` on
    the elements ``where``, and ``path``: what of the implementation this call exercises
    that the other does not ("causal flag"), named when this side alone is wrong."""

    name: str
    output: np.ndarray
    expected: np.ndarray
    allowed: np.ndarray | float
    where: np.ndarray | None = None
    path: str = ""


def _disagreement(side: Side) -> str | None:
    """How ``side`` disagrees with the spec (None: it agrees within its tolerance)."""
    try:
        compare_values("its output", side.output, side.expected, side.allowed, where=side.where)
    except PropertyFailure as exc:
        lines = str(exc).splitlines()
        detail = lines[0]
        worst = next((line.strip() for line in lines[1:] if line.strip().startswith("worst error/allowed")), None)
        return f"{detail}; {worst}" if worst else detail
    return None


def verdict(first: Side, reference: Side) -> str:
    """Which of two disagreeing calls disagrees with the spec: one, both, or neither."""
    ref_name = f"{reference.name} (reference side)"
    wrong_first, wrong_ref = _disagreement(first), _disagreement(reference)

    def blame(wrong: Side, right: Side) -> str:
        if wrong.path and right.path:
            return f"the implementation's {wrong.path} is wrong, not its {right.path}"
        return f"{wrong.name} is the wrong one"

    if wrong_ref and not wrong_first:
        return (f"{ref_name} disagrees with the spec: {wrong_ref}; {first.name} agrees with it: "
                f"{blame(reference, first)}")
    if wrong_first and not wrong_ref:
        return (f"{first.name} disagrees with the spec: {wrong_first}; {ref_name} agrees with it: "
                f"{blame(first, reference)}")
    if wrong_first and wrong_ref:
        return (f"both calls disagree with the spec: {first.name}: {wrong_first}; "
                f"{ref_name}: {wrong_ref}")
    return (f"each call alone agrees with the spec within its tolerance ({first.name}, {ref_name}); "
            "they differ from each other by more than the pair allows")


def compare_equivalent(what: str, first: Side, reference: Side, allowed: np.ndarray | float, *,
                       where: np.ndarray | None = None) -> Comparison:
    """``compare_values(what, first.output, reference.output, allowed, where=where)``; when
    the two disagree, the failure says first which side disagrees with the spec."""
    __tracebackhide__ = True
    try:
        return compare_values(what, first.output, reference.output, allowed, where=where)
    except PropertyFailure as exc:
        raise PropertyFailure(f"{what}: the two calls disagree; {verdict(first, reference)}\n"
                              f"  the outputs compared: {exc}", ratio=exc.ratio) from None


def sdpa_side(target: Any, name: str, case: Any, output: np.ndarray, *, path: str = "",
              view: Callable[[np.ndarray], np.ndarray] | None = None) -> Side:
    """An SDPA call as one :class:`Side`: the oracle's output for ``case`` within the
    tolerance rule on the rows attending a key; ``view`` selects or reorders what is
    compared (the same as is applied to ``output``: a batch item's slice, a permutation)."""
    from conformance.calls.sdpa import allowed_for, valid_rows

    allowed, ref = allowed_for(target, case)
    rows = np.broadcast_to(valid_rows(case), ref.output.shape)
    view = view or (lambda a: a)
    return Side(name, output, view(ref.output), view(allowed), view(rows), path)
