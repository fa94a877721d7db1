"""Mask builders and converters.

The spec has one canonical pair of masks:

* ``attend_mask`` — bool, **True = this query may attend this key** (SDPA, JAX);
* ``additive_mask`` — float, **added** to the scaled scores (0 = no effect, -inf = blocked).

Users meet other conventions, converted here both ways:

* ``mha_bool`` — ``nn.MultiheadAttention`` bool masks, **True = blocked**;
* ``keep_int`` — hand-written modules' integer masks, **1 = keep, 0 = blocked**;
* ``additive`` / ``mha_float`` — float masks added to the scores (also
  ``nn.MultiheadAttention``'s float ``attn_mask`` and float ``key_padding_mask``).

Dimension letters: B batch, N query heads, L query length, S key length.
Causal alignment: ``"upper_left"`` is ``tril(ones(L, S))`` (PyTorch ``is_causal``);
``"lower_right"`` is ``tril(ones(L, S), S - L)`` (FlashAttention, xformers, cuDNN):
the last query is aligned with the last key.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ._checks import (additive_mask_array, attend_mask_array, check_alignment, check_causal,
                      check_choice, is_real_float)
from .errors import fail

__all__ = [
    "CONVENTIONS",
    "causal_mask",
    "padding_mask",
    "sliding_window_mask",
    "streaming_mask",
    "fully_masked_rows",
    "combined_attend_mask",
    "from_mha_bool",
    "to_mha_bool",
    "from_keep_int",
    "to_keep_int",
    "to_additive",
    "from_additive",
    "to_canonical",
    "from_canonical",
    "merge_key_padding",
]

#: Every mask convention :func:`to_canonical` / :func:`from_canonical` understand.
CONVENTIONS = ("attend_bool", "mha_bool", "keep_int", "additive", "mha_float")


def _check_size(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        fail(name, value, f"must be an int >= {minimum}", f"pass a whole number >= {minimum}")
    return int(value)


def _diagonal_offset(L: int, S: int, alignment: str) -> int:
    """Key index aligned with query 0: 0 (upper_left) or S - L (lower_right)."""
    return 0 if alignment == "upper_left" else S - L


def causal_mask(L: int, S: int, alignment: str = "upper_left") -> np.ndarray:
    """Causal attend mask, bool (L, S), True = may attend.

    ``upper_left``: query i sees keys j <= i. ``lower_right``: query i sees keys
    j <= i + S - L (so with L > S the first L - S queries see nothing).
    """
    L, S = _check_size("L", L), _check_size("S", S)
    check_alignment(alignment)
    return np.tri(L, S, _diagonal_offset(L, S, alignment), dtype=bool)


def padding_mask(lengths: Sequence[int] | np.ndarray, S: int) -> np.ndarray:
    """Key-padding attend mask, bool (B, S): key j of batch b is real iff j < lengths[b]."""
    S = _check_size("S", S)
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
        fail("lengths", lengths, "must be a 1-D sequence of ints, one per batch element",
             "pass e.g. lengths=[3, 1]")
    if ((lengths < 0) | (lengths > S)).any():
        fail("lengths", lengths.tolist(), f"each length must lie in [0, S={S}]",
             "clip the lengths or build the mask for a larger S")
    return np.arange(S)[None, :] < lengths[:, None]


def sliding_window_mask(L: int, S: int, window: int | tuple[int, int],
                        alignment: str = "upper_left") -> np.ndarray:
    """Local (sliding-window) attend mask, bool (L, S), FlashAttention's ``window_size`` rule.

    With ``window=(left, right)`` query i sees keys j with ``p - left <= j <= p + right``
    where ``p = i`` (upper_left) or ``p = i + S - L`` (lower_right). An int ``w`` means
    ``(w, 0)``: causal, the query's own position and the ``w`` keys before it.
    """
    L, S = _check_size("L", L), _check_size("S", S)
    check_alignment(alignment)
    if isinstance(window, (int, np.integer)) and not isinstance(window, bool):
        left, right = int(window), 0
    elif isinstance(window, tuple) and len(window) == 2:
        left, right = window
    else:
        fail("window", window, "must be an int or a (left, right) pair of ints",
             "pass window=3 or window=(3, 0)")
    left, right = _check_size("window[0]", left), _check_size("window[1]", right)
    position = np.arange(L)[:, None] + _diagonal_offset(L, S, alignment)  # (L, 1)
    keys = np.arange(S)[None, :]                                                          # (1, S)
    return (keys >= position - left) & (keys <= position + right)


def streaming_mask(L: int, S: int, sink_tokens: int, window: int | tuple[int, int],
                   alignment: str = "lower_right") -> np.ndarray:
    """StreamingLLM's attend mask, bool (L, S): the first ``sink_tokens`` keys ("attention
    sinks" kept in the cache) visible to every query that may see them causally, plus the
    sliding window of :func:`sliding_window_mask` (``window`` as there; an int is causal).

    Query i sees key j iff ``j`` is in its window, or ``j < sink_tokens`` and ``j <= p_i +
    right`` (the sink tokens never see the future: they are the sequence's first keys).
    FlashAttention-3's early ``sink_token_length`` (its test reference's
    ``construct_local_mask``) is this rule, bottom-right aligned; no attention API certified
    here takes ``sink_tokens``, and this mask is how the pattern is expressed at the SDPA
    level (``spec.sdpa(attend_mask=streaming_mask(...))``).
    """
    window_part = sliding_window_mask(L, S, window, alignment)
    sink_tokens = _check_size("sink_tokens", sink_tokens)
    right = 0 if isinstance(window, (int, np.integer)) else int(window[1])
    position = np.arange(L)[:, None] + _diagonal_offset(L, S, alignment)                  # (L, 1)
    keys = np.arange(S)[None, :]                                                          # (1, S)
    return window_part | ((keys < sink_tokens) & (keys <= position + right))


def combined_attend_mask(shape: tuple[int, ...], attend_mask: np.ndarray | None = None,
                         additive_mask: np.ndarray | None = None,
                         causal: str | None = None) -> np.ndarray:
    """Everything that blocks a key, as one attend mask broadcast to ``shape`` (..., N, L, S).

    A key is blocked by ``attend_mask == False``, by the causal rule, or by an additive
    entry equal to -inf.
    """
    shape = tuple(shape)
    if len(shape) < 2:
        fail("shape", shape, "must be (..., L, S) with at least 2 dims", "pass the full (..., N, L, S) shape")
    L, S = shape[-2], shape[-1]
    allowed = np.ones(shape, dtype=bool)
    if attend_mask is not None:
        attend_mask = attend_mask_array(attend_mask, shape, "(..., N, L, S)")
        allowed &= attend_mask
    if causal is not None:
        allowed &= causal_mask(L, S, causal)
    if additive_mask is not None:
        additive_mask = additive_mask_array(additive_mask, shape, "(..., N, L, S)")
        allowed &= ~np.isneginf(additive_mask)
    return allowed


def fully_masked_rows(shape: tuple[int, ...], attend_mask: np.ndarray | None = None,
                      additive_mask: np.ndarray | None = None,
                      causal: str | None = None) -> np.ndarray:
    """Which query rows may attend no key at all: bool (..., N, L) for ``shape`` (..., N, L, S).

    ``attend_mask`` is True = may attend; ``additive_mask`` blocks where it is -inf.
    """
    check_causal(causal)
    return ~combined_attend_mask(shape, attend_mask, additive_mask, causal).any(axis=-1)


def _bool_array(name: str, mask: Any) -> np.ndarray:
    mask = np.asarray(mask)
    if mask.dtype != np.bool_:
        fail(name, mask, f"must be a bool array, got dtype {mask.dtype}", "pass a bool array")
    return mask


def from_mha_bool(mask: Any) -> np.ndarray:
    """nn.MultiheadAttention bool mask (True = blocked) -> attend mask (True = may attend)."""
    return ~_bool_array("mask", mask)


def to_mha_bool(attend_mask: Any) -> np.ndarray:
    """Attend mask (True = may attend) -> nn.MultiheadAttention bool mask (True = blocked)."""
    return ~_bool_array("attend_mask", attend_mask)


def from_keep_int(mask: Any) -> np.ndarray:
    """Integer keep mask (1 = keep, 0 = blocked) -> attend mask (True = may attend)."""
    mask = np.asarray(mask)
    if not np.issubdtype(mask.dtype, np.integer) or not np.isin(mask, (0, 1)).all():
        fail("mask", mask, "must be an integer array holding only 0 (blocked) and 1 (keep)",
             "pass a 0/1 int array; a bool mask needs no conversion (True = may attend)")
    return mask == 1


def to_keep_int(attend_mask: Any, dtype: Any = np.int64) -> np.ndarray:
    """Attend mask (True = may attend) -> integer keep mask (1 = keep, 0 = blocked)."""
    return _bool_array("attend_mask", attend_mask).astype(dtype)


def to_additive(attend_mask: Any, dtype: Any = np.float64) -> np.ndarray:
    """Attend mask (True = may attend) -> additive float mask (0 = attend, -inf = blocked)."""
    attend_mask = _bool_array("attend_mask", attend_mask)
    return np.where(attend_mask, 0.0, -np.inf).astype(dtype)


def from_additive(mask: Any) -> np.ndarray:
    """Additive 0/-inf float mask -> attend mask (True where the entry is 0).

    Only masks made of 0 and -inf are bool masks in disguise; any other value is a bias
    that a bool mask cannot express, and raises.
    """
    mask = np.asarray(mask)
    if not is_real_float(mask.dtype):
        fail("mask", mask, f"must be a float array, got dtype {mask.dtype}", "pass a float 0/-inf mask")
    mask = mask.astype(np.float64)
    if not ((mask == 0) | np.isneginf(mask)).all():
        fail("mask", mask, "holds values other than 0 and -inf, which no bool mask expresses",
             "keep it as an additive mask (to_canonical(mask, 'additive'))")
    return mask == 0


def to_canonical(mask: Any, convention: str) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A mask in ``convention`` -> the canonical ``(attend_mask, additive_mask)`` pair.

    Bool-like conventions fill ``attend_mask``; float conventions fill ``additive_mask``.
    """
    check_choice("convention", convention, CONVENTIONS)
    if convention == "attend_bool":
        return _bool_array("mask", mask), None
    if convention == "mha_bool":
        return from_mha_bool(mask), None
    if convention == "keep_int":
        return from_keep_int(mask), None
    mask = np.asarray(mask)
    if not is_real_float(mask.dtype):
        fail("mask", mask, f"convention={convention!r} needs a float array, got dtype {mask.dtype}",
             "pass a float mask or pick the convention that matches its dtype")
    return None, mask.astype(np.float64)


def from_canonical(attend_mask: Any | None, additive_mask: Any | None,
                   convention: str) -> np.ndarray | None:
    """The canonical pair -> one mask in ``convention`` (None when both are None).

    Into a float convention the pair merges exactly (blocked -> -inf, plus the biases);
    into a bool convention the additive part must be 0/-inf only.
    """
    check_choice("convention", convention, CONVENTIONS)
    if attend_mask is None and additive_mask is None:
        return None
    parts = []
    if attend_mask is not None:
        parts.append(to_additive(attend_mask))
    if additive_mask is not None:
        parts.append(np.asarray(additive_mask, dtype=np.float64))
    merged = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    if convention in ("additive", "mha_float"):
        return merged
    attend = from_additive(merged)
    if convention == "attend_bool":
        return attend
    if convention == "mha_bool":
        return to_mha_bool(attend)
    return to_keep_int(attend)


def _mha_mask_as_additive(name: str, mask: Any) -> np.ndarray:
    mask = np.asarray(mask)
    if mask.dtype == np.bool_:
        return np.where(mask, -np.inf, 0.0)     # MHA bool: True = blocked
    if is_real_float(mask.dtype):
        return mask.astype(np.float64)
    fail(name, mask, f"must be bool (True = blocked) or float (added), got dtype {mask.dtype}",
         "convert 1 = keep int masks with to_mha_bool(from_keep_int(mask))")


def merge_key_padding(key_padding_mask: Any | None, attn_mask: Any | None, *,
                      num_heads: int = 1) -> np.ndarray | None:
    """Merge nn.MultiheadAttention's two masks the way it does, into one additive mask.

    Both masks are in MHA's convention (bool True = blocked, float added). Each is turned
    into 0/-inf (bool) or kept (float), then they are **added**:

    * ``key_padding_mask`` (B, S) or (S,) -> (B, 1, 1, S) / (1, 1, 1, S);
    * ``attn_mask`` (L, S) -> (1, 1, L, S); (B*N, L, S) -> (B, N, L, S) with
      ``N = num_heads`` (row ``b * N + n`` is batch b, head n).

    Returns a float64 additive mask broadcastable to (B, N, L, S), or None.
    """
    num_heads = _check_size("num_heads", num_heads, 1)
    merged = None
    if attn_mask is not None:
        attn = _mha_mask_as_additive("attn_mask", attn_mask)
        if attn.ndim == 2:
            merged = attn[None, None]                                     # (1, 1, L, S)
        elif attn.ndim == 3 and attn.shape[0] % num_heads == 0:
            merged = attn.reshape(-1, num_heads, *attn.shape[1:])         # (B, N, L, S)
        else:
            fail("attn_mask", attn, f"must be (L, S) or (B*num_heads, L, S) with num_heads={num_heads}",
                 "pass a 2-D mask shared by all batches and heads or a 3-D one with B*num_heads rows")
    if key_padding_mask is not None:
        padding = _mha_mask_as_additive("key_padding_mask", key_padding_mask)
        if padding.ndim not in (1, 2):
            fail("key_padding_mask", padding, "must be (B, S) or, unbatched, (S,)",
                 "pass one row of S entries per batch element")
        padding = padding.reshape(-1, 1, 1, padding.shape[-1])             # (B, 1, 1, S)
        merged = padding if merged is None else merged + padding
    return merged
