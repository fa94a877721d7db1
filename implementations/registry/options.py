"""``--impl-option key=value``: override any declared or probed capability.

Keys are :class:`~implementations.base.Capabilities` fields, e.g. ``causal=lower_right``,
``fully_masked=nan``, ``dtypes=float32,float16``, ``gqa=false``; each value is parsed and
validated, and a bad key or value raises ImplementationError listing what is valid.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from implementations.base import (
    ALL_DTYPES,
    ALL_FLASH_FEATURES,
    ALL_MASK_KINDS,
    ALL_MHA_FEATURES,
    CAUSAL_ALIGNMENTS,
    FULLY_MASKED_POLICIES,
    Capabilities,
    Implementation,
    ImplementationError,
)

__all__ = ["apply_options"]


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError("use true or false")


def _parse_list(choices: tuple[str, ...] | frozenset[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(item.strip() for item in text.split(",") if item.strip())
        bad = [item for item in items if item not in choices]
        if bad or not items:
            raise ValueError(f"a comma-separated list of {sorted(choices)}; {bad or text!r} is not")
        return items
    return parse


def _parse_choice(choices: tuple[str, ...], *, allow_none: bool = False) -> Callable[[str], str | None]:
    def parse(text: str) -> str | None:
        if allow_none and text.strip().lower() in ("none", "false", "no"):
            return None
        if text.strip() not in choices:
            raise ValueError(f"one of {list(choices) + (['none'] if allow_none else [])}")
        return text.strip()
    return parse


def _parse_optional_int(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    value = int(text)
    if value < 1:
        raise ValueError("a positive integer or none")
    return value


def _parse_mha_features(text: str) -> frozenset[str]:
    return frozenset(() if text.strip().lower() == "none" else _parse_list(ALL_MHA_FEATURES)(text))


def _parse_flash_features(text: str) -> frozenset[str]:
    return frozenset(() if text.strip().lower() == "none" else _parse_list(ALL_FLASH_FEATURES)(text))


def _option_parsers() -> dict[str, Callable[[str], Any]]:
    """Capabilities field -> parser of its ``--impl-option`` text (every bool field too)."""
    parsers: dict[str, Callable[[str], Any]] = {
        "devices": _parse_list(("cpu", "cuda", "mps", "xpu")),
        "dtypes": _parse_list(ALL_DTYPES),
        "mask_kinds": lambda text: frozenset(_parse_list(ALL_MASK_KINDS)(text)),
        "causal": _parse_choice(CAUSAL_ALIGNMENTS, allow_none=True),
        "fully_masked": _parse_choice(FULLY_MASKED_POLICIES),
        "mha_features": _parse_mha_features,
        "flash_features": _parse_flash_features,
        "max_head_dim": _parse_optional_int,
        "max_seq_len": _parse_optional_int,
        "min_head_dim": _parse_optional_int,
    }
    for field in dataclasses.fields(Capabilities):
        if field.type in ("bool", bool):
            parsers[field.name] = _parse_bool
    return parsers


_OPTION_PARSERS = _option_parsers()


def apply_options(impl: Implementation, options: Mapping[str, str]) -> Implementation:
    """``impl`` with capabilities overridden by ``--impl-option key=value`` pairs
    (applied at both levels)."""
    changes: dict[str, Any] = {}
    for key_name, text in options.items():
        parser = _OPTION_PARSERS.get(key_name)
        if parser is None:
            raise ImplementationError(
                f"--impl-option {key_name}={text}: unknown option {key_name!r}; valid options are "
                f"{', '.join(sorted(_OPTION_PARSERS))}"
            )
        try:
            changes[key_name] = parser(str(text))
        except ValueError as exc:
            raise ImplementationError(
                f"--impl-option {key_name}={text}: bad value for {key_name!r}; expected {exc}"
            ) from exc
    def overridden(caps: Capabilities) -> Capabilities:
        # A probe note ("causal: ...") no longer describes a value the user set.
        notes = tuple(n for n in caps.probe_notes if n.split(":", 1)[0] not in changes)
        return caps.replace(**changes, probe_notes=notes)

    try:
        caps = overridden(impl.capabilities)
        mha_caps = overridden(impl.mha_capabilities) if impl.mha_capabilities else None
        flash_caps = overridden(impl.flash_capabilities) if impl.flash_capabilities else None
    except ImplementationError as exc:
        raise ImplementationError(f"--impl-option values {dict(options)} are inconsistent: {exc}") from exc
    return dataclasses.replace(impl, capabilities=caps, mha_capabilities=mha_caps,
                               flash_capabilities=flash_caps)
