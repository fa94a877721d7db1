"""The one exception every invalid input raises, and the helpers that phrase it.

A message always has three parts: the argument as ``name=value``, the rule it
breaks, and how to fix the call.
"""

from __future__ import annotations

from typing import Any, NoReturn

import numpy as np

__all__ = ["SpecError", "describe", "fail"]


class SpecError(ValueError):
    """An input that the attention spec does not define (bad rank, shape, dtype, flag...)."""


def describe(value: Any) -> str:
    """Short ``repr`` for a message: arrays by shape and dtype, never by contents."""
    if isinstance(value, np.ndarray) or hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"<array shape={tuple(value.shape)} dtype={value.dtype}>"
    return repr(value)


def fail(name: str, value: Any, rule: str, fix: str) -> NoReturn:
    """Raise :class:`SpecError` reading ``name=value: rule. Fix: fix.``."""
    raise SpecError(f"{name}={describe(value)}: {rule}. Fix: {fix}.")
