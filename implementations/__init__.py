"""Implementations to certify: the registry, adapters, built-ins and the bug zoo."""

from implementations.base import (
    Capabilities,
    ExpectedFailure,
    Implementation,
    ImplementationError,
)

__all__ = ["Capabilities", "ExpectedFailure", "Implementation", "ImplementationError"]
