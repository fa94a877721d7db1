"""The ``nn.MultiheadAttention`` directed examples: :data:`MHA_EXAMPLES`, one per bug
class, and :func:`mha_directed`, which adapts them to a property's ``mha_cases``
arguments (``conformance.directed.examples`` says how; it re-exports these names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from conformance.calls.declarations import fit_head_dims, fit_lengths
from conformance.core.cases import MHACase
from conformance.directed.admission import MAX_DIRECTED, _pick, _seed, admitted
from conformance.directed.shrink import remember_arguments
from spec import MHAParams
from spec.emulate import round_arrays_to, round_to

__all__ = ["MHAExample", "MHA_EXAMPLES", "mha_directed"]


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
    examples (``cross``) need S != L and the "cross_attention" feature ("kv_cross_attention"
    where key and value are one input, ``shared_kv``).
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
    shared_kv: bool = False  # a cross example whose key and value are one input


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
    MHAExample("cross-attention with one key/value input (key is value), L != S", L=2, S=3,
               features=frozenset({"kv_cross_attention"}), cross=True, shared_kv=True),
    MHAExample("unbatched (L, D) input without biases", L=3, S=3,
               features=frozenset({"unbatched", "no_bias"})),
    MHAExample("batch_first, per-head weights, a float per-head attn_mask", L=2, S=2, B=2,
               features=frozenset({"batch_first", "attn_mask", "per_head_attn_mask", "need_weights",
                                   "per_head_weights"}),
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
        "mask_kinds": [k for k in ("bool", "float") if (given is None or k in given)
                       and (k == "bool" or "additive" in target.caps.mask_kinds)],
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
    if mask == "head_row" and (flags["is_causal"] or "per_head_attn_mask" not in options["features"]
                               or "attn_mask" not in options["features"]):
        mask = "padding"  # attn_mask is the causal mask (or absent): a dead row from key padding
    if mask in ("head_row", "padding"):
        if fully_masked is False:
            return None
        features |= {"attn_mask", "per_head_attn_mask"} if mask == "head_row" else {"key_padding_mask"}
    kind = _pick(["bool", "float"], options["mask_kinds"])
    if kind is None or mask == "per_head" and "float" not in options["mask_kinds"]:
        return None
    if mask == "per_head":
        kind = "float"
    unbatched = "unbatched" in features
    B = 1 if unbatched else example.B
    L = example.L
    S = L if self_attention else example.S
    lengths = fit_lengths(target.caps, L, S)  # inside the declared lengths
    if lengths is None:
        return None
    L, S = lengths
    dims = fit_head_dims(target.caps, example.E, example.E)  # inside the declared head dims
    if dims is None:
        return None
    D = example.N * dims[0]
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
    elif example.shared_kv:
        key = value = inputs(S, D)
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
    return remember_arguments(cases[:MAX_DIRECTED], arguments)  # for directed.shrink
