"""The learner level's entry point: read a class, probe its conventions, declare it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

import spec
from implementations.base import ALL_MASK_KINDS, Capabilities, Implementation
from implementations.guard import CallRaised
from implementations.registry._errors import summarise
from implementations.registry.learner.construct import read_constructor, uninitialised
from implementations.registry.learner.dataflow import (
    causal_evidence,
    observe,
    read_projections,
)
from implementations.registry.learner.masks import _probe_mask
from implementations.registry.learner.options import _OPTIONS
from implementations.registry.learner.plan import LearnerPlan, _shape_text
from implementations.registry.learner.probes import (
    _B,
    _D,
    _H,
    _L,
    _Probe,
    _probe_backward,
    _probe_dropout,
    _probe_dtypes,
    _probe_fully_masked,
    _probe_fused,
    _probe_output,
)
from implementations.registry.learner.reading import (
    _forward,
    _usage,
    forward_of,
)
from implementations.registry.learner.terms import layer_at
from implementations.registry.learner.wrapper import (
    _materialised,
    _PlannedFactory,
    call_inner,
    load_learner_weights,
)
from implementations.registry.probe_plan import current_declarations


def _layout(probe: _Probe, plan: LearnerPlan, module: Any, x: Any, options: Mapping[str, str]) -> LearnerPlan:
    """Batch-first or sequence-first: a batch-first module's other batch items do not
    change when item 0 does; a sequence-first one's later positions do (told apart on the
    module's own calls, never by comparing with the spec)."""
    import torch

    if "learner_layout" in options:
        return replace(plan, seq_first=options["learner_layout"] == "seq_first",
                       layout_how="as --impl-option learner_layout says")

    def mixes(seq_first: bool) -> bool:
        trial = replace(plan, seq_first=seq_first)
        args = {"self": 1, "kv": 2, "qkv": 3}[plan.inputs]
        changed = x.clone()
        changed[0] = changed[0] + 1.0
        with torch.no_grad():
            a = call_inner(trial, module.eval(), (x,) * args)
            b = call_inner(trial, module, (changed,) * args)
        a, b = (t[0] if isinstance(t, (tuple, list)) else t for t in (a, b))
        return not bool(torch.allclose(a[1:], b[1:], rtol=0, atol=0))

    if probe.value("the layout", lambda: mixes(False)) and probe.value("the layout", lambda: mixes(True)) is False:
        return replace(plan, seq_first=True, layout_how="sequence-first (L, B, D): read on its calls, where a "
                       "change to x[0] reaches x[1:] (--impl-option learner_layout=batch_first overrides)")
    return plan


def _optional_key_value(probe: _Probe, plan: LearnerPlan, module: Any, x: Any) -> LearnerPlan:
    """A self-attention forward with an optional key/value input (transformers'
    ``key_value_states``) is cross-attention where a call with it runs and changes the
    output; else it stays self-attention."""
    import inspect

    import torch

    from implementations.registry.learner.reading import _input_role

    if plan.inputs != "self" or not plan.keyword or plan.causal is not None:
        return plan
    optional = [p.name for p in inspect.signature(forward_of(plan.cls)).parameters.values() if p.default is not p.empty]
    kv = next((n for n in optional if _input_role(n) == "kv"), None)
    if kv is None:
        return plan
    trial = replace(plan, inputs="kv", forward_names=(plan.forward_names[0], kv),
                    bind_how=f"bound by name; {kv} read as the key/value input")

    def first(out: Any) -> Any:
        return out[0] if isinstance(out, (tuple, list)) else out

    memory = x.flip(1) * 0.5 + 1.0
    with torch.no_grad():
        crossed = probe.value("an optional key/value input", lambda: first(call_inner(trial, module, (x, memory))))
        alone = probe.value("a plain call", lambda: first(call_inner(plan, module, (x,))))
    if crossed is None or alone is None or crossed.shape != alone.shape or torch.allclose(crossed, alone):
        return plan
    return trial


def _causal(plan: LearnerPlan, module: Any) -> str | None:
    """Why every call is causal: the declaration, or the code's evidence where the forward
    takes no mask and no causal argument (a module that takes a mask and applies a causal
    rule anyway is tested as what its signature says: non-causal)."""
    import inspect

    if current_declarations("mha").get("causal_only"):
        return "declared: --impl-option causal_only=true"
    names = [p.lower() for p in inspect.signature(forward_of(plan.cls)).parameters]
    if plan.mask_arg is not None or any("causal" in n for n in names):
        return None
    evidence = causal_evidence(plan.cls, module)
    return None if evidence is None else f"always causal ({evidence})"


def recognise_learner(cls: type, *, name: str, origin: str, timeout: float | None) -> Implementation:
    """An MHA-level Implementation for a hand-written attention module class (see the module
    docstring); a class too unusual to read raises ImplementationError saying what was not
    understood and which ``--impl-option`` settles it."""
    import torch

    held = _OPTIONS.get()
    options = held or {}
    if held is not None:
        held["_used"] = "yes"
    probe = _Probe(origin, timeout)
    construction = read_constructor(cls, origin, options)
    inputs, forward_names, mask_arg, keyword, bind_how = _forward(cls, origin)
    plan = LearnerPlan(cls=cls, construction=construction, projections=(), projections_how="", inputs=inputs,
                       forward_names=forward_names, keyword=keyword, bind_how=bind_how, mask_arg=mask_arg,
                       origin=origin)
    configs: list[Any] = []
    try:
        module = probe.call("building it", lambda: _materialised(construction.build(cls, _D, _H, 0.0, configs),
                                                                 plan, _D))
    except CallRaised as exc:
        raise _usage(origin, f"{construction.text(cls.__name__)} with d_model={_D}, heads={_H} raised "
                     f"{summarise(exc.error)}", "pass --impl-option learner_init=DIM,HEADS (or learner_config="
                     "NAME=VALUE for a config) if those are not its model dim and head count") from exc.error
    if configs:
        read = [n for n in object.__getattribute__(configs[-1], "__dict__").get("_read_", [])
                if not n.startswith("_")]
        construction = replace(construction, read=tuple(dict.fromkeys(read)))
        if construction.limit_name not in read and construction.limit_name not in construction.user:
            construction = replace(construction, limit_name=None, max_len=None)  # a limit it never reads
        plan = replace(plan, construction=construction)
    gen = np.random.default_rng(0)
    params = spec.MHAParams.random(gen, _D, _H)
    x = torch.from_numpy(gen.standard_normal((_B, _L, _D)))
    plan = _layout(probe, plan, module.double(), x, options)
    plan = replace(plan, causal=_causal(plan, module))
    plan = _optional_key_value(probe, plan, module, x)
    roles = {"self": ("x",), "kv": ("q", "kv"), "qkv": ("q", "k", "v")}[inputs]
    tensors = tuple(torch.from_numpy(gen.standard_normal((_B, _L, _D))) for _ in roles)
    observed = probe.value("one observed call", lambda: observe(module, lambda: call_inner(plan, module, tensors)))
    seen, output = observed if observed is not None else ({}, None)
    projections, how = read_projections(module, seen, output, dict(zip(roles, tensors, strict=True)), _D, _H, cls,
                                        origin, options)
    plan = replace(plan, projections=projections, projections_how=how)
    free = [path for _, path in projections if getattr(layer_at(module, path.replace("*", "0")), "bias", 0) is None]
    if free:
        plan = replace(plan, notes=(f"bias-free as written: {', '.join(free)} (the suite's bias=True cases give "
                                    "them a bias, which a Linear applies when it has one; bias=False cases run "
                                    "them as written)",))
    unset = uninitialised(cls, _D, _H)
    if unset:
        plan = replace(plan, notes=(*plan.notes, f"left uninitialised by the constructor: {', '.join(unset)} "
                                    "(skip_init or torch.empty; the suite draws them as nn.Linear would, the "
                                    "projections then get each case's weights)"))
    plan = _probe_output(probe, plan, params, x)
    plan = _probe_fused(probe, plan, params, x, options)
    plan = _probe_mask(probe, plan, params, x, options)
    fully_masked, fm_text = _probe_fully_masked(probe, plan, params, x)
    dropout_on = _probe_dropout(probe, plan, params, x)
    features = {"batch_first", "unbatched", "no_bias"}
    if plan.mask is not None and any("B" in s for s in plan.mask_shapes):
        features.add("key_padding_mask")
    # A mask with a query axis carries attn_mask and causal cases: per head where it has a
    # head axis, else as one (L, S) mask for every head (the MHA level's 2-D attn_mask).
    query_axis = plan.mask is not None and any("L" in s for s in plan.mask_shapes)
    if query_axis or plan.causal is not None:
        features |= {"attn_mask", "is_causal"}
    if plan.mask is not None and any("H" in s and "L" in s for s in plan.mask_shapes):
        features.add("per_head_attn_mask")
    if plan.weights is not None:
        features.add("need_weights")
    if plan.weights == "per_head":
        features.add("per_head_weights")
    if dropout_on:
        features.add("dropout")
    if plan.inputs == "qkv":
        features.add("cross_attention")
    elif plan.inputs == "kv":
        features.add("kv_cross_attention")
    notes = list(_notes(plan, fm_text, dropout_on, features))
    caps = Capabilities(
        devices=("cpu",), dtypes=_probe_dtypes(probe, plan, params, notes) or ("float32",), causal="upper_left",
        causal_only=plan.causal is not None, max_seq_len=plan.construction.max_len,
        # a mask the module takes as bool cannot carry the float biases of an additive one
        mask_kinds=ALL_MASK_KINDS if plan.mask in (None, "additive") or plan.also_additive
        else ALL_MASK_KINDS - {"additive"},
        fully_masked=fully_masked, dropout=dropout_on, autograd=_probe_backward(probe, plan), mask_grad=False,
        gqa=False, different_v_dim=False, mha_features=frozenset(features), probe_notes=tuple(notes),
        # The module's own conventions, as the probes found them (its fully-masked rows
        # among them: a learner's -1e9 fill is its convention), shown as probed.
        sources={"causal": "contract", "fully_masked": "probed" if plan.mask is not None and
                 not fm_text.startswith(("an error", "neither")) else "contract"})
    factory = _PlannedFactory(plan)
    return Implementation(name=name, capabilities=caps, mha=factory, load_weights=load_learner_weights,
                          description=f"learner module {origin}: " + "; ".join(n.split(": ", 1)[-1] for n in notes[:1]))


def _roles_text(plan: LearnerPlan) -> str:
    """The projections in the module's terms: ``c_attn fused q|k|v, c_proj``; per-head
    layers as ``heads.*.query`` (one per head)."""
    words = {"q": "q", "k": "k", "v": "v", "o": "out", "qkv": "fused q|k|v", "kv": "fused k|v"}
    parts: list[str] = []
    for role, path in plan.projections:
        base, _, head = role.partition("@")
        if head:
            parts.append(f"{path} {base} per head")
            continue
        parts.append(f"{path} {words[base]}")
    if plan.out_identity:
        parts.append("no output projection (the identity; the spec's applied after it)")
    return ", ".join(parts)


def _signature_text(fn: Any) -> str:
    """A forward's parameters as written (``*`` before keyword-only ones), self left out."""
    import inspect

    params = list(inspect.signature(fn).parameters.values())[1:]
    parts, star = [], False
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        star = star or p.kind is p.VAR_POSITIONAL
        parts.append(("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name
                     + ("=..." if p.default is not p.empty else ""))
    return ", ".join(parts)


def _notes(plan: LearnerPlan, fm_text: str, dropout_on: bool, features: set[str]) -> tuple[str, ...]:
    proj = ", ".join(path for _, path in plan.projections)
    fused = f", fused one {plan.fused_how}" if plan.fused_how else ""
    forward = f"forward({_signature_text(forward_of(plan.cls))})"
    bound = {"self": "", "kv": f" ({plan.bind_how}: {', '.join(f'{r}={n}' for r, n in zip(('query', 'key/value'), plan.forward_names, strict=False))})",
             "qkv": f" ({plan.bind_how}: {', '.join(f'{r}={n}' for r, n in zip(('query', 'key', 'value'), plan.forward_names, strict=False))})"}[plan.inputs]
    inputs = {"self": "self-attention only (one input; cross-attention cases skipped: forward(query, key, value) "
                      "would enable them)",
              "kv": "one key/value input (key = value): cross-attention cases draw it as one array "
                    "(kv_cross_attention); those with key and value apart skipped",
              "qkv": "query, key, value"}[plan.inputs]
    causal = f"; {plan.causal}: certified as causal self-attention (causal calls only)" if plan.causal else ""
    layout = f"; {plan.layout_how}" if plan.seq_first else ""
    free = "".join(f"; {n}" for n in plan.notes)
    notes = [f"learner module: {plan.construction.text(plan.cls.__name__)}, {_roles_text(plan)}; projections "
             f"{proj} ({plan.projections_how}{fused}); {forward}{bound}: {inputs}{causal}{layout}{free}"]
    if plan.mask is None:
        notes.append(f"learner mask: none certified ({plan.mask_how})")
    else:
        shapes = ", ".join(_shape_text(s) for s in plan.mask_shapes)
        attn = _query_axis_text(plan, features)
        notes.append(f"learner mask: {plan.mask_arg} {plan.mask_how}; shapes {shapes}; {attn}")
    notes.append(f"fully_masked: a row with every key blocked gives {fm_text}")
    weights = {None: "returns the output only: need_weights cases skipped (returning (output, weights) would "
                     "enable them)",
               "per_head": "returns (output, weights per head (B, H, L, S))",
               "averaged": "returns (output, weights averaged over heads): per-head weight cases skipped"}
    notes.append(f"learner output: {weights[plan.weights]}; dropout "
                 + ("switchable" if dropout_on else "not switchable as attention-weight dropout (no dropout "
                    "argument that works, or it also drops the output): dropout cases skipped"))
    return tuple(notes)


def _query_axis_text(plan: LearnerPlan, features: set[str]) -> str:
    """What happens to masks with a query axis (attn_mask, causal): per head where the
    module takes a head axis, else one (L, S) mask for every head; none: key padding only."""
    if "per_head_attn_mask" in features:
        return "attn_mask and causal cases run as one full (B, H, L, S) mask"
    if "attn_mask" in features:
        return ("attn_mask and causal cases run as one (L, S) mask for every head (merged with key padding); "
                "per-head (B*H, L, S) attn_mask cases skipped: no mask shape it takes has a head axis")
    return ("read as key padding only: it takes no mask with a query axis, so attn_mask and causal cases "
            "are skipped")
