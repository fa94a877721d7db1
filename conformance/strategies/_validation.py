"""Argument checks shared by the strategies.

Every impossible argument raises :class:`hypothesis.errors.InvalidArgument` when
the strategy is built (never while drawing), with the argument echoed as
``name=value``, why it is impossible, and the fix.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from hypothesis.errors import InvalidArgument

from implementations.base import (
    ALL_DTYPES,
    ALL_MHA_FEATURES,
    Capabilities,
    implied_mha_features,
    renamed_mha_features,
)


def fail(name: str, value: Any, why: str, fix: str) -> InvalidArgument:
    """The error for argument ``name=value``: ``"name=value why; fix"``."""
    return InvalidArgument(f"{name}={value!r} {why}; {fix}")


def check_dtype(dtype: Any, caps: Capabilities | None) -> None:
    if dtype not in ALL_DTYPES:
        raise fail("dtype", dtype, f"is not one of {ALL_DTYPES}", "pass one of them")
    if caps is not None and dtype not in caps.dtypes:
        raise fail("dtype", dtype, f"is not in caps.dtypes={caps.dtypes}",
                   "draw only the dtypes the implementation declares")


def check_device(device: Any, caps: Capabilities | None) -> None:
    if caps is not None and device not in caps.devices:
        raise fail("device", device, f"is not in caps.devices={caps.devices}",
                   "pass one of the declared devices")


def check_bool_or_none(name: str, value: Any) -> None:
    if value not in (None, True, False):
        raise fail(name, value, "must be True, False or None (either)", "pass one of them")


def check_range(name_min: str, lo: int, name_max: str, hi: int, floor: int = 1) -> None:
    """``lo`` and ``hi`` are ints with ``floor <= lo <= hi``."""
    if not isinstance(lo, int) or lo < floor:
        raise fail(name_min, lo, f"must be an int >= {floor}", f"pass {name_min}>={floor}")
    if not isinstance(hi, int) or hi < lo:
        raise fail(name_max, hi, f"must be an int >= {name_min}={lo}",
                   f"pass {name_max}>={lo} or lower {name_min}")


def check_capped_range(name_min: str, lo: int, name_max: str, hi: int, given_min: Any,
                       given_max: Any, caps_note: str) -> None:
    """Raise when [lo, hi] (user bounds tightened by the caps) is empty."""
    for name, value in ((name_min, given_min), (name_max, given_max)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise fail(name, value, "must be an int >= 1", f"pass {name}>=1")
    if hi < lo:
        raise fail(name_max if given_max is not None else name_min,
                   given_max if given_max is not None else given_min,
                   f"leaves no size: [{name_min}, {name_max}] tightened by {caps_note} is [{lo}, {hi}]",
                   f"choose bounds that overlap {caps_note}")


def choices(name: str, value: Any, known: Sequence[str], default: Sequence[str]) -> list[str]:
    """A non-empty sub-sequence of ``known`` (``value=None`` means ``default``), in ``known``'s order.

    ``known`` is ordered simplest first, so the result is too: a strategy that
    samples from it shrinks toward the simplest allowed name.
    """
    if value is None:
        value = default
    if isinstance(value, str) or not isinstance(value, Collection):
        raise fail(name, value, "must be a collection of names", f"pass e.g. {name}={tuple(known[:1])!r}")
    unknown = [v for v in value if v not in known]
    if unknown:
        raise fail(name, value, f"contains unknown {unknown!r}", f"choose from {tuple(known)}")
    chosen = [k for k in known if k in value]
    if not chosen:
        raise fail(name, value, "is empty", f"pass at least one of {tuple(known)}")
    return chosen


def _choose_features(names: set[str]) -> str:
    renamed = renamed_mha_features(names)
    return (f"{renamed}; " if renamed else "") + f"choose from {sorted(ALL_MHA_FEATURES)}"


def mha_feature_sets(caps: Capabilities | None, features: Any, required: Any) -> tuple[set[str], set[str]]:
    """(allowed, required) MHA feature sets, checked against each other and ``caps``."""
    declared = implied_mha_features(caps.mha_features if caps is not None else ALL_MHA_FEATURES)
    if features is None:
        allowed = declared
    else:
        if isinstance(features, str) or not isinstance(features, Collection):
            raise fail("features", features, "must be a collection of MHA feature names",
                       "pass e.g. features={'need_weights'} (or an empty set for none)")
        allowed = implied_mha_features(features)
        if allowed - ALL_MHA_FEATURES:
            raise fail("features", features, f"has unknown {sorted(allowed - ALL_MHA_FEATURES)}",
                       _choose_features(allowed))
        if allowed - declared:
            raise fail("features", features, f"has {sorted(allowed - declared)} outside "
                       f"caps.mha_features", "drop them")
    required = set(required or ())
    unknown = required - ALL_MHA_FEATURES
    if unknown:
        raise fail("required_features", sorted(required), f"has unknown {sorted(unknown)}",
                   _choose_features(unknown))
    if required - allowed:
        raise fail("required_features", sorted(required), f"needs {sorted(required - allowed)} "
                   "which features/caps.mha_features do not allow", "allow them or drop them")
    if "dropout" in required:
        raise fail("required_features", sorted(required), "contains 'dropout', which cases do "
                   "not carry (the runner sets the module's dropout)", "drop 'dropout'")
    return allowed, required


def resolve_flag(name: str, value: Any, feature: str, allowed: set[str], required: set[str],
                 *, on_means_feature: bool = True) -> bool | None:
    """An MHA forward flag forced by argument or feature set; None = draw it."""
    check_bool_or_none(name, value)
    uses = value if on_means_feature else (None if value is None else not value)
    if uses and feature not in allowed:
        raise fail(name, value, f"needs feature {feature!r}, not allowed by features/caps",
                   f"pass {name}=None")
    if uses is False and feature in required:
        raise fail(name, value, f"contradicts required_features containing {feature!r}",
                   "drop one of them")
    if uses is None:
        if feature in required:
            uses = True
        elif feature not in allowed:
            uses = False
    if uses is None:
        return None
    return uses if on_means_feature else not uses
