"""Calling an MHA implementation's module on a case, and what the oracle says of it.

The module is built by the implementation's factory with the case's options,
the oracle's weights are copied in with ``load_weights``, and the module is
called with nn.MultiheadAttention's conventions (bool masks True = blocked).
Every call goes through ``core.target.call_guarded``. This module computes the inputs
of the error bounds (output magnitude, logit range); the bounds themselves are
in ``conformance.core.tolerance``. Its SDPA twin is ``conformance.calls.sdpa``.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

import spec
from conformance.core import observe
from conformance.calls import mha_bounds
from conformance.core import tolerance
from conformance.calls.sdpa import assert_returned_tensor, check_dropout_spread
from conformance.core.cases import MHACase
from conformance.core.compare import compare_values, fail
from conformance.calls.declarations import require_inside
from conformance.calls.call_specs import (
    MHACallSpec,
    build_module,
    mha_content_seed,
    mha_output_shape,
    run_mha_call,
)
from conformance.core.target import Target, call_guarded
from conformance.core.tensors import to_numpy

__all__ = [
    "MHACall",
    "BuiltModule",
    "has_feature",
    "build",
    "run_mha",
    "oracle",
    "fully_masked_policy",
    "pair_allowed",
    "output_rows",
    "weight_rows",
    "check_mha",
    "upstream_gradient",
    "check_parameter_grads",
    "check_input_derivative",
    "check_dropout_mean",
    "attended_magnitude",
]


def has_feature(target: Target, feature: str) -> bool:
    """Whether the target declares MHA feature ``feature`` (``Capabilities.mha_features``)."""
    return feature in target.caps.mha_features


@dataclass
class BuiltModule:
    """A module built by :func:`build`, with the options it was built with (which
    the calls made on it record)."""

    module: Any
    dropout: float
    training: bool


def build(target: Target, case: MHACase, *, dropout: float = 0.0, training: bool = False) -> BuiltModule:
    """The implementation's module with the case's options and weights."""
    __tracebackhide__ = True
    spec_ = MHACallSpec(case, dropout=dropout, training=training)
    module = build_module(target.impl, spec_, invoke=partial(call_guarded, target))
    return BuiltModule(module, dropout, training)


@dataclass
class MHACall:
    output: np.ndarray  # float64 copy of the module output
    weights: np.ndarray | None  # float64 copy of the weights, None when not returned
    out_tensor: Any  # the output tensor itself
    weights_tensor: Any  # the weights tensor itself (or None)
    inputs: dict[str, Any]  # the forward keyword arguments handed over
    module: Any  # the module called
    spec: MHACallSpec | None = None  # the call exactly as made (what a failure reproduces)


def run_mha(target: Target, case: MHACase, module: BuiltModule | None = None, *, requires_grad: bool = False,
            inputs: dict[str, Any] | None = None, grad_output: np.ndarray | None = None,
            samples: int = 1, seed_salt: str = "", **overrides: Any) -> MHACall:
    """Call ``module`` (default: :func:`build` of the case) on the case's inputs
    (``inputs`` when given) with the forward arguments ``overrides``
    (need_weights, average_attn_weights, is_causal) replaced, through
    ``replay.run_mha_call``, and log the call on the target.

    ``requires_grad``: inputs require grad and autograd is on (otherwise the call
    runs under ``torch.no_grad()``); ``grad_output``: backpropagate it after the call
    (:func:`upstream_gradient`); ``samples``: call on that many copies of the case
    along the batch. Dropout is seeded from the case's contents (and ``seed_salt``: two
    calls that must draw different dropout samples give different salts)."""
    __tracebackhide__ = True
    case = case.replace(**overrides) if overrides else case
    dropout, training = (module.dropout, module.training) if module is not None else (0.0, False)
    seed = mha_content_seed(case, f"dropout|{dropout!r}|{samples}{seed_salt}") if dropout else None
    call = MHACallSpec(case, dropout=dropout, training=training, grad=requires_grad or grad_output is not None,
                       grad_output=grad_output, dropout_seed=seed, samples=samples)
    require_inside(target, call)
    if target.log is not None:
        target.log.calls.append(call)
    outcome = run_mha_call(target.impl, call, invoke=partial(call_guarded, target),
                           module=None if module is None else module.module, inputs=inputs)
    out, weights = outcome.output, outcome.weights
    assert_returned_tensor("module output", out, device=case.device)
    if weights is not None:
        assert_returned_tensor("attention weights", weights, device=case.device)
    result = MHACall(to_numpy(out), None if weights is None else to_numpy(weights), out, weights,
                     outcome.inputs, outcome.module, call)
    built = module if module is not None else BuiltModule(outcome.module, dropout, training)
    observe.observe_mha(call.called_case, result.output, result.weights, module=built, overrides={})
    return result


def fully_masked_policy(target: Target, case: MHACase) -> str:
    """The declared policy for the case's fully-masked rows: nn.MultiheadAttention merges
    its masks into one, additive when either is float, else bool."""
    floats = [m for m in (case.key_padding_mask, case.attn_mask) if m is not None and m.dtype != np.bool_]
    return target.caps.fully_masked_policy("additive" if floats else "bool")


def oracle(case: MHACase, fully_masked: str = "zero", **overrides: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """``spec.mha_forward`` on the case (forward arguments ``overrides`` replaced)."""
    args = dict(key_padding_mask=case.key_padding_mask, attn_mask=case.attn_mask,
                need_weights=case.need_weights, average_attn_weights=case.average_attn_weights,
                is_causal=case.is_causal, batch_first=case.batch_first, fully_masked=fully_masked)
    args.update(overrides)
    return spec.mha_forward(case.params, case.query, case.key, case.value, **args)


def pair_allowed(target: Target, case: MHACase) -> np.ndarray:
    """Allowed difference between two outputs of the module, each within the bound."""
    return mha_bounds.pair_allowed(case, tf32=target.tf32).output


def output_rows(case: MHACase, rows_bl: np.ndarray) -> np.ndarray:
    """(B, L) row selection laid out like the module output (for broadcasting)."""
    if case.unbatched:
        return rows_bl[0][:, None]
    return rows_bl[:, :, None] if case.batch_first else rows_bl.T[:, :, None]


def weight_rows(case: MHACase, dead: np.ndarray, averaged: bool) -> np.ndarray:
    """Rows of the weights without a fully-masked head (``dead``: (B, N, L)),
    laid out like averaged or per-head weights."""
    rows = ~dead.any(axis=1) if averaged else ~dead  # (B, L) or (B, N, L)
    rows = rows[..., None]
    return rows[0] if case.unbatched else rows


def check_mha(target: Target, case: MHACase, call: MHACall, *, fully_masked: str = "zero",
              include_dead: bool = False, what: str = "module output") -> float:
    """Compare the call's output (and weights, when asked for and declared) with
    the oracle; fully-masked rows only with ``include_dead``, under ``fully_masked``."""
    __tracebackhide__ = True
    expected_out, expected_w = oracle(case, fully_masked=fully_masked)
    allowed, w_allowed = mha_bounds.allowed_error(case, tf32=target.tf32, fully_masked=fully_masked)
    dead = case.blocked_rows()
    rows = None if include_dead else output_rows(case, ~dead.any(axis=1))
    ratio = compare_values(what, call.output, expected_out, allowed, where=rows).ratio
    if case.need_weights and has_feature(target, "need_weights"):
        if call.weights is None:
            fail("weights=None with need_weights=True, but should be the attention weights")
        w_rows = None if include_dead else weight_rows(case, dead, case.average_attn_weights)
        ratio = max(ratio, compare_values("attention weights", call.weights, expected_w, w_allowed,
                                          where=w_rows).ratio)
    return ratio


def upstream_gradient(case: MHACase) -> np.ndarray:
    """A random upstream gradient of the module output's shape, seeded by the
    case's contents (the same in every process and on replay)."""
    rng = np.random.default_rng(mha_content_seed(case, "grad"))
    return rng.standard_normal(mha_output_shape(case))


def check_parameter_grads(module: Any, *, require_all: bool = True) -> None:
    """Every trainable parameter's gradient is finite (and, with ``require_all``, present)."""
    __tracebackhide__ = True
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            if require_all:
                fail(f"gradient of parameter {name} is None, but every parameter should get one "
                     "(is it used in forward?)")
            continue
        grad = to_numpy(param.grad)
        if not np.isfinite(grad).all():
            bad = int((~np.isfinite(grad)).sum())
            fail(f"gradient of parameter {name} has {bad} non-finite entries, but should be finite "
                 "(a NaN here poisons every later step)")


def attended_magnitude(case: MHACase, weights: np.ndarray) -> np.ndarray:
    """(L, D) for an unbatched-layout case of batch 1 (L, 1, D): Σ_j |W_o[d, j]|
    Σ_s w_s |v_s[j]|, the size of what each output element sums before the output
    bias (``weights``: the oracle's per-head weights (1, N, L, S'))."""
    pr = case.params
    _, _, wv = pr.projection_weights()
    _, _, bv = pr.projection_biases()
    v = case.value[:, 0] @ wv.T + bv  # (S, D)
    if pr.bias_v is not None:
        v = np.concatenate([v, pr.bias_v.reshape(1, -1)])
    if pr.add_zero_attn:
        v = np.concatenate([v, np.zeros((1, v.shape[1]))])
    E = pr.head_dim
    attended = np.concatenate([weights[0, h] @ np.abs(v[:, h * E:(h + 1) * E]) for h in range(pr.num_heads)],
                              axis=-1)  # (L, D)
    return attended @ np.abs(pr.out_proj_weight).T


def _perturbed(case: MHACase, direction: dict[str, np.ndarray], h: float) -> MHACase:
    q = case.query + h * direction["query"]
    k = q if case.key is case.query else case.key + h * direction["key"]
    if case.value is case.query:
        v = q
    elif case.value is case.key:
        v = k
    else:
        v = case.value + h * direction["value"]
    return case.replace(query=q, key=k, value=v)


def check_input_derivative(target: Target, case: MHACase, inputs: dict[str, Any], grad_output: np.ndarray) -> float:
    """The gradients a backward of ``grad_output`` left on the query, key and value
    tensors (``inputs``) against the oracle's derivative along a random direction
    (seeded by the case's contents; float64 central differences of
    ``spec.mha_forward``); returns error/allowed."""
    __tracebackhide__ = True
    rng = np.random.default_rng(mha_content_seed(case, "direction"))
    direction = {n: rng.standard_normal(getattr(case, n).shape) for n in ("query", "key", "value")}
    analytic = 0.0
    scale = 0.0
    seen = set()
    for name in ("query", "key", "value"):
        t = inputs[name]
        if id(t) in seen:
            continue
        seen.add(id(t))
        if t.grad is None:
            fail(f"gradient with respect to {name} is None, but should reach the inputs")
        grad = to_numpy(t.grad)
        analytic += float((grad * direction[name]).sum())
        scale += float((np.abs(grad) * np.abs(direction[name])).sum())
    h = 1e-5
    plus = oracle(_perturbed(case, direction, h), need_weights=False)[0]
    minus = oracle(_perturbed(case, direction, -h), need_weights=False)[0]
    g = grad_output
    numeric = float((g * (plus - minus)).sum() / (2 * h))
    allowed = tolerance.mha_derivative_allowed(
        case.dtype, analytic_size=scale, numeric=numeric,
        logit_range=mha_bounds.logit_range(case, tf32=target.tf32),
        cancellation=float(np.abs(g * plus).sum()), step=h, tf32=target.tf32)
    err = abs(analytic - numeric)
    ratio = err / allowed if allowed > 0 else 0.0
    if not np.isfinite(analytic) or err > allowed:
        fail(f"directional derivative of Σ g·output along a random input direction={analytic!r}, "
             f"but should be {numeric!r} (float64 central differences of the oracle; "
             f"|diff|={err:.3g}, allowed {allowed:.3g})", ratio=ratio if np.isfinite(analytic) else None)
    return ratio


def check_dropout_mean(target: Target, case: MHACase, output: np.ndarray, dropout: float, samples: int) -> float:
    """``output`` (L, samples, D) of a train-mode module with ``dropout`` on
    ``samples`` copies of ``case`` (B = 1, (L, B, D) layout): no NaN in rows with
    an attendable key, and the mean is the eval output within Hoeffding's bound
    (``tolerance.mha_dropout_allowed``)."""
    __tracebackhide__ = True
    dead = case.blocked_rows().any(axis=1)[0]  # (L,)
    if np.isnan(output[~dead]).any():
        fail(f"train-mode output has NaN with dropout={dropout} in rows that have attendable keys")
    expected, weights = oracle(case, need_weights=True, average_attn_weights=False)
    # Correctly rounded sums: numpy's mean along a strided axis adds sequentially, an
    # error of up to samples * eps (2e-14 in float64 at M = 2048) that a near-deterministic
    # case's bound (c ~ 0) does not allow.
    mean = np.apply_along_axis(math.fsum, 1, output)[:, None, :] / samples  # (L, 1, D)
    c = attended_magnitude(case, weights) / (1 - dropout)  # (L, D)
    rounding = mha_bounds.allowed_error(case, tf32=target.tf32).output[:, 0]  # (L, D)
    bound = tolerance.mha_dropout_allowed(c, samples, mean.size, rounding)
    ratio = compare_values(f"mean of {samples} train-mode outputs (dropout={dropout})", mean[:, 0], expected[:, 0],
                           bound, where=~dead[:, None]).ratio
    # The mean alone passes a module that never applies its dropout: the spread tells.
    sigma = np.sqrt(dropout / (1 - dropout) * _dropped_terms_squared(case, weights))  # (L, D)
    return max(ratio, check_dropout_spread(output, sigma, c, rounding, ~dead[:, None],
                                           f"dropout={dropout}, train mode", axis=1))


def _dropped_terms_squared(case: MHACase, weights: np.ndarray) -> np.ndarray:
    """(L, D): Σ_h Σ_s (w_hs · Σ_{j in head h} W_o[d, j] v_s[j])², the sum of the squared
    terms that dropout keeps or drops independently in each output element (``weights``:
    the oracle's per-head weights (1, N, L, S'))."""
    pr = case.params
    _, _, wv = pr.projection_weights()
    _, _, bv = pr.projection_biases()
    v = case.value[:, 0] @ wv.T + bv  # (S, D)
    if pr.bias_v is not None:
        v = np.concatenate([v, pr.bias_v.reshape(1, -1)])
    if pr.add_zero_attn:
        v = np.concatenate([v, np.zeros((1, v.shape[1]))])
    E = pr.head_dim
    wo = np.asarray(pr.out_proj_weight)
    return sum(weights[0, h] ** 2 @ (v[:, h * E:(h + 1) * E] @ wo[:, h * E:(h + 1) * E].T) ** 2
               for h in range(pr.num_heads))
