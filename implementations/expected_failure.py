"""A known deviation of an implementation, as data: :class:`ExpectedFailure`, and how its
``match`` table is read against a case's attributes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["MATCH_COMPARISONS", "ExpectedFailure"]


@dataclass(frozen=True)
class ExpectedFailure:
    """A known deviation: property id (+ optional case filter) -> reason.

    ``match`` maps case attribute names (see ``conformance.core.cases``) to the value
    (or list of values) they must have for the entry to apply, e.g. ``{"level": "mha",
    "need_weights": True}``; an empty match applies to every case of the property.
    """

    property: str
    reason: str
    match: Mapping[str, Any] = field(default_factory=dict)
    reference: str = ""  # e.g. "pytorch/pytorch#41508"
    #: A deviation that shows on some values, sizes and machines only (which ones
    #: depend on the CPU's kernels, not on a rule the entry could state): the cases it
    #: covers may pass, so it is never STALE.
    intermittent: bool = False

    def applies(self, property_id: str, case_attrs: Mapping[str, Any]) -> bool:
        """Whether this entry covers ``property_id`` on a case with ``case_attrs``.

        ``property`` may be ``"*"`` (a deviation that shows in every property).
        A ``match`` value is compared with the case attribute of that name: a
        list matches any of its members; a table of comparisons
        (``lt/le/gt/ge/ne/in``, e.g. ``{"le": 0.0}``) must all hold (a None
        attribute never satisfies one); the string ``"none"`` matches None
        (TOML has no null); anything else must be equal.
        """
        if self.property not in ("*", property_id):
            return False
        return all(_matches(case_attrs.get(key), wanted) for key, wanted in self.match.items())


#: The comparisons a table value of ``ExpectedFailure.match`` may use.
MATCH_COMPARISONS: dict[str, Callable[[Any, Any], bool]] = {
    "lt": lambda got, bound: got < bound,
    "le": lambda got, bound: got <= bound,
    "gt": lambda got, bound: got > bound,
    "ge": lambda got, bound: got >= bound,
    "ne": lambda got, bound: got != bound,
    "in": lambda got, bound: got in bound,
}


def _matches(got: Any, wanted: Any) -> bool:
    if isinstance(wanted, Mapping):
        if got is None:
            return False
        try:
            return all(MATCH_COMPARISONS[op](got, bound) for op, bound in wanted.items())
        except (TypeError, KeyError):
            return False
    if isinstance(wanted, (list, tuple, set, frozenset)):
        return any(_matches(got, w) for w in wanted)
    if wanted == "none":
        return got is None or got == "none"
    return got == wanted
