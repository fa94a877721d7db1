"""The learner level's entry point: read a class, probe its conventions, declare it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

import spec
from implementations.base import Capabilities, Implementation
from implementations.guard import CallRaised
from implementations.registry._errors import summarise
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
    _constructor,
    _forward,
    _projections,
    _usage,
)
from implementations.registry.learner.wrapper import (
    _materialised,
    _PlannedFactory,
    load_learner_weights,
)


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
    dim, heads, dropout, init_notes = _constructor(cls, origin, options)
    inputs, forward_names, mask_arg = _forward(cls, origin)
    plan = LearnerPlan(cls=cls, dim_arg=dim, heads_arg=heads, dropout_arg=dropout, projections=(),
                       projections_how="", inputs=inputs, forward_names=forward_names, mask_arg=mask_arg,
                       origin=origin)
    try:
        module = probe.call("building it", lambda: _materialised(cls(**{dim: _D, heads: _H}), inputs, _D))
    except CallRaised as exc:
        raise _usage(origin, f"{cls.__name__}({dim}={_D}, {heads}={_H}) raised {summarise(exc.error)}",
                     "pass --impl-option learner_init=DIM,HEADS if those are not its model dim and head "
                     "count") from exc.error
    projections, how = _projections(module, _D, cls, origin, options)
    plan = replace(plan, projections=projections, projections_how=how)
    gen = np.random.default_rng(0)
    params = spec.MHAParams.random(gen, _D, _H)
    x = torch.from_numpy(gen.standard_normal((_B, _L, _D)))
    plan = _probe_output(probe, plan, params, x)
    plan = _probe_fused(probe, plan, params, x, options)
    plan = _probe_mask(probe, plan, params, x, options)
    fully_masked, fm_text = _probe_fully_masked(probe, plan, params, x)
    dropout_on = _probe_dropout(probe, plan, params, x)
    features = {"batch_first", "unbatched", "no_bias"}
    if plan.mask is not None and any("B" in s for s in plan.mask_shapes):
        features.add("key_padding_mask")
    if plan.mask == "additive" and any("H" in s for s in plan.mask_shapes):
        features |= {"attn_mask", "is_causal"}
    if plan.weights is not None:
        features.add("need_weights")
    if plan.weights == "per_head":
        features.add("per_head_weights")
    if dropout_on:
        features.add("dropout")
    if plan.inputs == "qkv":
        features.add("cross_attention")
    notes = list(_notes(plan, init_notes, fm_text, dropout_on, features))
    caps = Capabilities(
        devices=("cpu",), dtypes=_probe_dtypes(probe, plan, params, notes) or ("float32",), causal="upper_left",
        fully_masked=fully_masked, dropout=dropout_on, autograd=_probe_backward(probe, plan), mask_grad=False,
        gqa=False, different_v_dim=False, mha_features=frozenset(features), probe_notes=tuple(notes),
        # The module's own conventions, as the probes found them (its fully-masked rows
        # among them: a learner's -1e9 fill is its convention), shown as probed.
        sources={"causal": "contract", "fully_masked": "probed" if plan.mask is not None and
                 not fm_text.startswith(("an error", "neither")) else "contract"})
    factory = _PlannedFactory(plan)
    return Implementation(name=name, capabilities=caps, mha=factory, load_weights=load_learner_weights,
                          description=f"learner module {origin}: " + "; ".join(n.split(": ", 1)[-1] for n in notes[:1]))


def _notes(plan: LearnerPlan, init_notes: list[str], fm_text: str, dropout_on: bool,
           features: set[str]) -> tuple[str, ...]:
    proj = ", ".join(f"{path}" for _, path in plan.projections)
    fused = f", fused one {plan.fused_how}" if plan.fused_how else ""
    forward = f"forward({', '.join(plan.forward_names + ((plan.mask_arg,) if plan.mask_arg else ()))})"
    inputs = {"self": "self-attention only (one input; cross-attention cases skipped: forward(query, key, value) "
                      "would enable them)",
              "kv": "one key/value input (key = value; cross-attention cases, which draw key != value, skipped)",
              "qkv": "query, key, value"}[plan.inputs]
    notes = [f"learner module: {init_notes[0]}, projections {proj} ({plan.projections_how}{fused}); {forward}: "
             f"{inputs}"]
    if plan.mask is None:
        notes.append(f"learner mask: none certified ({plan.mask_how})")
    else:
        shapes = ", ".join(_shape_text(s) for s in plan.mask_shapes)
        attn = ("attn_mask and causal cases run as one additive mask" if "attn_mask" in features else
                "read as key padding only: attn_mask cases (float biases, per-head masks) skipped, an additive "
                "mask taking (B, H, L, S) would enable them")
        notes.append(f"learner mask: {plan.mask_arg} {plan.mask_how}; shapes {shapes}; {attn}")
    notes.append(f"fully_masked: a row with every key blocked gives {fm_text}")
    weights = {None: "returns the output only: need_weights cases skipped (returning (output, weights) would "
                     "enable them)",
               "per_head": "returns (output, weights per head (B, H, L, S))",
               "averaged": "returns (output, weights averaged over heads): per-head weight cases skipped"}
    notes.append(f"learner output: {weights[plan.weights]}; dropout "
                 + ("switchable" if dropout_on else "not switchable (no dropout constructor argument that works): "
                    "dropout cases skipped"))
    return tuple(notes)
