"""Small pieces the property tests share: drawing within a target's claims (and
the directed examples that go with each strategy), probes, skip reasons. (An input
that must raise: ``calls.sdpa.expect_sdpa_raises``.)"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

import spec
from conformance.calls.call_specs import case_rng  # noqa: F401 - the properties' name for it
from conformance.core.cases import MHACase, SDPACase
from conformance.core.target import Target
from conformance.directed import examples as directed
from conformance.strategies import mha_cases, sdpa_cases
from implementations.capabilities import backward_lengths

__all__ = [
    "backward_target",
    "cases_for",
    "mha_cases_for",
    "directed_for",
    "mha_directed_for",
    "case_rng",
    "identity_probe",
    "attend_matrix",
    "skip_unless",
    "needs_separate_values",
    "flash_named",
]


def backward_target(target: Target) -> Target:
    """``target`` whose length rules are its backward's (``backward_seq_multiple`` inside the
    forward's rules): what a property that takes gradients of every case draws from;
    ``target`` itself without the rule."""
    caps = target.impl.caps(target.level)
    if not caps.backward_seq_multiple:
        return target
    field = f"{target.level}_capabilities"  # where Implementation.caps read them
    if getattr(target.impl, field, None) is None:
        field = "capabilities"
    return dataclasses.replace(target, impl=dataclasses.replace(target.impl, **{field: backward_lengths(caps)}))


def cases_for(target: Target, **kwargs: Any) -> Any:
    """``sdpa_cases`` restricted to what ``target`` declares; the strategy keeps
    ``kwargs`` as ``case_arguments`` (what it can produce is then known without
    drawing: ``directed.examples.producible_regimes``)."""
    kwargs.setdefault("shape_budget", target.shape_budget)
    strategy = sdpa_cases(dtype=target.dtype, device=target.device, caps=target.caps, **kwargs)
    strategy.case_arguments = dict(kwargs)
    return strategy


def directed_for(target: Target, **kwargs: Any) -> list[SDPACase]:
    """The directed SDPA examples of the property whose cases are
    ``cases_for(target, **kwargs)`` (``conformance.directed.examples``)."""
    return directed.sdpa_directed(target, **kwargs)


def _mha_arguments(target: Target, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for ``mha_cases`` within ``target``'s claims: self-attention only
    without the ``cross_attention`` and ``kv_cross_attention`` features (with the latter
    alone, cross-attention cases have one key/value input)."""
    if not {"cross_attention", "kv_cross_attention"} & set(target.caps.mha_features):
        kwargs = dict(kwargs, self_attention=True)
        features = set(kwargs.get("features", target.caps.mha_features))
        kwargs["features"] = features - {"kdim_vdim"}
    return kwargs


def mha_cases_for(target: Target, **kwargs: Any) -> Any:
    """``mha_cases`` restricted to what ``target`` declares (self-attention only
    without the ``cross_attention`` feature)."""
    return mha_cases(dtype=target.dtype, device=target.device, caps=target.caps,
                     **_mha_arguments(target, kwargs))


def mha_directed_for(target: Target, **kwargs: Any) -> list[MHACase]:
    """The directed MHA examples of the property whose cases are
    ``mha_cases_for(target, **kwargs)``."""
    return directed.mha_directed(target, **_mha_arguments(target, kwargs))


def identity_probe(case: SDPACase, min_head_dim: Any = None) -> SDPACase:
    """The case with V = I (Ev = S): the output's first S columns are then the attention
    weights. With ``min_head_dim`` (a declared lower bound, or the capabilities: their
    ``min_head_dim`` and ``head_dims``) V is I padded with zero columns to Ev = max(S,
    min_head_dim), or to the smallest declared head dim at least S, so the call stays
    inside the declarations (where no declared head dim holds S, Ev is the largest and
    the weights beyond it are not read)."""
    caps = min_head_dim if hasattr(min_head_dim, "head_dims") else None
    lower = caps.min_head_dim if caps is not None else min_head_dim
    Ev = max(case.S, lower or 0)
    if caps is not None and caps.head_dims:
        Ev = next((d for d in caps.head_dims if d >= Ev), caps.head_dims[-1])
    eye = np.broadcast_to(np.eye(case.S, Ev), (case.B, case.K, case.S, Ev)).copy()
    return case.replace(value=eye, layout="contiguous")


def attend_matrix(case: SDPACase) -> np.ndarray:
    """Bool (B, N, L, S): which keys each query may attend (masks and causal combined)."""
    return spec.masks.combined_attend_mask(
        (case.B, case.N, case.L, case.S), case.attend_mask, case.additive_mask, case.causal
    )


def skip_unless(condition: bool, reason: str) -> str | None:
    """For ``conformance_property(skip_reason=...)``: None (run) when ``condition``
    holds, else ``reason`` (the skip reason)."""
    return None if condition else reason


def needs_separate_values(target: Target) -> str | None:
    """For ``skip_reason=`` of a property that calls the implementation with values other
    than its keys (V = identity, V changed alone, fresh keys and values): the skip
    reason when the target declares ``shared_kv`` (key is value), else None."""
    return skip_unless(not target.caps.shared_kv, "calls with value != key, but shared_kv "
                       "declares key is value (one memory tensor)")


def flash_named(case: Any, changes: dict[str, Any]) -> Any:
    """``case`` (a flash-level directed case) with ``changes`` and a name saying what it is
    (``notes``: ``directed: NAME``, which a report names a shrunk case's start by): its
    lengths, GQA and value width, then each feature the variant sets."""
    s = case.sizes()
    L, S = s["L"], s["S"]
    parts = [f"L={L} {'<' if L < S else '>' if L > S else '='} S={S}"]
    if s["N"] != s["K"]:
        parts.append(f"{s['N']} query heads on {s['K']} kv heads")
    if s["Ev"] != s["E"]:
        parts.append(f"Ev={s['Ev']}, E={s['E']}")
    if case.fp8 is not None:
        parts.append(case.fp8)
    for key, value in changes.items():
        if key == "causal":
            parts += ["causal"] if value else []
        elif key.endswith("_descale"):
            if key == "q_descale":
                parts.append("per-tensor descales" if np.shape(value) == (1,) else "(B, K) descales")
        elif isinstance(value, np.ndarray):
            parts.append(key.replace("_", " "))
        else:
            parts.append(f"{key} {value}")
    return case.replace(notes=(f"directed: {', '.join(parts)}",), **changes)

