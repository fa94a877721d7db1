"""Hypothesis strategies that draw attention problems: SDPA and MHA cases.

Dimension letters: B batch, N query heads, K kv heads, L query length, S key
length, E q/k head dim, Ev value head dim, D model dim. Bool masks of an
:class:`~conformance.cases.SDPACase` are **True = may attend**; MHA cases keep
``nn.MultiheadAttention``'s convention (bool **True = blocked**, float added).

How the strategies draw:

* Structure (sizes, mask kind and shape, regime, layout, scale, causal) is drawn
  by Hypothesis, each choice ordered so that it shrinks toward the simplest case:
  B = N = K = L = S = 1, small E = Ev, no mask, regime ``"normal"``, layout
  ``"contiguous"``, default scale, no causal flag.
* Array values come from one drawn integer seed fed to a NumPy Generator (never
  element by element): fast, and the seed shrinks to 0.
* Values are drawn in float64 and rounded through the case's dtype (float16 via
  NumPy, bfloat16 via ml_dtypes), so a case holds exactly the values an
  implementation stores.
* When ``caps`` (an :class:`implementations.base.Capabilities`) is given, only
  cases inside its claims are drawn, so nothing is generated and then skipped.
  Arguments that force something the capabilities (or the other arguments) rule
  out raise :class:`hypothesis.errors.InvalidArgument` at once, naming the
  argument as ``name=value`` and the fix.

Notes a case may carry (``case.notes``), read by :mod:`conformance.tensors`:
``"mask:expanded"`` (hand the mask over expanded to (B, N, L, S) with stride 0),
``"stride0:batch"`` / ``"stride0:heads"`` (key/value expanded along that dim with
stride 0; the drawn values are equal along it), plus descriptive labels
``"mask_pattern=..."``, ``"mask_shape=..."``, ``"additive=..."``,
``"fully_masked:forced"``, ``"self_attention"``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Collection, Sequence, TypeVar

import ml_dtypes
import numpy as np
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from conformance.cases import LAYOUTS, MHACase, SDPACase
from implementations.base import (
    ALL_DTYPES,
    ALL_MHA_FEATURES,
    CAUSAL_ALIGNMENTS,
    Capabilities,
)

__all__ = [
    "BLOCK_LENGTHS",
    "MASK_PATTERNS",
    "MASK_SHAPES",
    "MHA_MASK_KINDS",
    "NOTE_MASK_EXPANDED",
    "NOTE_STRIDE0_BATCH",
    "NOTE_STRIDE0_HEADS",
    "REGIMES",
    "SCALE_KINDS",
    "MaskDraw",
    "dtypes",
    "head_configs",
    "layouts",
    "masks",
    "mha_cases",
    "round_to_dtype",
    "scales",
    "sdpa_cases",
    "sdpa_shapes",
    "value_regimes",
]

T = TypeVar("T")

#: Value regimes, simplest first (shrinking goes to "normal").
REGIMES = ("normal", "large_logits", "near_ties", "tiny", "constant_rows", "wide_range", "ascending")
#: Kinds of ``scale``, simplest first: None (1/sqrt(E)), an explicit positive
#: value, 1e-6, a negative value, 0.
SCALE_KINDS = ("default", "positive", "tiny", "negative", "zero")
#: What an SDPA mask blocks (before it is written as bool or additive), simplest first.
MASK_PATTERNS = (
    "all",                 # every key may be attended (the mask is present but blocks nothing)
    "random",              # independent Bernoulli entries
    "padding",             # key padding from per-batch lengths
    "causal_upper_left",   # explicit tril(ones(L, S))
    "causal_lower_right",  # explicit tril(ones(L, S), S - L)
    "sliding_window",      # a band of keys around the (either-aligned) diagonal
)
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
#: Which of B, N, L, S a pattern needs to vary along.
_PATTERN_NEEDS = {
    "all": (False, False, False, False),
    "random": (False, False, False, True),
    "padding": (True, False, False, True),
    "causal_upper_left": (False, False, True, True),
    "causal_lower_right": (False, False, True, True),
    "sliding_window": (False, False, True, True),
}
_PATTERN_WEIGHTS = {"all": 1, "random": 3, "padding": 2, "causal_upper_left": 1,
                    "causal_lower_right": 1, "sliding_window": 1}
#: Lengths around kernel block sizes: ≡ -1, 0, 1 mod 16, 32 and 64.
BLOCK_LENGTHS = (15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65)
_BLOCK_HEAD_DIMS = (31, 32, 33, 48, 63, 64)
#: MHA mask dtypes: "bool" (True = blocked) or "float" (added).
MHA_MASK_KINDS = ("bool", "float")

NOTE_MASK_EXPANDED = "mask:expanded"
NOTE_STRIDE0_BATCH = "stride0:batch"
NOTE_STRIDE0_HEADS = "stride0:heads"
_NOTE_FORCED = "fully_masked:forced"

_SMALL_LENGTH = 12
_SMALL_HEAD_DIM = 16
_DEFAULT_MAX_LENGTH = 65
_DEFAULT_MAX_HEAD_DIM = 64
_SMALL_HEADS = 4
_LARGE_HEADS = (6, 8)

#: Largest |q·k| partial sum (scale included) a float16 case may reach: float16
#: overflows at 65504; leave room for implementations that scale before the dot.
_FLOAT16_DOT_LIMIT = 2.0e4
#: Target max |scale · q·k| of the "large_logits" regime, per dtype.
_LARGE_LOGITS = {"float16": 1.5e4, "bfloat16": 1.0e5, "float32": 1.0e5, "float64": 1.0e6}
#: Magnitude of the "tiny" regime, per dtype (products stay normal numbers).
_TINY = {"float16": 2.0**-6, "bfloat16": 2.0**-30, "float32": 2.0**-30, "float64": 2.0**-100}
#: Spread (powers of two) of the "wide_range" regime across rows and batch items.
_WIDE_EXPONENT = {"float16": 3, "bfloat16": 8, "float32": 8, "float64": 12}
_NUMPY_DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16,
                 "bfloat16": ml_dtypes.bfloat16}
_MAX_SEED = 2**32 - 1


# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------

def round_to_dtype(x: Any, dtype: str) -> np.ndarray:
    """``x`` as float64 holding the nearest values representable in ``dtype``.

    float16 through NumPy, bfloat16 through ml_dtypes; -inf and inf are kept.
    """
    array = np.asarray(x, dtype=np.float64)
    if dtype not in _NUMPY_DTYPES:
        raise InvalidArgument(f"dtype={dtype!r} is not one of {ALL_DTYPES}")
    if dtype == "float64":
        return array.copy()
    with np.errstate(over="ignore"):
        return array.astype(_NUMPY_DTYPES[dtype]).astype(np.float64)


def _fail(name: str, value: Any, why: str, fix: str) -> InvalidArgument:
    return InvalidArgument(f"{name}={value!r} {why}; {fix}")


def _weighted(draw: Any, options: Sequence[tuple[T, int]]) -> T:
    """Draw one option with the given integer weights; shrinks toward the first."""
    options = [(value, weight) for value, weight in options if weight > 0]
    index = draw(st.integers(0, sum(w for _, w in options) - 1))
    for value, weight in options:
        if index < weight:
            return value
        index -= weight
    raise AssertionError("unreachable")


def _draw_seed(draw: Any) -> np.random.Generator:
    return np.random.default_rng(draw(st.integers(0, _MAX_SEED)))


def _check_dtype(dtype: Any, caps: Capabilities | None) -> None:
    if dtype not in ALL_DTYPES:
        raise _fail("dtype", dtype, f"is not one of {ALL_DTYPES}", "pass one of them")
    if caps is not None and dtype not in caps.dtypes:
        raise _fail("dtype", dtype, f"is not in caps.dtypes={caps.dtypes}",
                    "draw only the dtypes the implementation declares")


def _check_device(device: Any, caps: Capabilities | None) -> None:
    if caps is not None and device not in caps.devices:
        raise _fail("device", device, f"is not in caps.devices={caps.devices}",
                    "pass one of the declared devices")


def _check_bool_or_none(name: str, value: Any) -> None:
    if value not in (None, True, False):
        raise _fail(name, value, "must be True, False or None (either)", "pass one of them")


def _check_range(name_min: str, lo: int, name_max: str, hi: int, floor: int = 1) -> None:
    if not isinstance(lo, int) or lo < floor:
        raise _fail(name_min, lo, f"must be an int >= {floor}", f"pass {name_min}>={floor}")
    if not isinstance(hi, int) or hi < lo:
        raise _fail(name_max, hi, f"must be an int >= {name_min}={lo}",
                    f"pass {name_max}>={lo} or lower {name_min}")


def _choices(name: str, value: Any, known: Sequence[str], default: Sequence[str]) -> list[str]:
    """A non-empty sub-sequence of ``known`` (``value=None`` means ``default``), in ``known``'s order."""
    if value is None:
        value = default
    if isinstance(value, str) or not isinstance(value, Collection):
        raise _fail(name, value, "must be a collection of names", f"pass e.g. {name}={tuple(known[:1])!r}")
    unknown = [v for v in value if v not in known]
    if unknown:
        raise _fail(name, value, f"contains unknown {unknown!r}", f"choose from {tuple(known)}")
    chosen = [k for k in known if k in value]
    if not chosen:
        raise _fail(name, value, "is empty", f"pass at least one of {tuple(known)}")
    return chosen


# ---------------------------------------------------------------------------
# sizes
# ---------------------------------------------------------------------------

def dtypes(*, caps: Capabilities | None = None) -> st.SearchStrategy[str]:
    """Dtype names ("float64", "float32", "float16", "bfloat16") the caps declare.

    Shrinks toward the first declared dtype (float64 when declared).
    """
    names = [d for d in ALL_DTYPES if caps is None or d in caps.dtypes]
    if not names:
        raise _fail("caps.dtypes", caps.dtypes if caps else None, "declares no dtype",
                    f"declare at least one of {ALL_DTYPES}")
    return st.sampled_from(names)


def _head_bounds(min_heads: int, max_heads: int, gqa: bool | None) -> tuple[int, int]:
    _check_range("min_heads", min_heads, "max_heads", max_heads)
    _check_bool_or_none("gqa", gqa)
    if gqa and max_heads < 2:
        raise _fail("max_heads", max_heads, "leaves no room for gqa=True (K < N needs N >= 2)",
                    "pass max_heads>=2 or gqa=None")
    return (max(min_heads, 2) if gqa else min_heads), max_heads


def _draw_heads(draw: Any, lo: int, hi: int, gqa: bool | None) -> tuple[int, int]:
    # Mostly 1..4; sometimes 5..8 (6 and 8 a little more often).
    n = _draw_size(draw, lo, hi, _SMALL_HEADS, _LARGE_HEADS, small_weight=8, special_weight=2)
    proper = [k for k in range(n - 1, 0, -1) if n % k == 0]  # largest first
    if gqa is False:
        return n, n
    if gqa:
        return n, draw(st.sampled_from(proper))
    return n, draw(st.sampled_from([n, *proper]))


def head_configs(*, min_heads: int = 1, max_heads: int = 8,
                 gqa: bool | None = None) -> st.SearchStrategy[tuple[int, int]]:
    """(N, K) head counts with N % K == 0.

    ``gqa=False``: K == N; ``gqa=True``: K < N (K a proper divisor of N);
    ``None``: either. N is mostly at most 4, occasionally 6 or 8 when the bounds
    allow. Shrinks toward N = K = min_heads (K toward N, i.e. no grouping).
    """
    lo, hi = _head_bounds(min_heads, max_heads, gqa)

    @st.composite
    def draw_heads(draw: Any) -> tuple[int, int]:
        return _draw_heads(draw, lo, hi, gqa)

    return draw_heads()


@functools.lru_cache(maxsize=512)
def _size_table(lo: int, hi: int, small: int, specials: tuple[int, ...], small_weight: int,
                special_weight: int, others: bool) -> tuple[int, ...]:
    """Sizes in [lo, hi], ascending, each repeated by its weight: the small ones
    (<= ``small``) ``small_weight`` times, ``specials`` ``special_weight`` times,
    other (prime) sizes once when ``others``. Drawing an index into this table is
    weighted toward small sizes yet shrinks monotonically: every step down in the
    index is a step down (or none) in size, so the shrinker walks to the smallest
    size that still fails."""
    table: list[int] = []
    for n in range(lo, hi + 1):
        if n <= small:
            table += [n] * small_weight
        elif n in specials:
            table += [n] * special_weight
        elif others and all(n % d for d in range(2, int(n**0.5) + 1)):
            table.append(n)
    return tuple(table) or tuple(range(lo, hi + 1))


def _draw_size(draw: Any, lo: int, hi: int, small: int, specials: tuple[int, ...], *,
               small_weight: int = 20, special_weight: int = 2, others: bool = True) -> int:
    table = _size_table(lo, hi, small, specials, small_weight, special_weight, others)
    return table[draw(st.integers(0, len(table) - 1))]


def _draw_length(draw: Any, lo: int, hi: int, block_weight: int = 2) -> int:
    """Mostly 1..12; sometimes a block-size neighbour (15, 16, 17, ..., 65) or a prime above 12."""
    return _draw_size(draw, lo, hi, _SMALL_LENGTH, BLOCK_LENGTHS, special_weight=block_weight)


def _draw_head_dim(draw: Any, lo: int, hi: int) -> int:
    """Mostly 1..16; sometimes 31, 32, 33, 48, 63, 64 or a prime above 16."""
    return _draw_size(draw, lo, hi, _SMALL_HEAD_DIM, _BLOCK_HEAD_DIMS)


@dataclass(frozen=True)
class _SizeBounds:
    min_batch: int
    max_batch: int
    min_heads: int
    max_heads: int
    gqa: bool | None
    min_L: int
    max_L: int
    min_S: int
    max_S: int
    min_head_dim: int
    max_head_dim: int
    different_v_dim: bool | None


def _cap_bound(value: int | None, default: int, cap: int | None, *, upper: bool) -> int:
    """A user bound tightened by a capability bound (None: the default, tightened)."""
    bound = default if value is None else value
    if cap is None:
        return bound
    return min(bound, cap) if upper else max(bound, cap)


def _check_capped_range(name_min: str, lo: int, name_max: str, hi: int, given_min: Any,
                        given_max: Any, caps_note: str) -> None:
    """Raise when [lo, hi] (user bounds tightened by the caps) is empty."""
    for name, value in ((name_min, given_min), (name_max, given_max)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise _fail(name, value, "must be an int >= 1", f"pass {name}>=1")
    if hi < lo:
        raise _fail(name_max if given_max is not None else name_min,
                    given_max if given_max is not None else given_min,
                    f"leaves no size: [{name_min}, {name_max}] tightened by {caps_note} is [{lo}, {hi}]",
                    f"choose bounds that overlap {caps_note}")


def _size_bounds(caps: Capabilities | None, *, min_batch: int, max_batch: int,
                 min_heads: int, max_heads: int, gqa: bool | None, min_L: int,
                 max_L: int | None, min_S: int, max_S: int | None,
                 min_head_dim: int | None, max_head_dim: int | None,
                 different_v_dim: bool | None, default_max_length: int = _DEFAULT_MAX_LENGTH,
                 default_max_head_dim: int = _DEFAULT_MAX_HEAD_DIM) -> _SizeBounds:
    _check_range("min_batch", min_batch, "max_batch", max_batch)
    _check_bool_or_none("different_v_dim", different_v_dim)
    _check_bool_or_none("gqa", gqa)
    seq_cap = caps.max_seq_len if caps else None
    seq_note = f"caps.max_seq_len={seq_cap}"
    for name, value in (("min_L", min_L), ("min_S", min_S)):
        _check_capped_range(name, 1, name, 1, value, None, seq_note)
    given_max_L, given_max_S = max_L, max_S
    max_L = _cap_bound(max_L, max(default_max_length, min_L), seq_cap, upper=True)
    max_S = _cap_bound(max_S, max(default_max_length, min_S), seq_cap, upper=True)
    _check_capped_range("min_L", min_L, "max_L", max_L, min_L, given_max_L, seq_note)
    _check_capped_range("min_S", min_S, "max_S", max_S, min_S, given_max_S, seq_note)
    dim_caps = (caps.min_head_dim, caps.max_head_dim) if caps else (None, None)
    lo_dim = _cap_bound(min_head_dim, 1, dim_caps[0], upper=False)
    hi_dim = _cap_bound(max_head_dim, max(default_max_head_dim, lo_dim), dim_caps[1], upper=True)
    _check_capped_range("min_head_dim", lo_dim, "max_head_dim", hi_dim, min_head_dim, max_head_dim,
                        f"caps.min_head_dim={dim_caps[0]}, caps.max_head_dim={dim_caps[1]}")
    if caps is not None and not caps.gqa:
        if gqa:
            raise _fail("gqa", gqa, "but caps.gqa=False", "pass gqa=None or False")
        gqa = False
    if caps is not None and not caps.different_v_dim:
        if different_v_dim:
            raise _fail("different_v_dim", different_v_dim, "but caps.different_v_dim=False",
                        "pass different_v_dim=None or False")
        different_v_dim = False
    if different_v_dim and hi_dim == lo_dim:
        raise _fail("different_v_dim", different_v_dim,
                    f"needs two head dims but min_head_dim=max_head_dim={lo_dim}",
                    "widen the head-dim bounds")
    min_heads, max_heads = _head_bounds(min_heads, max_heads, gqa)
    return _SizeBounds(min_batch, max_batch, min_heads, max_heads, gqa, min_L, max_L,
                       min_S, max_S, lo_dim, hi_dim, different_v_dim)


def _draw_sizes(draw: Any, b: _SizeBounds, *, relation: str | None = None,
                min_batch: int | None = None, block_weight: int = 2) -> dict[str, int]:
    """Sizes B, N, K, L, S, E, Ev; ``relation`` "L>S" or "L<=S" constrains the lengths;
    ``block_weight`` is how often each block-size neighbour comes vs 20 for each small length."""
    length = functools.partial(_draw_length, block_weight=block_weight)
    B = draw(st.integers(max(b.min_batch, min_batch or 1), b.max_batch))
    N, K = _draw_heads(draw, b.min_heads, b.max_heads, b.gqa)
    if relation == "L>S":
        L = length(draw, max(b.min_L, b.min_S + 1), b.max_L)
        S = length(draw, b.min_S, min(b.max_S, L - 1))
    elif relation == "L<=S":
        L = length(draw, b.min_L, min(b.max_L, b.max_S))
        S = length(draw, max(b.min_S, L), b.max_S)
    else:
        L = length(draw, b.min_L, b.max_L)
        S = length(draw, b.min_S, b.max_S)
    E = _draw_head_dim(draw, b.min_head_dim, b.max_head_dim)
    differ = b.different_v_dim
    if differ is None:
        differ = draw(st.booleans())
    Ev = E
    if differ:
        Ev = _draw_head_dim(draw, b.min_head_dim, b.max_head_dim)
        if Ev == E:
            Ev = E + 1 if E < b.max_head_dim else E - 1
    return {"B": B, "N": N, "K": K, "L": L, "S": S, "E": E, "Ev": Ev}


def sdpa_shapes(*, caps: Capabilities | None = None, gqa: bool | None = None,
                different_v_dim: bool | None = None, min_batch: int = 1, max_batch: int = 3,
                min_heads: int = 1, max_heads: int = 8, min_L: int = 1, max_L: int | None = None,
                min_S: int = 1, max_S: int | None = None, min_head_dim: int | None = None,
                max_head_dim: int | None = None) -> st.SearchStrategy[dict[str, int]]:
    """Size dicts ``{"B", "N", "K", "L", "S", "E", "Ev"}`` of SDPA problems.

    Typical sizes are tiny (L, S mostly at most 12, E, Ev mostly at most 16); L and
    S are drawn independently, so L < S and L > S are both common; sometimes a
    length is a block-size neighbour (15, 16, 17, 31, 32, 33, ... 65) or up to
    ``max_L``/``max_S`` (default 65), and a head dim up to 64. ``caps`` bounds
    everything (max_seq_len, min/max_head_dim, gqa, different_v_dim); ``gqa`` and
    ``different_v_dim`` force (True), forbid (False) or allow (None).
    Shrinks toward B = N = K = L = S = 1 and E = Ev = the smallest head dim.
    """
    bounds = _size_bounds(caps, min_batch=min_batch, max_batch=max_batch, min_heads=min_heads,
                          max_heads=max_heads, gqa=gqa, min_L=min_L, max_L=max_L, min_S=min_S,
                          max_S=max_S, min_head_dim=min_head_dim, max_head_dim=max_head_dim,
                          different_v_dim=different_v_dim)

    @st.composite
    def draw_shapes(draw: Any) -> dict[str, int]:
        return _draw_sizes(draw, bounds)

    return draw_shapes()


# ---------------------------------------------------------------------------
# masks
# ---------------------------------------------------------------------------

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


def _pattern(rng: np.random.Generator, pattern: str, shape: tuple[int, int, int, int],
             L: int, S: int) -> np.ndarray:
    """Bool attend pattern of ``shape`` (B|1, N|1, L|1, S|1)."""
    b, n, l, s = shape
    if pattern == "all":
        return np.ones(shape, dtype=bool)
    if pattern == "random":
        keep = rng.uniform(0.4, 0.95)
        return rng.random(shape) < keep
    if pattern == "padding":
        lengths = rng.integers(1, S + 1, size=b)
        return np.broadcast_to((np.arange(S)[None, :] < lengths[:, None])[:, None, None, :], shape).copy()
    rows = np.arange(L)[:, None]
    keys = np.arange(S)[None, :]
    if pattern in ("causal_upper_left", "causal_lower_right"):
        offset = 0 if pattern == "causal_upper_left" else S - L
        band = keys <= rows + offset
    else:  # sliding_window, either alignment, window of 1..S keys
        offset = int(rng.choice([0, S - L]))
        window = int(rng.integers(1, S + 1))
        band = (keys <= rows + offset) & (keys > rows + offset - window)
    return np.broadcast_to(band, shape).copy()


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


def _force_blocked_row(rng: np.random.Generator, pattern: np.ndarray) -> None:
    index = tuple(int(rng.integers(0, d)) for d in pattern.shape[:3])
    pattern[index] = False


def _nonzero_bias(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """N(0, 1) entries pushed away from 0 (|x| >= 0.125), exact in ``dtype``: no
    entry can be mistaken for "not masked" by an implementation that treats a float
    mask as bool."""
    bias = rng.standard_normal(shape)
    bias = np.where(np.abs(bias) < 0.125, np.copysign(0.125, bias) + bias, bias)
    return round_to_dtype(bias, dtype)


def _draw_mask(draw: Any, rng: np.random.Generator, sizes: dict[str, int], *,
               kinds: Sequence[str], patterns: Sequence[str], dtype: str,
               causal: str | None, fully_masked: bool | None) -> MaskDraw:
    B, N, L, S = sizes["B"], sizes["N"], sizes["L"], sizes["S"]
    kind = draw(st.sampled_from(list(kinds)))
    if kind == "none":
        return MaskDraw(None, None, ())
    pattern_name = _weighted(draw, [(p, _PATTERN_WEIGHTS[p]) for p in patterns])
    needs = _PATTERN_NEEDS[pattern_name]
    shape_names = [name for name, (vary, _) in MASK_SHAPES.items()
                   if all(v or not need for v, need in zip(vary, needs))]
    shape_name = draw(st.sampled_from(shape_names))
    vary, ndim = MASK_SHAPES[shape_name]
    shape4 = tuple(size if v else 1 for size, v in zip((B, N, L, S), vary))
    if fully_masked is None:
        force = _weighted(draw, [(False, 3), (True, 1)])
    else:
        force = fully_masked
    form = draw(st.sampled_from(["zero_inf", "bias"])) if kind == "additive" else None
    expanded = shape4 != (B, N, L, S) and _weighted(draw, [(False, 3), (True, 1)])

    pattern = _pattern(rng, pattern_name, shape4, L, S)
    notes = [f"mask_pattern={pattern_name}", f"mask_shape={shape_name}"]
    blocked = _fully_blocked_rows(pattern, L, S, causal)
    if force and not blocked.any():
        _force_blocked_row(rng, pattern)
        notes.append(_NOTE_FORCED)
    elif fully_masked is False and blocked.any():
        # The causal flag never blocks key 0 here (lower-right needs L <= S when
        # fully_masked=False), so opening key 0 unblocks every such row.
        pattern[..., 0:1] |= np.broadcast_to(blocked, pattern[..., 0:1].shape)
    if expanded:
        notes.append(NOTE_MASK_EXPANDED)
    pattern = pattern.reshape(pattern.shape[4 - ndim:])
    if kind == "bool":
        return MaskDraw(pattern, None, tuple(notes))
    notes.append(f"additive={form}")
    values = np.zeros(pattern.shape) if form == "zero_inf" else _nonzero_bias(rng, pattern.shape, dtype)
    return MaskDraw(None, np.where(pattern, values, -np.inf), tuple(notes))


def _mask_kinds(mask_kinds: Any, caps: Capabilities | None) -> list[str]:
    known = ("none", "bool", "additive")
    allowed = [k for k in known if caps is None or k in caps.mask_kinds]
    chosen = _choices("mask_kinds", mask_kinds, known, allowed)
    outside = [k for k in chosen if k not in allowed]
    if outside:
        raise _fail("mask_kinds", mask_kinds, f"asks for {outside} outside caps.mask_kinds="
                    f"{sorted(caps.mask_kinds)}", "drop them")
    return chosen


def masks(*, B: int, N: int, L: int, S: int, kinds: Sequence[str] | None = None,
          patterns: Sequence[str] | None = None, dtype: str = "float32",
          causal: str | None = None, fully_masked: bool | None = None,
          caps: Capabilities | None = None) -> st.SearchStrategy[MaskDraw]:
    """SDPA masks for a (B, N, L, S) problem, as :class:`MaskDraw`.

    ``kinds`` ⊆ {"none", "bool", "additive"} (default: all that ``caps`` declares):
    none; bool (True = may attend); additive (float: 0/-inf, or a N(0, 1) bias with
    no exact zeros and -inf where blocked). ``patterns`` ⊆ :data:`MASK_PATTERNS`:
    what is blocked (all keys open, random, key padding from lengths, explicit
    causal in both alignments, sliding window). Shapes broadcast to (B, N, L, S):
    (L, S), (1, 1, L, S), (1, S), (B, 1, 1, S), (N, L, S), (B, 1, L, S), (B, N, L, S);
    sometimes flagged ``"mask:expanded"`` (hand it over expanded with stride 0).
    ``fully_masked`` (together with ``causal``, the flag the call will also use):
    True forces at least one query row with every key blocked, False forbids it,
    None allows it (sometimes by construction).
    Shrinks toward no mask, then pattern "all" in shape (L, S), 0/-inf form.
    """
    _check_dtype(dtype, caps)
    chosen = _mask_kinds(kinds, caps)
    chosen_patterns = _choices("patterns", patterns, MASK_PATTERNS, MASK_PATTERNS)
    for name, value in (("B", B), ("N", N), ("L", L), ("S", S)):
        _check_range(name, value, name, value)
    _check_bool_or_none("fully_masked", fully_masked)
    if causal is not None and causal not in CAUSAL_ALIGNMENTS:
        raise _fail("causal", causal, f"is not None or one of {CAUSAL_ALIGNMENTS}", "pass one of them")
    if fully_masked:
        chosen = [k for k in chosen if k != "none"]
        if not chosen:
            raise _fail("kinds", kinds, "allows no mask, so fully_masked=True cannot be met",
                        "allow 'bool' or 'additive', or pass fully_masked=None")
    if fully_masked is False and causal == "lower_right" and L > S:
        raise _fail("fully_masked", fully_masked, f"is impossible: causal='lower_right' with "
                    f"L={L} > S={S} blocks the first L - S rows", "pass L <= S or fully_masked=None")

    @st.composite
    def draw_masks(draw: Any) -> MaskDraw:
        rng = _draw_seed(draw)
        sizes = {"B": B, "N": N, "L": L, "S": S}
        return _draw_mask(draw, rng, sizes, kinds=chosen, patterns=chosen_patterns,
                          dtype=dtype, causal=causal, fully_masked=fully_masked)

    return draw_masks()


# ---------------------------------------------------------------------------
# values, scales, layouts
# ---------------------------------------------------------------------------

def value_regimes(*, regimes: Sequence[str] | None = None) -> st.SearchStrategy[str]:
    """Names of value regimes (see :data:`REGIMES`):

    "normal" unit normal; "large_logits" scaled logits near the dtype's safe range
    (float16: every |q·k| partial sum, scale included, below 2e4); "near_ties" keys
    within a few ulps of each other per head; "tiny" every value ~2^-6 (float16) to
    2^-100 (float64); "constant_rows" some heads with all keys / values / queries
    equal along the sequence; "wide_range" row and batch magnitudes spread over
    powers of two; "ascending" logits that grow along the keys for about half the
    queries (the running max of a tiled softmax changes in every key block).
    Shrinks toward "normal".
    """
    return st.sampled_from(_choices("regimes", regimes, REGIMES, REGIMES))


def _scale_kinds(value: Any, caps: Capabilities | None) -> list[str]:
    custom = caps is None or caps.custom_scale
    if value is True:
        return list(SCALE_KINDS) if custom else ["default"]
    if value is False:
        return ["default"]
    chosen = _choices("scales", value, SCALE_KINDS, SCALE_KINDS)
    if not custom and chosen != ["default"]:
        raise _fail("scales", value, "asks for explicit scales but caps.custom_scale=False",
                    "pass scales=False")
    return chosen


def _draw_scale(draw: Any, kinds: Sequence[str], dtype: str) -> float | None:
    weights = {"default": 6, "positive": 2, "tiny": 1, "negative": 1, "zero": 1}
    kind = _weighted(draw, [(k, weights[k]) for k in kinds])
    if kind == "default":
        return None
    if kind == "tiny":
        return 1e-6 if dtype == "float64" else float(np.float32(1e-6))
    if kind == "zero":
        return 0.0
    magnitude = draw(st.one_of(st.sampled_from([0.5, 0.25, 1.0, 0.125, 1.5]),
                               st.floats(0.01, 1.5, allow_nan=False)))
    # Exact in float32, so every implementation sees the same number.
    magnitude = float(np.float32(magnitude)) if dtype != "float64" else magnitude
    return magnitude if kind == "positive" else -magnitude


def scales(*, kinds: Sequence[str] | bool = True, dtype: str = "float64",
           caps: Capabilities | None = None) -> st.SearchStrategy[float | None]:
    """``scale`` arguments: None (default 1/sqrt(E), the most common), an explicit
    positive value in [0.01, 1.5], 1e-6, a negative value, 0.0.

    ``kinds``: True (all that ``caps.custom_scale`` allows), False (None only), or
    a subset of :data:`SCALE_KINDS`. Explicit values are exact in float32 (unless
    ``dtype="float64"``). Shrinks toward None, then 0.5.
    """
    chosen = _scale_kinds(kinds, caps)

    @st.composite
    def draw_scales(draw: Any) -> float | None:
        return _draw_scale(draw, chosen, dtype)

    return draw_scales()


def _layout_choices(value: Any, caps: Capabilities | None) -> list[str]:
    chosen = _choices("layouts", value, LAYOUTS, LAYOUTS)
    if caps is not None and not caps.non_contiguous and chosen != ["contiguous"]:
        raise _fail("layouts", value, "asks for non-contiguous layouts but "
                    "caps.non_contiguous=False", "pass layouts=('contiguous',)")
    return chosen


def layouts(*, allowed: Sequence[str] | None = None,
            caps: Capabilities | None = None) -> st.SearchStrategy[str]:
    """Memory layouts (:data:`conformance.cases.LAYOUTS`): "contiguous",
    "transposed", "stride0", "poisoned", restricted to ``allowed`` and to what
    ``caps.non_contiguous`` allows. Shrinks toward "contiguous"."""
    if allowed is None and caps is not None and not caps.non_contiguous:
        allowed = ("contiguous",)
    return st.sampled_from(_layout_choices(allowed, caps))


# ---------------------------------------------------------------------------
# SDPA values
# ---------------------------------------------------------------------------

def _dot_bound(query: np.ndarray, key: np.ndarray) -> float:
    """max over (b, n, l, s) of sum_e |q||k| (kv heads repeated): bounds every q·k partial sum."""
    group = query.shape[1] // key.shape[1]
    key = np.repeat(np.abs(key), group, axis=1)
    return float(np.max(np.abs(query) @ np.swapaxes(key, -1, -2), initial=0.0))


def _regime_values(rng: np.random.Generator, sizes: dict[str, int], regime: str,
                   dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    B, N, K, L, S, E, Ev = (sizes[d] for d in ("B", "N", "K", "L", "S", "E", "Ev"))
    query = rng.standard_normal((B, N, L, E))
    key = rng.standard_normal((B, K, S, E))
    value = rng.standard_normal((B, K, S, Ev))
    if regime == "near_ties":
        base = key[:, :, :1, :]                                      # (B, K, 1, E)
        eps = np.finfo(np.float32).eps if dtype == "float64" else _ulp(dtype)
        key = base + rng.standard_normal(key.shape) * 4 * eps * np.abs(base)
    elif regime == "tiny":
        query, key, value = (x * _TINY[dtype] for x in (query, key, value))
    elif regime == "constant_rows":
        for b in range(B):
            for h in range(K):
                if rng.random() < 0.5:
                    key[b, h] = key[b, h, :1]
                if rng.random() < 0.5:
                    value[b, h] = value[b, h, :1]
            for h in range(N):
                if rng.random() < 0.5:
                    query[b, h] = query[b, h, :1]
        key[0, 0] = key[0, 0, :1]  # at least one head with uniform weights
    elif regime == "ascending":
        direction = rng.standard_normal((B, K, 1, E))                 # (B, K, 1, E)
        steps = np.linspace(0.0, 3.0, S).reshape(1, 1, S, 1)         # (1, 1, S, 1)
        key = steps * direction + 0.1 * key
    elif regime == "wide_range":
        r = _WIDE_EXPONENT[dtype]
        batch = 2.0 ** rng.integers(-r, r + 1, size=(B, 1, 1, 1))
        query = query * batch * 2.0 ** rng.integers(-r, r + 1, size=(B, N, L, 1))
        key = key * batch * 2.0 ** rng.integers(-r, r + 1, size=(B, K, S, 1))
        value = value * batch * 2.0 ** rng.integers(-r, r + 1, size=(B, K, S, 1))
    return query, key, value


def _ulp(dtype: str) -> float:
    return float(ml_dtypes.finfo(_NUMPY_DTYPES[dtype]).eps)


def _sdpa_values(rng: np.random.Generator, sizes: dict[str, int], regime: str, dtype: str,
                 scale: float | None, stride0_axes: Sequence[int]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    query, key, value = _regime_values(rng, sizes, regime, dtype)
    for axis in stride0_axes:  # K/V equal along the expanded dim
        key = np.broadcast_to(key.take([0], axis=axis), key.shape).copy()
        value = np.broadcast_to(value.take([0], axis=axis), value.shape).copy()
    effective_scale = abs(scale) if scale is not None else 1.0 / math.sqrt(sizes["E"])
    if regime == "large_logits":
        # Aim |scale·q·k| at the dtype's target, with raw q·k kept finite (a zero or
        # tiny scale would otherwise ask for astronomically large q and k).
        target = _LARGE_LOGITS[dtype] / (effective_scale or 1.0)
        limit = _FLOAT16_DOT_LIMIT / max(1.0, effective_scale) if dtype == "float16" else 1e12
        bound = _dot_bound(query, key)
        if bound > 0:
            factor = math.sqrt(min(target, limit) / bound)
            query, key = query * factor, key * factor
    query, key, value = (round_to_dtype(x, dtype) for x in (query, key, value))
    if dtype == "float16":
        # Every partial sum of q·k (and of scale·q·k) must stay finite in float16.
        limit = _FLOAT16_DOT_LIMIT / max(1.0, effective_scale)
        for _ in range(8):
            bound = _dot_bound(query, key)
            if bound <= limit:
                break
            factor = math.sqrt(limit / bound) * 0.95
            query, key = round_to_dtype(query * factor, dtype), round_to_dtype(key * factor, dtype)
    return query, key, value


# ---------------------------------------------------------------------------
# SDPA cases
# ---------------------------------------------------------------------------

def _causal_choices(causal: Any, caps: Capabilities | None) -> list[str | None]:
    if caps is None:
        allowed: list[str | None] = [None, *CAUSAL_ALIGNMENTS]
    else:
        allowed = [None] + ([caps.causal] if caps.causal else [])
    if causal is None:
        return allowed
    if isinstance(causal, str) or not isinstance(causal, Collection) or not causal:
        raise _fail("causal", causal, "must be None or a non-empty collection of None / "
                    f"alignments {CAUSAL_ALIGNMENTS}", "pass e.g. causal=('upper_left',)")
    known = [None, *CAUSAL_ALIGNMENTS]
    unknown = [c for c in causal if c not in known]
    if unknown:
        raise _fail("causal", causal, f"contains unknown {unknown!r}", f"choose from {known}")
    outside = [c for c in causal if c not in allowed]
    if outside:
        raise _fail("causal", causal, f"asks for {outside} but caps.causal="
                    f"{caps.causal!r} (the alignment is_causal=True means)",
                    f"pass causal=(None, {caps.causal!r})" if caps.causal else "pass causal=(None,)")
    return [c for c in known if c in causal]


def sdpa_cases(
    *,
    dtype: str,
    device: str = "cpu",
    caps: Capabilities | None = None,
    mask_kinds: Sequence[str] | None = None,
    mask_patterns: Sequence[str] | None = None,
    causal: Sequence[str | None] | None = None,
    gqa: bool | None = None,
    different_v_dim: bool | None = None,
    regimes: Sequence[str] | None = None,
    layouts: Sequence[str] = ("contiguous",),
    scales: Sequence[str] | bool = True,
    fully_masked: bool | None = None,
    min_batch: int = 1,
    max_batch: int = 3,
    min_heads: int = 1,
    max_heads: int = 8,
    min_L: int = 1,
    max_L: int | None = None,
    min_S: int = 1,
    max_S: int | None = None,
    min_head_dim: int | None = None,
    max_head_dim: int | None = None,
) -> st.SearchStrategy[SDPACase]:
    """:class:`~conformance.cases.SDPACase` problems inside ``caps``.

    Forcing arguments (each a collection allows exactly its members; None allows
    everything ``caps`` declares):

    * ``mask_kinds`` ⊆ {"none", "bool", "additive"}; ``mask_patterns`` ⊆
      :data:`MASK_PATTERNS` (see :func:`masks` for shapes and forms);
    * ``causal``: alignments the case's ``causal`` field may hold, e.g.
      ``("upper_left",)`` forces a causal case, ``(None,)`` forbids one; a mask may
      come with it (both then apply); an alignment other than ``caps.causal`` raises;
    * ``gqa`` / ``different_v_dim``: True forces K < N / Ev != E, False forbids;
    * ``regimes`` ⊆ :data:`REGIMES`; ``layouts`` ⊆ :data:`~conformance.cases.LAYOUTS`
      (default contiguous only; "stride0" draws B >= 2 and K/V equal along the
      expanded batch (and sometimes kv-head) dim; non-contiguous cases get
      block-size-neighbour lengths more often); ``scales`` True / False /
      subset of :data:`SCALE_KINDS`;
    * ``fully_masked``: True forces at least one query row with every key blocked
      (by the mask, or by a lower-right causal flag with L > S when no mask is
      allowed), False forbids such rows (a lower-right causal case then has
      L <= S), None allows them (and sometimes builds one);
    * size bounds ``min_/max_batch``, ``min_/max_heads``, ``min_/max_L``,
      ``min_/max_S``, ``min_/max_head_dim`` (defaults from ``caps``; tiny typical
      sizes, see :func:`sdpa_shapes`).

    Values: a drawn seed feeds a NumPy Generator; arrays are drawn in float64 and
    rounded through ``dtype``. Shrinks toward B = N = K = L = S = 1, small E = Ev,
    no mask, no causal flag, regime "normal", layout "contiguous", default scale,
    seed 0.
    """
    _check_dtype(dtype, caps)
    _check_device(device, caps)
    _check_bool_or_none("fully_masked", fully_masked)
    kinds = _mask_kinds(mask_kinds, caps)
    patterns = _choices("mask_patterns", mask_patterns, MASK_PATTERNS, MASK_PATTERNS)
    causal_options = _causal_choices(causal, caps)
    regime_options = _choices("regimes", regimes, REGIMES, REGIMES)
    layout_options = _layout_choices(layouts, caps)
    scale_options = _scale_kinds(scales, caps)
    bounds = _size_bounds(caps, min_batch=min_batch, max_batch=max_batch, min_heads=min_heads,
                          max_heads=max_heads, gqa=gqa, min_L=min_L, max_L=max_L, min_S=min_S,
                          max_S=max_S, min_head_dim=min_head_dim, max_head_dim=max_head_dim,
                          different_v_dim=different_v_dim)
    if "stride0" in layout_options and bounds.max_batch < 2:
        raise _fail("max_batch", max_batch, "leaves no batch dim to expand for layout 'stride0'",
                    "pass max_batch>=2 or drop 'stride0' from layouts")
    l_gt_s_possible = bounds.max_L > bounds.min_S
    l_le_s_possible = bounds.min_L <= bounds.max_S
    if fully_masked:
        if "none" in kinds and len(kinds) > 1:
            kinds = [k for k in kinds if k != "none"]
        elif kinds == ["none"]:
            if "lower_right" not in causal_options or not l_gt_s_possible:
                raise _fail("fully_masked", fully_masked, f"cannot be met with mask_kinds={kinds} "
                            f"and causal options {causal_options} (and L > S possible: "
                            f"{l_gt_s_possible})", "allow a 'bool' or 'additive' mask, "
                            "or causal=('lower_right',) with max_L > min_S")
            causal_options = ["lower_right"]
    if fully_masked is False and not l_le_s_possible:
        causal_options = [c for c in causal_options if c != "lower_right"]
        if not causal_options:
            raise _fail("fully_masked", fully_masked, "is impossible: causal='lower_right' with "
                        "every L > S blocks rows", "pass max_S>=min_L or fully_masked=None")
    if fully_masked is None and "lower_right" in causal_options and not l_le_s_possible:
        pass  # fine: rows may be fully masked

    @st.composite
    def draw_case(draw: Any) -> SDPACase:
        layout = draw(st.sampled_from(layout_options))
        regime = draw(st.sampled_from(regime_options))
        scale = _draw_scale(draw, scale_options, dtype)
        causal_value = draw(st.sampled_from(causal_options))
        kind_options = kinds
        relation = None
        if causal_value == "lower_right":
            if fully_masked is False:
                relation = "L<=S"
            elif fully_masked and kinds == ["none"]:
                relation = "L>S"
        # Kernel bugs live at block boundaries (docs/KNOWN_BUGS.md #9): every case sees
        # block-size neighbours (15..17, 31..33, 63..65) about one time in seven,
        # non-contiguous and "ascending" cases about a quarter of the time.
        boundary_heavy = layout != "contiguous" or regime == "ascending"
        sizes = _draw_sizes(draw, bounds, relation=relation,
                            min_batch=2 if layout == "stride0" else None,
                            block_weight=8 if boundary_heavy else 4)
        rng = _draw_seed(draw)
        mask = _draw_mask(draw, rng, sizes, kinds=kind_options, patterns=patterns, dtype=dtype,
                          causal=causal_value, fully_masked=fully_masked)
        notes = list(mask.notes)
        stride0_axes: list[int] = []
        if layout == "stride0":
            stride0_axes.append(0)
            notes.append(NOTE_STRIDE0_BATCH)
            if sizes["K"] > 1 and draw(st.booleans()):
                stride0_axes.append(1)
                notes.append(NOTE_STRIDE0_HEADS)
        query, key, value = _sdpa_values(rng, sizes, regime, dtype, scale, stride0_axes)
        return SDPACase(query=query, key=key, value=value, attend_mask=mask.attend_mask,
                        additive_mask=mask.additive_mask, causal=causal_value, scale=scale,
                        dtype=dtype, device=device, layout=layout, regime=regime,
                        notes=tuple(notes))

    return draw_case()


# ---------------------------------------------------------------------------
# MHA cases
# ---------------------------------------------------------------------------

#: Features a case turns on by a drawn boolean (the rest follow from other draws).
_MHA_TOGGLES = ("bias", "kdim_vdim", "bias_kv", "zero_attn", "batch_first", "unbatched",
                "key_padding_mask", "attn_mask")


def _mha_features(caps: Capabilities | None, features: Any, required: Any) -> tuple[set[str], set[str]]:
    declared = set(caps.mha_features) if caps is not None else set(ALL_MHA_FEATURES)
    if features is None:
        allowed = declared
    else:
        if isinstance(features, str) or not isinstance(features, Collection):
            raise _fail("features", features, "must be a collection of MHA feature names",
                        "pass e.g. features={'need_weights'} (or an empty set for none)")
        allowed = set(features)
        if allowed - ALL_MHA_FEATURES:
            raise _fail("features", features, f"has unknown {sorted(allowed - ALL_MHA_FEATURES)}",
                        f"choose from {sorted(ALL_MHA_FEATURES)}")
        if allowed - declared:
            raise _fail("features", features, f"has {sorted(allowed - declared)} outside "
                        f"caps.mha_features", "drop them")
    required = set(required or ())
    unknown = required - ALL_MHA_FEATURES
    if unknown:
        raise _fail("required_features", sorted(required), f"has unknown {sorted(unknown)}",
                    f"choose from {sorted(ALL_MHA_FEATURES)}")
    if required - allowed:
        raise _fail("required_features", sorted(required), f"needs {sorted(required - allowed)} "
                    "which features/caps.mha_features do not allow", "allow them or drop them")
    if "dropout" in required:
        raise _fail("required_features", sorted(required), "contains 'dropout', which cases do "
                    "not carry (the runner sets the module's dropout)", "drop 'dropout'")
    return allowed, required


def _resolve_flag(name: str, value: Any, feature: str, allowed: set[str], required: set[str],
                  *, on_means_feature: bool = True) -> bool | None:
    """A forward flag forced by argument or feature set; None = draw it."""
    _check_bool_or_none(name, value)
    uses = value if on_means_feature else (None if value is None else not value)
    if uses and feature not in allowed:
        raise _fail(name, value, f"needs feature {feature!r}, not allowed by features/caps",
                    f"pass {name}=None")
    if uses is False and feature in required:
        raise _fail(name, value, f"contradicts required_features containing {feature!r}",
                    "drop one of them")
    if uses is None:
        if feature in required:
            uses = True
        elif feature not in allowed:
            uses = False
    if uses is None:
        return None
    return uses if on_means_feature else not uses


def _mha_mask(rng: np.random.Generator, blocked: np.ndarray, kind: str, dtype: str,
              bias: bool) -> np.ndarray:
    """``blocked`` (True = blocked) in MHA convention: bool as is, float 0 / bias and -inf."""
    if kind == "bool":
        return blocked
    values = _nonzero_bias(rng, blocked.shape, dtype) if bias else np.zeros(blocked.shape)
    return np.where(blocked, -np.inf, values)


def mha_cases(
    *,
    dtype: str,
    device: str = "cpu",
    caps: Capabilities | None = None,
    features: Collection[str] | None = None,
    required_features: Collection[str] = (),
    need_weights: bool | None = None,
    average_attn_weights: bool | None = None,
    is_causal: bool | None = None,
    mask_kinds: Sequence[str] | None = None,
    fully_masked: bool | None = None,
    self_attention: bool | None = None,
    min_batch: int = 1,
    max_batch: int = 3,
    min_heads: int = 1,
    max_heads: int = 4,
    min_head_dim: int | None = None,
    max_head_dim: int | None = None,
    min_L: int = 1,
    max_L: int | None = None,
    min_S: int = 1,
    max_S: int | None = None,
) -> st.SearchStrategy[MHACase]:
    """:class:`~conformance.cases.MHACase` problems: an ``nn.MultiheadAttention``
    call with ``spec.MHAParams.random`` weights, every array exact in ``dtype``.

    D = N * E with N <= 4 and E <= 8 by default. Features used come only from
    ``features`` (default: ``caps.mha_features``); each of bias=False, kdim/vdim,
    add_bias_kv, add_zero_attn, batch_first, unbatched, key_padding_mask and
    attn_mask is drawn on or off unless ``required_features`` forces it on.
    ``need_weights``, ``average_attn_weights``, ``is_causal``: True/False force,
    None draws (within the features). ``is_causal=True`` carries attn_mask = the
    upper-left causal mask (True = blocked / 0 and -inf) as torch requires.
    ``mask_kinds`` ⊆ {"bool", "float"}: the type of both masks (bool True = blocked;
    float: key_padding_mask 0/-inf, attn_mask 0 or a no-zero bias, -inf blocked),
    shapes key_padding_mask (B, S) ((S,) unbatched), attn_mask (L, S) or (B*N, L, S).
    ``fully_masked``: True forces a query row with every key blocked (then no
    bias_kv/zero_attn), False forbids, None allows. ``self_attention``: True passes
    the same array as query, key and value (kdim = vdim = D, S = L; the module's
    fast path needs it), False never, None sometimes.
    Shrinks toward B = N = 1, small E, L = S = 1, default options, no masks,
    need_weights as allowed, seed 0.
    """
    _check_dtype(dtype, caps)
    _check_device(device, caps)
    _check_bool_or_none("fully_masked", fully_masked)
    _check_bool_or_none("self_attention", self_attention)
    allowed, required = _mha_features(caps, features, required_features)
    kinds = _choices("mask_kinds", mask_kinds, MHA_MASK_KINDS, MHA_MASK_KINDS)
    need = _resolve_flag("need_weights", need_weights, "need_weights", allowed, required)
    average = _resolve_flag("average_attn_weights", average_attn_weights, "average_weights",
                            allowed, required, on_means_feature=False)
    causal = _resolve_flag("is_causal", is_causal, "is_causal", allowed, required)
    if causal and "attn_mask" not in allowed:
        raise _fail("is_causal", is_causal, "needs feature 'attn_mask' (torch wants the causal "
                    "mask passed along)", "allow 'attn_mask' or pass is_causal=None")
    if causal is None and "attn_mask" not in allowed:
        causal = False
    toggles: dict[str, bool | None] = {}
    for feature in _MHA_TOGGLES:
        toggles[feature] = True if feature in required else (None if feature in allowed else False)
    if causal:
        toggles["attn_mask"] = True
    if self_attention:
        if "kdim_vdim" in required:
            raise _fail("self_attention", self_attention, "needs kdim = vdim = D but "
                        "required_features has 'kdim_vdim'", "drop one of them")
        toggles["kdim_vdim"] = False
    if fully_masked:
        for feature in ("bias_kv", "zero_attn"):
            if feature in required:
                raise _fail("fully_masked", fully_masked, f"is impossible with required feature "
                            f"{feature!r} (it adds a key no mask blocks)", "drop one of them")
            toggles[feature] = False
        if toggles["key_padding_mask"] is False and (toggles["attn_mask"] is False or causal):
            raise _fail("fully_masked", fully_masked, "needs a key_padding_mask, or a non-causal "
                        "attn_mask, allowed by features/caps", "allow one or pass fully_masked=None")
    _check_range("min_batch", min_batch, "max_batch", max_batch)
    _check_range("min_heads", min_heads, "max_heads", max_heads)
    bounds = _size_bounds(caps, min_batch=min_batch, max_batch=max_batch, min_heads=min_heads,
                          max_heads=max_heads, gqa=False, min_L=min_L, max_L=max_L, min_S=min_S,
                          max_S=max_S, min_head_dim=min_head_dim, max_head_dim=max_head_dim,
                          different_v_dim=False, default_max_length=16, default_max_head_dim=8)
    if toggles["unbatched"] and bounds.min_batch > 1:
        raise _fail("min_batch", min_batch, "contradicts a required 'unbatched' (B = 1)",
                    "pass min_batch=1")
    if toggles["unbatched"] is None and bounds.min_batch > 1:
        toggles["unbatched"] = False
    if self_attention and bounds.min_L > bounds.max_S or self_attention and bounds.min_S > bounds.max_L:
        raise _fail("self_attention", self_attention, "needs S = L but the length bounds "
                    "do not overlap", "widen min_L/max_L/min_S/max_S")

    @st.composite
    def draw_case(draw: Any) -> MHACase:
        on = {f: (draw(st.booleans()) if v is None else v) for f, v in toggles.items()}
        is_causal_value = draw(st.booleans()) if causal is None else causal
        if is_causal_value:
            on["attn_mask"] = True
        if fully_masked and not on["key_padding_mask"] and (is_causal_value or not on["attn_mask"]):
            if toggles["key_padding_mask"] is not False:
                on["key_padding_mask"] = True
            else:  # validated: a non-causal attn_mask is allowed
                on["attn_mask"], is_causal_value = True, False
        need_value = draw(st.booleans()) if need is None else need
        # Shrinks toward the default average_attn_weights=True.
        average_value = (not draw(st.booleans())) if average is None else average
        kind = draw(st.sampled_from(kinds))

        sizes = _draw_sizes(draw, bounds)
        N, E, L, S = sizes["N"], sizes["E"], sizes["L"], sizes["S"]
        B = 1 if on["unbatched"] else sizes["B"]
        D = N * E
        kdim = vdim = D
        if on["kdim_vdim"]:
            kdim = draw(st.integers(1, 12))
            vdim = draw(st.integers(1, 12))
            if kdim == D and vdim == D:
                kdim = D + 1
        same = False
        if kdim == D and vdim == D and self_attention is not False:
            lo, hi = max(bounds.min_L, bounds.min_S), min(bounds.max_L, bounds.max_S)
            if lo <= hi:
                same = True if self_attention else draw(st.booleans())
                if same:
                    L = S = min(max(L, lo), hi)
        rng = _draw_seed(draw)

        from spec import MHAParams

        params = MHAParams.random(rng, D, N, bias=not on["bias"], add_bias_kv=on["bias_kv"],
                                  add_zero_attn=on["zero_attn"],
                                  kdim=kdim if on["kdim_vdim"] else None,
                                  vdim=vdim if on["kdim_vdim"] else None)
        params = _round_params(params, dtype)

        def inputs(length: int, dim: int) -> np.ndarray:
            if on["unbatched"]:
                shape: tuple[int, ...] = (length, dim)
            elif on["batch_first"]:
                shape = (B, length, dim)
            else:
                shape = (length, B, dim)
            return round_to_dtype(rng.standard_normal(shape), dtype)

        query = inputs(L, D)
        if same:
            key = value = query
        else:
            key, value = inputs(S, kdim), inputs(S, vdim)

        notes: list[str] = ["self_attention"] if same else []
        kpm_blocked = attn_blocked = None
        if on["key_padding_mask"]:
            lengths = rng.integers(1, S + 1, size=B)
            kpm_blocked = np.arange(S)[None, :] >= lengths[:, None]                 # (B, S)
        if is_causal_value:
            attn_blocked = np.triu(np.ones((L, S), dtype=bool), k=1)                # upper-left
        elif on["attn_mask"]:
            per_head = draw(st.booleans())
            shape = (B * N, L, S) if per_head else (L, S)
            attn_blocked = rng.random(shape) < rng.uniform(0.05, 0.6)
        kpm_blocked, attn_blocked = _mha_fully_masked(
            draw, rng, kpm_blocked, attn_blocked, B=B, N=N, L=L, S=S,
            extra_key=on["bias_kv"] or on["zero_attn"], causal=is_causal_value,
            fully_masked=fully_masked, notes=notes)
        key_padding_mask = attn_mask = None
        if kpm_blocked is not None:
            if on["unbatched"]:
                kpm_blocked = kpm_blocked[0]                                        # (S,)
            key_padding_mask = _mha_mask(rng, kpm_blocked, kind, dtype, bias=False)
        if attn_blocked is not None:
            if on["unbatched"] and attn_blocked.ndim == 3:
                attn_blocked = attn_blocked.reshape(N, L, S)
            bias = not is_causal_value and draw(st.booleans())
            attn_mask = _mha_mask(rng, attn_blocked, kind, dtype, bias=bias)
        return MHACase(params=params, query=query, key=key, value=value,
                       key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                       is_causal=is_causal_value, need_weights=need_value,
                       average_attn_weights=average_value, batch_first=on["batch_first"],
                       unbatched=on["unbatched"], dtype=dtype, device=device, notes=tuple(notes))

    return draw_case()


def _mha_fully_masked(draw: Any, rng: np.random.Generator, kpm: np.ndarray | None,
                      attn: np.ndarray | None, *, B: int, N: int, L: int, S: int,
                      extra_key: bool, causal: bool, fully_masked: bool | None,
                      notes: list[str]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Force, forbid or leave fully-masked rows (True = blocked masks, (B, S) and
    (L, S) / (B*N, L, S)); bias_kv / zero_attn keys are never blocked."""
    if kpm is None and attn is None:
        return kpm, attn
    blocked = np.zeros((B, N, L, S), dtype=bool)
    if kpm is not None:
        blocked |= kpm.reshape(B, 1, 1, S)
    if attn is not None:
        blocked |= attn.reshape((B, N, L, S) if attn.ndim == 3 else (1, 1, L, S))
    has_rows = bool(blocked.all(axis=-1).any()) and not extra_key
    force = fully_masked
    if fully_masked is None:
        force = not extra_key and _weighted(draw, [(False, 3), (True, 1)])
    if force and not has_rows and (kpm is not None or not causal):
        if kpm is not None:
            kpm = kpm.copy()
            kpm[int(rng.integers(0, B))] = True                     # a batch item sees no key
        else:
            attn = attn.copy()
            head = (int(rng.integers(0, attn.shape[0])),) if attn.ndim == 3 else ()
            attn[head + (int(rng.integers(0, L)),)] = True          # one query row sees no key
        notes.append(_NOTE_FORCED)
    elif fully_masked is False and has_rows:
        # Key 0 is never blocked by the upper-left causal mask: open it everywhere.
        if kpm is not None:
            kpm = kpm.copy()
            kpm[:, 0] = False
        if attn is not None and not causal:
            attn = attn.copy()
            attn[..., 0] = False
    return kpm, attn


def _round_params(params: Any, dtype: str) -> Any:
    changes = {f.name: round_to_dtype(getattr(params, f.name), dtype)
               for f in dataclasses.fields(params)
               if isinstance(getattr(params, f.name), np.ndarray)}
    return dataclasses.replace(params, **changes)
