"""The flash level's oracle, error bounds and the checks against them: ``spec.flash_attention``
on a :class:`~conformance.calls.flash_cases.FlashCase`, a naive same-precision
``flash_attn_func`` (:func:`emulate_flash`) and the allowed errors of the output and the LSE
built from it (``conformance.core.tolerance``'s rule), the bounds of an FP8 call
(``tolerance.fp8_allowed``); the checks of a call's output, LSE and gradients against them
(:func:`check_output`, :func:`check_lse`, :func:`compare_gradients`, :func:`check_fp8`) and of
a dropout call (the mean of its copies; the pattern it returned; its gradients).
``conformance.calls.flash`` makes the calls (as ``mha_bounds`` is for the MHA level).

Dimension letters: B batch, N query heads, K kv heads, L query length, S key length,
E q/k head dim, Ev value head dim.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

import spec
from conformance.calls.flash_cases import FlashCase
from conformance.calls.sdpa import check_dropout_spread, grad_magnitudes, policy_source
from conformance.core import tolerance
from conformance.core.cases import SDPACase
from conformance.core.compare import Comparison, compare_values, fail
from conformance.core.target import Target
from conformance.core.tensors import to_numpy
from spec.emulate import _rounder

__all__ = ["FP8_OUTPUT_DTYPES", "allowed_lse", "allowed_output", "check_dropout_mean", "check_fp8", "check_lse",
           "check_output", "compare_dropout_gradients", "compare_gradients", "dropout_pattern_of", "emulate_flash",
           "fp8_allowed_lse", "fp8_allowed_output", "oracle"]


def oracle(case: FlashCase, **overrides: Any) -> spec.FlashResult:
    """``spec.flash_attention`` on the stored values, with the LSE (policy zero)."""
    options = dict(case.options(), **overrides)
    return spec.flash_attention(case.query, case.key, case.value, return_lse=True, **options)


def _forward(case: FlashCase) -> Any:
    """The oracle's intermediate steps (heads first): logits, weights, LSE, empty rows."""
    from spec import flash as spec_flash

    problem = spec_flash.prepare(case.query, case.key, case.value, **case.options())
    return problem, spec_flash.attend(problem)


def emulate_flash(case: FlashCase) -> tuple[np.ndarray, np.ndarray]:
    """(output (B, L, N, Ev), lse (B, N, L)) of a naive same-precision ``flash_attn_func``:
    every operation rounded to the case's dtype, float32 accumulation for 16-bit dtypes
    (``spec.emulate``'s rule), soft-capping and the ALiBi bias as rounded steps."""
    problem, _ = _forward(case)
    if case.dtype == "float64":
        ref = oracle(case)
        return ref.output, ref.lse
    store, accumulate = _rounder(case.dtype)
    q, k, v = store(problem.query), store(problem.key), store(problem.value)
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        s = store(accumulate(problem.scale) * store(q @ np.swapaxes(k, -1, -2)))
        if problem.softcap:
            c = accumulate(problem.softcap)
            s = store(c * store(np.tanh(store(s / c))))
        if problem.bias is not None:
            s = store(s + store(problem.bias))
        s = np.where(problem.allowed, s, accumulate(-np.inf))
        empty = ~problem.allowed.any(axis=-1, keepdims=True)
        key_max = np.where(empty, accumulate(0), s.max(axis=-1, keepdims=True))
        e = np.exp(s - key_max)
        total = e.sum(axis=-1, keepdims=True)
        lse = np.where(empty, -np.inf, key_max + np.log(np.where(empty, accumulate(1), total)))
        if problem.sinks is None:
            weights = store(e / np.where(empty, accumulate(1), total))
        else:  # the sink (float32-exact) joins the max and the denominator, then is dropped
            sink = accumulate(problem.sinks)[None, :, None, None]
            row_max = np.where(empty, sink, np.maximum(key_max, sink))
            e = np.exp(s - row_max)
            weights = store(e / (e.sum(axis=-1, keepdims=True) + np.exp(sink - row_max)))
        output = store(weights @ v)
    return output.astype(np.float64).transpose(0, 2, 1, 3), lse[..., 0].astype(np.float64)


def _naive_errors(case: FlashCase, ref: spec.FlashResult) -> tuple[float, float]:
    """Largest error of the naive same-precision output and LSE (rows attending a key)."""
    if case.dtype == "float64":
        return 0.0, 0.0
    out, lse = emulate_flash(case)
    rows = ~case.empty_rows()
    with np.errstate(invalid="ignore"):  # -inf - -inf in rows attending no key (not selected)
        out_err = np.abs(out - ref.output)[:, rows]
        lse_err = np.abs(lse - ref.lse)[:, :, rows]

    def worst(a: np.ndarray) -> float:
        finite = a[np.isfinite(a)]
        return float(finite.max()) if finite.size else 0.0

    return worst(out_err), worst(lse_err)


def _score_sizes(case: FlashCase, problem: Any, forward: Any) -> np.ndarray:
    """(B, N, L, 1): the largest |scale|·Σ|q||k| + |bias| over the keys each row attends
    (what a computed score's rounding error is proportional to)."""
    size = abs(problem.scale) * (np.abs(problem.query) @ np.swapaxes(np.abs(problem.key), -1, -2))
    if problem.softcap:
        size = np.minimum(size, problem.softcap)
    if problem.bias is not None:
        size = size + np.abs(problem.bias)
    attended = np.broadcast_to(problem.allowed, size.shape) & (forward.weights > 0)
    return np.where(attended, size, 0.0).max(axis=-1, keepdims=True)


def allowed_output(target: Target, case: FlashCase, ref: spec.FlashResult | None = None) -> np.ndarray:
    """Elementwise allowed error of the output (B, L, N, Ev): ``tolerance.sdpa_allowed``."""
    ref = ref if ref is not None else oracle(case)
    problem, forward = _forward(case)
    magnitude = forward.weights @ np.abs(problem.value)                      # (B, N, L, Ev)
    naive, _ = _naive_errors(case, ref)
    allowed = tolerance.sdpa_allowed(case.dtype, naive, magnitude, tf32=target.tf32,
                                     logit_scale=_score_sizes(case, problem, forward))
    return allowed.transpose(0, 2, 1, 3)


#: Unit roundoff order of the dtypes, to tell whether a returned LSE is stored coarser.
_PRECISION = {"float64": 3, "float32": 2, "bfloat16": 0, "float16": 1}


def allowed_lse(target: Target, case: FlashCase, ref: spec.FlashResult | None = None, *,
                stored: str | None = None) -> np.ndarray:
    """Elementwise allowed error of the LSE (B, N, L): ``tolerance.lse_allowed``; an LSE
    returned in a coarser dtype ``stored`` than the case's (FlashAttention-2 returns it in
    float32 for every input dtype) is allowed that dtype's rounding too."""
    ref = ref if ref is not None else oracle(case)
    problem, forward = _forward(case)
    _, naive = _naive_errors(case, ref)
    size = _score_sizes(case, problem, forward)[..., 0]
    allowed = tolerance.lse_allowed(case.dtype, naive, size, tf32=target.tf32)
    if stored in _PRECISION and _PRECISION[stored] < _PRECISION[case.dtype]:
        allowed = np.maximum(allowed, tolerance.lse_allowed(stored, naive, size))
    return allowed


# --------------------------------------------------------------------------- FP8 inputs


def _fp8_row_sizes(case: FlashCase) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    """(problem, forward, keys n (B, N, L, 1), score sizes Z (B, N, L, 1)) of an FP8 case,
    on the dequantised values (the oracle's problem)."""
    problem, forward = _forward(case)
    keys = np.broadcast_to(problem.allowed, forward.weights.shape).sum(axis=-1, keepdims=True)
    return problem, forward, keys.astype(np.float64), _score_sizes(case, problem, forward)


def fp8_allowed_output(case: FlashCase, ref: spec.FlashResult, out_dtype: str) -> np.ndarray:
    """Elementwise allowed error (B, L, N, Ev) of an FP8 call's output returned in
    ``out_dtype``: ``tolerance.fp8_allowed`` with M = weights @ |v|, A = Σ |v| over the
    attended keys, on the dequantised values."""
    problem, forward, keys, size = _fp8_row_sizes(case)
    magnitude = forward.weights @ np.abs(problem.value)                      # (B, N, L, Ev)
    attended = np.broadcast_to(problem.allowed, forward.weights.shape).astype(np.float64)
    key_values = attended @ np.abs(problem.value)                            # (B, N, L, Ev)
    t = (0, 2, 1, 3)
    allowed = tolerance.fp8_allowed(case.fp8, out_dtype, magnitude=magnitude, key_values=key_values,
                                    keys=keys, score_size=size, head_dim=case.E,
                                    expected=ref.output.transpose(t))
    return allowed.transpose(t)


def fp8_allowed_lse(case: FlashCase, ref: spec.FlashResult, stored: str) -> np.ndarray:
    """Allowed error (B, N, L) of an FP8 call's LSE returned in ``stored``."""
    _, _, keys, size = _fp8_row_sizes(case)
    return tolerance.fp8_lse_allowed(case.fp8, stored, keys=keys[..., 0], score_size=size[..., 0],
                                     head_dim=case.E, expected=ref.lse)


# --------------------------------------------------------------------------- checks against the oracle and its bounds


def check_output(target: Target, case: FlashCase, actual: np.ndarray, *, what: str = "output",
                 ref: spec.FlashResult | None = None, allowed: np.ndarray | None = None) -> Comparison:
    """The output against ``spec.flash_attention`` under the tolerance rule (or ``allowed``);
    rows attending no key follow the declared policy (zero: exactly 0, nan: NaN)."""
    __tracebackhide__ = True
    ref = ref if ref is not None else oracle(case)
    rows = ~case.empty_rows()                                                 # (L,)
    where = rows[None, :, None, None]
    allowed = allowed if allowed is not None else allowed_output(target, case, ref)
    comparison = compare_values(what, actual, ref.output, allowed, where=where)
    dead = actual[:, ~rows]
    policy = "zero" if case.sinks is not None else target.caps.fully_masked
    if dead.size and case.sinks is not None and not (dead == 0).all():
        fail(f"{what} of rows attending no key (window/causal, L > S) = {dead.ravel()[:4]}, but should be 0 "
             "(with sinks such a row puts all its weight on the sink, which carries no value)")
    if dead.size and policy == "zero" and not (dead == 0).all():
        fail(f"{what} of rows attending no key (window/causal, L > S) = {dead.ravel()[:4]}, but should be 0 "
             f"({policy_source(target)} fully_masked='zero', FlashAttention's)")
    if dead.size and policy == "nan" and not np.isnan(dead).all():
        fail(f"{what} of rows attending no key should be NaN ({policy_source(target)} fully_masked='nan')")
    return comparison


def check_lse(target: Target, case: FlashCase, lse: np.ndarray, *,
              ref: spec.FlashResult | None = None, stored: str | None = None) -> Comparison:
    """The LSE (B, N, L) against the oracle's natural-log LSE; -inf (FlashAttention-2's +inf
    is mapped to it) in rows attending no key."""
    __tracebackhide__ = True
    ref = ref if ref is not None else oracle(case)
    with np.errstate(invalid="ignore"):  # -inf against -inf
        return compare_values("softmax_lse", lse, ref.lse, allowed_lse(target, case, ref, stored=stored))


def compare_gradients(target: Target, call: Any, tensors: dict[str, Any], *,
                      expected: spec.FlashGrads | None = None, factor: float = 1.0) -> float:
    """dq, dk, dv against ``expected`` (default the VJP of the call's case) within the
    gradient floor at the case's magnitudes, times ``factor``."""
    __tracebackhide__ = True
    case, grad_out = call.case, call.grad_output
    grads = expected or spec.flash_attention_vjp(case.query, case.key, case.value, grad_out, **case.options())
    problem, forward = _forward(case)
    t = (0, 2, 1, 3)
    view = SDPACase(problem.query, case.key.transpose(t), case.value.transpose(t), scale=problem.scale)
    bounds = grad_magnitudes(view, SimpleNamespace(weights=forward.weights), grad_out.transpose(t))
    finite = forward.logits[np.isfinite(forward.logits)]
    logit_range = float(np.abs(finite).max()) if finite.size else 0.0
    if problem.bias is not None:
        logit_range += float(np.abs(problem.bias).max())
    worst = 0.0
    for what, name, expected in (("dq", "q", grads.dquery), ("dk", "k", grads.dkey), ("dv", "v", grads.dvalue)):
        grad = tensors[name].grad
        if grad is None:
            fail(f"{what} is None, but should be a gradient (autograd is declared)")
        bound = bounds[{"dq": "dquery", "dk": "dkey", "dv": "dvalue"}[what]].transpose(t)
        allowed = factor * tolerance.grad_allowed(case.dtype, bound, logit_range, tf32=target.tf32)
        worst = max(worst, compare_values(what, to_numpy(grad), expected, allowed).ratio)
    return worst


#: The dtypes an FP8 call's output may come back in (FlashAttention-3's is bfloat16).
FP8_OUTPUT_DTYPES = ("bfloat16", "float16", "float32")


def check_fp8(target: Target, case: FlashCase, call: Any) -> float:
    """An FP8 call (``case.fp8``): the output, in a 16- or 32-bit float dtype, against the
    oracle on the dequantised inputs within ``tolerance.fp8_allowed`` for the dtype it came
    back in; the LSE, when asked for, within ``tolerance.fp8_lse_allowed``."""
    __tracebackhide__ = True
    if call.out_dtype not in FP8_OUTPUT_DTYPES:
        fail(f"output dtype={call.out_dtype} for q, k, v in {case.fp8}, but should be one of "
             f"{', '.join(FP8_OUTPUT_DTYPES)} (an FP8 call's output is not FP8; FlashAttention-3 returns bfloat16)")
    ref = oracle(case)
    ratio = check_output(target, case, call.output, ref=ref, what=f"output (q, k, v in {case.fp8})",
                         allowed=fp8_allowed_output(case, ref, call.out_dtype)).ratio
    if call.lse is not None:
        stored = call.lse_dtype if call.lse_dtype in tolerance.EPS else "float32"
        with np.errstate(invalid="ignore"):  # -inf against -inf
            ratio = max(ratio, compare_values(f"softmax_lse (q, k, v in {case.fp8})", call.lse, ref.lse,
                                              fp8_allowed_lse(case, ref, stored)).ratio)
    return ratio


def compare_dropout_gradients(target: Target, call: Any, tensors: dict[str, Any],
                              keep: np.ndarray) -> float:
    """dq, dk, dv of a dropout call against ``spec.flash_attention_vjp`` with the call's own
    pattern ``keep``, within the gradient floor at the dropout-free magnitudes / (1 - p)."""
    __tracebackhide__ = True
    case, p = call.case, call.dropout_p
    grads = spec.flash_attention_vjp(case.query, case.key, case.value, call.grad_output, **case.options(),
                                     dropout_p=p, dropout_mask=keep)
    return compare_gradients(target, call, tensors, expected=grads, factor=1 / (1 - p))


# --------------------------------------------------------------------------- dropout


def check_dropout_mean(target: Target, case: FlashCase, call: Any) -> float:
    """A dropout call on ``samples`` copies of ``case`` (V >= 0): no NaN in rows attending a
    key, and the mean over the copies is the dropout-free oracle within Hoeffding's bound
    plus each sample's rounding (``tolerance.flash_dropout_allowed``)."""
    __tracebackhide__ = True
    p, samples = call.spec.dropout_p, call.spec.samples
    out = call.output.reshape(samples, case.B, case.L, case.N, case.Ev)
    rows = ~case.empty_rows()
    if np.isnan(out[:, :, rows]).any():
        fail(f"dropout output has NaN with dropout_p={p}")
    ref = oracle(case)
    problem, forward = _forward(case)
    c = (forward.weights @ np.abs(problem.value)).transpose(0, 2, 1, 3) / (1 - p)   # (B, L, N, Ev)
    rounding = allowed_output(target, case, ref) / (1 - p)
    mean = out.mean(axis=0)
    bound = tolerance.flash_dropout_allowed(c, samples, mean.size, rounding)
    ratio = compare_values(f"mean of {samples} dropout outputs (dropout_p={p})", mean, ref.output, bound,
                           where=rows[None, :, None, None]).ratio
    # The mean alone passes a dropout_p that is ignored or one mask shared by every copy.
    sigma = np.sqrt(p / (1 - p) * (forward.weights ** 2 @ problem.value ** 2)).transpose(0, 2, 1, 3)
    return max(ratio, check_dropout_spread(out, sigma, c, rounding, rows[None, :, None, None],
                                           f"dropout_p={p}"))


def dropout_pattern_of(case: FlashCase, call: Any) -> np.ndarray:
    """The dropout pattern (B, N, L, S), True = kept, read off ``return_attn_probs``' third
    element (FlashAttention-2's S_dmask (B, N, >= L, >= S): negative where dropped)."""
    __tracebackhide__ = True
    probs = call.probs
    B, N, L, S = case.B * call.spec.samples, case.N, case.L, case.S
    if probs is None or probs.ndim != 4 or probs.shape[:2] != (B, N) or probs.shape[2] < L or probs.shape[3] < S:
        shape = None if probs is None else probs.shape
        fail(f"return_attn_probs=True with dropout_p={call.spec.dropout_p} returned S_dmask of shape {shape}, "
             f"but should return (output, softmax_lse, S_dmask (B, N, >= L, >= S) = ({B}, {N}, >= {L}, >= {S})) "
             "as flash_attn_func does (dropout_pattern declared)")
    return ~(probs[:, :, :L, :S] < 0)
