"""Probing a learner's conventions: what it returns, how a fused projection is cut,
what a fully-masked row gives, dropout, dtypes, backward."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

import spec
from implementations.base import ALL_DTYPES, ImplementationError
from implementations.guard import CallRaised, CallTimedOut, guarded_call
from implementations.registry._errors import summarise
from implementations.registry.learner.plan import LearnerPlan
from implementations.registry.learner.reading import _usage
from implementations.registry.learner.wrapper import (
    LearnerMHA,
    _PlannedFactory,
    call_inner,
    load_learner_weights,
)

# --------------------------------------------------------------------------- probing

# B != H, so that a (B, L, S) mask broadcast as (H, L, S) against the scores is not taken
# for one read per batch item.
_D, _H, _B, _L = 8, 2, 3, 4


class _Probe:
    def __init__(self, origin: str, timeout: float | None) -> None:
        self.origin, self.timeout = origin, timeout

    def call(self, what: str, fn: Any) -> Any:
        try:
            return guarded_call(fn, timeout=self.timeout, rng=True)
        except CallTimedOut:
            raise ImplementationError(f"{self.origin}: probing {what} did not return within {self.timeout:g}s "
                                      "(--example-timeout); fix the hang") from None

    def value(self, what: str, fn: Any) -> Any:
        """``fn()``, or None when it raises."""
        try:
            return self.call(what, fn)
        except CallRaised:
            return None


def _build(plan: LearnerPlan, params: Any, **options: Any) -> Any:
    import torch

    module = _PlannedFactory(plan)(params.embed_dim, params.num_heads, dtype=torch.float64, **options)
    load_learner_weights(module, params)
    return module.eval()


def _raw(module: Any, plan: LearnerPlan, x: Any, mask: Any = None) -> Any:
    """The learner module called on batch-first ``x`` (self-attention), output only (the
    spec's output projection after it where the module has none)."""
    args = {"self": (x,), "kv": (x, x), "qkv": (x, x, x)}[plan.inputs]
    out = call_inner(plan, module.inner, args, mask)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out if module.out_proj is None else module.out_proj(out)


def causal_call(plan: LearnerPlan, L: int) -> dict[str, Any]:
    """The wrapper's arguments of a causal call where the module is always causal."""
    import torch

    if plan.causal is None:
        return {}
    return {"attn_mask": torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1), "is_causal": True}


def causal_spec(plan: LearnerPlan, L: int) -> dict[str, Any]:
    """``spec.mha_forward``'s arguments of the same call."""
    if plan.causal is None:
        return {}
    return {"attn_mask": np.triu(np.ones((L, L), dtype=bool), k=1), "is_causal": True}


def _probe_output(probe: _Probe, plan: LearnerPlan, params: Any, x: Any) -> LearnerPlan:
    import torch

    def plain() -> Any:
        module = _build(plan, params)
        args = {"self": (x,), "kv": (x, x), "qkv": (x, x, x)}[plan.inputs]
        return call_inner(plan, module.inner, args)

    try:
        out = probe.call("a plain call", plain)
    except CallRaised as exc:
        raise _usage(probe.origin, f"building {plan.cls.__name__} with d_model={_D}, heads={_H} and calling it on "
                     f"x of shape ({_B}, {_L}, {_D}) raised {summarise(exc.error)}",
                     "it must at least run that (batch-first (B, L, D) inputs)") from exc.error
    shape = (_B, _L, _D)
    if isinstance(out, torch.Tensor) and tuple(out.shape) == shape:
        return replace(plan, returns="output")
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) and tuple(out[0].shape) == shape:
        w = out[1] if len(out) > 1 else None
        kind = None
        if isinstance(w, torch.Tensor) and tuple(w.shape) == (_B, _H, _L, _L):
            kind = "per_head"
        elif isinstance(w, torch.Tensor) and tuple(w.shape) == (_B, _L, _L):
            kind = "averaged"
        return replace(plan, returns="pair", weights=kind)
    got = (f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__)
    raise _usage(probe.origin, f"{plan.cls.__name__} on x ({_B}, {_L}, {_D}) returned {got}",
                 f"it must return the output ({_B}, {_L}, {_D}) or (output, weights)")


def _exact(got: Any, want: np.ndarray) -> bool:
    got = got.detach().double().numpy()
    return got.shape == want.shape and bool(np.allclose(got, want, rtol=1e-9, atol=1e-9))


def _probe_fused(probe: _Probe, plan: LearnerPlan, params: Any, x: Any, options: Mapping[str, str]) -> LearnerPlan:
    if "qkv" not in dict(plan.projections):
        return plan
    if "learner_fused" in options:
        return replace(plan, fused=options["learner_fused"], fused_how="as --impl-option learner_fused says")
    xs = x.double().numpy()
    want, _ = spec.mha_forward(params, xs, xs, xs, batch_first=True, need_weights=False, **causal_spec(plan, _L))
    for layout in ("qkv", "qkv_per_head"):
        candidate = replace(plan, fused=layout)
        got = probe.value(f"fused layout {layout}", lambda c=candidate: _raw(_build(c, params), c, x))
        if got is not None and _exact(got, want):
            how = ("q, k, v blocks of d_model rows each" if layout == "qkv" else
                   "per head: q, k, v rows of each head together")
            return replace(plan, fused=layout, fused_how=f"cut as {how} (the module matches the oracle exactly "
                           "with it); the order q, k, v is assumed, --impl-option learner_fused=kqv if yours "
                           "differs")
    return replace(plan, fused="qkv", fused_how="assumed cut as q, k, v blocks of d_model rows (no layout "
                   "matched the oracle exactly on a probe; --impl-option learner_fused=qkv|kqv|qkv_per_head "
                   "overrides)")



def torch_allclose(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.allclose(a.double(), b.double(), rtol=1e-9, atol=1e-9, equal_nan=True))


def _probe_fully_masked(probe: _Probe, plan: LearnerPlan, params: Any, x: Any) -> tuple[str, str]:
    import torch

    if plan.mask is None:
        return "unspecified", "nothing certified (no mask is certified)"
    blocked = torch.zeros(_B, _L, dtype=torch.bool)
    blocked[0] = True
    xs = x.double().numpy()
    # Probed in the shape that fixed the convention (the first one found), so that a
    # shape the module reads the other way does not change the declaration.
    plan = replace(plan, mask_shapes=plan.mask_shapes[:1])
    causal = causal_call(plan, _L)
    got = probe.value("a fully-masked row", lambda: _build(plan, params, batch_first=True)(
        x, x, x, key_padding_mask=blocked, need_weights=False, **causal)[0])
    # A row the probe cannot classify is not a convention: the contract's zero is tested
    # (mha_fully_masked_rows fails on it), never "unspecified", which would check nothing.
    if got is None:
        return "zero", ("an error (a row with every key blocked raised); zero is tested, "
                        "declare --impl-option fully_masked=... if another policy is intended")
    row = got.detach().double().numpy()[0]
    if np.isnan(row).all():
        return "nan", "NaN"
    # Zero: the attention output of every row of batch item 0 is 0, so the module outputs
    # its output bias there, whatever its other steps do.
    zero, _ = spec.mha_forward(params, xs, xs, xs, key_padding_mask=blocked.numpy(), batch_first=True,
                               need_weights=False, fully_masked="zero", **causal_spec(plan, _L))
    if np.allclose(row, zero[0], rtol=1e-7, atol=1e-7):
        return "zero", "zero (attention output 0, module output = the output bias)"
    if plan.causal is not None:  # uniform over all keys or over the causal prefix: not told apart here
        return "zero", ("neither zero nor NaN; zero is tested, declare --impl-option fully_masked=... if "
                        "another policy is intended")
    # Uniform: with the query projection zeroed every score is 0, so every row of the
    # module's own unmasked call is uniform over the keys; a blocked row is uniform when it
    # equals it. The module's own call is the reference, not the spec's, so that a mistake
    # in another step (the scale, the head split) does not hide the convention.
    D = params.embed_dim
    flat = replace(params, in_proj_weight=np.concatenate([np.zeros((D, D)), params.in_proj_weight[D:]]),
                   in_proj_bias=None if params.in_proj_bias is None else
                   np.concatenate([np.zeros(D), params.in_proj_bias[D:]]))
    pair = probe.value("a fully-masked row against uniform weights", lambda: (
        _build(plan, flat, batch_first=True)(x, x, x, key_padding_mask=blocked, need_weights=False)[0],
        _build(plan, flat, batch_first=True)(x, x, x, need_weights=False)[0]))
    if pair is not None:
        masked, uniform = (t.detach().double().numpy()[0] for t in pair)
        if np.isfinite(uniform).all() and np.allclose(masked, uniform, rtol=1e-7, atol=1e-7):
            return "uniform", "uniform over all keys (a finite fill such as -1e9)"
    return "zero", ("neither zero, NaN nor uniform; zero is tested, declare "
                    "--impl-option fully_masked=... if another policy is intended")


def _probe_dropout(probe: _Probe, plan: LearnerPlan, params: Any, x: Any) -> bool:
    if plan.dropout_arg is None:
        return False

    def differs() -> bool:
        module = _build(plan, params, dropout=0.5).train()
        a, b = _raw(module, plan, x), _raw(module, plan, x)
        return not bool((a == b).all())

    if not probe.value("dropout", differs):
        return False
    # nn.MultiheadAttention's dropout drops attention weights, never the output bias: with
    # every weight zero, the output is the output bias on every call. A module whose
    # dropout also drops its output (nanoGPT's resid_dropout) is not that switch.
    D = params.embed_dim
    zero = replace(params, in_proj_weight=np.zeros((3 * D, D)), out_proj_weight=np.zeros((D, D)),
                   in_proj_bias=None if params.in_proj_bias is None else np.zeros(3 * D),
                   out_proj_bias=np.ones(D) if params.out_proj_bias is not None else None)
    if zero.out_proj_bias is None:
        return True

    def bias_kept() -> bool:
        module = _build(plan, zero, dropout=0.5).train()
        return all(bool((_raw(module, plan, x) == 1.0).all()) for _ in range(3))

    return bool(probe.value("dropout keeps the output bias", bias_kept))


def _probe_dtypes(probe: _Probe, plan: LearnerPlan, params: Any, notes: list[str]) -> tuple[str, ...]:
    """The dtypes the module runs in: a plain call and, when a mask is certified, a masked
    one (a fill such as -1e9 raises in float16); a dtype left out for its mask is a note."""
    import torch

    def run(dtype: str, masked: bool = False) -> bool:
        module = LearnerMHA(plan)(_D, _H, dtype=getattr(torch, dtype), batch_first=True)
        module._learner_plan = plan
        x = torch.randn(_B, _L, _D).to(getattr(torch, dtype))
        blocked = torch.zeros(_B, _L, dtype=torch.bool)
        blocked[:, -1] = True
        out = module(x, x, x, need_weights=False, key_padding_mask=blocked if masked else None,
                     **causal_call(plan, _L))[0]
        return out.dtype == x.dtype

    dtypes = []
    for d in ALL_DTYPES:
        if not probe.value(f"dtype {d}", lambda d=d: run(d)):
            continue
        if plan.mask is not None and not probe.value(f"a mask in {d}", lambda d=d: run(d, masked=True)):
            notes.append(f"dtypes: {d} runs without a mask but a masked call raised (a mask fill "
                         f"such as -1e9 does not fit {d}: torch.finfo(scores.dtype).min does); "
                         f"{d} is not certified")
            continue
        dtypes.append(d)
    return tuple(dtypes)


def _probe_backward(probe: _Probe, plan: LearnerPlan) -> bool:
    import torch

    def run() -> bool:
        module = LearnerMHA(plan)(_D, _H, batch_first=True)
        x = torch.randn(_B, _L, _D, requires_grad=True)
        module(x, x, x, need_weights=False, **causal_call(plan, _L))[0].sum().backward()
        return x.grad is not None

    return bool(probe.value("backward", run))

