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
way, in one sweep, or until :data:`BUDGET` examples were checked.

A proposal is checked only when the property's own strategy could have drawn it
(``directed.admission.admitted``, with the arguments the property built its directed
cases with: :func:`remember_arguments`), so a shrunk case is never one the implementation
does not claim. SDPA and MHA cases are shrunk (an MHA case in its batch and lengths,
a self-attention one with L = S, and its inputs' values; its module's weights are kept);
a directed case of another level is reported as written.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from conformance.core.cases import MHACase, SDPACase

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


def _smaller(value: int, low: int = 1) -> list[int]:
    """Smaller sizes to try for ``value``, smallest first."""
    return sorted({v for v in (low, value // 2, value - 1) if low <= v < value})


def _cut(mask: np.ndarray | None, shape: tuple[int, int, int, int]) -> np.ndarray | None:
    """``mask`` (broadcastable to (B, N, L, S)) cut to a smaller ``shape``."""
    if mask is None:
        return None
    index = tuple(slice(None) if size == 1 else slice(0, shape[axis - mask.ndim + 4])
                  for axis, size in enumerate(mask.shape))
    return np.ascontiguousarray(mask[index])


def _resized(case: SDPACase, **sizes: int) -> SDPACase:
    s = {**case.sizes(), **sizes}
    B, N, K, L, S, E, Ev = (s[d] for d in ("B", "N", "K", "L", "S", "E", "Ev"))
    shared = case.value is case.key
    key = np.ascontiguousarray(case.key[:B, :K, :S, :E])
    return case.replace(
        query=np.ascontiguousarray(case.query[:B, :N, :L, :E]),
        key=key,
        value=key if shared else np.ascontiguousarray(case.value[:B, :K, :S, :Ev]),
        attend_mask=_cut(case.attend_mask, (B, N, L, S)),
        additive_mask=_cut(case.additive_mask, (B, N, L, S)),
        sinks=None if case.sinks is None else np.ascontiguousarray(case.sinks[:N]),
    )


def _heads(case: SDPACase) -> Iterator[dict[str, int]]:
    s = case.sizes()
    group = s["N"] // s["K"]
    pairs = {(g * k, k) for k in [*_smaller(s["K"]), s["K"]] for g in [*_smaller(group), group]}
    for n, k in sorted(pairs - {(s["N"], s["K"])}):
        yield {"N": n, "K": k}


def _dim(name: str) -> Callable[[SDPACase], Iterator[dict[str, int]]]:
    def changes(case: SDPACase) -> Iterator[dict[str, int]]:
        for v in _smaller(case.sizes()[name]):
            yield {name: v}
    return changes


def _head_dims(case: SDPACase) -> Iterator[dict[str, int]]:
    s = case.sizes()
    if case.value is case.key or s["E"] == s["Ev"]:
        for v in _smaller(s["E"]):
            yield {"E": v, "Ev": v}
    if case.value is not case.key and s["E"] != s["Ev"]:
        for name in ("E", "Ev"):
            for v in _smaller(s[name]):
                yield {name: v}


#: The passes over the sizes, in order: each tries its smaller sizes, smallest first.
_SIZE_PASSES: tuple[Callable[[SDPACase], Iterator[dict[str, int]]], ...] = (
    _dim("B"), _heads, _dim("L"), _dim("S"), _head_dims)


def _quarters(a: np.ndarray, steps: int) -> np.ndarray:
    """``a`` scaled to at most 2 in magnitude and rounded to multiples of 1/``steps``
    (exact in every dtype the suite draws, float8 included)."""
    a = np.asarray(a, dtype=np.float64)
    finite = np.isfinite(a)
    top = float(np.abs(a[finite]).max()) if finite.any() else 0.0
    if top == 0.0:
        return a.copy()
    out = a.copy()
    out[finite] = np.round(a[finite] / top * 2 * steps) / steps
    return out + 0.0  # no negative zeros in the reproducer


def _value_changes(case: SDPACase) -> Iterator[SDPACase]:
    for steps in (1, 2, 4):
        key = _quarters(case.key, steps)
        yield case.replace(query=_quarters(case.query, steps), key=key,
                           value=key if case.value is case.key else _quarters(case.value, steps),
                           regime="normal")


def _mha_resized(case: MHACase, B: int, L: int, S: int) -> MHACase:
    """``case`` cut to batch ``B`` and lengths ``L``, ``S`` (a self-attention case stays one;
    masks cut alike: key padding (B, S), attn_mask (L, S) or (B*N, L, S) batch-major)."""
    self_attention = case.self_attention

    def cut(x: np.ndarray, length: int) -> np.ndarray:
        if case.unbatched:
            return np.ascontiguousarray(x[:length])
        return np.ascontiguousarray(x[:B, :length] if case.batch_first else x[:length, :B])

    query = cut(case.query, L)
    key = query if self_attention else cut(case.key, S)
    value = query if self_attention else key if case.value is case.key else cut(case.value, S)
    padding = case.key_padding_mask
    if padding is not None:
        padding = np.ascontiguousarray(padding[..., :S] if padding.ndim == 1 else padding[:B, :S])
    attn = case.attn_mask
    if attn is not None:
        attn = np.ascontiguousarray(attn[:L, :S] if attn.ndim == 2 else attn[:B * case.N, :L, :S])
    return case.replace(query=query, key=key, value=value, key_padding_mask=padding, attn_mask=attn)


def _mha_sizes(case: MHACase) -> Iterator[Callable[[MHACase], Iterator[MHACase]]]:
    """The size passes of an MHA case: the batch, then the lengths (together for
    self-attention, whose keys are its queries)."""
    self_attention = case.self_attention
    if not case.unbatched:
        yield lambda c: (_mha_resized(c, b, c.L, c.S) for b in _smaller(c.B))
    if self_attention:
        yield lambda c: (_mha_resized(c, c.B, n, n) for n in _smaller(c.L))
    else:
        yield lambda c: (_mha_resized(c, c.B, n, c.S) for n in _smaller(c.L))
        yield lambda c: (_mha_resized(c, c.B, c.L, n) for n in _smaller(c.S))


def _mha_values(case: MHACase) -> Iterator[MHACase]:
    if _simple(case):
        return
    self_attention = case.self_attention
    for steps in (1, 2, 4):
        query = _quarters(case.query, steps)
        key = query if self_attention else _quarters(case.key, steps)
        yield case.replace(query=query, key=key, value=query if self_attention else key if case.value is case.key
                           else _quarters(case.value, steps))


def passes(case: Any) -> list[Callable[[Any], Iterator[Any]]]:
    """The shrinking passes of ``case``, simplest change first, each a function of the
    current smallest case giving its proposals (none for a case of a level other than SDPA
    and MHA)."""
    if isinstance(case, MHACase):
        return [*_mha_sizes(case), _mha_values]
    if not isinstance(case, SDPACase):
        return []
    sizes = [lambda c, p=p: (_resized(c, **change) for change in p(c)) for p in _SIZE_PASSES]
    return [*sizes, lambda c: _value_changes(c) if c.regime != "normal" or not _simple(c) else iter(())]


def _simple(case: SDPACase | MHACase) -> bool:
    """Whether every value is already a multiple of a quarter within [-2, 2]."""
    arrays = [np.asarray(a, dtype=np.float64) for a in (case.query, case.key, case.value)]
    return all(np.all(np.abs(a) <= 2) and np.all(a * 4 == np.round(a * 4)) for a in arrays)


def shrink(case: Any, fails: Callable[[Any], bool], *, admit: Callable[[Any], bool] | None = None,
           budget: int = BUDGET) -> tuple[Any, int]:
    """The smallest case found from ``case`` on which ``fails(candidate)`` holds, and the
    number of examples checked (at most ``budget``); ``admit(candidate)``: whether a
    proposal may be checked at all. One sweep of :func:`passes`: each keeps its first
    (smallest) failing proposal; a size that could not shrink is not tried again."""
    best, checked = case, 0
    for proposals in passes(case):
        for candidate in proposals(best):
            if checked >= budget:
                return best, checked
            if admit is not None and not admit(candidate):
                continue
            checked += 1
            if fails(candidate):
                best = candidate
                break
    return best, checked
