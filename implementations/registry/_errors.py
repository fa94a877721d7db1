"""One-line summaries of exceptions, for the registry's one-paragraph error messages."""

from __future__ import annotations

from implementations.guard import summarise

__all__ = ["summarise"]
