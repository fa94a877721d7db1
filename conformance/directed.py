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
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis.errors import InvalidArgument

from conformance.cases import LAYOUTS, NOTE_STRIDE0_BATCH, MHACase, SDPACase
from conformance.strategies import MASK_KINDS, REGIMES, mha_cases, sdpa_cases
from conformance.strategies.values import sdpa_values
from spec import MHAParams
from spec.emulate import round_arrays_to, round_to

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

#: Most directed cases a property runs per target (regime and layout coverage first).
MAX_DIRECTED = 9

#: A case attribute an example needs ("required"), would like ("preferred") or
#: does without unless the property forces it ("incidental").
REQUIRED, PREFERRED, INCIDENTAL = "required", "preferred", "incidental"


# ---------------------------------------------------------------------------
# SDPA
# ---------------------------------------------------------------------------

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
    SDPAExample("one key block + 1 (S=17)", L=2, S=17, regime="ascending"),
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


def _scale_kind(scale: float | None) -> str:
    if scale is None:
        return "default"
    if scale == 0:
        return "zero"
    if scale < 0:
        return "negative"
    return "tiny" if abs(scale) <= 1e-5 else "positive"


def _sdpa_forcing(case: SDPACase, arguments: dict[str, Any]) -> dict[str, Any] | None:
    """``arguments`` narrowed to exactly ``case`` (None: the arguments rule it out)."""
    narrowed = dict(arguments)
    checks = (("mask_kinds", case.mask_kind, None), ("causal", case.causal, None),
              ("regimes", case.regime, None), ("layouts", case.layout, ("contiguous",)))
    for name, value, default in checks:
        allowed = arguments.get(name, default)
        if allowed is not None and value not in allowed:
            return None
        narrowed[name] = (value,)
    pattern = next((n.split("=", 1)[1] for n in case.notes if n.startswith("mask_pattern=")), None)
    if pattern is not None and arguments.get("mask_patterns") is not None:
        if pattern not in arguments["mask_patterns"]:
            return None
    kinds = arguments.get("scale_kinds", True)
    kind = _scale_kind(case.scale)
    if kinds is False and kind != "default" or kinds not in (True, False) and kind not in kinds:
        return None
    narrowed["scale_kinds"] = (kind,)
    for name, value in (("gqa", case.K != case.N), ("different_v_dim", case.E != case.Ev)):
        if arguments.get(name) not in (None, value):
            return None
        narrowed[name] = value
    if arguments.get("fully_masked") not in (None, bool(case.fully_masked_rows().any())):
        return None
    sizes = (("batch", case.B, 1, 3), ("heads", case.N, 1, 8), ("L", case.L, 1, None),
             ("S", case.S, 1, None), ("head_dim", min(case.E, case.Ev), None, None),
             ("head_dim", max(case.E, case.Ev), None, None))
    for dim, value, low, high in sizes:
        lo, hi = arguments.get(f"min_{dim}", low), arguments.get(f"max_{dim}", high)
        if lo is not None and value < lo or hi is not None and value > hi:
            return None
    narrowed.update(min_batch=case.B, max_batch=case.B, min_heads=case.N, max_heads=case.N,
                    min_L=case.L, max_L=case.L, min_S=case.S, max_S=case.S,
                    min_head_dim=min(case.E, case.Ev), max_head_dim=max(case.E, case.Ev))
    return narrowed


def _freeze(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(value))
    if isinstance(value, list):
        return tuple(value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "set":
        return set(value[1])
    return value


@functools.lru_cache(maxsize=4096)
def _strategy_accepts(level: str, caps: Any, device: str, dtype: str,
                      frozen: tuple[tuple[str, Any], ...]) -> bool:
    """Whether ``sdpa_cases`` / ``mha_cases`` accepts these arguments (a pure
    function of them, memoized: building a strategy costs milliseconds)."""
    strategy = mha_cases if level == "mha" else sdpa_cases
    try:
        strategy(dtype=dtype, device=device, caps=caps, **{k: _thaw(v) for k, v in frozen})
    except InvalidArgument:
        return False
    return True


def _accepts(level: str, target: Any, arguments: dict[str, Any]) -> bool:
    frozen = tuple(sorted((k, _freeze(v)) for k, v in arguments.items()))
    if target.dtype not in target.caps.dtypes:
        return False
    # Past the dtype check the strategies' argument checks do not depend on the
    # dtype: one declared dtype stands for all of them.
    return _strategy_accepts(level, target.caps, target.device, target.caps.dtypes[0], frozen)


def admitted(target: Any, case: SDPACase | MHACase, **arguments: Any) -> bool:
    """Whether ``cases_for(target, **arguments)`` (``mha_cases_for`` for an MHA
    case) could draw ``case``: the strategy accepts the case's attributes as
    forcing arguments, so the target claims the case and the property takes it."""
    if isinstance(case, MHACase):
        narrowed = _mha_forcing(case, arguments)
        level = "mha"
    else:
        narrowed = _sdpa_forcing(case, arguments)
        level = "sdpa"
    return narrowed is not None and _accepts(level, target, narrowed)


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
        causal=within(arguments.get("causal"), [None, caps.causal] if caps.causal else [None]),
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


def _pick(preferred: Sequence[Any], allowed: Sequence[Any]) -> Any:
    """The first of ``preferred`` that is allowed, else the first allowed (None: none)."""
    for option in preferred:
        if option in allowed:
            return option
    return allowed[0] if allowed else None


def _seed(name: str, dtype: str) -> np.random.Generator:
    # crc32, not hash(): the same values in every process.
    return np.random.default_rng(zlib.crc32(f"{name}/{dtype}".encode()))


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
    L, S = example.L, example.S
    if target.caps.self_attention_lengths:  # L == S only: the example at its larger length
        L = S = max(L, S)
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
    regime = _pick([example.regime, "normal"], options.regimes)
    scale = example.scale if example.scale is not None else \
        _incidental_scale(example.E, options.scale_kinds)
    sizes = {"B": B, "N": N, "K": K, "L": L, "S": S, "E": example.E, "Ev": Ev}
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
    return _cap(cases, MAX_DIRECTED)


def producible_regimes(target: Any, **arguments: Any) -> list[str]:
    """The regimes ``sdpa_cases(dtype=target.dtype, ..., **arguments)`` can draw
    (the strategy accepts ``regimes=(r,)`` with the rest of ``arguments``)."""
    given = arguments.get("regimes")
    return [r for r in REGIMES if (given is None or r in given)
            and _accepts("sdpa", target, {**arguments, "regimes": (r,)})]


# ---------------------------------------------------------------------------
# MHA
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class MHAExample:
    """One ``nn.MultiheadAttention`` bug class and its smallest case.

    ``features``: module options the example needs (``Capabilities.mha_features``
    names, e.g. "zero_attn", "kdim_vdim", "unbatched"); ``mask``: "head_row" (a
    bool (B*N, L, S) attn_mask blocking every key of row 0 in head 0 only: a
    fully-masked row whose NaN, if any, can leak through the output projection;
    key padding of batch item 0 where attn_mask is taken by the causal mask),
    "per_head" (a float (B*N, L, S) attn_mask), or None; ``is_causal`` /
    ``need_weights`` / ``average_attn_weights``: required values, or None
    (incidental: what the property allows, simplest first). Cross-attention
    examples (``cross``) need S != L and the "cross_attention" feature.
    """

    name: str
    L: int
    S: int
    B: int = 1
    N: int = 2
    E: int = 2
    kdim: int | None = None
    vdim: int | None = None
    features: frozenset[str] = frozenset()
    mask: str | None = None
    is_causal: bool | None = None
    need_weights: bool | None = None
    average_attn_weights: bool | None = None
    cross: bool = False


#: The MHA bug classes, smallest case each, most common first.
MHA_EXAMPLES: tuple[MHAExample, ...] = (
    MHAExample("a query row fully masked in one head only", L=2, S=2, B=2, mask="head_row"),
    MHAExample("is_causal with its causal mask, need_weights=False", L=3, S=3,
               features=frozenset({"attn_mask", "is_causal"}), is_causal=True, need_weights=False),
    MHAExample("is_causal with add_zero_attn, need_weights=False", L=3, S=3,
               features=frozenset({"attn_mask", "is_causal", "zero_attn"}), is_causal=True,
               need_weights=False),
    MHAExample("cross-attention, L != S, kdim and vdim != D", L=2, S=3, kdim=3, vdim=5,
               features=frozenset({"kdim_vdim", "cross_attention"}), cross=True),
    MHAExample("unbatched (L, D) input without biases", L=3, S=3,
               features=frozenset({"unbatched", "no_bias"})),
    MHAExample("batch_first, per-head weights, a float per-head attn_mask", L=2, S=2, B=2,
               features=frozenset({"batch_first", "attn_mask", "need_weights", "per_head_weights"}),
               mask="per_head", need_weights=True, average_attn_weights=False),
    MHAExample("add_bias_kv", L=2, S=2, N=1, E=4, features=frozenset({"bias_kv"})),
    MHAExample("four heads of dim 1 (head split and merge)", L=2, S=2, N=4, E=1),
)


def _mha_options(target: Any, arguments: dict[str, Any]) -> dict[str, list[Any]]:
    """Values of each MHA flag the property's arguments and the target's features
    allow, simplest first (the final word is :func:`admitted`)."""
    features = set(arguments.get("features") or target.caps.mha_features)

    def flag(name: str, feature: str, on_means_feature: bool = True) -> list[bool]:
        if arguments.get(name) is not None:
            return [arguments[name]]
        if feature in features:
            return [True, False]
        return [not on_means_feature]

    given = arguments.get("mask_kinds")
    return {
        "features": sorted(features),
        "need_weights": flag("need_weights", "need_weights"),
        "average_attn_weights": flag("average_attn_weights", "per_head_weights", on_means_feature=False),
        "is_causal": flag("is_causal", "is_causal") if "attn_mask" in features else [False],
        "mask_kinds": [k for k in ("bool", "float") if given is None or k in given],
    }


def _build_mha(example: MHAExample, target: Any, arguments: dict[str, Any],
               options: dict[str, list[Any]]) -> MHACase | None:
    """``example`` adapted to the property's options (None: its bug class is ruled out)."""
    features = set(example.features)
    self_attention = not example.cross
    if arguments.get("self_attention") and example.cross:
        return None
    flags = {}
    for name, preferred in (("need_weights", True), ("average_attn_weights", True), ("is_causal", False)):
        required = getattr(example, name)
        allowed = options[name]
        flags[name] = (required if required in allowed else None) if required is not None \
            else _pick([preferred, not preferred], allowed)
        if flags[name] is None:
            return None
    if flags["is_causal"]:
        features |= {"attn_mask", "is_causal"}
    fully_masked = arguments.get("fully_masked")
    mask = example.mask
    if fully_masked and mask != "head_row":
        mask = "head_row"
    if mask == "head_row" and (flags["is_causal"] or "attn_mask" not in options["features"]):
        mask = "padding"  # attn_mask is the causal mask (or absent): a dead row from key padding
    if mask in ("head_row", "padding"):
        if fully_masked is False:
            return None
        features.add("attn_mask" if mask == "head_row" else "key_padding_mask")
    kind = _pick(["bool", "float"], options["mask_kinds"])
    if kind is None or mask == "per_head" and "float" not in options["mask_kinds"]:
        return None
    if mask == "per_head":
        kind = "float"
    unbatched = "unbatched" in features
    B = 1 if unbatched else example.B
    L = example.L
    S = L if self_attention else example.S
    D = example.N * example.E
    rng = _seed(example.name, target.dtype)
    params = round_arrays_to(MHAParams.random(
        rng, D, example.N, bias="no_bias" not in features, add_bias_kv="bias_kv" in features,
        add_zero_attn="zero_attn" in features, kdim=example.kdim, vdim=example.vdim), target.dtype)
    batch_first = "batch_first" in features

    def inputs(length: int, dim: int) -> np.ndarray:
        shape = (length, dim) if unbatched else (B, length, dim) if batch_first else (length, B, dim)
        return round_to(rng.standard_normal(shape), target.dtype)

    query = inputs(L, D)
    if self_attention:
        key = value = query
    else:
        key, value = inputs(S, params.kdim), inputs(S, params.vdim)
    key_padding_mask = attn_mask = None
    notes: list[str] = ["self_attention"] if self_attention else []
    if mask == "padding":
        blocked = np.zeros((B, S), dtype=bool)
        blocked[0] = True                                                   # item 0 sees no key
        blocked = blocked[0] if unbatched else blocked
        key_padding_mask = blocked if kind == "bool" else np.where(blocked, -np.inf, 0.0)
        notes.append("fully_masked:forced")
    if flags["is_causal"]:
        causal = np.triu(np.ones((L, S), dtype=bool), k=1)                  # upper-left, True = blocked
        attn_mask = causal if kind == "bool" else np.where(causal, -np.inf, 0.0)
    elif mask == "head_row":
        blocked = np.zeros((B * example.N, L, S), dtype=bool)
        blocked[0, 0] = True                                                # item 0, head 0, row 0
        attn_mask = blocked if kind == "bool" else np.where(blocked, -np.inf, 0.0)
        notes.append("fully_masked:forced")
        if unbatched:
            attn_mask = attn_mask.reshape(example.N, L, S)
    elif mask == "per_head":
        bias = round_to(rng.standard_normal((B * example.N, L, S)), target.dtype)
        attn_mask = np.where(np.eye(L, S, dtype=bool)[None], bias, -np.inf)   # the diagonal attended
        if unbatched:
            attn_mask = attn_mask.reshape(example.N, L, S)
    return MHACase(params=params, query=query, key=key, value=value,
                   key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                   is_causal=flags["is_causal"], need_weights=flags["need_weights"],
                   average_attn_weights=flags["average_attn_weights"], batch_first=batch_first,
                   unbatched=unbatched, dtype=target.dtype, device=target.device,
                   notes=tuple(notes) + (f"directed: {example.name}",))


def _mha_forcing(case: MHACase, arguments: dict[str, Any]) -> dict[str, Any] | None:
    """``arguments`` narrowed to exactly ``case`` (None: the arguments rule it out)."""
    narrowed = dict(arguments)
    features = case.mha_features() - {"dropout"}
    self_attention = case.key is case.query and case.value is case.query
    if not self_attention:
        features.add("cross_attention")
    narrowed["required_features"] = features
    for name in ("need_weights", "average_attn_weights", "is_causal"):
        value = getattr(case, name)
        if arguments.get(name) not in (None, value):
            return None
        narrowed[name] = value
    if arguments.get("fully_masked") not in (None, case.fully_masked_rows()):
        return None
    if arguments.get("self_attention") not in (None, self_attention):
        return None
    narrowed["self_attention"] = self_attention
    kinds = {("bool" if m.dtype == np.bool_ else "float")
             for m in (case.key_padding_mask, case.attn_mask) if m is not None}
    if len(kinds) == 1:
        (kind,) = kinds
        if arguments.get("mask_kinds") is not None and kind not in arguments["mask_kinds"]:
            return None
        narrowed["mask_kinds"] = (kind,)
    E = case.D // case.N
    sizes = (("batch", case.B, 1, 3), ("heads", case.N, 1, 4), ("head_dim", E, None, None),
             ("L", case.L, 1, None), ("S", case.S, 1, None))
    for dim, value, low, high in sizes:
        lo, hi = arguments.get(f"min_{dim}", low), arguments.get(f"max_{dim}", high)
        if lo is not None and value < lo or hi is not None and value > hi:
            return None
        narrowed[f"min_{dim}"] = narrowed[f"max_{dim}"] = value
    return narrowed


def mha_directed(target: Any, **arguments: Any) -> list[MHACase]:
    """The directed MHA cases of a property whose strategy is
    ``mha_cases(dtype=target.dtype, device=target.device, caps=target.caps, **arguments)``:
    :data:`MHA_EXAMPLES` adapted to ``arguments``, each kept only when :func:`admitted`;
    at most :data:`MAX_DIRECTED`."""
    options = _mha_options(target, arguments)
    cases = []
    for example in MHA_EXAMPLES:
        case = _build_mha(example, target, arguments, options)
        if case is not None and admitted(target, case, **arguments):
            cases.append(case)
    return cases[:MAX_DIRECTED]
