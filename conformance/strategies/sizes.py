"""Sizes of attention problems: dtypes, head counts, lengths and head dims.

Typical sizes are tiny (lengths mostly at most 12, head dims mostly at most 16),
with block-size neighbours and primes mixed in. Every size is an index into a
weighted table of ascending sizes, so it shrinks monotonically toward the
smallest allowed size.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from hypothesis import strategies as st

from conformance.strategies._drawing import named_strategy
from conformance.strategies._validation import (
    check_bool_or_none,
    check_capped_range,
    check_range,
    fail,
)
from implementations.base import ALL_DTYPES, Capabilities
from implementations.capabilities import draw_length_cap

__all__ = ["BLOCK_LENGTHS", "LENGTH_RELATIONS", "SeededDraw", "dtypes", "head_configs", "sdpa_shapes"]

#: Lengths around kernel block sizes: ≡ -1, 0, 1 mod 16, 32 and 64.
BLOCK_LENGTHS = (15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65)
_BLOCK_HEAD_DIMS = (31, 32, 33, 48, 63, 64)
#: Head dims of real kernels above 64 and their tile edges, drawn more often than other
#: sizes only where a declared min_head_dim above 16 widens the range (the default draws
#: are unchanged by them).
_LARGE_HEAD_DIMS = (65, 80, 96, 127, 128, 129, 160, 192, 255, 256)

_SMALL_LENGTH = 12
_SMALL_HEAD_DIM = 16
_DEFAULT_MAX_LENGTH = 65
_DEFAULT_MAX_HEAD_DIM = 64
_SMALL_HEADS = 4
_LARGE_HEADS = (6, 8)

T = TypeVar("T")


def dtypes(*, caps: Capabilities | None = None) -> st.SearchStrategy[str]:
    """Dtype names ("float64", "float32", "float16", "bfloat16") the caps declare.

    Shrinks toward the first declared dtype (float64 when declared).
    """
    arguments = dict(locals())
    names = [d for d in ALL_DTYPES if caps is None or d in caps.dtypes]
    if not names:
        raise fail("caps.dtypes", caps.dtypes if caps else None, "declares no dtype",
                   f"declare at least one of {ALL_DTYPES}")
    return named_strategy(dtypes, arguments, lambda draw: draw(st.sampled_from(names)))


# ---------------------------------------------------------------------------
# the three kinds of choice, from Hypothesis or from a seed
# ---------------------------------------------------------------------------

class SeededDraw:
    """Stands in for Hypothesis's ``draw`` in the size helpers below when sizes are
    drawn outside a test (a shape budget's shapes, drawn once per strategy): each
    choice comes from ``rng``, or is the one Hypothesis shrinks to (the lower bound,
    the first option, False) when ``rng`` is None."""

    def __init__(self, rng: np.random.Generator | None) -> None:
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return lo if self.rng is None else int(self.rng.integers(lo, hi + 1))

    def element(self, options: list[T]) -> T:
        return options[0] if self.rng is None else options[int(self.rng.integers(len(options)))]

    def boolean(self) -> bool:
        return False if self.rng is None else bool(self.rng.integers(2))


Draw = st.DrawFn | SeededDraw


def _integer(draw: Draw, lo: int, hi: int) -> int:
    return draw.integer(lo, hi) if isinstance(draw, SeededDraw) else draw(st.integers(lo, hi))


def _element(draw: Draw, options: list[T]) -> T:
    return draw.element(options) if isinstance(draw, SeededDraw) else draw(st.sampled_from(options))


def _boolean(draw: Draw) -> bool:
    return draw.boolean() if isinstance(draw, SeededDraw) else draw(st.booleans())


# ---------------------------------------------------------------------------
# head counts
# ---------------------------------------------------------------------------

def head_bounds(min_heads: int, max_heads: int, gqa: bool | None) -> tuple[int, int]:
    """Checked [min_heads, max_heads], raised to N >= 2 when ``gqa`` forces K < N."""
    check_range("min_heads", min_heads, "max_heads", max_heads)
    check_bool_or_none("gqa", gqa)
    if gqa and max_heads < 2:
        raise fail("max_heads", max_heads, "leaves no room for gqa=True (K < N needs N >= 2)",
                   "pass max_heads>=2 or gqa=None")
    return (max(min_heads, 2) if gqa else min_heads), max_heads


def draw_heads(draw: Draw, lo: int, hi: int, gqa: bool | None) -> tuple[int, int]:
    """(N, K): N in [lo, hi], K a divisor of N as ``gqa`` asks."""
    # Mostly 1..4; sometimes 5..8 (6 and 8 a little more often).
    n = draw_size(draw, lo, hi, _SMALL_HEADS, _LARGE_HEADS, small_weight=8, special_weight=2)
    proper = [k for k in range(n - 1, 0, -1) if n % k == 0]  # largest first
    if gqa is False:
        return n, n
    if gqa:
        return n, _element(draw, proper)
    return n, _element(draw, [n, *proper])


def head_configs(*, min_heads: int = 1, max_heads: int = 8,
                 gqa: bool | None = None) -> st.SearchStrategy[tuple[int, int]]:
    """(N, K) head counts with N % K == 0.

    ``gqa=False``: K == N; ``gqa=True``: K < N (K a proper divisor of N);
    ``None``: either. N is mostly at most 4, occasionally 6 or 8 when the bounds
    allow. Shrinks toward N = K = min_heads (K toward N, i.e. no grouping).
    """
    arguments = dict(locals())
    lo, hi = head_bounds(min_heads, max_heads, gqa)
    return named_strategy(head_configs, arguments, lambda draw: draw_heads(draw, lo, hi, gqa))


# ---------------------------------------------------------------------------
# lengths and head dims
# ---------------------------------------------------------------------------

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


def draw_size(draw: Draw, lo: int, hi: int, small: int, specials: tuple[int, ...], *,
              small_weight: int = 20, special_weight: int = 2, others: bool = True) -> int:
    table = _size_table(lo, hi, small, specials, small_weight, special_weight, others)
    return table[_integer(draw, 0, len(table) - 1)]


def _draw_length(draw: Draw, lo: int, hi: int, block_weight: int = 2) -> int:
    """Mostly 1..12; sometimes a block-size neighbour (15, 16, 17, ..., 65) or a prime above 12."""
    return draw_size(draw, lo, hi, _SMALL_LENGTH, BLOCK_LENGTHS, special_weight=block_weight)


def _draw_head_dim(draw: Draw, lo: int, hi: int) -> int:
    """Mostly 1..16; sometimes 31, 32, 33, 48, 63, 64 (and 65, 80, 96, 127-129, 160, 192,
    255, 256 when the lower bound is above 16) or a prime above 16."""
    specials = _BLOCK_HEAD_DIMS + _LARGE_HEAD_DIMS if lo > _SMALL_HEAD_DIM else _BLOCK_HEAD_DIMS
    return draw_size(draw, lo, hi, _SMALL_HEAD_DIM, specials)


# ---------------------------------------------------------------------------
# bounds of a whole problem
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class SizeBounds:
    """Checked size bounds of a problem (user bounds tightened by the caps)."""

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
    #: L == S in every problem (``Capabilities.self_attention_lengths``).
    equal_lengths: bool = False
    #: L and S multiples of this (``Capabilities.seq_multiple``): drawn in blocks.
    seq_multiple: int = 1
    #: E and Ev drawn from these (``Capabilities.head_dims`` inside the bounds), or any.
    head_dims: tuple[int, ...] | None = None

    def in_blocks(self) -> "SizeBounds":
        """The length bounds counted in blocks of ``seq_multiple`` (L, S = blocks x it)."""
        m = self.seq_multiple
        return dataclasses.replace(self, min_L=-(-self.min_L // m), max_L=self.max_L // m,
                                   min_S=-(-self.min_S // m), max_S=self.max_S // m, seq_multiple=1)


def _cap_bound(value: int | None, default: int, cap: int | None, *, upper: bool) -> int:
    """A user bound tightened by a capability bound (None: the default, tightened)."""
    bound = default if value is None else value
    if cap is None:
        return bound
    return min(bound, cap) if upper else max(bound, cap)


def _length_bounds(caps: Capabilities | None, min_L: int, max_L: int | None, min_S: int,
                   max_S: int | None, default_max: int) -> tuple[int, int]:
    """Checked (max_L, max_S): the user's, or the default, tightened by caps.max_seq_len
    and, for ``caps.seq_block`` (any length up to the block, multiples beyond), by the
    block: random draws stay inside one block (the sweeps visit the multiples)."""
    seq_cap = draw_length_cap(caps) if caps else None
    seq_note = f"caps.max_seq_len={caps.max_seq_len}" if caps else "caps.max_seq_len=None"
    if caps is not None and getattr(caps, "seq_block", None):
        seq_note += f", caps.seq_block={caps.seq_block}"
    for name, value in (("min_L", min_L), ("min_S", min_S)):
        check_capped_range(name, 1, name, 1, value, None, seq_note)
    # Lengths a multiple m of a block: at least two blocks' room (L < S and L > S), within
    # max_seq_len; the user's bounds are widened to it.
    m = (caps.seq_multiple if caps else None) or 1
    if m > 1:
        max_L, max_S = (None if bound is None else max(bound, 2 * m) for bound in (max_L, max_S))
        default_max = max(default_max, 2 * m)
    hi_L = _cap_bound(max_L, max(default_max, min_L), seq_cap, upper=True)
    hi_S = _cap_bound(max_S, max(default_max, min_S), seq_cap, upper=True)
    check_capped_range("min_L", min_L, "max_L", hi_L, min_L, max_L, seq_note)
    check_capped_range("min_S", min_S, "max_S", hi_S, min_S, max_S, seq_note)
    return hi_L, hi_S


def _head_dim_bounds(caps: Capabilities | None, min_head_dim: int | None,
                     max_head_dim: int | None, default_max: int) -> tuple[int, int]:
    """Checked (min, max) head dim: the user's, or the defaults, tightened by the caps."""
    dim_caps = (caps.min_head_dim, caps.max_head_dim) if caps else (None, None)
    lo = _cap_bound(min_head_dim, 1, dim_caps[0], upper=False)
    # A declared minimum within a factor of two of the default maximum widens the default
    # to twice the minimum (min_head_dim=16 at a default of 16: E in 16..32; 64: 64..128),
    # so Ev != E and more than one head dim are drawn; smaller minimums keep the default.
    default_hi = default_max if 2 * lo <= default_max else max(default_max, 2 * lo)
    hi = _cap_bound(max_head_dim, default_hi, dim_caps[1], upper=True)
    check_capped_range("min_head_dim", lo, "max_head_dim", hi, min_head_dim, max_head_dim,
                       f"caps.min_head_dim={dim_caps[0]}, caps.max_head_dim={dim_caps[1]}")
    return lo, hi


def size_bounds(caps: Capabilities | None, *, min_batch: int, max_batch: int,
                min_heads: int, max_heads: int, gqa: bool | None, min_L: int,
                max_L: int | None, min_S: int, max_S: int | None,
                min_head_dim: int | None, max_head_dim: int | None,
                different_v_dim: bool | None, default_max_length: int = _DEFAULT_MAX_LENGTH,
                default_max_head_dim: int = _DEFAULT_MAX_HEAD_DIM) -> SizeBounds:
    """Check the size arguments of a strategy against each other and ``caps``."""
    check_range("min_batch", min_batch, "max_batch", max_batch)
    check_bool_or_none("different_v_dim", different_v_dim)
    check_bool_or_none("gqa", gqa)
    max_L, max_S = _length_bounds(caps, min_L, max_L, min_S, max_S, default_max_length)
    lo_dim, hi_dim = _head_dim_bounds(caps, min_head_dim, max_head_dim, default_max_head_dim)
    if caps is not None and not caps.gqa:
        if gqa:
            raise fail("gqa", gqa, "but caps.gqa=False", "pass gqa=None or False")
        gqa = False
    if caps is not None and (not caps.different_v_dim or caps.shared_kv):
        declared = "caps.different_v_dim=False" if not caps.different_v_dim else \
            "caps.shared_kv=True (key is value)"
        if different_v_dim:
            raise fail("different_v_dim", different_v_dim, f"but {declared}",
                       "pass different_v_dim=None or False")
        different_v_dim = False
    equal_lengths = caps is not None and caps.self_attention_lengths
    if equal_lengths and max(min_L, min_S) > min(max_L, max_S):
        raise fail("min_L", min_L, f"with min_S={min_S}, max_L={max_L}, max_S={max_S} leaves no "
                   "L == S, which caps.self_attention_lengths=True requires",
                   "let the L and S bounds overlap")
    if different_v_dim and hi_dim == lo_dim:
        raise fail("different_v_dim", different_v_dim,
                   f"needs two head dims but min_head_dim=max_head_dim={lo_dim}",
                   "widen the head-dim bounds")
    min_heads, max_heads = head_bounds(min_heads, max_heads, gqa)
    m = (caps.seq_multiple if caps else None) or 1
    if m > 1 and (max_L < max(min_L, m) or max_S < max(min_S, m)):
        raise fail("caps.seq_multiple", m, f"leaves no length in [{min_L}, {max_L}] x [{min_S}, {max_S}]",
                   "raise max_seq_len (or the length bounds) to at least the block")
    dims = None
    if caps is not None and caps.head_dims is not None:
        # The set decides the range (the default maximum does not cut it off): its smallest
        # three inside the declared and given bounds.
        his = [bound for bound in (max_head_dim, caps.max_head_dim) if bound is not None]
        dims = tuple(d for d in caps.head_dims if d >= lo_dim and (not his or d <= min(his)))[:3]
        if not dims:
            raise fail("caps.head_dims", caps.head_dims, f"has no head dim in [{lo_dim}, {hi_dim}]",
                       "widen the head-dim bounds or the set")
        if len(dims) == 1 and different_v_dim:
            raise fail("different_v_dim", different_v_dim, f"needs two head dims but head_dims={dims}",
                       "pass different_v_dim=None or declare more head dims")
        lo_dim, hi_dim = dims[0], dims[-1]
    return SizeBounds(min_batch, max_batch, min_heads, max_heads, gqa, min_L, max_L,
                      min_S, max_S, lo_dim, hi_dim, different_v_dim, equal_lengths, m, dims)


#: How the query length L may relate to the key length S, simplest first
#: (``sdpa_cases(length_relations=...)``).
LENGTH_RELATIONS = ("L=S", "L=1<S", "1<L<S", "L>S")


def relation_possible(relation: str, b: SizeBounds) -> bool:
    """Whether the length bounds leave an (L, S) pair in ``relation``."""
    if b.seq_multiple > 1:
        b = b.in_blocks()
    if b.equal_lengths and relation not in ("L=S", "L<=S"):
        return False
    if relation == "L=S":
        return max(b.min_L, b.min_S) <= min(b.max_L, b.max_S)
    if relation == "L=1<S":
        return b.min_L == 1 and b.max_S >= 2
    if relation == "1<L<S":
        return max(b.min_L, 2) <= min(b.max_L, b.max_S - 1)
    if relation == "L>S":
        return b.max_L > b.min_S
    if relation == "L<=S":
        return b.min_L <= b.max_S
    raise ValueError(f"relation={relation!r}")


def draw_sizes(draw: Draw, b: SizeBounds, *, relation: str | None = None,
               min_batch: int | None = None, block_weight: int = 2) -> dict[str, int]:
    """Sizes B, N, K, L, S, E, Ev; ``relation`` (one of :data:`LENGTH_RELATIONS`, or
    "L<=S") constrains the lengths; ``block_weight`` is how often each block-size
    neighbour comes vs 20 for each small length. With ``b.equal_lengths`` L == S
    whatever ``relation`` asks. With ``b.seq_multiple`` m, L and S are drawn as numbers of
    blocks (shrinking toward one block) times m; with ``b.head_dims``, E and Ev from the set."""
    if b.seq_multiple > 1:
        sizes = draw_sizes(draw, b.in_blocks(), relation=relation, min_batch=min_batch, block_weight=block_weight)
        return {**sizes, "L": sizes["L"] * b.seq_multiple, "S": sizes["S"] * b.seq_multiple}
    length = functools.partial(_draw_length, block_weight=block_weight)
    if b.equal_lengths:
        relation = "L=S"
    B = _integer(draw, max(b.min_batch, min_batch or 1), b.max_batch)
    N, K = draw_heads(draw, b.min_heads, b.max_heads, b.gqa)
    if relation == "L>S":
        L = length(draw, max(b.min_L, b.min_S + 1), b.max_L)
        S = length(draw, b.min_S, min(b.max_S, L - 1))
    elif relation == "L<=S":
        L = length(draw, b.min_L, min(b.max_L, b.max_S))
        S = length(draw, max(b.min_S, L), b.max_S)
    elif relation == "L=S":
        L = S = length(draw, max(b.min_L, b.min_S), min(b.max_L, b.max_S))
    elif relation == "L=1<S":
        L = 1
        S = length(draw, max(b.min_S, 2), b.max_S)
    elif relation == "1<L<S":
        L = length(draw, max(b.min_L, 2), min(b.max_L, b.max_S - 1))
        S = length(draw, max(b.min_S, L + 1), b.max_S)
    else:
        L = length(draw, b.min_L, b.max_L)
        S = length(draw, b.min_S, b.max_S)
    differ = b.different_v_dim
    if b.head_dims is not None:
        E = _element(draw, list(b.head_dims))
        if differ is None:
            differ = _boolean(draw)
        others = [d for d in b.head_dims if d != E]
        Ev = _element(draw, others) if differ and others else E
        return {"B": B, "N": N, "K": K, "L": L, "S": S, "E": E, "Ev": Ev}
    E = _draw_head_dim(draw, b.min_head_dim, b.max_head_dim)
    if differ is None:
        differ = _boolean(draw)
    Ev = E
    if differ and b.max_head_dim > b.min_head_dim:  # one head dim allowed: Ev == E
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
    arguments = dict(locals())
    bounds = size_bounds(caps, min_batch=min_batch, max_batch=max_batch, min_heads=min_heads,
                         max_heads=max_heads, gqa=gqa, min_L=min_L, max_L=max_L, min_S=min_S,
                         max_S=max_S, min_head_dim=min_head_dim, max_head_dim=max_head_dim,
                         different_v_dim=different_v_dim)
    return named_strategy(sdpa_shapes, arguments, lambda draw: draw_sizes(draw, bounds))
