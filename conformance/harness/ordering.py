"""The order of the properties within a level: most bugs killed per second first.

A run that stops at its first failure (``-x``, ``--impl-exitfirst``) pays, on a wrong
implementation, for every property certified before the one that fails. The order is
measured, not guessed: ``benchmarks/kill_matrix.py`` runs every property on every
mutant of the bug zoo, times each property on the correct built-ins, orders each level
greedily by new kills per second and writes ``property_order.json`` next to this file.
A property the file does not list (a new one) keeps its place after the listed ones of
its level, in collection order; a file that is missing or unreadable leaves the
collection order as it is.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

__all__ = ["LEVEL_ORDER", "ORDER_FILE", "property_rank"]

#: The order in which an implementation's levels are certified: the SDPA level first, the
#: levels built on it after it. A bug of an SDPA callable also fails the flash level
#: derived from it (``implementations/flash_from_sdpa.py``), where the case is a flash
#: call, no ``spec.variants`` variant names a cause and the directed examples are not
#: shrunk; found first at its own level it gets the smallest case and its diagnosis
#: (measured on the zoo: minimal counterexamples 29/78 with the flash level first).
LEVEL_ORDER = {"sdpa": 0, "mha": 1, "flash": 2, "varlen": 3, "kvcache": 4, "sharded": 5}

ORDER_FILE = Path(__file__).resolve().parent / "property_order.json"


@lru_cache(maxsize=1)
def _ranks() -> dict[str, dict[str, int]]:
    try:
        levels = json.loads(ORDER_FILE.read_text())["levels"]
        return {level: {prop: rank for rank, prop in enumerate(props)} for level, props in levels.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def property_rank(level: str, prop: str | None) -> int:
    """``prop``'s place in ``level``'s measured order; unlisted ones after the listed."""
    ranks = _ranks().get(level, {})
    return ranks.get(prop or "", len(ranks))
