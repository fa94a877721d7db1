"""The flash level: a ``flash_attn_func`` call as a case, calling it, and what ``spec.flash`` says.

A :class:`FlashCase` (``conformance.calls.flash_cases``, re-exported) is one call of ``flash_attn_func`` in its layout:
query (B, L, N, E), key (B, S, K, E), value (B, S, K, Ev), with ``causal`` (lower-right),
``window`` (left, right), ``softcap`` and ``alibi_slopes`` (N,) or (B, N). A
:class:`FlashCallSpec` is the call as made (with or without the LSE, with an upstream
gradient); :func:`run_flash` makes it through ``core.target.call_guarded`` and logs it, like
``calls.sdpa.run_sdpa``. The tolerance is the SDPA rule (``conformance.core.tolerance``): k × the
error of a naive same-precision computation of the very same case
(:func:`emulate_flash`, rounding after every operation as ``spec.emulate_sdpa`` does,
soft-capping included) plus a rounding floor at the magnitude of what the output sums;
the oracle and those bounds live in ``conformance.calls.flash_bounds`` (re-exported here).

Dimension letters: B batch, N query heads, K kv heads, L query length, S key length,
E q/k head dim, Ev value head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import Any

import numpy as np

import spec
from conformance.core import observe, tolerance
from conformance.calls.call_specs import Invoke, call_directly, case_rng
from conformance.calls.sdpa import assert_returned_tensor, grad_magnitudes
from conformance.core.cases import SDPACase
from conformance.core.compare import (
    Comparison,
    PropertyFailure,
    assert_contract,
    compare_values,
    fail,
)
from conformance.calls.declarations import require_inside
from conformance.calls.flash_bounds import _forward, allowed_lse, allowed_output, emulate_flash, oracle
from conformance.calls.flash_cases import FLASH_ATTRIBUTES, FlashCase
from conformance.calls.call_reports import CallReport
from conformance.core.target import ImplementationRaised, Target, call_guarded
from conformance.core.tensors import dtype_of, to_numpy
from spec.emulate import round_to

__all__ = [
    "ATTRIBUTES",
    "FLASH_ATTRIBUTES",
    "SHOW",
    "CallSpec",
    "Case",
    "FlashCall",
    "FlashCallSpec",
    "FlashCase",
    "allowed_lse",
    "allowed_output",
    "case_from_meta",
    "case_meta",
    "check_gradients",
    "check_lse",
    "check_output",
    "emulate_flash",
    "expect_flash_raises",
    "flash_inputs",
    "oracle",
    "report_call",
    "report_flash_call",
    "run_flash",
    "run_flash_call",
    "show_flash_call",
    "validate",
]





# --------------------------------------------------------------------------- calls


@dataclass(frozen=True, eq=False)
class FlashCallSpec:
    """One call of ``impl.flash``, exactly as made: the case, whether the LSE was asked
    for (``return_attn_probs=True``), and the upstream gradient backpropagated after."""

    case: FlashCase
    lse: bool = False
    grad_output: np.ndarray | None = None

    @property
    def level(self) -> str:
        return "flash"

    @property
    def grad(self) -> bool:
        return self.grad_output is not None

    @property
    def called_case(self) -> FlashCase:
        return self.case

    @property
    def passed_case(self) -> FlashCase:
        return self.case

    def attrs(self) -> dict[str, Any]:
        return self.case.attrs(grad=self.grad, lse=self.lse)

    def keyword_arguments(self) -> dict[str, Any]:
        """What is passed besides q, k, v (tensors as placeholders): the options that
        differ from flash_attn_func's defaults, and softmax_scale and causal always."""
        c = self.case
        kwargs: dict[str, Any] = {"softmax_scale": c.scale, "causal": c.causal}
        if c.window != (-1, -1):
            kwargs["window_size"] = c.window
        if c.softcap:
            kwargs["softcap"] = c.softcap
        if c.alibi_slopes is not None:
            kwargs["alibi_slopes"] = "<float32 tensor>"
        if c.sinks is not None:
            kwargs["sinks"] = "<float32 tensor>"
        if self.lse:
            kwargs["return_attn_probs"] = True
        return kwargs

    def arguments(self) -> str:
        text = ", ".join(f"{k}={v!r}" if not isinstance(v, str) else f"{k}={v}"
                         for k, v in self.keyword_arguments().items())
        if self.grad:
            text += "; backward with a seeded upstream gradient"
        return text

    def describe(self) -> str:
        return f"{self.case.describe()}; {self.arguments()}"

    def same_as(self, case: Any) -> bool:
        return self.case is case and not self.grad and not self.lse


def flash_inputs(case: FlashCase, *, requires_grad: bool = False) -> dict[str, Any]:
    """Contiguous tensors of the case (q, k, v in its dtype, slopes float32) on its device."""
    import torch

    dtype = dtype_of(case.dtype)

    def tensor(a: np.ndarray) -> Any:
        t = torch.tensor(np.ascontiguousarray(a), dtype=dtype, device=case.device)
        return t.requires_grad_(True) if requires_grad else t

    def float32(a: np.ndarray | None) -> Any:
        return None if a is None else torch.tensor(a, dtype=torch.float32, device=case.device)

    return {"q": tensor(case.query), "k": tensor(case.key), "v": tensor(case.value),
            "alibi_slopes": float32(case.alibi_slopes), "sinks": float32(case.sinks)}


@dataclass
class FlashOutcome:
    tensor: Any  # the output tensor
    lse: Any  # the LSE tensor (None unless asked for)
    inputs: dict[str, Any]  # the tensors handed over (.grad filled after backward)


def run_flash_call(impl: Any, call: FlashCallSpec, *, invoke: Invoke = call_directly,
                   inputs: dict[str, Any] | None = None, check_output: bool = True) -> FlashOutcome:
    """Make ``call`` on ``impl.flash`` (through ``invoke``); with ``check_output``, check
    that the output (and the LSE when asked for) came back, and backpropagate."""
    __tracebackhide__ = True
    import torch

    case = call.case
    tensors = inputs if inputs is not None else flash_inputs(case, requires_grad=call.grad)
    kwargs = call.keyword_arguments()
    for name in ("alibi_slopes", "sinks"):
        if name in kwargs:
            kwargs[name] = tensors[name]

    def forward() -> Any:
        return impl.flash(tensors["q"], tensors["k"], tensors["v"], **kwargs)

    result = invoke(forward)
    lse = None
    if call.lse and check_output:
        if not isinstance(result, (tuple, list)) or len(result) < 2:
            fail(f"return_attn_probs=True returned {type(result).__name__}, but should return "
                 "(output, softmax_lse, ...) as flash_attn_func does")
        out, lse = result[0], result[1]
    else:
        out = result[0] if isinstance(result, (tuple, list)) and call.lse else result
    if check_output:
        if not isinstance(out, torch.Tensor):
            fail(f"output type={type(out).__name__}, but should be torch.Tensor")
        shape = (case.B, case.L, case.N, case.Ev)
        if tuple(out.shape) != shape:
            fail(f"output shape={tuple(out.shape)}, but should be {shape} (B, L, N, Ev)")
        if lse is not None and (not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (case.B, case.N, case.L)):
            fail(f"softmax_lse shape={tuple(getattr(lse, 'shape', ()))}, but should be "
                 f"{(case.B, case.N, case.L)} (B, N, L)")
    if call.grad_output is not None:
        g = torch.from_numpy(call.grad_output).to(dtype_of(case.dtype)).to(out.device)
        invoke(out.backward, g)
    return FlashOutcome(out, lse, tensors)


@dataclass
class FlashCall:
    output: np.ndarray  # float64 copy of the output
    lse: np.ndarray | None  # float64 copy of the LSE (+inf mapped to -inf), when asked for
    tensor: Any
    inputs: dict[str, Any]
    spec: FlashCallSpec
    lse_dtype: str | None = None  # the dtype the LSE came back in ("float32", ...)


def run_flash(target: Target, case: FlashCase, *, lse: bool = False,
              grad_output: np.ndarray | None = None) -> FlashCall:
    """Call ``target.impl.flash`` on ``case`` through ``core.target.call_guarded`` and log the call."""
    __tracebackhide__ = True
    call = FlashCallSpec(case, lse=lse, grad_output=grad_output)
    require_inside(target, call)
    if target.log is not None:
        target.log.calls.append(call)
    outcome = run_flash_call(target.impl, call, invoke=partial(call_guarded, target))
    assert_returned_tensor("output", outcome.tensor, device=case.device)
    lse_values = None
    if outcome.lse is not None:
        lse_values = to_numpy(outcome.lse)
        # FlashAttention-2 writes +inf for a row attending no key; the spec says -inf.
        lse_values = np.where(np.isposinf(lse_values), -np.inf, lse_values)
    lse_dtype = None if outcome.lse is None else str(outcome.lse.dtype).removeprefix("torch.")
    output = to_numpy(outcome.tensor)
    observe.observe_flash(case, output, lse_values, lse_dtype)
    return FlashCall(output, lse_values, outcome.tensor, outcome.inputs, call, lse_dtype)


def expect_flash_raises(target: Target, case: FlashCase, what: str) -> None:
    """``case`` is invalid per the spec: the call must raise."""
    __tracebackhide__ = True
    call = FlashCallSpec(case)
    if target.log is not None:
        target.log.calls.append(call)
    try:
        outcome = run_flash_call(target.impl, call, invoke=partial(call_guarded, target), check_output=False)
    except ImplementationRaised:
        return
    fail(f"{what}: returned {type(outcome.tensor).__name__}, but should raise an error "
         "(the input is invalid per the spec)")


# --------------------------------------------------------------------------- checks against the oracle and its bounds


def check_output(target: Target, case: FlashCase, actual: np.ndarray, *, what: str = "output",
                 ref: spec.FlashResult | None = None) -> Comparison:
    """The output against ``spec.flash_attention`` under the tolerance rule; rows attending
    no key follow the declared policy (zero: exactly 0, nan: NaN)."""
    __tracebackhide__ = True
    ref = ref if ref is not None else oracle(case)
    rows = ~case.empty_rows()                                                 # (L,)
    where = rows[None, :, None, None]
    comparison = compare_values(what, actual, ref.output, allowed_output(target, case, ref), where=where)
    dead = actual[:, ~rows]
    policy = "zero" if case.sinks is not None else target.caps.fully_masked
    if dead.size and case.sinks is not None and not (dead == 0).all():
        fail(f"{what} of rows attending no key (window/causal, L > S) = {dead.ravel()[:4]}, but should be 0 "
             "(with sinks such a row puts all its weight on the sink, which carries no value)")
    if dead.size and policy == "zero" and not (dead == 0).all():
        fail(f"{what} of rows attending no key (window/causal, L > S) = {dead.ravel()[:4]}, but should be 0 "
             "(declared fully_masked='zero', FlashAttention's)")
    if dead.size and policy == "nan" and not np.isnan(dead).all():
        fail(f"{what} of rows attending no key should be NaN (declared fully_masked='nan')")
    return comparison


def check_lse(target: Target, case: FlashCase, lse: np.ndarray, *,
              ref: spec.FlashResult | None = None, stored: str | None = None) -> Comparison:
    """The LSE (B, N, L) against the oracle's natural-log LSE; -inf (FlashAttention-2's +inf
    is mapped to it) in rows attending no key."""
    __tracebackhide__ = True
    ref = ref if ref is not None else oracle(case)
    with np.errstate(invalid="ignore"):  # -inf against -inf
        return compare_values("softmax_lse", lse, ref.lse, allowed_lse(target, case, ref, stored=stored))


def check_gradients(target: Target, case: FlashCase) -> float:
    """dq, dk, dv of a seeded upstream gradient against ``spec.flash_attention_vjp``, within
    ``tolerance.grad_allowed`` (magnitudes of ``calls.sdpa.grad_magnitudes`` on the heads-first
    problem; soft-capping's derivative is at most 1); the worst error/allowed ratio."""
    __tracebackhide__ = True
    rng = case_rng(case, "grad")
    grad_out = round_to(rng.standard_normal((case.B, case.L, case.N, case.Ev)), case.dtype)
    call = run_flash(target, case, grad_output=grad_out)
    return compare_gradients(target, call.spec, call.inputs)


def compare_gradients(target: Target, call: FlashCallSpec, tensors: dict[str, Any]) -> float:
    __tracebackhide__ = True
    case, grad_out = call.case, call.grad_output
    grads = spec.flash_attention_vjp(case.query, case.key, case.value, grad_out, **case.options())
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
        allowed = tolerance.grad_allowed(case.dtype, bound, logit_range, tf32=target.tf32)
        worst = max(worst, compare_values(what, to_numpy(grad), expected, allowed).ratio)
    return worst


def assert_output_contract(target: Target, case: FlashCase, call: FlashCall) -> None:
    __tracebackhide__ = True
    assert_contract("output", call.tensor, shape=(case.B, case.L, case.N, case.Ev),
                    dtype=dtype_of(case.dtype), device=target.device)


# --------------------------------------------------------------------------- saving and reproducing


_ARRAYS = ("query", "key", "value", "alibi_slopes", "sinks")


def case_meta(case: FlashCase) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(meta, arrays)`` of a flash case for ``conformance.reporting.failures`` (kind ``"flash"``)."""
    arrays = {n: np.asarray(getattr(case, n)) for n in _ARRAYS if getattr(case, n) is not None}
    meta = {"kind": "flash", "causal": case.causal, "window": list(case.window), "softcap": case.softcap,
            "scale": case.scale, "dtype": case.dtype, "device": case.device, "regime": case.regime,
            "notes": list(case.notes)}
    return meta, arrays


def case_from_meta(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> FlashCase:
    return FlashCase(**{n: arrays.get(n) for n in _ARRAYS}, causal=bool(meta["causal"]),
                     window=tuple(meta["window"]), softcap=float(meta["softcap"]), scale=meta["scale"],
                     dtype=meta["dtype"], device=meta["device"], regime=meta["regime"],
                     notes=tuple(meta["notes"]))


def report_flash_call(impl: Any, call: FlashCallSpec, *, invoke: Invoke = call_directly) -> CallReport:
    """Make ``call`` and compare its output (and LSE, gradients) with ``spec.flash``."""
    case = call.case
    target = Target(impl, "flash", case.dtype, case.device)
    report = CallReport(call, [f"call: impl.flash(q, k, v, {call.arguments()})",
                               f"case as called: {case.describe()}"])
    try:
        ref = oracle(case)
    except (spec.SpecError, ValueError) as err:
        report.lines.append(f"the spec calls this input invalid: {str(err).strip().splitlines()[0]}")
        try:
            run_flash_call(impl, call, invoke=invoke, check_output=False)
        except Exception as exc:  # noqa: BLE001 - raising is right here
            report.lines.append(f"raised, as it should: {type(exc).__name__}: {exc}")
        else:
            report.finding("returned a result, but should raise an error (the input is invalid per the spec)")
        return report
    try:
        outcome = run_flash_call(impl, call, invoke=invoke)
    except PropertyFailure as exc:
        report.finding(str(exc))
        return report
    except Exception as exc:  # noqa: BLE001 - the implementation's own error, called directly
        report.finding(f"raised on a case it claims to support: {type(exc).__name__}: {exc}")
        return report
    report.lines.append(f"oracle: spec.flash_attention({', '.join(f'{k}={v!r}' for k, v in case.options().items() if k not in ('alibi_slopes', 'sinks'))}, ...)")
    checks = [lambda: check_output(target, case, to_numpy(outcome.tensor), ref=ref)]
    if outcome.lse is not None:
        lse = to_numpy(outcome.lse)
        stored = str(outcome.lse.dtype).removeprefix("torch.")
        checks.append(lambda: check_lse(target, case, np.where(np.isposinf(lse), -np.inf, lse), ref=ref,
                                        stored=stored))
    if call.grad:
        checks.append(lambda: compare_gradients(target, call, outcome.inputs))
    for check in checks:
        try:
            check()
        except PropertyFailure as exc:
            report.finding(str(exc))
    out = to_numpy(outcome.tensor)
    diff = np.abs(out - ref.output)[np.isfinite(out) & np.isfinite(ref.output)]
    report.max_difference = float(diff.max()) if diff.size else 0.0
    report.lines.append(f"max |out - oracle| = {report.max_difference:.6g}")
    return report


def show_flash_call(impl: Any, call: FlashCallSpec) -> CallReport:
    """Make ``call`` in this interpreter and print how it differs from ``spec.flash``."""
    report = report_flash_call(impl, call)
    print(report.text())
    return report


def validate(case: FlashCase) -> None:
    """ValueError (``spec.SpecError``) when the spec calls ``case`` invalid."""
    for name in ("query", "key", "value"):
        if np.ndim(getattr(case, name)) != 4:
            raise ValueError(f"{name} has shape {np.shape(getattr(case, name))}, but should be 4-D")
    spec.flash_attention(case.query, case.key, case.value, **case.options())


# The level's entries of conformance.core.levels (what the shared machinery reads).
Case = FlashCase
CallSpec = FlashCallSpec
ATTRIBUTES = FLASH_ATTRIBUTES
report_call = report_flash_call
SHOW = "show_flash_call"
