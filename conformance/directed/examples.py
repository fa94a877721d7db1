"""Directed examples: the smallest case of each known class of attention bug, run
by every property before its random search.

A property takes them with ``conformance_property(directed=...)`` and the same
arguments its strategy takes::

    cases=lambda t: cases_for(t, layouts=("contiguous",)),
    directed=lambda t: directed_for(t, layouts=("contiguous",)),

There is one generic list per level (:data:`SDPA_EXAMPLES`, :data:`MHA_EXAMPLES`),
built through the case model the strategies use (``SDPACase`` / ``MHACase``, values
from ``strategies.values.sdpa_values``), so checking, expected failures, reporting
and saving are unchanged. Each property adapts the list through its arguments:

* what defines an example's bug class (its sizes, a causal flag it needs, a
  fully-masked row, a scale, a layout, grouped heads, a module option) is kept or
  the example is dropped;
* the rest is adapted to what the property draws: the value regime, the absence
  of a mask / causal flag / grouping (replaced by the simplest the property
  allows when it forces one), contiguity, Ev != E where it is only preferred;
* the result is kept only when the property's strategy could have drawn it: its
  attributes are handed to ``sdpa_cases`` / ``mha_cases`` as forcing arguments
  (:func:`admitted`), whose own checks reject whatever the target's capabilities
  or the property's arguments rule out. A directed case is never one the
  implementation does not claim.

Every value regime a property can draw appears in at least one of its directed
SDPA cases (the examples carry different regimes; a plain small case fills in any
left out), so the derandomized ``ci`` profile reaches every regime × property pair
(``benchmarks/regime_coverage.py``). At most :data:`MAX_DIRECTED` per property.

The parts: ``directed_admission`` (:func:`admitted`, :func:`producible_regimes`, the
cap), ``directed_sdpa`` (the SDPA examples and their building) and ``directed_mha``
(the MHA ones); their public names are importable from here.
"""

from __future__ import annotations

from conformance.directed.admission import MAX_DIRECTED, admitted, producible_regimes
from conformance.directed.mha import MHA_EXAMPLES, MHAExample, mha_directed
from conformance.directed.sdpa import SDPA_EXAMPLES, SDPAExample, sdpa_directed
from conformance.strategies import REGIMES  # noqa: F401 - directed.REGIMES, as before the split

__all__ = [
    "MAX_DIRECTED",
    "SDPAExample",
    "MHAExample",
    "SDPA_EXAMPLES",
    "MHA_EXAMPLES",
    "sdpa_directed",
    "mha_directed",
    "admitted",
    "producible_regimes",
]
