"""Reading a learner's module by its dataflow: one observed call, with a forward hook on
every projection layer (``nn.Linear``, and ``Conv1D``-style layers whose weight is stored
transposed, ``(in, out)``), says which layer reads which input and which one gives the
output. That finds the projections whatever they are named, per-head sub-modules (a
``ModuleList`` of heads, each with its own key/query/value) and a module with no output
projection (BERT's self-attention: the identity); names only break ties between layers
that read the same input (self-attention's q, k, v), definition order where names say
nothing. It also reads the code's evidence of a causal rule and the sequence layout.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from typing import Any

from implementations.registry.learner.reading import (
    _projections,
    _role_of,
    _usage,
    in_out,
    is_projection,
    transposed,
)

__all__ = ["causal_evidence", "is_projection", "observe", "read_projections", "transposed"]


def observe(module: Any, call: Any) -> tuple[dict[str, tuple[Any, Any]], Any]:
    """``call()`` (which calls ``module``; eval, no grad) with a hook on every projection
    layer: ``({path: (its input, its output)}, the module's output)``; a layer called
    more than once keeps its first call."""
    import torch

    seen: dict[str, tuple[Any, Any]] = {}
    handles = []
    for path, layer in module.named_modules():
        if path and is_projection(layer):
            def hook(_layer, inputs, output, path=path):
                if inputs and path not in seen:
                    seen[path] = (inputs[0], output)
            handles.append(layer.register_forward_hook(hook))
    training = module.training
    try:
        with torch.no_grad():
            module.eval()
            out = call()
    finally:
        for handle in handles:
            handle.remove()
        module.train(training)
    return seen, out[0] if isinstance(out, (tuple, list)) else out


def _same(a: Any, b: Any) -> bool:
    import torch

    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim() == 3):
        return False
    # A sequence-first module sees the (L, B, D) transpose of the batch-first tensor.
    return any(a.shape == t.shape and bool(torch.equal(a, t)) for t in (b, b.transpose(0, 1)))


def _per_head(paths: list[str], dh: int, H: int, sizes: Mapping[str, tuple[int, int]],
              roles: tuple[str, ...]) -> list[tuple[str, str]] | None:
    """Per-head layers (out = head dim) read by name (key/query/value), numbered in
    definition order; None unless there are H of each role."""
    if len(paths) != len(roles) * H or any(sizes[p][1] != dh for p in paths):
        return None
    by_role: dict[str, list[str]] = {roles[0]: paths} if len(roles) == 1 else {}
    for path in paths if len(roles) > 1 else ():
        by_role.setdefault(_role_of(path), []).append(path)
    if set(by_role) != set(roles) or any(len(v) != H for v in by_role.values()):
        return None
    pairs = []
    for role in roles:
        pattern = _pattern(by_role[role])
        if pattern is None:
            return None
        pairs.append((f"{role}@*", pattern))
    return pairs


def _pattern(paths: list[str]) -> str | None:
    """``heads.*.query`` from ``heads.0.query``, ``heads.1.query``, ...: the one path part
    that counts the heads in order; None where there is none."""
    parts = [p.split(".") for p in paths]
    if len({len(p) for p in parts}) != 1:
        return None
    for i in range(len(parts[0])):
        if [p[i] for p in parts] == [str(h) for h in range(len(paths))] and \
                all(p[:i] + p[i + 1:] == parts[0][:i] + parts[0][i + 1:] for p in parts):
            return ".".join(parts[0][:i] + ["*"] + parts[0][i + 1:])
    return None


def read_projections(module: Any, seen: Mapping[str, tuple[Any, Any]], output: Any, inputs: Mapping[str, Any],
                     D: int, H: int, cls: type, origin: str, options: Mapping[str, str]
                     ) -> tuple[tuple[tuple[str, str], ...], str]:
    """``(role -> layer path pairs, how they were read)`` from an observed call whose
    forward inputs were ``inputs`` (role "x" self-attention, "q"/"k"/"v", "kv" -> tensor).
    Roles: q, k, v, o, qkv, kv, and ``q@i`` for head i's own layer; no "o": the module
    has no output projection (the identity)."""
    order = [p for p, layer in module.named_modules() if p and is_projection(layer)]
    sizes = {p: in_out(module.get_submodule(p)) for p in order}
    if "learner_projections" in options or not seen:
        found = [(p, module.get_submodule(p)) for p in order]
        return _projections(module, D, cls, origin, options, found=found)
    consumers: dict[str, list[str]] = {role: [] for role in inputs}
    for path in order:
        if path in seen:
            role = next((r for r, t in inputs.items() if _same(seen[path][0], t)), None)
            if role is not None:
                consumers[role].append(path)
    taken = {p for paths in consumers.values() for p in paths}
    out = [p for p in order if p in seen and p not in taken and _same(seen[p][1], output)]
    o = [("o", out[-1])] if out else []
    o_text = f"{out[-1]} gives the output" if out else "no layer gives the output: no output projection (identity)"
    dh = D // H
    listing = "; ".join(f"{r} read by {', '.join(p) or 'none'}" for r, p in consumers.items())
    fix = "pass --impl-option learner_projections=Q,K,V,O (or QKV,O) naming its projection layers"
    if "x" in consumers:  # self-attention: one input, read by every projection
        paths = consumers["x"]
        heads = _per_head(paths, dh, H, sizes, ("q", "k", "v"))
        if heads is not None:
            return (*heads, *o), f"by dataflow: per-head layers of {H} heads read x (by name), {o_text}"
        found = [(p, module.get_submodule(p)) for p in paths] + [(p, module.get_submodule(p)) for _, p in o]
        try:
            roles, how = _projections(module, D, cls, origin, options, found=found,
                                     output=out[-1] if out else None, dataflow=True)
        except Exception as exc:
            raise _usage(origin, f"{cls.__name__}'s dataflow: x is read by {', '.join(paths) or 'no layer'} and "
                         f"{o_text}, which is not q, k, v (four layers, or fused ones)", fix) from exc
        return roles, f"by dataflow ({how}); {o_text}"
    pairs: list[tuple[str, str]] = []
    for role, paths in consumers.items():
        wanted = {"q": D, "k": D, "v": D, "kv": 2 * D}[role]
        if len(paths) == 1 and sizes[paths[0]][1] == wanted:
            pairs.append((role, paths[0]))
            continue
        if role == "kv" and len(paths) == 2 and all(sizes[p][1] == D for p in paths):
            named = {_role_of(p): p for p in paths}
            pairs += ([("k", named["k"]), ("v", named["v"])] if set(named) == {"k", "v"} else
                      [("k", paths[0]), ("v", paths[1])])
            continue
        heads = _per_head(paths, dh, H, sizes, (role,))
        if heads is None:
            raise _usage(origin, f"{cls.__name__}'s dataflow: {listing}; {role} is not read by one projection of "
                         "d_model outputs, nor one per head", fix)
        pairs += heads
    return (*pairs, *o), f"by dataflow ({listing}; {o_text})"


def _source(cls: type) -> str:
    """The code of ``cls`` and its own bases (not torch's)."""
    parts = []
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch"):
            break
        try:
            parts.append(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
    return "\n".join(parts)


def causal_evidence(cls: type, module: Any) -> str | None:
    """What in the code makes every call causal: a lower-triangular buffer, ``is_causal=True``
    or a ``tril``/``triu`` mask; None: nothing."""
    import torch

    for name, buffer in module.named_buffers():
        if buffer.dim() >= 2 and buffer.shape[-1] == buffer.shape[-2] >= 2:
            square = buffer.reshape(-1, *buffer.shape[-2:])[0].double()
            if bool(((square == 0) | (square == 1)).all()) and bool(torch.equal(square, torch.tril(torch.ones_like(
                    square)))):
                return f"a lower-triangular buffer {name}"
    code = _source(cls)
    if re.search(r"is_causal\s*=\s*True", code):
        return "is_causal=True in its code"
    if re.search(r"\b(tril|triu)\b", code):
        return "a tril/triu mask in its code"
    return None
