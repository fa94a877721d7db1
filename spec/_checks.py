"""Private validation pieces shared by the public functions (each raises SpecError)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .errors import fail

CAUSAL_ALIGNMENTS = ("upper_left", "lower_right")
FULLY_MASKED_POLICIES = ("zero", "nan", "uniform")


def is_bfloat16(dtype: np.dtype) -> bool:
    return np.dtype(dtype).name == "bfloat16"


#: ml_dtypes' 8-bit float formats (``spec.fp8``), read exactly like bfloat16.
FP8_DTYPE_NAMES = ("float8_e4m3fn", "float8_e5m2")


def is_real_float(dtype: np.dtype) -> bool:
    dtype = np.dtype(dtype)
    return np.issubdtype(dtype, np.floating) or is_bfloat16(dtype) or dtype.name in FP8_DTYPE_NAMES


def as_float64(name: str, value: Any) -> np.ndarray:
    """Upcast a real numeric array to float64 exactly (low-precision values kept as stored)."""
    array = np.asarray(value)
    if array.dtype == np.bool_ or not (is_real_float(array.dtype) or np.issubdtype(array.dtype, np.integer)):
        fail(name, array, f"must hold real numbers, got dtype {array.dtype}",
             "pass a float array (float8, float16, bfloat16, float32 or float64)")
    return array.astype(np.float64)


def check_rank(name: str, array: np.ndarray, min_rank: int, letters: str) -> None:
    if array.ndim < min_rank:
        fail(name, array, f"must have rank >= {min_rank} with shape {letters}, got rank {array.ndim}",
             f"add the missing leading dimensions (e.g. x[None]) so the shape reads {letters}")


def check_choice(name: str, value: Any, choices: tuple, fix_hint: str = "") -> None:
    if not isinstance(value, str) or value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        fail(name, value, f"must be one of {allowed}", fix_hint or f"pass one of {allowed}")


def check_causal(value: Any) -> None:
    if value is None:
        return
    check_choice("causal", value, CAUSAL_ALIGNMENTS,
                 "pass causal=None, 'upper_left' (PyTorch is_causal, tril(ones(L, S))) or "
                 "'lower_right' (FlashAttention, tril(ones(L, S), S - L)); "
                 "a bool is ambiguous between the two")


def check_policy(value: Any) -> None:
    check_choice("fully_masked", value, FULLY_MASKED_POLICIES,
                 "pass fully_masked='zero' (the spec's default), 'nan' or 'uniform'")


def resolve_scale(scale: Any, head_dim: int) -> float:
    """The scale multiplying q·kᵀ: 1/sqrt(E) when None, else the given real number as is."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        fail("scale", scale, "must be None or a real number", "pass scale=None (1/sqrt(E)) or a float")
    scale = float(scale)
    if math.isnan(scale):
        fail("scale", scale, "must not be NaN", "pass scale=None (1/sqrt(E)) or a finite float")
    if math.isinf(scale):
        fail("scale", scale, "must be finite", "pass scale=None (1/sqrt(E)) or a finite float")
    return scale


def check_broadcast(name: str, mask: np.ndarray, target: tuple[int, ...], letters: str) -> None:
    try:
        ok = mask.ndim <= len(target) and np.broadcast_shapes(mask.shape, target) == tuple(target)
    except ValueError:
        ok = False
    if not ok:
        fail(name, mask, f"must broadcast to {letters} = {tuple(target)}",
             f"build the mask with shape {tuple(target)} or with size-1 dims where it is shared "
             "(a mask built for other L or S cannot be reused)")


def attend_mask_array(mask: Any, target: tuple[int, ...], letters: str) -> np.ndarray:
    mask = np.asarray(mask)
    if mask.dtype != np.bool_:
        if np.issubdtype(mask.dtype, np.integer):
            fix = "a 1 = keep / 0 = blocked int mask converts with spec.masks.from_keep_int(mask)"
        elif is_real_float(mask.dtype):
            fix = "pass a float mask as additive_mask= (it is added to the scaled scores)"
        else:
            fix = "pass a bool array, True = may attend"
        fail("attend_mask", mask, f"must be bool (True = may attend), got dtype {mask.dtype}", fix)
    check_broadcast("attend_mask", mask, target, letters)
    return mask


def additive_mask_array(mask: Any, target: tuple[int, ...], letters: str) -> np.ndarray:
    mask = np.asarray(mask)
    if not is_real_float(mask.dtype):
        if mask.dtype == np.bool_:
            fix = ("pass a bool mask as attend_mask= (True = may attend), or convert it with "
                   "spec.masks.to_additive(mask)")
        else:
            fix = "pass a float array of 0 / finite biases / -inf"
        fail("additive_mask", mask, f"must be a float array, got dtype {mask.dtype}", fix)
    check_broadcast("additive_mask", mask, target, letters)
    mask = mask.astype(np.float64)
    if np.isnan(mask).any() or np.isposinf(mask).any():
        fail("additive_mask", mask, "must hold finite values or -inf (NaN and +inf have no meaning)",
             "use -inf (or attend_mask=False) to block a key and finite values to bias it")
    return mask


def check_alignment(value: Any) -> None:
    """A causal alignment that must be given (mask builders): 'upper_left' or 'lower_right'."""
    check_choice("alignment", value, CAUSAL_ALIGNMENTS,
                 "pass alignment='upper_left' (PyTorch is_causal, tril(ones(L, S))) or "
                 "'lower_right' (FlashAttention, tril(ones(L, S), S - L))")
