"""Shrinking a failing directed case: a smaller failing case of the same property and
target, searched for on a budget counted in examples.

A directed example (``conformance.directed.examples``) is the smallest case of its bug
class as written for every implementation, not for the one that fails: ``gqa_tile`` fails
the grouped-query example (``B=1 N=4 K=2 L=2 S=3 E=4``, values near 1e-31) as surely with
``L = S = E = 1`` and values of a quarter. After a directed case fails, the runner
(``conformance.harness.runner``) hands it here: :func:`passes` propose smaller cases,
simplest change first (each size towards 1, smallest first, then the values set to the
normal regime and rounded to halves or quarters, exact in every dtype and printed in a
few digits), and :func:`shrink` keeps each pass's first proposal that still fails the same
way, sweeping the passes again while one of them found a smaller case (a shorter key
axis can let the queries shrink), until a sweep finds none or :data:`BUDGET` examples
were checked.

A proposal is checked only when the property's own strategy could have drawn it
(``directed.admission.admitted``, with the arguments the property built its directed
cases with: :func:`remember_arguments`), so a shrunk case is never one the implementation
does not claim. SDPA, flash, varlen and MHA cases are shrunk (an MHA case in its masks,
dropped, its batch, heads and head dim, its module's weights cut with them, its lengths, a
self-attention one with L = S and then in its queries alone over the same keys, its
inputs' values and its weights' values; a flash case in its sizes and q, k, v values, its features as written: causal, window,
softcap, ALiBi and sink values cut to the heads kept, FP8 descales to the batch and kv heads
kept; a varlen case in its sequences (each alone, then each left out), heads, each
sequence's query and key lengths, head dims and values, per-sequence slopes and descales
cut alike, FP8 values as written; a kvcache case in its sequences (every per-sequence
array cut alike: cache_seqlens, cache_batch_idx, cache_leftpad, new keys, slopes, descales,
block table), heads, query length, new keys, each sequence's valid cache length, the
cache's room (whole pages when paged), head dims, page size, spare cache rows and pages,
and values, FP8 values as written); a sharded case
(``conformance.sharded.shrinking``, one layer up) in its sequence, world size (where a
group of another size starts cheaply: ranks forked on the CPU; else as written), window
sides, batch, heads, head dims and values (layout, causal flag and scale as written). The
passes are in ``shrink_sizes`` (SDPA, flash, MHA) and ``shrink_sequences`` (varlen, kvcache).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

from conformance.calls.flash_cases import FlashCase
from conformance.calls.kvcache import KVCacheCase
from conformance.calls.varlen import VarlenCase
from conformance.core.cases import MHACase, SDPACase
from conformance.directed.shrink_sequences import kvcache_passes, varlen_passes
from conformance.directed.shrink_sizes import mha_passes, sdpa_passes

__all__ = ["BUDGET", "remember_arguments", "arguments_of", "passes", "shrink"]

#: Most examples checked while shrinking one failing directed case (the proposals the
#: property's strategy could not draw are not checked, and not counted).
BUDGET = 24

#: The property's ``sdpa_cases`` arguments each directed case was built with.
_ARGUMENTS: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def remember_arguments(cases: list[Any], arguments: dict[str, Any]) -> list[Any]:
    """Note ``arguments`` (a property's strategy arguments) on each of ``cases``."""
    for case in cases:
        try:
            _ARGUMENTS[case] = dict(arguments)
        except TypeError:  # not weakly referenceable: shrunk without the property's arguments
            pass
    return cases


def arguments_of(case: Any) -> dict[str, Any] | None:
    """The strategy arguments ``case`` was built with (None: unknown)."""
    try:
        return _ARGUMENTS.get(case)
    except TypeError:
        return None


def passes(case: Any) -> list[Callable[[Any], Iterator[Any]]]:
    """The shrinking passes of ``case``, simplest change first, each a function of the
    current smallest case giving its proposals (none for a case of a level other than SDPA,
    MHA, flash, varlen and kvcache: the sharded level's are ``conformance.sharded.shrinking``'s)."""
    if isinstance(case, MHACase):
        return mha_passes(case)
    if isinstance(case, VarlenCase):
        return varlen_passes()
    if isinstance(case, KVCacheCase):
        return kvcache_passes()
    if isinstance(case, (SDPACase, FlashCase)):
        return sdpa_passes(case)
    return []


def shrink(case: Any, fails: Callable[[Any], bool], *, admit: Callable[[Any], bool] | None = None,
           budget: int = BUDGET,
           passes_of: Callable[[Any], list[Callable[[Any], Iterator[Any]]]] | None = None) -> tuple[Any, int]:
    """The smallest case found from ``case`` on which ``fails(candidate)`` holds, and the
    number of examples checked (at most ``budget``); ``admit(candidate)``: whether a
    proposal may be checked at all. Sweeps of ``passes_of(case)`` (default :func:`passes`;
    a level above this layer brings its own): each keeps its first
    (smallest) failing proposal; a pass that found nothing is not tried again until
    another pass finds a smaller case; the sweeps end when one finds none."""
    best, checked = case, 0
    tried: set[int] = set()  # passes that found nothing smaller since the last change
    while True:
        changed = False
        for i, proposals in enumerate((passes_of or passes)(case)):
            if i in tried:
                continue
            for candidate in proposals(best):
                if checked >= budget:
                    return best, checked
                if candidate is None:  # a change no case of the level can make
                    continue
                if admit is not None and not admit(candidate):
                    continue
                checked += 1
                if fails(candidate):
                    best, changed = candidate, True
                    tried.clear()
                    break
            else:
                tried.add(i)
        if not changed:
            return best, checked
