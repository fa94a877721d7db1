"""The directed cases a target runs, for tests of directed examples at any level."""

from __future__ import annotations

from typing import Any

from conformance.core.registry import registered_properties, skip_reasons
from conformance.core.target import Target


def directed_cases(target: Target) -> list[tuple[str, Any]]:
    """(property, directed case) for every property of ``target``'s level that runs on it
    (not skipped by ``skip_reasons``: what the target supports, what the property
    ``requires``, its own ``skip_reason``)."""
    out = []
    for pid, info in registered_properties().items():
        if info.level != target.level or info.directed is None or skip_reasons(info, target):
            continue
        out += [(pid, case) for case in info.directed(target)]
    return out
