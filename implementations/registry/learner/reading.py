"""Reading a learner's class: its constructor, its Linear layers, its forward."""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from typing import Any

from implementations.base import ImplementationError
from implementations.registry.learner.options import (
    DIM_NAMES,
    DROPOUT_NAMES,
    HEAD_NAMES,
)

# --------------------------------------------------------------------------- reading the class


def is_learner_candidate(cls: type) -> bool:
    """Whether ``cls`` is a torch module class (the learner level's domain)."""
    try:
        from torch import nn
    except ImportError:
        return False
    return isinstance(cls, type) and issubclass(cls, nn.Module)


def _usage(origin: str, what: str, fix: str) -> ImplementationError:
    return ImplementationError(
        f"{origin}: not recognised as a hand-written attention module: {what}; {fix}. It is not a drop-in "
        "for torch.nn.MultiheadAttention either (__init__(embed_dim, num_heads, ...), forward(query, key, "
        "value, key_padding_mask, need_weights, attn_mask, ...)); or write an implementations.Implementation")


def _signature(fn: Any, origin: str) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(fn).parameters.values())[1:]
    except (TypeError, ValueError) as exc:
        raise _usage(origin, f"its signature cannot be read ({exc})",
                     "give the class a Python __init__/forward") from exc


def _constructor(cls: type, origin: str, options: Mapping[str, str]) -> tuple[Any, Any, str | None, list[str]]:
    params = [p for p in _signature(cls.__init__, origin) if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    names = [p.name for p in params]
    notes = []
    if "learner_init" in options:
        dim, heads = (n.strip() for n in options["learner_init"].split(","))
        missing = [n for n in (dim, heads) if n not in names]
        if missing:
            raise _usage(origin, f"learner_init names {missing}, which {cls.__name__}.__init__({', '.join(names)}) "
                         "does not take", "give the names of its model-dim and head-count parameters")
    else:
        dim = next((n for n in names if n.lower() in DIM_NAMES), None)
        heads = next((n for n in names if n.lower() in HEAD_NAMES), None)
        required = [p.name for p in params if p.default is p.empty]
        if dim is None and heads is None and len(required) == 1:
            raise _usage(origin, f"{cls.__name__}.__init__({', '.join(names)}) takes one object ({required[0]}: a "
                         "config, as GPT- and BERT-style modules do), not a model dim and a head count, and "
                         "the learner level cannot know which fields it reads",
                         f"wrap it in a module whose __init__(d_model, n_heads) builds the {required[0]}")
        if dim is None and heads is None and len(required) >= 2:
            dim, heads = required[0], required[1]
        elif (dim is None) != (heads is None):
            rest = [n for n in required if n not in (dim, heads)]
            if not rest:
                raise _usage(origin, f"{cls.__name__}.__init__({', '.join(names)}) has no parameter named like "
                             f"the {'model dim' if dim is None else 'head count'}",
                             "pass --impl-option learner_init=DIM,HEADS naming its two parameters")
            dim, heads = (rest[0], heads) if dim is None else (dim, rest[0])
        elif dim is None:
            raise _usage(origin, f"{cls.__name__}.__init__({', '.join(names)}) takes no model dim and head count "
                         f"(names tried: {', '.join(DIM_NAMES[:5])}...; {', '.join(HEAD_NAMES[:5])}...)",
                         "pass --impl-option learner_init=DIM,HEADS")
    others = [p.name for p in params if p.default is p.empty and p.name not in (dim, heads)]
    if others:
        raise _usage(origin, f"{cls.__name__}.__init__ also requires {others}, which the suite cannot choose",
                     "give them defaults")
    dropout = next((n for n in names if n.lower() in DROPOUT_NAMES and n not in (dim, heads)), None)
    order = "heads first" if names.index(heads) < names.index(dim) else "model dim first"
    notes.append(f"{cls.__name__}({dim}, {heads})" if order == "model dim first" else
                 f"{cls.__name__}({heads}, {dim}), heads first")
    return dim, heads, dropout, notes


_STRIP_PREFIX = ("linear", "proj", "lin", "to", "fc", "w")
_STRIP_SUFFIX = ("projection", "linear", "proj", "layer", "dense", "lin", "fc", "weight", "net")
_ROLE_WORDS = {
    "q": "q", "query": "q", "queries": "q", "k": "k", "key": "k", "keys": "k", "v": "v", "value": "v",
    "values": "v", "o": "o", "out": "o", "output": "o", "c": "o", "": "o", "concat": "o", "final": "o",
    "merge": "o", "outproj": "o", "combine": "o", "qkv": "qkv", "cattn": "qkv", "inproj": "qkv", "attn": "qkv",
    "kv": "kv", "keyvalue": "kv",
}


def _role_of(path: str) -> str | None:
    """q/k/v/o/qkv/kv from a Linear's attribute name, or None (e.g. ``linears.0``)."""
    last = path.rsplit(".", 1)[-1].lower()
    if last.isdigit():
        return None
    compact = re.sub(r"[^a-z]", "", last)
    if "qkv" in compact:
        return "qkv"
    for prefix in _STRIP_PREFIX:
        if compact.startswith(prefix) and compact[len(prefix):] in _ROLE_WORDS:
            compact = compact[len(prefix):]
            break
    for suffix in _STRIP_SUFFIX:
        if compact.endswith(suffix) and compact[:-len(suffix)] in _ROLE_WORDS:
            compact = compact[:-len(suffix)]
            break
    return _ROLE_WORDS.get(compact)


def _linears(module: Any, D: int) -> list[tuple[str, Any]]:
    from torch import nn

    return [(name, sub) for name, sub in module.named_modules()
            if isinstance(sub, nn.Linear) and name and sub.in_features == D
            and sub.out_features in (D, 2 * D, 3 * D)]


def _projections(module: Any, D: int, cls: type, origin: str,
                 options: Mapping[str, str]) -> tuple[tuple[tuple[str, str], ...], str]:
    found = _linears(module, D)
    shapes = {name: sub.out_features // D for name, sub in found}
    listing = ", ".join(f"{name} ({sub.out_features}x{sub.in_features})" for name, sub in found) or "none"
    if "learner_projections" in options:
        names = [n.strip() for n in options["learner_projections"].split(",")]
        bad = [n for n in names if n not in shapes]
        if bad:
            raise _usage(origin, f"learner_projections names {bad}, not Linear layers of in_features d_model "
                         f"(found: {listing})", "name its q, k, v, o Linear layers")
        roles = ("q", "k", "v", "o") if len(names) == 4 else ("qkv", "o")
        return tuple(zip(roles, names, strict=True)), "as --impl-option learner_projections says"
    fix = ("pass --impl-option learner_projections=Q,K,V,O (or QKV,O) naming its Linear layers in_features "
           "= d_model")
    fused3 = [n for n, k in shapes.items() if k == 3]
    fused2 = [n for n, k in shapes.items() if k == 2]
    square = [n for n, k in shapes.items() if k == 1]
    by_role = {}
    for name in square + fused2 + fused3:
        by_role.setdefault(_role_of(name), []).append(name)
    if len(fused3) == 1 and len(square) == 1:
        return (("qkv", fused3[0]), ("o", square[0])), "by shape (one fused q, k, v Linear of 3·d_model)"
    if len(fused2) == 1 and len(square) == 2:
        q = by_role.get("q", [None])[0] or square[0]
        o = next(n for n in square if n != q)
        return (("q", q), ("kv", fused2[0]), ("o", o)), "by name and shape (one fused k, v Linear of 2·d_model)"
    if len(square) == 4 and not fused2 and not fused3:
        roles = {r: names[0] for r, names in by_role.items() if r in ("q", "k", "v", "o") and len(names) == 1}
        if set(roles) == {"q", "k", "v", "o"}:
            return tuple((r, roles[r]) for r in "qkvo"), "by name"
        return tuple(zip("qkvo", square, strict=True)), "in definition order, assumed q, k, v, o"
    raise _usage(origin, f"{cls.__name__}'s Linear layers of in_features d_model are {listing}: expected four "
                 "(q, k, v, output), or a fused q, k, v one (3·d_model) and an output one", fix)


def _forward(cls: type, origin: str) -> tuple[str, tuple[str, ...], str | None]:
    forward = getattr(cls, "forward", None)
    if forward is None:
        raise _usage(origin, f"{cls.__name__} has no forward", "define forward(x, mask=None)")
    params = _signature(forward, origin)
    mask = next((p.name for p in params if "mask" in p.name.lower()), None)
    inputs = [p for p in params if p.name != mask and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
              and p.default is p.empty]
    extra = [p.name for p in params if p.name != mask and p.default is p.empty and p.kind is p.KEYWORD_ONLY]
    names = tuple(p.name for p in inputs)
    if extra or not 1 <= len(inputs) <= 3:
        raise _usage(origin, f"{cls.__name__}.forward({', '.join(p.name for p in params)}) takes "
                     f"{len(inputs)} required inputs{f' and requires {extra}' if extra else ''}",
                     "expected forward(x, mask=None), forward(q, kv, mask=None) or forward(query, key, value, "
                     "mask=None) on (B, L, D) inputs")
    return {1: "self", 2: "kv", 3: "qkv"}[len(inputs)], names, mask

