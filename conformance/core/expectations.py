"""Expected failures during a run: which entry excuses a failing example, which
entries cover a passing one, which are stale, and whether an implementation's
entries name real properties and case attributes at all.

An entry is matched against the cases the property actually called (the call
specs the example logged: the V = identity probe, the permuted keys, the invalid
variant, with the call's ``is_causal`` flag, ``dropout_p``, ``grad`` and
``training``), not against the case Hypothesis drew; an example is covered by an
entry when any of its calls is.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from conformance.core.cases import MHA_ATTRIBUTES, SDPA_ATTRIBUTES
from implementations.base import ExpectedFailure

__all__ = ["ExpectedFailureLedger", "entry_errors", "attributes_of_level"]


def attributes_of_level(level: str | None) -> frozenset[str]:
    """The case attributes a ``match`` may name at ``level`` (None: any level)."""
    if level == "sdpa":
        return SDPA_ATTRIBUTES
    if level == "mha":
        return MHA_ATTRIBUTES
    from conformance.core import levels

    if level in levels.LEVEL_MODULES:
        return levels.module(level).ATTRIBUTES
    if level is not None:
        return frozenset()
    return SDPA_ATTRIBUTES.union(MHA_ATTRIBUTES, *(levels.module(n).ATTRIBUTES for n in levels.LEVEL_MODULES))


class ExpectedFailureLedger:
    """The expected failures of one property test (one target) and what happened
    to each: hits (failing examples it excused) and covered passes (passing
    examples it covered)."""

    def __init__(self, entries: Sequence[ExpectedFailure], property_id: str) -> None:
        self.property_id = property_id
        #: (index in the implementation's list, entry) of the entries of this property.
        self.entries = [(i, e) for i, e in enumerate(entries) if e.property in ("*", property_id)]
        self.hits = [0] * len(self.entries)
        self.covered_passes = [0] * len(self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def _covering(self, attrs: Sequence[Mapping[str, Any]]) -> list[int]:
        return [k for k, (_, e) in enumerate(self.entries)
                if any(e.applies(self.property_id, a) for a in attrs)]

    def excuse(self, attrs: Sequence[Mapping[str, Any]]) -> ExpectedFailure | None:
        """The first entry covering a failing example whose calls have ``attrs``
        (counted as a hit), or None: a real failure."""
        covering = self._covering(attrs)
        if not covering:
            return None
        self.hits[covering[0]] += 1
        return self.entries[covering[0]][1]

    def passed(self, attrs: Sequence[Mapping[str, Any]]) -> None:
        """A passing example whose calls have ``attrs``: evidence against the entries covering it."""
        for k in self._covering(attrs):
            self.covered_passes[k] += 1

    def stale(self) -> list[tuple[ExpectedFailure, int]]:
        """Entries whose covered cases were drawn and all passed, with how many
        passed. A wildcard entry ("*") is never judged by one property: many
        properties cannot see its deviation at all (output_contract, say); nor is an
        intermittent one, whose covered cases may pass."""
        return [(e, n) for (_, e), n, h in zip(self.entries, self.covered_passes, self.hits, strict=True)
                if n and not h and e.property != "*" and not e.intermittent]

    def summary(self) -> list[dict[str, Any]]:
        """Per entry: its index in the implementation's list, hits, covered passes
        (what the certificate sums over the run for "never applied")."""
        return [{"entry": i, "hits": h, "covered_passes": n}
                for (i, _), h, n in zip(self.entries, self.hits, self.covered_passes, strict=True)]


def entry_errors(entries: Sequence[ExpectedFailure], properties: Mapping[str, Any]) -> list[str]:
    """One message per mistake in ``entries``: a property that is not a registered
    id (``properties``: id -> info with ``.level``), a ``match`` key that is not a
    case attribute of the property's level. Each message names the valid ones."""
    errors = []
    for index, entry in enumerate(entries):
        where = f"expected failure {index} (property={entry.property!r}, reason={entry.reason[:50]!r})"
        level = None
        if entry.property != "*":
            info = properties.get(entry.property)
            if info is None:
                close = difflib.get_close_matches(entry.property, list(properties), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                errors.append(f"{where}: property {entry.property!r} is not a property id{hint}; "
                              f"valid: '*' or one of {', '.join(sorted(properties))}")
                continue
            level = info.level
        valid = attributes_of_level(level)
        for key in entry.match:
            if key not in valid:
                close = difflib.get_close_matches(key, sorted(valid), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                errors.append(f"{where}: match key {key!r} is not a case attribute"
                              f"{' of level ' + level if level else ''}{hint}; valid: {', '.join(sorted(valid))}")
    return errors
