"""One-line summaries of exceptions, for the registry's one-paragraph error messages."""

from __future__ import annotations

import traceback

__all__ = ["summarise"]


def summarise(exc: BaseException) -> str:
    """``Type: message (at file:line)`` for the innermost frame, on one line."""
    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})"
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}{where}"
