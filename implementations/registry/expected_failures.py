"""Expected-failures files: ``implementations/xfail/<name>.toml`` as ExpectedFailure data.

A built-in's file is named after its registered name; the registry attaches the
entries when it builds the built-in (:func:`implementations.registry.resolution.registered`).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from implementations.base import MATCH_COMPARISONS, ExpectedFailure, ImplementationError

__all__ = ["XFAIL_DIR", "load_expected_failures"]

#: Where the built-ins' expected-failures files live.
XFAIL_DIR = Path(__file__).resolve().parent.parent / "xfail"

_ENTRY_KEYS = {"property", "match", "reason", "reference"}


def load_expected_failures(name: str, directory: Path | None = None) -> tuple[ExpectedFailure, ...]:
    """Entries of ``implementations/xfail/<name>.toml`` (none when the file is absent).

    Each ``[[xfail]]`` has ``property`` (or ``"*"``), ``reason``, optional ``match`` and
    ``reference`` (CONTRACTS.md); ``match`` values are matched by
    :meth:`ExpectedFailure.applies` (plain value, list = any of, ``"none"`` = None, or a
    table of comparisons ``lt/le/gt/ge/ne/in``, validated here).
    """
    path = (directory or XFAIL_DIR) / f"{name}.toml"
    if not path.is_file():
        return ()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ImplementationError(f"{path} is not valid TOML: {exc}") from exc
    return tuple(_entry(path, index, entry) for index, entry in enumerate(data.get("xfail", [])))


def _entry(path: Path, index: int, entry: dict) -> ExpectedFailure:
    """One validated ``[[xfail]]`` table."""
    unknown = set(entry) - _ENTRY_KEYS
    if unknown or "property" not in entry or "reason" not in entry:
        raise ImplementationError(
            f"{path} entry {index}: needs property and reason (optional match, reference); "
            f"got keys {sorted(entry)}"
        )
    match = dict(entry.get("match", {}))
    for key_name, wanted in match.items():
        if isinstance(wanted, dict) and (not wanted or set(wanted) - set(MATCH_COMPARISONS)):
            raise ImplementationError(
                f"{path} entry {index}: match.{key_name}={wanted!r}; a table value must use "
                f"only {sorted(MATCH_COMPARISONS)} (e.g. {{ le = 0.0 }})"
            )
    return ExpectedFailure(
        property=entry["property"], reason=entry["reason"],
        match=match, reference=entry.get("reference", ""),
    )
