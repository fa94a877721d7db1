"""The SDPA directed examples: :data:`SDPA_EXAMPLES`, one per bug class, and
:func:`sdpa_directed`, which adapts them to a property's ``sdpa_cases`` arguments
(``conformance.directed.examples`` says how; it re-exports these names).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from conformance.calls.declarations import fit_head_dims, fit_lengths
from conformance.core.cases import LAYOUTS, NOTE_STRIDE0_BATCH, SDPACase
from conformance.directed.admission import MAX_DIRECTED, _pick, _seed, admitted
from conformance.directed.shrink import remember_arguments
from conformance.strategies import MASK_KINDS, REGIMES
from conformance.strategies.values import sdpa_values

__all__ = ["SDPAExample", "SDPA_EXAMPLES", "sdpa_directed"]

#: A case attribute an example needs ("required"), would like ("preferred") or
#: does without unless the property forces it ("incidental").
REQUIRED, PREFERRED, INCIDENTAL = "required", "preferred", "incidental"


@dataclass(frozen=True)
class SDPAExample:
    """One SDPA bug class and its smallest case.

    ``causal``: whether the declared causal flag is required, preferred or
    incidental; ``dead_row``: a mask that blocks every key of query row 0;
    ``Ev``: a value head dim other than E, preferred (E when the target or the
    property rules Ev != E out); ``scale`` and a non-contiguous ``layout`` are
    required; ``regime`` is the one this example brings, replaced by "normal" where
    the property does not draw it.
    """

    name: str
    L: int
    S: int
    B: int = 1
    N: int = 1
    K: int = 1
    E: int = 4
    Ev: int | None = None
    causal: str = INCIDENTAL
    dead_row: bool = False
    scale: float | None = None
    layout: str = "contiguous"
    regime: str = "normal"

    @property
    def grouped(self) -> bool:
        return self.K != self.N


#: The SDPA bug classes, smallest case each, most common first.
SDPA_EXAMPLES: tuple[SDPAExample, ...] = (
    SDPAExample("causal, one query before several keys (L=1<S)", L=1, S=2, causal=REQUIRED),
    SDPAExample("causal, more queries than keys (L>S; lower_right: the flag alone empties row 0)",
                L=3, S=2, causal=REQUIRED, regime="near_ties"),
    SDPAExample("grouped-query attention (N=4, K=2)", L=2, S=3, N=4, K=2, regime="tiny"),
    SDPAExample("a fully-masked query row", L=2, S=3, dead_row=True, regime="constant_rows"),
    # Ev != E here too (default scale, logits that vary): a default scale taken from the
    # value head dim, 1/sqrt(Ev), shows; the S=33 example's saturated softmax hides it.
    SDPAExample("one key block + 1 (S=17), Ev != E", L=2, S=17, Ev=2, regime="ascending"),
    SDPAExample("two key blocks + 1 (S=33), Ev != E", L=2, S=33, Ev=2, regime="large_logits"),
    SDPAExample("scale = 0 (read as 'no scale given' by `scale or default`)", L=1, S=2, scale=0.0),
    SDPAExample("negative scale (with the causal flag where allowed)", L=2, S=3, scale=-0.5,
                causal=PREFERRED),
    # Logits near 1e9 (the wide_range regime at its edge) with a scale that is not a
    # power of two: a backward that recomputes the softmax from a saved logsumexp is
    # off by exp(rounding error of a logit). Four heads: four draws of values.
    SDPAExample("logits near 1e9 (L=4, S=12, E=2, 4 heads)", L=4, S=12, E=2, N=4, K=4,
                regime="wide_range"),
    SDPAExample("stride-0 key/value (expanded along the batch)", L=2, S=3, B=2, layout="stride0"),
    SDPAExample("transposed q/k/v (non-contiguous heads)", L=3, S=3, N=2, K=2, layout="transposed"),
)

#: The plain case that brings a regime no example carries for a property.
_FILLER = SDPAExample("value regime", L=2, S=3)


@dataclass(frozen=True)
class _SDPAOptions:
    """What a property's SDPA arguments allow, option by option, simplest first:
    the preferences an example is adapted by (the final word is :func:`admitted`)."""

    causal: list[str | None]
    mask_kinds: list[str]
    regimes: list[str]
    layouts: list[str]
    gqa: list[bool]
    different_v_dim: list[bool]
    fully_masked: bool | None
    #: ``sdpa_cases``' ``scale_kinds``: True (any), False (default only) or the kinds.
    scale_kinds: Any = True


def _sdpa_options(target: Any, arguments: dict[str, Any]) -> _SDPAOptions:
    caps = target.caps

    def within(given: Any, declared: Sequence[Any]) -> list[Any]:
        return [d for d in declared if given is None or d in given]

    def flag(name: str, declared: bool) -> list[bool]:
        given = arguments.get(name)
        return [given] if given is not None else [False, True] if declared else [False]

    layouts = arguments.get("layouts", ("contiguous",))
    return _SDPAOptions(
        causal=within(arguments.get("causal"), [caps.causal] if caps.causal_only else
                      [None, caps.causal] if caps.causal else [None]),
        mask_kinds=within(arguments.get("mask_kinds"), [k for k in MASK_KINDS if k in caps.mask_kinds]),
        regimes=within(arguments.get("regimes"), REGIMES),
        layouts=within(layouts, LAYOUTS if caps.non_contiguous else ("contiguous",)),
        gqa=flag("gqa", caps.gqa),
        different_v_dim=flag("different_v_dim", caps.different_v_dim and not caps.shared_kv),
        fully_masked=arguments.get("fully_masked"),
        scale_kinds=arguments.get("scale_kinds", True),
    )


def _scale_allowed(kind: str, kinds: Any) -> bool:
    if kinds is True:
        return True
    if kinds is False:
        return kind == "default"
    return kind in kinds


def _incidental_scale(E: int, kinds: Any) -> float | None:
    """The scale of an example that needs none: the default where the property draws
    it, else the default's value given explicitly (same logits), else the simplest
    allowed kind."""
    if _scale_allowed("default", kinds):
        return None
    for kind, value in (("positive", 1 / np.sqrt(E)), ("negative", -1 / np.sqrt(E)),
                        ("tiny", 1e-6), ("zero", 0.0)):
        if _scale_allowed(kind, kinds):
            return float(value)
    return None


def _sdpa_mask(kind: str, dead_row: bool, B: int, L: int, S: int
               ) -> tuple[np.ndarray | None, np.ndarray | None, tuple[str, ...]]:
    """(attend_mask, additive_mask, notes): none; a dead row (every key of row 0
    blocked, shape (L, S)); or, for a property that needs some mask, key padding of
    the last key (shape (B, 1, 1, S))."""
    if kind == "none":
        return None, None, ()
    if dead_row:
        attend = np.ones((L, S), dtype=bool)
        attend[0] = False
        notes = ("mask_pattern=all", "mask_shape=(L,S)", "fully_masked:forced")
    else:
        attend = np.broadcast_to(np.arange(S) < max(S - 1, 1), (B, 1, 1, S)).copy()
        notes = ("mask_pattern=padding", "mask_shape=(B,1,1,S)")
    if kind == "bool":
        return attend, None, notes
    return None, np.where(attend, 0.0, -np.inf), notes + ("additive=zero_inf",)


def _build_sdpa(example: SDPAExample, target: Any, options: _SDPAOptions,
                index: int = 0) -> SDPACase | None:
    """``example`` adapted to the property's options (None: its bug class is ruled
    out); ``index`` spreads the examples over the layouts of a property that takes
    no contiguous input."""
    declared = target.caps.causal
    # Inside the declared lengths: L == S only at the larger length, multiples of a block
    # (the relation of L to S kept), under max_seq_len.
    lengths = fit_lengths(target.caps, example.L, example.S)
    if lengths is None:
        return None
    L, S = lengths
    if example.scale is not None and example.scale <= 0 and target.caps.positive_scale:
        return None
    if example.causal == REQUIRED:
        causal = declared if declared in options.causal else "ruled out"
    elif example.causal == PREFERRED:
        causal = _pick([declared, None], options.causal)
    else:
        causal = _pick([None, declared], options.causal)
    # A lower-right flag empties the first L - S rows by itself; otherwise a property
    # that needs a fully-masked row gets one from the mask.
    flag_empties_rows = causal == "lower_right" and L > S
    dead_row = example.dead_row or (options.fully_masked is True and not flag_empties_rows)
    masks = [k for k in options.mask_kinds if k != "none"] if dead_row else options.mask_kinds
    kind = _pick(["none", "bool", "additive"], masks)
    if causal == "ruled out" or kind is None:
        return None
    if example.grouped:
        heads = (example.N, example.K) if True in options.gqa else None
    else:
        heads = (example.N, example.K) if False in options.gqa else (2, 1)
    if example.layout == "contiguous":
        others = [x for x in options.layouts if x != "stride0"] or options.layouts
        layout = "contiguous" if "contiguous" in options.layouts else \
            others[index % len(others)] if others else None
    else:
        layout = example.layout if example.layout in options.layouts else None
    if heads is None or layout is None:
        return None
    N, K = heads
    B = max(example.B, 2) if layout == "stride0" else example.B
    Ev = example.Ev if example.Ev is not None and True in options.different_v_dim else example.E
    # The head dims inside the declared bounds (an example's E is incidental to its bug
    # class; Ev != E is kept where two head dims are allowed).
    dims = fit_head_dims(target.caps, example.E, Ev)
    if dims is None:
        return None
    E, Ev = dims
    regime = _pick([example.regime, "normal"], options.regimes)
    scale = example.scale if example.scale is not None else \
        _incidental_scale(E, options.scale_kinds)
    sizes = {"B": B, "N": N, "K": K, "L": L, "S": S, "E": E, "Ev": Ev}
    attend, additive, notes = _sdpa_mask(kind, dead_row, B, L, S)
    stride0 = [0] if layout == "stride0" else []
    query, key, value = sdpa_values(_seed(example.name, target.dtype), sizes, regime, target.dtype,
                                    scale, stride0, extreme=True)
    if target.caps.shared_kv:
        value = key  # one memory tensor
    notes += (NOTE_STRIDE0_BATCH,) if stride0 else ()
    return SDPACase(query=query, key=key, value=value, attend_mask=attend, additive_mask=additive,
                    causal=causal, scale=scale, dtype=target.dtype, device=target.device,
                    layout=layout, regime=regime, notes=notes + (f"directed: {example.name}",))


def _cap(cases: list[SDPACase], limit: int) -> list[SDPACase]:
    """At most ``limit`` cases, in their order: the first case of each regime and of
    each layout, then the others from the front."""
    chosen: set[int] = set()
    seen: set[tuple[str, str]] = set()
    for i, case in enumerate(cases):
        for key in (("regime", case.regime), ("layout", case.layout)):
            if key not in seen:
                seen.add(key)
                chosen.add(i)
    for i in range(len(cases)):
        if len(chosen) >= limit:
            break
        chosen.add(i)
    return [case for i, case in enumerate(cases) if i in chosen]


def sdpa_directed(target: Any, **arguments: Any) -> list[SDPACase]:
    """The directed SDPA cases of a property whose strategy is
    ``sdpa_cases(dtype=target.dtype, device=target.device, caps=target.caps, **arguments)``.

    :data:`SDPA_EXAMPLES` adapted to ``arguments`` (see the module docstring), each
    kept only when :func:`admitted`, then a plain small case for every regime the
    property draws that none of them carries; at most :data:`MAX_DIRECTED`.
    """
    options = _sdpa_options(target, arguments)
    cases: list[SDPACase] = []
    for index, example in enumerate(SDPA_EXAMPLES):
        case = _build_sdpa(example, target, options, index)
        if case is not None and admitted(target, case, **arguments):
            cases.append(case)
    carried = {case.regime for case in cases}
    for regime in options.regimes:
        if regime in carried:
            continue
        case = _build_sdpa(dataclasses.replace(_FILLER, name=f"value regime {regime}", regime=regime),
                           target, options)
        if case is not None and case.regime == regime and admitted(target, case, **arguments):
            cases.append(case)
    return remember_arguments(_cap(cases, MAX_DIRECTED), arguments)  # for directed.shrink
