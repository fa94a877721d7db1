"""Calling an SDPA implementation on a case, and what the oracle says of that case.

Everything that crosses into the implementation goes through
``core.target.call_guarded`` so that its exceptions and hangs become property
failures, never a crashed run. This module computes the inputs of the error
bounds (magnitudes, naive errors, logit ranges); the bounds themselves are in
``conformance.core.tolerance``. Its MHA twin is ``conformance.calls.mha``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

import spec
from conformance.calls.call_specs import (
    SDPACallSpec,
    case_rng,
    content_seed,
    fold_causal,
    run_sdpa_call,
    uses_causal_flag,
)
from conformance.calls.declarations import require_inside
from conformance.core import observe, tolerance
from conformance.core.cases import SDPACase
from conformance.core.compare import Comparison, assert_contract, compare_values, fail
from conformance.core.target import ImplementationRaised, Target, call_guarded
from conformance.core.tensors import dtype_of, to_numpy
from spec.emulate import round_to
from implementations.capabilities import backward_allowed

__all__ = [
    "SDPACall",
    "policy_source",
    "check_dropout_spread",
    "fold_causal",
    "oracle",
    "valid_rows",
    "magnitude",
    "logit_scale",
    "naive_error",
    "uses_causal_flag",
    "fully_masked_kind",
    "fully_masked_policy",
    "allowed_error",
    "allowed_for",
    "run_sdpa",
    "expect_sdpa_raises",
    "check_against_oracle",
    "check_fully_masked_policy",
    "check_dropout_mean",
    "assert_output_contract",
    "assert_returned_tensor",
    "grad_magnitudes",
    "grad_logit_range",
    "check_gradients",
    "compare_gradients",
]


def oracle(case: SDPACase, **overrides: Any) -> spec.SDPAResult:
    """The float64 oracle on the case's stored values (fully-masked rows -> 0)."""
    args = dict(
        attend_mask=case.attend_mask,
        additive_mask=case.additive_mask,
        causal=case.causal,
        scale=case.scale,
        sinks=case.sinks,
        fully_masked="zero",
    )
    args.update(overrides)
    return spec.sdpa(case.query, case.key, case.value, **args)


def valid_rows(case: SDPACase) -> np.ndarray:
    """Bool (B, N, L, 1): rows with at least one attendable key."""
    return ~case.fully_masked_rows()[..., None]


def magnitude(case: SDPACase, weights: np.ndarray) -> np.ndarray:
    """``weights @ |V|`` (B, N, L, Ev): the size of what each output element sums."""
    group = case.N // case.K
    value = np.repeat(np.abs(case.value), group, axis=1)  # (B, N, S, Ev)
    return weights @ value


def logit_scale(case: SDPACase, ref: spec.SDPAResult) -> np.ndarray:
    """(B, N, L, 1): the largest |scale|·Σ|q_i·k_i| (+ |additive mask|) over the keys
    each row attends: what a computed logit's rounding error is proportional to
    (a dot product of large entries can cancel to a small logit; its error does not)."""
    scale = case.scale if case.scale is not None else 1 / np.sqrt(case.E)
    key = np.repeat(np.abs(case.key), case.N // case.K, axis=1)  # (B, N, S, E)
    size = abs(scale) * (np.abs(case.query) @ np.swapaxes(key, -1, -2))  # (B, N, L, S)
    if case.additive_mask is not None:
        with np.errstate(invalid="ignore"):
            size = size + np.abs(case.additive_mask)
    attended = np.isfinite(size) & (ref.weights > 0)
    return np.where(attended, size, 0.0).max(axis=-1, keepdims=True)


def naive_error(case: SDPACase, reference: np.ndarray, rows: np.ndarray) -> float:
    """Largest error of a naive same-precision computation of this case."""
    if case.dtype == "float64":
        return 0.0
    emulated = spec.emulate_sdpa(
        case.query, case.key, case.value, dtype=case.dtype,
        attend_mask=case.attend_mask, additive_mask=case.additive_mask,
        causal=case.causal, scale=case.scale, fully_masked="zero", sinks=case.sinks,
    )
    diff = np.where(rows, np.abs(emulated - reference), 0.0)
    finite = np.isfinite(diff)
    return float(diff[finite].max()) if finite.any() else 0.0


def fully_masked_kind(target: Target, case: SDPACase) -> str:
    """What blocks the case's fully-masked rows as the implementation is called
    (``implementations.base.FULLY_MASKED_KINDS``): the causal flag alone, else the
    mask the causal constraint is folded into (additive when there is one, else bool)."""
    if uses_causal_flag(target, case):
        return "causal"
    return "additive" if case.additive_mask is not None else "bool"


def policy_source(target: Target) -> str:
    """How the fully-masked-row policy was set, in a message's words: "declared", "probed"
    or "the contract's" (a message must not call a probed policy declared)."""
    source = target.caps.source("fully_masked")
    return {"contract": "the contract's", "probed": "probed"}.get(source, "declared")


def fully_masked_policy(target: Target, case: SDPACase) -> str:
    """The declared policy for ``case``'s fully-masked rows (per kind, where declared so)."""
    return target.caps.fully_masked_policy(fully_masked_kind(target, case))


def allowed_error(target: Target, case: SDPACase, ref: spec.SDPAResult) -> np.ndarray:
    """Elementwise allowed error of ``case``'s output under the tolerance rule."""
    return tolerance.sdpa_allowed(
        case.dtype, naive_error(case, ref.output, valid_rows(case)), magnitude(case, ref.weights),
        tf32=target.tf32, logit_scale=logit_scale(case, ref),
    )


def allowed_for(target: Target, case: SDPACase) -> tuple[np.ndarray, spec.SDPAResult]:
    """Elementwise allowed error of ``case``'s output, and the oracle's result."""
    ref = oracle(case)
    return allowed_error(target, case, ref), ref


@dataclass
class SDPACall:
    output: np.ndarray  # float64 copy of the implementation's output
    tensor: Any  # the output tensor itself
    inputs: dict[str, Any] | None = None  # the tensors handed over (.grad filled after backward)
    spec: SDPACallSpec | None = None  # the call exactly as made (what a failure reproduces)


def _record(target: Target, call: Any) -> None:
    """Append ``call`` to the example's call log (the runner gives each example one)."""
    if target.log is not None:
        target.log.calls.append(call)


def run_sdpa(
    target: Target,
    case: SDPACase,
    *,
    dropout_p: float = 0.0,
    inputs: dict[str, Any] | None = None,
    samples: int = 1,
    grad_output: np.ndarray | None = None,
    mask_grad: bool = False,
) -> SDPACall:
    """Call ``target.impl.sdpa`` on ``case`` (causal folded into the mask unless
    the implementation's flag means the case's alignment and no mask is given),
    through ``replay.run_sdpa_call``, and log the call on the target.

    ``inputs``: the tensors to hand over (``sdpa_inputs`` of the case as called),
    when the caller keeps them to inspect afterwards. ``samples``: call on that
    many copies of ``case`` along the batch. ``grad_output``: backpropagate it
    after the call (``mask_grad``: through the additive mask too). Dropout is
    seeded from the case's contents."""
    __tracebackhide__ = True
    seed = None
    if dropout_p:
        seed = content_seed("dropout", case.query, case.key, case.value, case.attend_mask, case.additive_mask,
                            extra=f"{case.scale!r}|{case.causal}|{dropout_p!r}|{samples}")
    call = SDPACallSpec(case, is_causal=uses_causal_flag(target, case), dropout_p=dropout_p,
                        dropout_seed=seed, grad_output=grad_output, mask_grad=mask_grad, samples=samples)
    require_inside(target, call)
    _record(target, call)
    outcome = run_sdpa_call(target.impl, call, invoke=partial(call_guarded, target), inputs=inputs)
    assert_returned_tensor("output", outcome.tensor, device=case.device)
    output = to_numpy(outcome.tensor)
    observe.observe_sdpa(call.passed_case, output, dropout_p=dropout_p)
    return SDPACall(output, outcome.tensor, outcome.inputs, call)


def expect_sdpa_raises(target: Target, case: SDPACase, what: str) -> None:
    """``case`` is invalid per the spec: the call must raise, not return a result."""
    __tracebackhide__ = True
    call = SDPACallSpec(case, is_causal=uses_causal_flag(target, case))
    _record(target, call)
    try:
        outcome = run_sdpa_call(target.impl, call, invoke=partial(call_guarded, target), check_output=False)
    except ImplementationRaised:
        return
    shape = tuple(getattr(outcome.tensor, "shape", ()))
    fail(f"{what}: returned a result of shape {shape}, but should raise an error "
         "(the input is invalid per the spec)")


def assert_returned_tensor(what: str, out: Any, *, device: str, shape: tuple[int, ...] | None = None,
                           dims: str = "") -> None:
    """What the implementation returned is a torch.Tensor with data on ``device`` (and of
    ``shape``): anything else fails the property before the suite reads it."""
    import torch

    if not isinstance(out, torch.Tensor):
        fail(f"{what} type={type(out).__module__}.{type(out).__qualname__}, but should be torch.Tensor")
    if out.device.type != device:
        fail(f"{what} device={out.device}, but should be {device} (the inputs' device)")
    if shape is not None and tuple(out.shape) != tuple(shape):
        fail(f"{what} shape={tuple(out.shape)}, but should be {tuple(shape)} {dims}".rstrip())


def check_against_oracle(target: Target, case: SDPACase, actual: np.ndarray, *,
                         what: str = "output") -> Comparison:
    """Compare an SDPA output with the oracle under the tolerance rule (rows with
    every key blocked excluded)."""
    __tracebackhide__ = True
    ref = oracle(case)
    allowed = allowed_error(target, case, ref)
    return compare_values(what, actual, ref.output, allowed, where=valid_rows(case))


def check_fully_masked_policy(target: Target, case: SDPACase, output: np.ndarray) -> None:
    """Rows with every key blocked follow the declared policy for what blocks them
    (:func:`fully_masked_policy`; zero: output 0; nan: NaN; uniform: mean of V;
    unspecified: anything)."""
    __tracebackhide__ = True
    policy = fully_masked_policy(target, case)
    declared = f"{policy_source(target)} fully_masked={policy!r} for {fully_masked_kind(target, case)} rows"
    dead = case.fully_masked_rows()[..., None]  # (B, N, L, 1)
    dead_full = np.broadcast_to(dead, output.shape)
    if policy == "zero":
        bad = dead_full & ~(output == 0)
        if bad.any():
            i = tuple(int(x) for x in np.argwhere(bad)[0])
            fail(f"fully-masked row output at {i}={output[i]!r}, but should be 0 "
                 f"({declared}); {int(bad.sum())} such elements")
    elif policy == "nan":
        bad = dead_full & ~np.isnan(output)
        if bad.any():
            i = tuple(int(x) for x in np.argwhere(bad)[0])
            fail(f"fully-masked row output at {i}={output[i]!r}, but should be NaN ({declared})")
    elif policy == "uniform":
        uniform = oracle(case, fully_masked="uniform").output
        # The rounding floor sits at the magnitude of what the row sums (the tolerance rule:
        # weights @ |V|), the mean of |V|, not at the mean of V, which cancels towards 0.
        summed = oracle(case.replace(value=np.abs(case.value)), fully_masked="uniform").output
        compare_values(f"fully-masked row output ({declared})", output, uniform,
                       tolerance.sdpa_allowed(case.dtype, 0.0, summed + 1e-300), where=dead)


def check_dropout_mean(target: Target, case: SDPACase, output: np.ndarray, dropout_p: float,
                       samples: int) -> float:
    """``output`` (samples·B, N, L, Ev) of ``samples`` copies of ``case`` with
    dropout: no NaN in rows that attend a key, and the mean is the dropout-free
    oracle within Hoeffding's bound (``tolerance.sdpa_dropout_allowed``; needs V ≥ 0)."""
    __tracebackhide__ = True
    out = output.reshape(samples, *case.query.shape[:3], case.Ev)
    rows = valid_rows(case)
    if np.isnan(out[:, rows[..., 0]]).any():
        fail(f"dropout output has NaN with dropout_p={dropout_p} (e.g. -inf mask entries times a dropout mask)")
    rounding, ref = allowed_for(target, case)
    mean = out.mean(axis=0)
    c = magnitude(case, ref.weights) / (1 - dropout_p)
    bound = tolerance.sdpa_dropout_allowed(c, samples, mean.size)
    ratio = compare_values(f"mean of {samples} dropout outputs (dropout_p={dropout_p})", mean, ref.output,
                           bound, where=rows).ratio
    # The mean alone passes a dropout_p that is accepted and ignored: the spread tells.
    value = np.repeat(case.value, case.N // case.K, axis=1)  # (B, N, S, Ev), positive
    sigma = np.sqrt(dropout_p / (1 - dropout_p) * (ref.weights ** 2 @ value ** 2))
    return max(ratio, check_dropout_spread(out, sigma, c, rounding, rows, f"dropout_p={dropout_p}"))


def _sample_std(samples: np.ndarray, axis: int) -> np.ndarray:
    """The sample standard deviation (ddof=1) along ``axis``, with correctly rounded sums.
    numpy's sums along a strided axis add one term at a time: the mean of 2048 equal
    outputs near 0.9 came out 2e-14 off, and every deviation from it with it, so a spread
    that must be 0 read 2e-14 where the output's rounding allows 2e-15 (a false alarm on
    torch-mha in float64, seed 704 of benchmarks/false_alarms.py)."""
    moved = np.moveaxis(samples, axis, -1)
    count = moved.shape[-1]
    rows = moved.reshape(-1, count)
    if rows.size == 0 or count < 2 or not np.isfinite(rows).all():  # nothing to sum, or NaN/inf to report
        return samples.std(axis=axis, ddof=1)
    mean = np.array([math.fsum(row) for row in rows]) / count
    deviation = rows - mean[:, None]
    variance = np.array([math.fsum(row) for row in deviation * deviation]) / (count - 1)
    return np.sqrt(variance).reshape(moved.shape[:-1])


def check_dropout_spread(samples: np.ndarray, sigma: np.ndarray, width: np.ndarray, rounding: np.ndarray,
                         where: np.ndarray, what: str, axis: int = 0) -> float:
    """The standard deviation of the dropout ``samples`` (along ``axis``) is ``sigma``, what
    dropping each attention weight independently gives, within the bound of
    ``tolerance.dropout_spread_allowed`` for draws spread over ``width`` (plus the output's
    own ``rounding``, broadcast to the spread's shape). Samples that are all identical to
    rounding are named as such: the dropout had no effect, or one mask served every sample."""
    __tracebackhide__ = True
    count = samples.shape[axis]
    spread = _sample_std(samples, axis)
    rounding = np.broadcast_to(rounding, spread.shape)
    selected = np.broadcast_to(where, spread.shape) & (sigma > 2 * rounding)
    if selected.any() and not (spread[selected] > rounding[selected]).any():
        fail(f"dropout had no effect ({what}): the {count} samples are identical (to rounding) where dropping each "
             "attention weight independently spreads them (dropout accepted but never applied, or one "
             "mask shared by every batch item)")
    bound = tolerance.dropout_spread_allowed(width, count, spread.size) + rounding
    return compare_values(f"standard deviation of {count} dropout outputs ({what}; each attention weight "
                          "dropped independently)", spread, sigma, bound, where=where).ratio


def assert_output_contract(target: Target, case: SDPACase, call: SDPACall) -> None:
    __tracebackhide__ = True
    shape = (case.B, case.N, case.L, case.Ev)
    assert_contract("output", call.tensor, shape=shape, dtype=dtype_of(case.dtype), device=target.device)


def grad_magnitudes(case: SDPACase, ref: spec.SDPAResult, grad_out: np.ndarray) -> dict[str, np.ndarray]:
    """Absolute-value bounds on each gradient: the VJP run on |q|, |k|, |v| and
    |grad_out|, spread over each head (``tolerance.spread_over_head``)."""
    group = case.N // case.K
    w = ref.weights  # (B, N, L, S)
    v = np.repeat(np.abs(case.value), group, axis=1)  # (B, N, S, Ev)
    k = np.repeat(np.abs(case.key), group, axis=1)  # (B, N, S, E)
    g = np.abs(grad_out)
    dp = g @ np.swapaxes(v, -1, -2)  # (B, N, L, S)
    ds = w * (dp + (w * dp).sum(-1, keepdims=True))
    scale = abs(case.scale if case.scale is not None else 1 / np.sqrt(case.E))

    def fold(x: np.ndarray) -> np.ndarray:  # (B, N, S, .) -> (B, K, S, .)
        return x.reshape(case.B, case.K, group, *x.shape[2:]).sum(2)

    spread = tolerance.spread_over_head
    return {
        "dquery": spread(scale * ds @ k),
        "dkey": spread(fold(scale * np.swapaxes(ds, -1, -2) @ np.abs(case.query))),
        "dvalue": spread(fold(np.swapaxes(w, -1, -2) @ g)),
        "dmask": spread(ds),
    }


def grad_logit_range(case: SDPACase, ref: spec.SDPAResult) -> float:
    """The largest |scaled logit| plus the largest finite |additive mask| entry."""
    finite_logits = ref.logits[np.isfinite(ref.logits)]
    logit_range = float(np.abs(finite_logits).max()) if finite_logits.size else 0.0
    if case.additive_mask is not None:
        add = case.additive_mask[np.isfinite(case.additive_mask)]
        logit_range += float(np.abs(add).max()) if add.size else 0.0
    return logit_range


def check_gradients(target: Target, case: SDPACase) -> float:
    """dq, dk, dv (and d-additive-mask where declared) of a random upstream
    gradient (seeded by the case's contents) against ``spec.sdpa_vjp``; returns
    the worst error/allowed ratio."""
    __tracebackhide__ = True
    if not backward_allowed(target.caps, case.L, case.S):
        return 0.0  # outside the declared backward rule (backward_seq_multiple): no gradient taken
    rng = case_rng(case, "grad")
    grad_out = round_to(rng.standard_normal((case.B, case.N, case.L, case.Ev)), case.dtype)
    with_mask_grad = case.additive_mask is not None and target.caps.mask_grad
    folded = case.causal is not None and not uses_causal_flag(target, case)
    call = run_sdpa(target, case, grad_output=grad_out, mask_grad=with_mask_grad and not folded)
    return compare_gradients(target, call.spec, call.inputs)


def compare_gradients(target: Target, call: SDPACallSpec, tensors: dict[str, Any]) -> float:
    """The gradients a backward of ``call`` left on ``tensors`` (the inputs handed
    over) against ``spec.sdpa_vjp`` of the case as called; worst error/allowed."""
    __tracebackhide__ = True
    case, grad_out = call.case, call.grad_output
    ref = oracle(case)
    grads = spec.sdpa_vjp(case.query, case.key, case.value, grad_out,
                          attend_mask=case.attend_mask, additive_mask=case.additive_mask,
                          causal=case.causal, scale=case.scale, sinks=case.sinks)
    bounds = grad_magnitudes(case, ref, grad_out)
    logit_range = grad_logit_range(case, ref)
    worst = 0.0
    pairs = [("dquery", "query", grads.dquery), ("dkey", "key", grads.dkey), ("dvalue", "value", grads.dvalue)]
    if tensors["value"] is tensors["key"]:
        # One tensor handed over as key and value (shared_kv): its gradient is dkey + dvalue.
        bounds = dict(bounds, dkey=bounds["dkey"] + bounds["dvalue"])
        pairs = [pairs[0], ("dkey + dvalue", "key", grads.dkey + grads.dvalue)]
    for what, name, expected in pairs:
        grad = tensors[name].grad
        if grad is None:
            fail(f"{what} is None, but should be a gradient (autograd is declared)")
        allowed = tolerance.grad_allowed(case.dtype, bounds["d" + name], logit_range, tf32=target.tf32)
        worst = max(worst, compare_values(what, to_numpy(grad), expected, allowed).ratio)
    mask_t = tensors["attn_mask"]
    if call.mask_grad and mask_t is not None and mask_t.requires_grad:
        if mask_t.grad is None:
            fail("dadditive_mask is None, but should be a gradient (mask_grad is declared)")
        bound = spec._sdpa._reduce_to_shape(bounds["dmask"], case.additive_mask.shape)
        allowed = tolerance.grad_allowed(case.dtype, bound, logit_range, tf32=target.tf32)
        expected = np.where(np.isfinite(case.additive_mask), grads.dadditive_mask, 0.0)
        reduced = spec._sdpa._reduce_to_shape(to_numpy(mask_t.grad), case.additive_mask.shape)
        actual = np.where(np.isfinite(case.additive_mask), reduced, 0.0)
        worst = max(worst, compare_values("dadditive_mask", actual, expected, allowed).ratio)
    return worst
