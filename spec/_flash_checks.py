"""Private validation of the FlashAttention-style options (each raises SpecError)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import _checks
from .errors import fail

WINDOW_FIX = ("pass window=(left, right) with ints >= 0, or -1 for no bound on that side: "
              "(-1, -1) is no window, (3, 0) the 3 keys before the query's position and itself")


def is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def size(name: str, value: Any, minimum: int = 0) -> int:
    if not is_int(value) or value < minimum:
        fail(name, value, f"must be an int >= {minimum}", f"pass a whole number >= {minimum}")
    return int(value)


def window_pair(window: Any) -> tuple[int, int]:
    """``(left, right)`` as ints >= -1; -1 = unbounded on that side."""
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        fail("window", window, "must be a (left, right) pair of ints", WINDOW_FIX)
    for side, value in zip(("window[0]", "window[1]"), window, strict=True):
        if not is_int(value) or value < -1:
            fail(side, value, "must be an int >= -1 (-1 = unbounded on that side)",
                 WINDOW_FIX + "; FlashAttention reads any negative as -1, the spec only -1")
    return int(window[0]), int(window[1])


def causal_flag(causal: Any) -> bool:
    if not isinstance(causal, (bool, np.bool_)):
        fail("causal", causal, "must be a bool (FlashAttention's flag: True = window right side 0)",
             "pass causal=True or False and choose the alignment with "
             "alignment='lower_right' (FlashAttention) or 'upper_left'")
    return bool(causal)


def alignment(value: Any) -> str:
    _checks.check_choice("alignment", value, _checks.CAUSAL_ALIGNMENTS,
                         "pass alignment='lower_right' (FlashAttention: query i sits at key "
                         "position i + S - L) or 'upper_left' (query i sits at key position i)")
    return value


def softcap_value(softcap: Any) -> float:
    """The soft-capping constant c >= 0 as a float; 0 = off."""
    if not (is_int(softcap) or isinstance(softcap, (float, np.floating))):
        fail("softcap", softcap, "must be a real number >= 0 (0 = off)", "pass softcap=0.0 or e.g. 30.0")
    softcap = float(softcap)
    if math.isnan(softcap) or math.isinf(softcap) or softcap < 0:
        fail("softcap", softcap, "must be finite and >= 0 (0 = off)",
             "pass softcap=0.0 to switch soft-capping off (FlashAttention also reads a negative "
             "softcap as off; the spec rejects it)")
    return softcap


def slopes_array(slopes: Any, batch: int, heads: int) -> np.ndarray | None:
    """ALiBi slopes (N,) or (B, N) -> float64 broadcastable to (B, N); None stays None."""
    if slopes is None:
        return None
    slopes = _checks.as_float64("alibi_slopes", slopes)
    if slopes.shape not in ((heads,), (batch, heads)):
        fail("alibi_slopes", slopes, f"must have shape (N,) = ({heads},) or (B, N) = ({batch}, {heads})",
             "pass one slope per query head, optionally one row per batch element")
    if not np.isfinite(slopes).all():
        fail("alibi_slopes", slopes, "must be finite", "pass finite slopes (e.g. 2 ** (-8 * h / N))")
    return slopes.reshape(-1, heads)                                   # (1 or B, N)


def sinks_array(sinks: Any, heads: int) -> np.ndarray | None:
    """Learned attention sinks (N,): one finite logit per query head; None stays None."""
    if sinks is None:
        return None
    sinks = _checks.as_float64("sinks", sinks)
    if sinks.shape != (heads,):
        fail("sinks", sinks, f"must have shape (N,) = ({heads},): one logit per query head",
             "pass one sink logit per query head (gpt-oss style learned sinks)")
    if not np.isfinite(sinks).all():
        fail("sinks", sinks, "must be finite", "pass finite sink logits (a sink of -inf is no sink: pass None)")
    return sinks


def dropout_pattern(dropout_p: Any, mask: Any, shape: tuple[int, ...]) -> np.ndarray | None:
    """The dropout pattern as float64 (B, N, L, S) holding ``mask / (1 - dropout_p)`` (kept
    weights rescaled, dropped ones 0), or None without dropout. ``dropout_p`` in [0, 1);
    ``mask`` bool (B, N, L, S), True = kept, required when ``dropout_p > 0``."""
    if not (is_int(dropout_p) or isinstance(dropout_p, (float, np.floating))) or not 0 <= float(dropout_p) < 1:
        fail("dropout_p", dropout_p, "must be a number in [0, 1)",
             "pass the probability of dropping a weight (0 = no dropout; 1 would rescale by 1/0)")
    if mask is None:
        if dropout_p:
            fail("dropout_mask", mask, f"is needed with dropout_p={float(dropout_p)}: the spec draws nothing",
                 "pass the pattern the call drew (bool (B, N, L, S), True = kept); the expectation "
                 "over patterns is the output with dropout_p=0")
        return None
    mask = np.asarray(mask)
    if mask.dtype != np.bool_ or mask.shape != tuple(shape):
        fail("dropout_mask", mask, f"must be bool with shape (B, N, L, S) = {tuple(shape)}",
             "pass one keep flag per query head, query and key (True = kept)")
    return mask / (1.0 - float(dropout_p))


def int_vector(name: str, value: Any) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        fail(name, array, "must be a 1-D array of ints", f"pass e.g. {name}=np.array([0, 3, 5])")
    return array.astype(np.int64)


def cu_seqlens(name: str, value: Any, total: int, total_name: str) -> np.ndarray:
    """Cumulative sequence starts: 0, non-decreasing, ending at ``total``; B + 1 >= 2 entries."""
    cu = int_vector(name, value)
    shown = cu.tolist() if cu.size <= 12 else cu
    if cu.size < 2:
        fail(name, shown, "must hold B + 1 >= 2 entries (at least one sequence)",
             "pass [0, len_0, len_0 + len_1, ...]; one sequence of length n is [0, n]")
    if cu[0] != 0:
        fail(name, shown, f"must start at 0, got {cu[0]}", "prefix the cumulative lengths with 0")
    lengths = np.diff(cu)
    if (lengths < 0).any():
        b = int(np.argmax(lengths < 0))
        fail(name, shown, f"must be non-decreasing (sequence {b} has length {lengths[b]})",
             "pass cumulative sums of non-negative lengths, e.g. np.concatenate([[0], np.cumsum(lengths)])")
    if cu[-1] != total:
        fail(name, shown, f"must end at {total_name}={total}, got {cu[-1]}",
             f"make the last entry the packed length ({total_name}), or pack exactly these sequences")
    return cu


def head_layout(query: np.ndarray, key: np.ndarray, value: np.ndarray, lead: int,
                letters: tuple[str, str, str]) -> None:
    """Shapes of FlashAttention-layout q/k/v: ``lead`` leading dims, then (heads, head dim).

    ``lead`` is 2 for (B, L|S, ...) and 1 for the packed (total, ...) layout; the leading
    dims of key and value (except the sequence dim) must equal query's.
    """
    rank = lead + 2
    for name, array, shape in zip(("query", "key", "value"), (query, key, value), letters, strict=True):
        if array.ndim != rank:
            fail(name, array, f"must have rank {rank} with shape {shape}, got rank {array.ndim}",
                 f"pass {name} in FlashAttention's layout {shape}")
    if key.shape[:-1] != value.shape[:-1]:
        fail("value", value, f"must share key's leading dims and kv heads {key.shape[:-1]}",
             "give key and value the same batch, length and kv-head dims")
    if query.shape[:lead - 1] != key.shape[:lead - 1]:
        fail("key", key, f"batch dims must equal query's {query.shape[:lead - 1]}",
             "give query, key and value the same batch size")
    N, E, K = query.shape[-2], query.shape[-1], key.shape[-2]
    if key.shape[-1] != E:
        fail("key", key, f"last dim E={key.shape[-1]} must equal query's E={E}",
             "project q and k to the same head dim")
    for name, dim in (("N", N), ("K", K), ("E", E)):
        if dim < 1:
            fail(name, dim, "must be >= 1", "pass at least one head and a non-empty head dim")
    if N % K != 0:
        fail("key", key, f"query heads N={N} must be a multiple of kv heads K={K} (GQA)",
             "use a K that divides N (K == N is plain multi-head attention)")
