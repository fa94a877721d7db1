"""Calling an MHA implementation's module on a case, and what the oracle says of it.

The module is built by the implementation's factory with the case's options,
the oracle's weights are copied in with ``load_weights``, and the module is
called with nn.MultiheadAttention's conventions (bool masks True = blocked).
Every call goes through ``runner.call_guarded``. This module computes the inputs
of the error bounds (output magnitude, logit range); the bounds themselves are
in ``conformance.tolerance``. Its SDPA twin is ``conformance.calls``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import spec
from conformance import tolerance
from conformance.calls import assert_returned_tensor
from conformance.cases import MHACase
from conformance.compare import compare_values, fail
from conformance.runner import Target, call_guarded
from conformance.tensors import dtype_of, mha_inputs, to_numpy

__all__ = [
    "MHACall",
    "has_feature",
    "build",
    "run_mha",
    "oracle",
    "output_bounds",
    "pair_allowed",
    "output_rows",
    "weight_rows",
    "check_mha",
    "random_backward",
    "check_parameter_grads",
    "attended_magnitude",
]


def has_feature(target: Target, feature: str) -> bool:
    """Whether the target declares MHA feature ``feature`` (``Capabilities.mha_features``)."""
    return feature in target.caps.mha_features


def build(target: Target, case: MHACase, *, dropout: float = 0.0, training: bool = False) -> Any:
    """The implementation's module with the case's options and weights."""
    p = case.params

    def make() -> Any:
        module = target.impl.mha(
            p.embed_dim, p.num_heads, dropout=dropout, bias=p.in_proj_bias is not None,
            add_bias_kv=p.bias_k is not None, add_zero_attn=bool(p.add_zero_attn),
            kdim=p.kdim, vdim=p.vdim, batch_first=case.batch_first,
            device=case.device, dtype=dtype_of(case.dtype),
        )
        target.impl.load_weights(module, p)
        module.train(training)
        return module

    return call_guarded(target, make)


@dataclass
class MHACall:
    output: np.ndarray  # float64 copy of the module output
    weights: np.ndarray | None  # float64 copy of the weights, None when not returned
    out_tensor: Any  # the output tensor itself
    weights_tensor: Any  # the weights tensor itself (or None)
    inputs: dict[str, Any]  # the forward keyword arguments handed over
    module: Any  # the module called


def run_mha(target: Target, case: MHACase, module: Any = None, *, requires_grad: bool = False,
            inputs: dict[str, Any] | None = None, **overrides: Any) -> MHACall:
    """Call ``module`` (default: :func:`build` of the case) on the case's inputs
    (``inputs`` when given), forward keyword arguments ``overrides`` replaced."""
    module = module if module is not None else build(target, case)
    kwargs = dict(inputs) if inputs is not None else mha_inputs(case, requires_grad=requires_grad)
    kwargs.update(overrides)
    result = call_guarded(target, module, **kwargs)
    if not isinstance(result, tuple) or len(result) != 2:
        fail(f"forward returned {type(result).__name__}, but should return (output, weights) "
             "as nn.MultiheadAttention does")
    out, weights = result
    assert_returned_tensor("module output", out, device=case.device)
    if weights is not None:
        assert_returned_tensor("attention weights", weights, device=case.device)
    return MHACall(to_numpy(out), None if weights is None else to_numpy(weights), out, weights, kwargs, module)


def oracle(case: MHACase, fully_masked: str = "zero", **overrides: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """``spec.mha_forward`` on the case (forward arguments ``overrides`` replaced)."""
    args = dict(key_padding_mask=case.key_padding_mask, attn_mask=case.attn_mask,
                need_weights=case.need_weights, average_attn_weights=case.average_attn_weights,
                is_causal=case.is_causal, batch_first=case.batch_first, fully_masked=fully_masked)
    args.update(overrides)
    return spec.mha_forward(case.params, case.query, case.key, case.value, **args)


def _to_batch_first(x: np.ndarray, case: MHACase) -> np.ndarray:
    if case.unbatched:
        return x[None]
    return x if case.batch_first else np.swapaxes(x, 0, 1)


def output_bounds(case: MHACase) -> tuple[np.ndarray, float]:
    """(output magnitude per feature (D,), largest |scaled logit| + |float mask|):
    what the module output's rounding error scales with."""
    p = case.params
    wq, wk, wv = (np.abs(w) for w in p.projection_weights())
    bq, bk, bv = (np.abs(b) for b in p.projection_biases())
    xq = np.abs(_to_batch_first(case.query, case))  # (B, L, D)
    xk = np.abs(_to_batch_first(case.key, case))  # (B, S, kdim)
    xv = np.abs(_to_batch_first(case.value, case))  # (B, S, vdim)
    q = xq @ wq.T + bq  # (B, L, D)
    k = xk @ wk.T + bk
    v = xv @ wv.T + bv
    E = p.head_dim
    if p.bias_k is not None:
        k = np.concatenate([k, np.abs(p.bias_k).reshape(1, 1, -1).repeat(k.shape[0], 0)], axis=1)
        v = np.concatenate([v, np.abs(p.bias_v).reshape(1, 1, -1).repeat(v.shape[0], 0)], axis=1)
    logit = 0.0
    for h in range(p.num_heads):
        sl = slice(h * E, (h + 1) * E)
        logit = max(logit, float((q[..., sl] @ np.swapaxes(k[..., sl], -1, -2)).max()) / np.sqrt(E))
    vmax = v.max(axis=(0, 1))  # (D,)
    out_bias = np.abs(p.out_proj_bias) if p.out_proj_bias is not None else 0.0
    magnitude = np.abs(p.out_proj_weight) @ vmax + out_bias  # (D,)
    mask_range = 0.0
    for m in (case.attn_mask, case.key_padding_mask):
        if m is not None and m.dtype != np.bool_:
            finite = np.abs(m[np.isfinite(m)])
            mask_range += float(finite.max()) if finite.size else 0.0
    return magnitude, logit + mask_range


def pair_allowed(target: Target, case: MHACase) -> np.ndarray:
    """Allowed difference between two outputs of the module, each within the bound."""
    magnitude, logit_range = output_bounds(case)
    return tolerance.mha_pair_allowed(case.dtype, magnitude, logit_range, tf32=target.tf32)


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
    expected_out, expected_w = oracle(case, fully_masked=fully_masked)
    magnitude, logit_range = output_bounds(case)
    allowed = tolerance.mha_allowed(case.dtype, magnitude, logit_range, tf32=target.tf32)
    dead = case.blocked_rows()
    rows = None if include_dead else output_rows(case, ~dead.any(axis=1))
    ratio = compare_values(what, call.output, expected_out, allowed, where=rows).ratio
    if case.need_weights and has_feature(target, "need_weights"):
        if call.weights is None:
            fail("weights=None with need_weights=True, but should be the attention weights")
        w_allowed = tolerance.mha_allowed(case.dtype, np.ones(1), logit_range, tf32=target.tf32)
        w_rows = None if include_dead else weight_rows(case, dead, case.average_attn_weights)
        ratio = max(ratio, compare_values("attention weights", call.weights, expected_w, w_allowed,
                                          where=w_rows).ratio)
    return ratio


def random_backward(target: Target, case: MHACase, call: MHACall) -> np.ndarray:
    """Backpropagate a random upstream gradient through the call's output; returns it."""
    import torch

    rng = np.random.default_rng(abs(hash(case.describe())) % 2**32)
    g = rng.standard_normal(call.output.shape)
    call_guarded(target, lambda: call.out_tensor.backward(
        torch.from_numpy(g).to(call.out_tensor.dtype).to(call.out_tensor.device)))
    return g


def check_parameter_grads(module: Any, *, require_all: bool = True) -> None:
    """Every trainable parameter's gradient is finite (and, with ``require_all``, present)."""
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
