"""Rotary position embeddings as ``flash_attn_with_kvcache`` applies them (``rotary_cos``,
``rotary_sin``, ``rotary_interleaved``).

A table ``cos``, ``sin`` of shape (seqlen_ro, R/2) holds, for each position p and pair j,
the two numbers that rotate pair j of a vector at position p; R = ``rotary_dim`` =
2·cos.shape[1] <= E. The table's entries are used as given (nothing requires
``cos² + sin² = 1``): a vector x at position p becomes x' with

* ``interleaved=True`` (GPT-J; FlashAttention's default): pair j is dims (2j, 2j + 1),
  ``x'[2j] = x[2j]·cos[p, j] − x[2j+1]·sin[p, j]``, ``x'[2j+1] = x[2j+1]·cos[p, j] + x[2j]·sin[p, j]``;
* ``interleaved=False`` (GPT-NeoX): pair j is dims (j, j + R/2),
  ``x'[j] = x[j]·cos[p, j] − x[j+R/2]·sin[p, j]``, ``x'[j+R/2] = x[j+R/2]·cos[p, j] + x[j]·sin[p, j]``;

dims R .. E − 1 are left as they are. With R = 2 both layouts rotate dims (0, 1).

Positions in a decoding step (:func:`rotary_positions`, FlashAttention's docstring): the
appended key i of sequence b sits at ``cache_seqlens[b] + i``; query i at
``cache_seqlens[b] + i`` when the call is causal or local (``window != (-1, -1)``), else
every query at ``cache_seqlens[b]``. Positions are cache indices: a ``cache_leftpad``
shifts none of them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _checks
from . import _flash_checks as checks
from .errors import fail

__all__ = ["apply_rotary", "rotary_pairs", "rotary_positions", "rotary_table"]

TABLE_FIX = "pass rotary_cos and rotary_sin of shape (seqlen_ro, rotary_dim / 2), rotary_dim <= E"


def rotary_table(cos: Any, sin: Any, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """``(cos, sin)`` as float64 (seqlen_ro, R/2) arrays after checking them: both 2-D, the
    same shape, at least one pair, R = 2·shape[1] <= ``head_dim``, finite."""
    cos, sin = _checks.as_float64("rotary_cos", cos), _checks.as_float64("rotary_sin", sin)
    if cos.ndim != 2:
        fail("rotary_cos", cos, f"must be 2-D (seqlen_ro, rotary_dim / 2), got rank {cos.ndim}", TABLE_FIX)
    if sin.shape != cos.shape:
        fail("rotary_sin", sin, f"must have rotary_cos's shape {cos.shape}", TABLE_FIX)
    if cos.shape[1] < 1:
        fail("rotary_cos", cos, "must hold at least one pair (rotary_dim >= 2)",
             "pass rotary_cos=None for no rotation")
    if 2 * cos.shape[1] > head_dim:
        fail("rotary_cos", cos, f"rotary_dim = 2 * {cos.shape[1]} must be <= the head dim E={head_dim}", TABLE_FIX)
    for name, table in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not np.isfinite(table).all():
            fail(name, table, "must be finite", "pass cos/sin of finite angles")
    return cos, sin


def rotary_pairs(rotary_dim: int, interleaved: bool) -> tuple[np.ndarray, np.ndarray]:
    """(first, second): the dims of each rotated pair j, (2j, 2j + 1) interleaved or
    (j, j + R/2) not."""
    half = rotary_dim // 2
    j = np.arange(half)
    return (2 * j, 2 * j + 1) if interleaved else (j, j + half)


def apply_rotary(x: Any, cos: Any, sin: Any, positions: Any, *, interleaved: bool = True) -> np.ndarray:
    """x (..., T, H, E) rotated at ``positions`` (..., T) ints: a float64 copy (see the
    module docstring). Every position must have a row of the table."""
    if not isinstance(interleaved, (bool, np.bool_)):
        fail("rotary_interleaved", interleaved, "must be a bool",
             "pass True (pairs (0, 1), (2, 3), ...) or False (pairs (0, R/2), (1, R/2 + 1), ...)")
    x = _checks.as_float64("x", x)
    cos, sin = rotary_table(cos, sin, x.shape[-1])
    positions = np.asarray(positions)
    if not np.issubdtype(positions.dtype, np.integer) or positions.shape != x.shape[:-2]:
        fail("positions", positions, f"must be ints of shape {x.shape[:-2]} (one per vector of x)",
             "pass one position per row of x")
    if positions.size and (positions.min() < 0 or positions.max() >= cos.shape[0]):
        fail("rotary_cos", cos, f"must have a row for every rotated position: positions reach "
             f"{int(positions.max())} but seqlen_ro={cos.shape[0]}",
             "make the tables longer than the largest position (FlashAttention asks for seqlen_ro >= "
             "the cache capacity)")
    first, second = rotary_pairs(2 * cos.shape[1], bool(interleaved))
    c, s = cos[positions][..., None, :], sin[positions][..., None, :]     # (..., T, 1, R/2)
    out = x.copy()
    out[..., first] = x[..., first] * c - x[..., second] * s
    out[..., second] = x[..., second] * c + x[..., first] * s
    return out


def rotary_positions(cache_seqlens: Any, L: int, S_new: int, *, causal: bool,
                     window: tuple[int, int] = (-1, -1)) -> tuple[np.ndarray, np.ndarray]:
    """(query positions (B, L), new-key positions (B, S_new)) of a decoding step: keys at
    ``cache_seqlens[b] + i``; queries likewise when ``causal`` or the window is bounded,
    else all at ``cache_seqlens[b]``."""
    lengths = checks.int_vector("cache_seqlens", cache_seqlens)
    local = tuple(checks.window_pair(window)) != (-1, -1)
    keys = lengths[:, None] + np.arange(S_new)[None, :]
    steps = np.arange(L)[None, :] if (checks.causal_flag(causal) or local) else np.zeros((1, L), dtype=np.int64)
    return lengths[:, None] + steps, keys
