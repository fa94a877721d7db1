"""Staged comparison of an implementation's result with what it should be.

Stages, in order, as ``torch.testing.assert_close`` does: shape, dtype, device,
NaN positions, inf positions, values. Every failure message reads
"what=got, but should be expected" and reports the mismatched count and
percentage, the worst absolute and relative error with its index, and the
allowed tolerance there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["PropertyFailure", "Comparison", "compare_values", "assert_contract", "fail"]


class PropertyFailure(AssertionError):
    """A property does not hold for the implementation on one case.

    ``ratio``: the failing comparison's worst error/allowed ratio (what the
    certificate shows in a FAIL cell), None when the failure is not ratio-based
    (a NaN, a wrong shape, a missing raise).
    """

    def __init__(self, message: str, *, ratio: float | None = None) -> None:
        super().__init__(message)
        self.ratio = ratio


def fail(what: str, *, ratio: float | None = None) -> None:
    """Raise :class:`PropertyFailure` (``ratio``: the failing comparison's error/allowed)."""
    __tracebackhide__ = True
    raise PropertyFailure(what, ratio=ratio)


@dataclass
class Comparison:
    ratio: float  # worst error / allowed over the compared elements (0 when exact)


def _index(shape: tuple[int, ...], flat: int) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat, shape))


def distinct_digits(got: float, want: float) -> tuple[str, str]:
    """Two values with as few significant digits as tell them apart (at least 4, at most 17).

    A float32 result compared in float64 would otherwise print 17 digits of which the last
    eight are noise of the conversion.
    """
    for digits in range(4, 18):
        a, b = f"{got:.{digits}g}", f"{want:.{digits}g}"
        if a != b:
            return a, b
    return repr(got), repr(want)


def compare_values(
    what: str,
    actual: np.ndarray,
    expected: np.ndarray,
    allowed: np.ndarray | float,
    *,
    where: np.ndarray | None = None,
) -> Comparison:
    """Check ``|actual - expected| <= allowed`` elementwise (NaN/inf staged first).

    ``actual`` and ``expected`` are float64 arrays of the same shape; ``where``
    (bool, broadcastable) restricts the comparison to selected elements.
    Returns the worst error/allowed ratio; raises :class:`PropertyFailure`.
    """
    __tracebackhide__ = True
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        fail(f"{what} shape={actual.shape}, but should be {expected.shape}")
    allowed = np.broadcast_to(np.asarray(allowed, dtype=np.float64), actual.shape)
    sel = np.ones(actual.shape, bool) if where is None else np.broadcast_to(where, actual.shape)
    n_sel = int(sel.sum())
    if n_sel == 0:
        return Comparison(0.0)

    def positions(mask: np.ndarray) -> str:
        idx = np.argwhere(mask)
        shown = ", ".join(str(tuple(int(i) for i in row)) for row in idx[:5])
        more = f" and {len(idx) - 5} more" if len(idx) > 5 else ""
        return f"{len(idx)}/{n_sel} elements ({100.0 * len(idx) / n_sel:.1f}%) at {shown}{more}"

    for name, test in (("NaN", np.isnan), ("inf", np.isinf)):
        bad = sel & test(actual) & ~test(expected)
        if bad.any():
            fail(f"{what} has {name} where it should be finite: {positions(bad)}")
        missing = sel & test(expected) & ~test(actual)
        if missing.any():
            fail(f"{what} is finite where it should be {name}: {positions(missing)}")
    both_inf = np.isinf(actual) & np.isinf(expected)
    sign_bad = sel & both_inf & (np.sign(actual) != np.sign(expected))
    if sign_bad.any():
        fail(f"{what} has inf of the wrong sign: {positions(sign_bad)}")
    finite = sel & np.isfinite(expected) & np.isfinite(actual)
    err = np.where(finite, np.abs(actual - expected), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(finite, err / np.where(allowed > 0, allowed, np.inf), 0.0)
        ratio = np.where(finite & (allowed <= 0) & (err > 0), np.inf, ratio)
    worst_ratio = float(ratio.max()) if ratio.size else 0.0
    bad = finite & (err > allowed)
    if bad.any():
        flat = int(np.argmax(np.where(bad, ratio, -1.0)))
        i = _index(actual.shape, flat)
        abs_flat = int(np.argmax(np.where(bad, err, -1.0)))
        j = _index(actual.shape, abs_flat)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(bad, err / np.abs(expected), 0.0)
        k = _index(actual.shape, int(np.nanargmax(np.where(bad, rel, -1.0))))
        got, want = distinct_digits(float(actual[i]), float(expected[i]))
        fail(
            f"{what} values mismatch: {positions(bad)}\n"
            f"  worst error/allowed = {worst_ratio:.3g} at {i}: got {got}, "
            f"but should be {want} (|diff|={err[i]:.3g}, allowed {allowed[i]:.3g})\n"
            f"  greatest abs diff {err[j]:.3g} at {j}; greatest rel diff "
            f"{float(err[k] / abs(expected[k])) if expected[k] != 0 else float('inf'):.3g} at {k}",
            ratio=worst_ratio,
        )
    return Comparison(worst_ratio)


def assert_contract(what: str, tensor: Any, *, shape: tuple[int, ...], dtype: Any, device: str) -> None:
    """Output contract: a tensor of the expected shape, dtype and device type."""
    __tracebackhide__ = True
    import torch

    if not isinstance(tensor, torch.Tensor):
        fail(f"{what} type={type(tensor).__name__}, but should be torch.Tensor")
    if tuple(tensor.shape) != tuple(shape):
        fail(f"{what} shape={tuple(tensor.shape)}, but should be {tuple(shape)}")
    if tensor.dtype != dtype:
        fail(f"{what} dtype={tensor.dtype}, but should be {dtype} (outputs have the input dtype)")
    if tensor.device.type != device:
        fail(f"{what} device={tensor.device.type}, but should be {device}")
