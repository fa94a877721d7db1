"""What a property requires of an implementation, as data.

A property registered with ``@conformance_property(..., requires=("gqa",))`` is skipped,
with the requirement's reason, on a target whose capabilities do not meet it; the
registry then knows which properties each capability field gates (:func:`gated_by`), and
docs/OPTIONS.md's table of them is generated from it (``python -m conformance.docgen``).
A property whose condition is more than a field's value keeps its own ``skip_reason``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["REQUIREMENTS", "Requirement", "gated_by", "known_requirements", "unmet"]


@dataclass(frozen=True)
class Requirement:
    """One requirement: the ``Capabilities`` field it reads, whether a target's capabilities
    meet it, and the skip reason when they do not."""

    field: str
    holds: Callable[[Any], bool]
    missing: str


def _mha_feature(name: str) -> Callable[[Any], bool]:
    return lambda caps: name in caps.mha_features


def _flash_feature(name: str) -> Callable[[Any], bool]:
    return lambda caps: name in caps.flash_features


#: Requirement name -> what it reads. ``flash:X`` and ``mha:X`` are features of those levels.
REQUIREMENTS: Mapping[str, Requirement] = {
    "autograd": Requirement("autograd", lambda c: bool(c.autograd), "autograd not declared"),
    "gqa": Requirement("gqa", lambda c: bool(c.gqa), "GQA not declared"),
    "custom_scale": Requirement("custom_scale", lambda c: bool(c.custom_scale), "custom scale not declared"),
    "non_contiguous": Requirement("non_contiguous", lambda c: bool(c.non_contiguous),
                                  "only contiguous inputs declared"),
    "dropout": Requirement("dropout", lambda c: bool(c.dropout), "dropout not declared"),
    "flash:window": Requirement("flash_features", _flash_feature("window"), "window not declared"),
    "flash:softcap": Requirement("flash_features", _flash_feature("softcap"), "softcap not declared"),
    "flash:alibi": Requirement("flash_features", _flash_feature("alibi"), "alibi not declared"),
    "flash:lse": Requirement("flash_features", _flash_feature("lse"), "LSE output not declared"),
    "flash:sinks": Requirement("flash_features", _flash_feature("sinks"), "sinks not declared"),
    "mha:need_weights": Requirement("mha_features", _mha_feature("need_weights"), "need_weights not declared"),
    "mha:dropout": Requirement("mha_features", _mha_feature("dropout"), "dropout not declared"),
}


def known_requirements(property_id: str, requires: Sequence[str]) -> tuple[str, ...]:
    """``requires`` of property ``property_id`` as registered; ValueError naming any name that
    is not one of :data:`REQUIREMENTS`."""
    unknown = [name for name in requires if name not in REQUIREMENTS]
    if unknown:
        raise ValueError(f"@conformance_property({property_id!r}, requires={tuple(requires)!r}): {unknown} are not "
                         f"requirements; use names of conformance.core.requirements.REQUIREMENTS: "
                         f"{', '.join(REQUIREMENTS)}")
    return tuple(requires)


def unmet(requires: Sequence[str], caps: Any) -> list[str]:
    """The skip reason of the first requirement ``caps`` do not meet (empty: all met)."""
    for name in requires:
        requirement = REQUIREMENTS[name]
        if not requirement.holds(caps):
            return [requirement.missing]
    return []


def gated_by(properties: Mapping[str, Any]) -> dict[str, list[str]]:
    """Capability field -> the ids of the properties whose ``requires`` read it, in
    registration order (``properties``: the registry's id -> info)."""
    gates: dict[str, list[str]] = {}
    for pid, info in properties.items():
        for name in getattr(info, "requires", ()):
            gates.setdefault(REQUIREMENTS[name].field, []).append(pid)
    return gates
