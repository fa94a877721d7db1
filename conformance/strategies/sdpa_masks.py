"""SDPA masks: what they block (patterns), their shapes, kinds and forms.

A mask pattern is one record in :data:`MASK_PATTERN_TABLE` (name, the dims it
varies along, how often it is drawn, the function that builds it): adding a
pattern means adding one :class:`MaskPattern` there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st

from conformance.core.cases import NOTE_MASK_EXPANDED
from conformance.strategies._drawing import draw_seed, named_strategy, weighted
from conformance.strategies._validation import (
    check_bool_or_none,
    check_dtype,
    check_range,
    choices,
    fail,
)
from implementations.base import CAUSAL_ALIGNMENTS, Capabilities
from spec.emulate import round_to

__all__ = [
    "MASK_KINDS",
    "MASK_PATTERNS",
    "MASK_PATTERN_TABLE",
    "MASK_SHAPES",
    "MaskDraw",
    "MaskPattern",
    "masks",
]

#: SDPA mask kinds, simplest first: no mask, bool (True = may attend), additive (float).
MASK_KINDS = ("none", "bool", "additive")

Shape4 = tuple[int, int, int, int]


@dataclass(frozen=True)
class MaskPattern:
    """What an SDPA mask blocks, before it is written as bool or additive."""

    name: str
    #: Which of B, N, L, S the pattern varies along (its mask shape must keep those dims).
    needs: tuple[bool, bool, bool, bool]
    #: Relative frequency among the allowed patterns.
    weight: int
    #: ``build(rng, shape, L, S)``: the bool attend pattern (True = may attend) of
    #: ``shape`` (B|1, N|1, L|1, S|1).
    build: Callable[[np.random.Generator, Shape4, int, int], np.ndarray]
    description: str


def _attend_all(rng: np.random.Generator, shape: Shape4, L: int, S: int) -> np.ndarray:
    return np.ones(shape, dtype=bool)


def _attend_random(rng: np.random.Generator, shape: Shape4, L: int, S: int) -> np.ndarray:
    keep = rng.uniform(0.4, 0.95)
    return rng.random(shape) < keep


def _attend_padding(rng: np.random.Generator, shape: Shape4, L: int, S: int) -> np.ndarray:
    lengths = rng.integers(1, S + 1, size=shape[0])                           # (B,)
    keys = np.arange(S)[None, :] < lengths[:, None]                            # (B, S)
    return np.broadcast_to(keys[:, None, None, :], shape).copy()


def _band(shape: Shape4, L: int, S: int, offset: int, window: int | None = None) -> np.ndarray:
    """Keys at most ``offset`` past the query's row (and fewer than ``window`` before it)."""
    rows = np.arange(L)[:, None]
    keys = np.arange(S)[None, :]
    band = keys <= rows + offset                                               # (L, S)
    if window is not None:
        band &= keys > rows + offset - window
    return np.broadcast_to(band, shape).copy()


def _attend_causal_upper_left(rng: np.random.Generator, shape: Shape4, L: int, S: int) -> np.ndarray:
    return _band(shape, L, S, offset=0)


def _attend_causal_lower_right(rng: np.random.Generator, shape: Shape4, L: int, S: int) -> np.ndarray:
    return _band(shape, L, S, offset=S - L)


def _attend_sliding_window(rng: np.random.Generator, shape: Shape4, L: int, S: int) -> np.ndarray:
    offset = int(rng.choice([0, S - L]))
    window = int(rng.integers(1, S + 1))
    return _band(shape, L, S, offset=offset, window=window)


#: Every mask pattern, simplest first (shrinking goes toward the first).
MASK_PATTERN_TABLE: tuple[MaskPattern, ...] = (
    MaskPattern("all", (False, False, False, False), 1, _attend_all,
                "every key may be attended (the mask is present but blocks nothing)"),
    MaskPattern("random", (False, False, False, True), 3, _attend_random,
                "independent Bernoulli entries"),
    MaskPattern("padding", (True, False, False, True), 2, _attend_padding,
                "key padding from per-batch lengths"),
    MaskPattern("causal_upper_left", (False, False, True, True), 1, _attend_causal_upper_left,
                "explicit tril(ones(L, S))"),
    MaskPattern("causal_lower_right", (False, False, True, True), 1, _attend_causal_lower_right,
                "explicit tril(ones(L, S), S - L)"),
    MaskPattern("sliding_window", (False, False, True, True), 1, _attend_sliding_window,
                "a band of 1..S keys around the (either-aligned) diagonal"),
)
_PATTERNS = {pattern.name: pattern for pattern in MASK_PATTERN_TABLE}
#: Names of the mask patterns, simplest first.
MASK_PATTERNS = tuple(_PATTERNS)

#: Mask shapes, simplest first: name -> (which of B, N, L, S vary, ndim).
MASK_SHAPES: dict[str, tuple[tuple[bool, bool, bool, bool], int]] = {
    "(L,S)": ((False, False, True, True), 2),
    "(1,1,L,S)": ((False, False, True, True), 4),
    "(1,S)": ((False, False, False, True), 2),
    "(B,1,1,S)": ((True, False, False, True), 4),
    "(N,L,S)": ((False, True, True, True), 3),
    "(B,1,L,S)": ((True, False, True, True), 4),
    "(B,N,L,S)": ((True, True, True, True), 4),
}

NOTE_FORCED = "fully_masked:forced"


@dataclass(frozen=True)
class MaskDraw:
    """One SDPA-level mask: at most one of ``attend_mask`` (bool, True = may
    attend) and ``additive_mask`` (float64, values exact in the dtype, -inf =
    blocked), broadcastable to (B, N, L, S); ``notes`` label it."""

    attend_mask: np.ndarray | None
    additive_mask: np.ndarray | None
    notes: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        if self.additive_mask is not None:
            return "additive"
        return "bool" if self.attend_mask is not None else "none"


# ---------------------------------------------------------------------------
# fully-masked rows
# ---------------------------------------------------------------------------

def _causal_allowed(L: int, S: int, causal: str | None) -> np.ndarray:
    if causal is None:
        return np.ones((L, S), dtype=bool)
    offset = 0 if causal == "upper_left" else S - L
    return np.arange(S)[None, :] <= np.arange(L)[:, None] + offset


def _fully_blocked_rows(pattern: np.ndarray, L: int, S: int, causal: str | None) -> np.ndarray:
    """Rows of ``pattern`` (4-D, broadcast dims of size 1) with no key left once
    combined with the causal flag, reduced to ``pattern``'s own shape (..., 1)."""
    combined = pattern & _causal_allowed(L, S, causal)              # broadcast to (., ., L, S)
    blocked = ~combined.any(axis=-1, keepdims=True)                 # (., ., L, 1)
    if pattern.shape[2] == 1 and blocked.shape[2] != 1:
        blocked = blocked.any(axis=2, keepdims=True)
    return blocked


def _settle_fully_masked(rng: np.random.Generator, pattern: np.ndarray, L: int, S: int,
                         causal: str | None, force: bool, fully_masked: bool | None) -> list[str]:
    """Block one whole row of ``pattern`` (in place) when ``force``d and none is,
    or open key 0 of every blocked row when ``fully_masked=False``; the notes to add."""
    blocked = _fully_blocked_rows(pattern, L, S, causal)
    if force and not blocked.any():
        index = tuple(int(rng.integers(0, d)) for d in pattern.shape[:3])
        pattern[index] = False
        return [NOTE_FORCED]
    if fully_masked is False and blocked.any():
        # The causal flag never blocks key 0 here (lower-right needs L <= S when
        # fully_masked=False), so opening key 0 unblocks every such row.
        pattern[..., 0:1] |= np.broadcast_to(blocked, pattern[..., 0:1].shape)
    return []


# ---------------------------------------------------------------------------
# drawing one mask
# ---------------------------------------------------------------------------

def nonzero_bias(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """N(0, 1) entries pushed away from 0 (|x| >= 0.125), exact in ``dtype``: no
    entry can be mistaken for "not masked" by an implementation that treats a float
    mask as bool."""
    bias = rng.standard_normal(shape)
    bias = np.where(np.abs(bias) < 0.125, np.copysign(0.125, bias) + bias, bias)
    return round_to(bias, dtype)


def _draw_shape(draw: st.DrawFn, pattern: MaskPattern, sizes: dict[str, int]) -> tuple[str, Shape4, int]:
    """A mask shape that keeps the dims ``pattern`` needs: (name, 4-D shape, ndim)."""
    names = [name for name, (vary, _) in MASK_SHAPES.items()
             if all(v or not need for v, need in zip(vary, pattern.needs, strict=True))]
    name = draw(st.sampled_from(names))
    vary, ndim = MASK_SHAPES[name]
    shape4 = tuple(size if v else 1 for size, v in zip((sizes[d] for d in "BNLS"), vary, strict=True))
    return name, shape4, ndim  # type: ignore[return-value]


def draw_mask(draw: st.DrawFn, rng: np.random.Generator, sizes: dict[str, int], *,
              mask_kinds: Sequence[str], mask_patterns: Sequence[str], dtype: str,
              causal: str | None, fully_masked: bool | None) -> MaskDraw:
    """One mask for a problem of ``sizes``; its entries come from ``rng``."""
    B, N, L, S = sizes["B"], sizes["N"], sizes["L"], sizes["S"]
    kind = draw(st.sampled_from(list(mask_kinds)))
    if kind == "none":
        return MaskDraw(None, None, ())
    pattern = weighted(draw, [(_PATTERNS[p], _PATTERNS[p].weight) for p in mask_patterns])
    shape_name, shape4, ndim = _draw_shape(draw, pattern, sizes)
    if fully_masked is None:
        force = weighted(draw, [(False, 3), (True, 1)])
    else:
        force = fully_masked
    form = draw(st.sampled_from(["zero_inf", "bias"])) if kind == "additive" else None
    expanded = shape4 != (B, N, L, S) and weighted(draw, [(False, 3), (True, 1)])

    attend = pattern.build(rng, shape4, L, S)
    notes = [f"mask_pattern={pattern.name}", f"mask_shape={shape_name}"]
    notes += _settle_fully_masked(rng, attend, L, S, causal, force, fully_masked)
    if expanded:
        notes.append(NOTE_MASK_EXPANDED)
    attend = attend.reshape(attend.shape[4 - ndim:])
    if kind == "bool":
        return MaskDraw(attend, None, tuple(notes))
    notes.append(f"additive={form}")
    values = np.zeros(attend.shape) if form == "zero_inf" else nonzero_bias(rng, attend.shape, dtype)
    return MaskDraw(None, np.where(attend, values, -np.inf), tuple(notes))


def mask_kind_choices(mask_kinds: Any, caps: Capabilities | None) -> list[str]:
    """The checked ``mask_kinds`` argument (None: every kind ``caps`` declares)."""
    allowed = [k for k in MASK_KINDS if caps is None or k in caps.mask_kinds]
    chosen = choices("mask_kinds", mask_kinds, MASK_KINDS, allowed)
    outside = [k for k in chosen if k not in allowed]
    if outside:
        raise fail("mask_kinds", mask_kinds, f"asks for {outside} outside caps.mask_kinds="
                   f"{sorted(caps.mask_kinds)}", "drop them")
    return chosen


def masks(*, B: int, N: int, L: int, S: int, mask_kinds: Sequence[str] | None = None,
          mask_patterns: Sequence[str] | None = None, dtype: str = "float32",
          causal: str | None = None, fully_masked: bool | None = None,
          caps: Capabilities | None = None) -> st.SearchStrategy[MaskDraw]:
    """SDPA masks for a (B, N, L, S) problem, as :class:`MaskDraw`.

    ``mask_kinds`` ⊆ :data:`MASK_KINDS` (default: all that ``caps`` declares):
    none; bool (True = may attend); additive (float: 0/-inf, or a N(0, 1) bias with
    no exact zeros and -inf where blocked). ``mask_patterns`` ⊆ :data:`MASK_PATTERNS`:
    what is blocked (all keys open, random, key padding from lengths, explicit
    causal in both alignments, sliding window). Shapes broadcast to (B, N, L, S):
    (L, S), (1, 1, L, S), (1, S), (B, 1, 1, S), (N, L, S), (B, 1, L, S), (B, N, L, S);
    sometimes flagged :data:`~conformance.core.cases.NOTE_MASK_EXPANDED` (hand it over
    expanded with stride 0). ``fully_masked`` (together with ``causal``, the flag
    the call will also use): True forces at least one query row with every key
    blocked, False forbids it, None allows it (sometimes by construction).
    Shrinks toward no mask, then pattern "all" in shape (L, S), 0/-inf form,
    mask entries from seed 0.
    """
    arguments = dict(locals())
    check_dtype(dtype, caps)
    kinds = mask_kind_choices(mask_kinds, caps)
    patterns = choices("mask_patterns", mask_patterns, MASK_PATTERNS, MASK_PATTERNS)
    for name, value in (("B", B), ("N", N), ("L", L), ("S", S)):
        check_range(name, value, name, value)
    check_bool_or_none("fully_masked", fully_masked)
    if causal is not None and causal not in CAUSAL_ALIGNMENTS:
        raise fail("causal", causal, f"is not None or one of {CAUSAL_ALIGNMENTS}", "pass one of them")
    if fully_masked:
        kinds = [k for k in kinds if k != "none"]
        if not kinds:
            raise fail("mask_kinds", mask_kinds, "allows no mask, so fully_masked=True cannot be met",
                       "allow 'bool' or 'additive', or pass fully_masked=None")
    if fully_masked is False and causal == "lower_right" and L > S:
        raise fail("fully_masked", fully_masked, f"is impossible: causal='lower_right' with "
                   f"L={L} > S={S} blocks the first L - S rows", "pass L <= S or fully_masked=None")
    sizes = {"B": B, "N": N, "L": L, "S": S}

    def draw_one(draw: st.DrawFn) -> MaskDraw:
        return draw_mask(draw, draw_seed(draw), sizes, mask_kinds=kinds, mask_patterns=patterns,
                         dtype=dtype, causal=causal, fully_masked=fully_masked)

    return named_strategy(masks, arguments, draw_one)
