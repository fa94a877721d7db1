"""The smaller cases a failing directed case is shrunk through (``conformance.directed.shrink``):
the sizes and values of SDPA, flash and MHA cases, and the helpers every level's passes
share (smaller sizes to try, values rounded to quarters, the head and head-dim changes of
a case seen through its sizes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from conformance.calls.flash_cases import FlashCase
from conformance.core.cases import MHACase, SDPACase


class _Sized:
    """A case of another level seen through ``sizes()`` (N, K, E, Ev), its ``key`` and
    ``value`` arrays, for the head passes shared with SDPA."""

    def __init__(self, case: Any, key: Any, value: Any) -> None:
        self.case, self.key, self.value = case, key, value

    def sizes(self) -> dict[str, int]:
        return {"N": self.case.N, "K": self.case.K, "E": self.case.E, "Ev": self.case.Ev}


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
    """E (with Ev where they are equal or the value is the key)."""
    s = case.sizes()
    together = case.value is case.key or s["E"] == s["Ev"]
    for v in _smaller(s["E"]):
        yield {"E": v, "Ev": v} if together else {"E": v}


def _value_dims(case: SDPACase) -> Iterator[dict[str, int]]:
    """Ev, where it differs from E (a pass of its own: E shrinking first must not stop it)."""
    s = case.sizes()
    if case.value is not case.key and s["E"] != s["Ev"]:
        for v in _smaller(s["Ev"]):
            yield {"Ev": v}


#: The passes over the sizes, in order: each tries its smaller sizes, smallest first.
_SIZE_PASSES: tuple[Callable[[SDPACase], Iterator[dict[str, int]]], ...] = (
    _dim("B"), _heads, _dim("L"), _dim("S"), _head_dims, _value_dims)


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


def _flash_resized(case: FlashCase, **sizes: int) -> FlashCase:
    """``case`` cut to smaller sizes, its options cut alike (ALiBi slopes and sinks to the
    heads kept, per-head FP8 descales to the batch and kv heads kept)."""
    s = {**case.sizes(), **sizes}
    B, N, K, L, S, E, Ev = (s[d] for d in ("B", "N", "K", "L", "S", "E", "Ev"))
    shared = case.value is case.key
    key = np.ascontiguousarray(case.key[:B, :S, :K, :E])
    changes: dict[str, Any] = {
        "query": np.ascontiguousarray(case.query[:B, :L, :N, :E]), "key": key,
        "value": key if shared else np.ascontiguousarray(case.value[:B, :S, :K, :Ev])}
    if case.alibi_slopes is not None:
        slopes = case.alibi_slopes
        changes["alibi_slopes"] = np.ascontiguousarray(slopes[:N] if slopes.ndim == 1 else slopes[:B, :N])
    if case.sinks is not None:
        changes["sinks"] = np.ascontiguousarray(case.sinks[:N])
    for name in ("q_descale", "k_descale", "v_descale"):
        d = getattr(case, name)
        if d is not None and d.shape != (1,):
            changes[name] = np.ascontiguousarray(d[:B, :K])
    return case.replace(**changes)


def _cut_sequence(case: MHACase, x: np.ndarray, length: int, B: int) -> np.ndarray:
    """An input ``x`` of ``case`` cut to its first ``length`` positions and ``B`` items, in
    the case's layout (unbatched (L, D), batch-first (B, L, D), else (L, B, D))."""
    if case.unbatched:
        return np.ascontiguousarray(x[:length])
    return np.ascontiguousarray(x[:B, :length] if case.batch_first else x[:length, :B])


def _mha_resized(case: MHACase, B: int, L: int, S: int) -> MHACase:
    """``case`` cut to batch ``B`` and lengths ``L``, ``S`` (a self-attention case stays one;
    masks cut alike: key padding (B, S), attn_mask (L, S) or (B*N, L, S) batch-major)."""
    self_attention = case.self_attention

    def cut(x: np.ndarray, length: int) -> np.ndarray:
        return _cut_sequence(case, x, length, B)

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


def _mha_queries(case: MHACase, L: int) -> MHACase:
    """Self-attention ``case`` with its first ``L`` queries over all its keys: a
    cross-attention case whose key and value are one input (the whole sequence)."""
    whole = case.query
    query = _cut_sequence(case, whole, L, case.B)
    attn = case.attn_mask
    if attn is not None:
        attn = np.ascontiguousarray(attn[..., :L, :])
    notes = tuple(n for n in case.notes if n != "self_attention")
    return case.replace(query=query, key=whole, value=whole, attn_mask=attn, notes=notes)


def _mha_heads(case: MHACase, N: int, E: int) -> MHACase | None:
    """``case`` with ``N`` heads of head dim ``E`` (embed_dim N·E): the module's weights cut
    to the first N heads' first E rows of each projection and the first N·E input and
    output features, inputs of embed_dim wide cut alike (kdim/vdim kept), a per-head
    attn_mask to the heads kept. None where a kdim/vdim module would become a packed one."""
    p, D, E0 = case.params, case.D, case.D // case.N
    D1 = N * E
    rows = np.array([h * E0 + e for h in range(N) for e in range(E)], dtype=int)
    packed = p.packed
    kdim, vdim = (D1, D1) if packed else (p.kdim, p.vdim)
    if not packed and kdim == D1 and vdim == D1:
        return None

    def cut(a: np.ndarray | None, index: Any) -> np.ndarray | None:
        return None if a is None else np.ascontiguousarray(a[index])

    three = np.concatenate([rows, D + rows, 2 * D + rows])
    params = dataclasses.replace(
        p, embed_dim=D1, num_heads=N, kdim=kdim, vdim=vdim,
        out_proj_weight=cut(p.out_proj_weight, np.ix_(np.arange(D1), rows)),
        out_proj_bias=cut(p.out_proj_bias, np.arange(D1)),
        in_proj_weight=cut(p.in_proj_weight, np.ix_(three, np.arange(D1))) if packed else None,
        in_proj_bias=cut(p.in_proj_bias, three),
        q_proj_weight=None if packed else cut(p.q_proj_weight, np.ix_(rows, np.arange(D1))),
        k_proj_weight=None if packed else cut(p.k_proj_weight, rows),
        v_proj_weight=None if packed else cut(p.v_proj_weight, rows),
        bias_k=cut(p.bias_k, (..., rows)), bias_v=cut(p.bias_v, (..., rows)))
    query = np.ascontiguousarray(case.query[..., :D1])
    if case.self_attention:
        key = value = query
    else:
        key = np.ascontiguousarray(case.key[..., :D1]) if packed else case.key
        value = key if case.value is case.key else (np.ascontiguousarray(case.value[..., :D1]) if packed
                                                    else case.value)
    attn = case.attn_mask
    if attn is not None and attn.ndim == 3:  # (B*N, L, S), batch-major
        attn = np.ascontiguousarray(attn[[b * case.N + h for b in range(case.B) for h in range(N)]])
    return case.replace(params=params, query=query, key=key, value=value, attn_mask=attn)


def _mha_sizes(case: MHACase) -> Iterator[Callable[[MHACase], Iterator[MHACase]]]:
    """The size passes of an MHA case: the batch, the heads, the head dim, then the
    lengths (together for self-attention, whose keys are its queries)."""
    self_attention = case.self_attention
    if not case.unbatched:
        yield lambda c: (_mha_resized(c, b, c.L, c.S) for b in _smaller(c.B))
    yield lambda c: (x for n in _smaller(c.N) if (x := _mha_heads(c, n, c.D // c.N)) is not None)
    yield lambda c: (x for e in _smaller(c.D // c.N) if (x := _mha_heads(c, c.N, e)) is not None)
    if self_attention:
        yield lambda c: (_mha_resized(c, c.B, n, n) for n in _smaller(c.L))
        # then fewer queries over the same keys: a bug that needs two keys (a scale, a
        # split of heads) shrinks to one query, as a cross-attention case (key = value)
        yield lambda c: (_mha_queries(c, n) for n in _smaller(c.L)) if c.self_attention else iter(())
    else:
        yield lambda c: (_mha_resized(c, c.B, n, c.S) for n in _smaller(c.L))
        yield lambda c: (_mha_resized(c, c.B, c.L, n) for n in _smaller(c.S))


def _mha_masks(case: MHACase) -> Iterator[MHACase]:
    """The case without its masks (both, then each alone: the key padding first): a bug
    that needs no mask then shrinks to one key, which a row masked in one head cannot. An
    ``is_causal`` case keeps its attn_mask (the flag is a hint about it)."""
    notes = tuple(n for n in case.notes if n != "fully_masked:forced")
    droppable = [name for name in ("key_padding_mask", "attn_mask")
                 if getattr(case, name) is not None and not (name == "attn_mask" and case.is_causal)]
    for dropped in ([droppable] if droppable else []) + ([[n] for n in droppable] if len(droppable) > 1 else []):
        yield case.replace(**dict.fromkeys(dropped), notes=notes)


def _mha_weights(case: MHACase) -> Iterator[MHACase]:
    """The module's weights and biases rounded as the inputs are (scaled to at most 2,
    multiples of 1, 1/2, 1/4): printed in a few digits, exact in every dtype."""
    p = case.params
    names = [f.name for f in dataclasses.fields(p)
             if isinstance(getattr(p, f.name), np.ndarray)]
    if _simple_arrays([getattr(p, n) for n in names]):
        return
    for steps in (1, 2, 4):
        yield case.replace(params=dataclasses.replace(p, **{n: _quarters(getattr(p, n), steps) for n in names}))


def _mha_values(case: MHACase) -> Iterator[MHACase]:
    if _simple(case):
        return
    self_attention = case.self_attention
    for steps in (1, 2, 4):
        query = _quarters(case.query, steps)
        key = query if self_attention else _quarters(case.key, steps)
        yield case.replace(query=query, key=key, value=query if self_attention else key if case.value is case.key
                           else _quarters(case.value, steps))


def _simple(case: SDPACase | MHACase) -> bool:
    """Whether every value is already a multiple of a quarter within [-2, 2]."""
    return _simple_arrays([case.query, case.key, case.value])


def _simple_arrays(arrays: list[np.ndarray]) -> bool:
    """Whether every value of ``arrays`` is a multiple of a quarter within [-2, 2]."""
    arrays = [np.asarray(a, dtype=np.float64) for a in arrays]
    return all(np.all(np.abs(a) <= 2) and np.all(a * 4 == np.round(a * 4)) for a in arrays)


def _through(resized: Callable[..., Any], changes: Callable[[Any], Iterator[dict[str, int]]],
             arrays: Callable[[Any], tuple[Any, Any]] | None = None) -> Callable[[Any], Iterator[Any]]:
    """A pass: ``resized(case, **change)`` for each size change ``changes`` proposes, the case
    seen through its sizes (a case of another level through ``_Sized``, with the key and
    value arrays ``arrays(case)`` gives)."""
    def proposals(case: Any) -> Iterator[Any]:
        seen = case if arrays is None else _Sized(case, *arrays(case))
        return (resized(case, **change) for change in changes(seen))
    return proposals


def sdpa_passes(case: SDPACase | FlashCase) -> list[Callable[[Any], Iterator[Any]]]:
    """The passes of an SDPA or flash case: its sizes, then its values."""
    resized = _flash_resized if isinstance(case, FlashCase) else _resized
    sizes = [_through(resized, p) for p in _SIZE_PASSES]
    return [*sizes, lambda c: _value_changes(c) if c.regime != "normal" or not _simple(c) else iter(())]


def mha_passes(case: MHACase) -> list[Callable[[Any], Iterator[Any]]]:
    """The passes of an MHA case: its masks dropped, its sizes, then its inputs' values
    and its module's weights."""
    return [_mha_masks, *_mha_sizes(case), _mha_values, _mha_weights]

