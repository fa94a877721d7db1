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


def transposed(layer: Any) -> bool:
    """A ``Conv1D``-style layer: a 2-D weight stored ``(in, out)``, applied as x @ W + b."""
    from torch import nn

    weight = getattr(layer, "weight", None)
    return (not isinstance(layer, nn.Linear) and weight is not None and getattr(weight, "dim", lambda: 0)() == 2
            and (type(layer).__name__ == "Conv1D" or hasattr(layer, "nf")))


def is_projection(layer: Any) -> bool:
    from torch import nn

    return isinstance(layer, nn.Linear) or transposed(layer)


def in_out(layer: Any) -> tuple[int, int]:
    """(in_features, out_features) of a projection layer."""
    rows, cols = layer.weight.shape
    return (int(rows), int(cols)) if transposed(layer) else (int(cols), int(rows))


def _linears(module: Any, D: int) -> list[tuple[str, Any]]:
    return [(name, sub) for name, sub in module.named_modules() if name and is_projection(sub)]


def _projections(module: Any, D: int, cls: type, origin: str, options: Mapping[str, str],
                 found: list[tuple[str, Any]] | None = None,
                 output: str | None = None, dataflow: bool = False) -> tuple[tuple[tuple[str, str], ...], str]:
    """q, k, v, o (or fused) among ``found`` (default: every projection layer), by shape
    and name; with ``dataflow``, ``found`` are the layers that read the input and ``output``
    the layer that gives the output (None: no output projection)."""
    found = [(n, s) for n, s in (_linears(module, D) if found is None else found)
             if in_out(s)[0] == D and in_out(s)[1] in (D, 2 * D, 3 * D)]
    shapes = {name: in_out(sub)[1] // D for name, sub in found}
    listing = ", ".join(f"{name} ({in_out(sub)[1]}x{in_out(sub)[0]})" for name, sub in found) or "none"
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
    square = [n for n, k in shapes.items() if k == 1 and n != output]
    o = () if output is None else (("o", output),)
    by_role = {}
    for name in square + fused2 + fused3:
        by_role.setdefault(_role_of(name), []).append(name)
    if dataflow:
        if len(fused3) == 1 and not square:
            return (("qkv", fused3[0]), *o), "by shape (one fused q, k, v layer of 3·d_model)"
        if len(fused2) == 1 and len(square) == 1:
            return (("q", square[0]), ("kv", fused2[0]), *o), "by shape (one fused k, v layer of 2·d_model)"
        if len(square) == 3 and not fused2 and not fused3:
            roles = {r: names[0] for r, names in by_role.items() if r in ("q", "k", "v") and len(names) == 1}
            if set(roles) == {"q", "k", "v"}:
                return (*((r, roles[r]) for r in "qkv"), *o), "q, k, v by name"
            return (*zip("qkv", square, strict=True), *o), "q, k, v in definition order (assumed)"
    elif len(fused3) == 1 and len(square) == 1:
        return (("qkv", fused3[0]), ("o", square[0])), "by shape (one fused q, k, v Linear of 3·d_model)"
    elif len(fused2) == 1 and len(square) == 2:
        q = by_role.get("q", [None])[0] or square[0]
        o_name = next(n for n in square if n != q)
        return (("q", q), ("kv", fused2[0]), ("o", o_name)), "by name and shape (one fused k, v Linear of 2·d_model)"
    elif len(square) == 4 and not fused2 and not fused3:
        roles = {r: names[0] for r, names in by_role.items() if r in ("q", "k", "v", "o") and len(names) == 1}
        if set(roles) == {"q", "k", "v", "o"}:
            return tuple((r, roles[r]) for r in "qkvo"), "by name"
        return tuple(zip("qkvo", square, strict=True)), "in definition order, assumed q, k, v, o"
    raise _usage(origin, f"{cls.__name__}'s Linear layers of in_features d_model are {listing}: expected four "
                 "(q, k, v, output), or a fused q, k, v one (3·d_model) and an output one", fix)


def _input_role(name: str) -> str | None:
    """q, k, v or kv from a forward parameter's name (``query``, ``key``, ``value``,
    ``memory``, ...), None where the name says nothing."""
    low = re.sub(r"[^a-z]", "", name.lower())
    for role, words in (("kv", ("kv", "keyvalue", "keyvalues", "memory", "context", "encoderout",
                                "encoderhiddenstates", "keyvaluestates")),
                        ("q", ("q", "query", "queries", "xq", "tgt")), ("k", ("k", "key", "keys", "xk")),
                        ("v", ("v", "value", "values", "xv"))):
        if low in words:
            return role
    return None


def forward_of(cls: type) -> Any:
    """The forward whose signature says the inputs: a forward taking only ``*args,
    **kwargs`` (a subclass adding logging) is read through its bases."""
    for klass in cls.__mro__:
        fn = klass.__dict__.get("forward")
        if fn is None:
            continue
        try:
            params = list(inspect.signature(fn).parameters.values())[1:]
        except (TypeError, ValueError):
            return fn
        if any(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            return fn
    return getattr(cls, "forward", None)


def _forward(cls: type, origin: str) -> tuple[str, tuple[str, ...], str | None, bool, str]:
    """``(inputs, the forward's parameters bound to q[, k, v | kv], its mask parameter,
    whether they are passed by keyword, how they were bound)``: required inputs are bound
    by name where the names say q, k, v (in any order: ``forward(key, value, query,
    mask)``), by position otherwise; a mask parameter is passed (None when no mask), with
    or without a default."""
    forward = forward_of(cls)
    if forward is None:
        raise _usage(origin, f"{cls.__name__} has no forward", "define forward(x, mask=None)")
    params = _signature(forward, origin)
    mask = next((p.name for p in params if "mask" in p.name.lower() and "head" not in p.name.lower()), None)
    kinds = inspect.Parameter
    data = (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
    inputs = [p for p in params if p.name != mask and p.kind in data and p.default is p.empty]
    names = tuple(p.name for p in inputs)
    shown = ", ".join(("*, " if p.kind is p.KEYWORD_ONLY and (i == 0 or params[i - 1].kind is not p.KEYWORD_ONLY)
                       else "") + p.name for i, p in enumerate(params))
    if not 1 <= len(inputs) <= 3:
        raise _usage(origin, f"{cls.__name__}.forward({shown}) takes {len(inputs)} required inputs",
                     "expected forward(x, mask=None), forward(q, kv, mask=None) or forward(query, key, value, "
                     "mask=None) on (B, L, D) inputs")
    rotary = [p.name for p in params if re.search(r"position_embeddings|rotary|freqs_cis|^rope|^(sin|cos)$", p.name.lower())]
    if rotary:
        raise _usage(origin, f"{cls.__name__}.forward({shown}) takes {', '.join(rotary)}: it rotates q and k with "
                     "rotary embeddings, which the learner level does not read yet (its MHA properties have no "
                     "positions)", "certify the rotary attention itself at the kvcache level, or the module with "
                     "the rotation taken out")
    kind = {1: "self", 2: "kv", 3: "qkv"}[len(inputs)]
    keyword = not any(p.kind is p.POSITIONAL_ONLY for p in inputs)
    wanted = {"self": (), "kv": ("q", "kv"), "qkv": ("q", "k", "v")}[kind]
    roles = [_input_role(n) for n in names]
    if kind == "kv" and roles.count("kv") == 1:
        roles = ["q" if r != "kv" else r for r in roles]
    how = "bound by position"
    if wanted and keyword and sorted(r or "" for r in roles) == sorted(wanted):
        names = tuple(names[roles.index(r)] for r in wanted)
        how = "bound by name"
    return kind, names, mask, keyword, how
