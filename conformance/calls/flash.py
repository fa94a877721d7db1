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
from typing import Any

import numpy as np

import spec
from conformance.calls.call_reports import CallReport
from conformance.calls.call_specs import (
    Invoke,
    _seeded,
    call_directly,
    case_rng,
    content_seed,
)
from conformance.calls.declarations import require_inside
from conformance.calls.flash_bounds import (
    FP8_OUTPUT_DTYPES,
    allowed_lse,
    allowed_output,
    check_dropout_mean,
    check_fp8,
    check_lse,
    check_output,
    compare_dropout_gradients,
    compare_gradients,
    dropout_pattern_of,
    emulate_flash,
    fp8_allowed_lse,
    fp8_allowed_output,
    oracle,
)
from conformance.calls.flash_cases import (
    FLASH_ATTRIBUTES,
    FlashCase,
    case_from_meta,
    case_meta,
    tile_flash_case,
)
from conformance.calls.sdpa import assert_returned_tensor
from conformance.core import observe
from conformance.core.compare import PropertyFailure, assert_contract, fail
from conformance.core.target import ImplementationRaised, Target, call_guarded
from conformance.core.tensors import dtype_of, to_numpy
from spec.emulate import round_to
from implementations.capabilities import backward_allowed

__all__ = [
    "ATTRIBUTES",
    "FLASH_ATTRIBUTES",
    "FP8_OUTPUT_DTYPES",
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
    "check_dropout_mean",
    "check_fp8",
    "check_output",
    "compare_dropout_gradients",
    "dropout_pattern_of",
    "emulate_flash",
    "expect_flash_raises",
    "flash_inputs",
    "fp8_allowed_lse",
    "fp8_allowed_output",
    "oracle",
    "tile_flash_case",
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
    for (``return_attn_probs=True``), the upstream gradient backpropagated after, and
    ``dropout_p`` with the seed torch's generator is seeded with for the call (the call
    is then made on ``samples`` copies of the case along the batch)."""

    case: FlashCase
    lse: bool = False
    grad_output: np.ndarray | None = None
    dropout_p: float = 0.0
    dropout_seed: int | None = None
    samples: int = 1

    @property
    def level(self) -> str:
        return "flash"

    @property
    def grad(self) -> bool:
        return self.grad_output is not None

    @property
    def called_case(self) -> FlashCase:
        return tile_flash_case(self.case, self.samples)

    @property
    def passed_case(self) -> FlashCase:
        return self.called_case

    def attrs(self) -> dict[str, Any]:
        return self.case.attrs(grad=self.grad, lse=self.lse, dropout_p=self.dropout_p)

    def keyword_arguments(self) -> dict[str, Any]:
        """What is passed besides q, k, v (tensors as placeholders): the options that
        differ from flash_attn_func's defaults, and softmax_scale and causal always."""
        c = self.case
        kwargs: dict[str, Any] = {"softmax_scale": c.scale, "causal": c.causal}
        if self.dropout_p:
            kwargs["dropout_p"] = self.dropout_p
        if c.window != (-1, -1):
            kwargs["window_size"] = c.window
        if c.softcap:
            kwargs["softcap"] = c.softcap
        if c.alibi_slopes is not None:
            kwargs["alibi_slopes"] = "<float32 tensor>"
        if c.sinks is not None:
            kwargs["sinks"] = "<float32 tensor>"
        for name in _DESCALES:
            if getattr(c, name) is not None:
                kwargs[name] = f"<float32 tensor {tuple(getattr(c, name).shape)}>"
        if self.lse:
            kwargs["return_attn_probs"] = True
        return kwargs

    def arguments(self) -> str:
        text = ", ".join(f"{k}={v!r}" if not isinstance(v, str) else f"{k}={v}"
                         for k, v in self.keyword_arguments().items())
        if self.case.fp8 is not None:
            text += f"; q, k, v in {self.case.fp8}"
        if self.dropout_p:
            text += f"; torch seeded with {self.dropout_seed}"
        if self.samples > 1:
            text += f"; {self.samples} copies along the batch"
        if self.grad:
            text += "; backward with a seeded upstream gradient"
        return text

    def describe(self) -> str:
        return f"{self.case.describe()}; {self.arguments()}"

    def same_as(self, case: Any) -> bool:
        return self.case is case and not self.grad and not self.lse and not self.dropout_p and self.samples == 1


#: FlashAttention-3's descale arguments of FP8 q, k, v.
_DESCALES = ("q_descale", "k_descale", "v_descale")


def flash_inputs(case: FlashCase, *, requires_grad: bool = False) -> dict[str, Any]:
    """Contiguous tensors of the case (q, k, v in its dtype, slopes float32) on its device."""
    import torch

    fp8 = case.fp8 is not None
    dtype = getattr(torch, case.fp8) if fp8 else dtype_of(case.dtype)

    def tensor(a: np.ndarray) -> Any:
        if fp8:  # float64 -> float8 (exact: the values are the format's), on the CPU, then moved
            return torch.tensor(np.ascontiguousarray(a), dtype=torch.float64).to(dtype).to(case.device)
        t = torch.tensor(np.ascontiguousarray(a), dtype=dtype, device=case.device)
        return t.requires_grad_(True) if requires_grad else t

    def float32(a: np.ndarray | None) -> Any:
        return None if a is None else torch.tensor(a, dtype=torch.float32, device=case.device)

    return {"q": tensor(case.query), "k": tensor(case.key), "v": tensor(case.value),
            "alibi_slopes": float32(case.alibi_slopes), "sinks": float32(case.sinks),
            **{name: float32(getattr(case, name)) for name in _DESCALES}}


@dataclass
class FlashOutcome:
    tensor: Any  # the output tensor
    lse: Any  # the LSE tensor (None unless asked for)
    inputs: dict[str, Any]  # the tensors handed over (.grad filled after backward)
    probs: Any = None  # return_attn_probs' third element (FlashAttention-2's S_dmask), if a tensor


def run_flash_call(impl: Any, call: FlashCallSpec, *, invoke: Invoke = call_directly,
                   inputs: dict[str, Any] | None = None, check_output: bool = True) -> FlashOutcome:
    """Make ``call`` on ``impl.flash`` (through ``invoke``); with ``check_output``, check
    that the output (and the LSE when asked for) came back, and backpropagate."""
    __tracebackhide__ = True
    import torch

    case = call.called_case
    tensors = inputs if inputs is not None else flash_inputs(case, requires_grad=call.grad)
    kwargs = call.keyword_arguments()
    for name in ("alibi_slopes", "sinks", *_DESCALES):
        if name in kwargs:
            kwargs[name] = tensors[name]

    def forward() -> Any:
        with _seeded(call.dropout_seed, case.device):
            return impl.flash(tensors["q"], tensors["k"], tensors["v"], **kwargs)

    result = invoke(forward)
    lse = probs = None
    if call.lse and check_output:
        if not isinstance(result, (tuple, list)) or len(result) < 2:
            fail(f"return_attn_probs=True returned {type(result).__name__}, but should return "
                 "(output, softmax_lse, ...) as flash_attn_func does")
        out, lse = result[0], result[1]
        probs = result[2] if len(result) > 2 and isinstance(result[2], torch.Tensor) else None
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
        g = torch.from_numpy(np.tile(call.grad_output, (call.samples, 1, 1, 1))).to(out.dtype).to(out.device)
        invoke(out.backward, g)
    return FlashOutcome(out, lse, tensors, probs)


@dataclass
class FlashCall:
    output: np.ndarray  # float64 copy of the output
    lse: np.ndarray | None  # float64 copy of the LSE (+inf mapped to -inf), when asked for
    tensor: Any
    inputs: dict[str, Any]
    spec: FlashCallSpec
    lse_dtype: str | None = None  # the dtype the LSE came back in ("float32", ...)
    probs: np.ndarray | None = None  # float64 copy of return_attn_probs' third element, if a tensor

    @property
    def out_dtype(self) -> str:
        return str(self.tensor.dtype).removeprefix("torch.")


def run_flash(target: Target, case: FlashCase, *, lse: bool = False, grad_output: np.ndarray | None = None,
              dropout_p: float = 0.0, samples: int = 1) -> FlashCall:
    """Call ``target.impl.flash`` on ``case`` through ``core.target.call_guarded`` and log the
    call; with ``dropout_p``, torch's generator is seeded from the case's contents and the
    call is made on ``samples`` copies of the case along the batch."""
    __tracebackhide__ = True
    seed = content_seed("flash-dropout", case.query, case.key, case.value) if dropout_p else None
    call = FlashCallSpec(case, lse=lse, grad_output=grad_output, dropout_p=dropout_p, dropout_seed=seed,
                         samples=samples)
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
    probs = None if outcome.probs is None else to_numpy(outcome.probs)
    output = to_numpy(outcome.tensor)
    if not dropout_p and case.fp8 is None:  # no variant models dropout or FP8 inputs
        observe.observe_flash(case, output, lse_values, lse_dtype)
    return FlashCall(output, lse_values, outcome.tensor, outcome.inputs, call, lse_dtype, probs)


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


def check_gradients(target: Target, case: FlashCase) -> float:
    """dq, dk, dv of a seeded upstream gradient against ``spec.flash_attention_vjp``, within
    ``tolerance.grad_allowed`` (magnitudes of ``calls.sdpa.grad_magnitudes`` on the heads-first
    problem; soft-capping's derivative is at most 1); the worst error/allowed ratio."""
    __tracebackhide__ = True
    if not backward_allowed(target.caps, case.L, case.S):
        return 0.0  # outside the declared backward rule (backward_seq_multiple): no gradient taken
    rng = case_rng(case, "grad")
    grad_out = round_to(rng.standard_normal((case.B, case.L, case.N, case.Ev)), case.dtype)
    call = run_flash(target, case, grad_output=grad_out)
    return compare_gradients(target, call.spec, call.inputs)


def assert_output_contract(target: Target, case: FlashCase, call: FlashCall) -> None:
    __tracebackhide__ = True
    assert_contract("output", call.tensor, shape=(case.B, case.L, case.N, case.Ev),
                    dtype=dtype_of(case.dtype), device=target.device)


# --------------------------------------------------------------------------- saving and reproducing


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
    shown = ", ".join(f"{k}={v!r}" for k, v in case.options().items() if not isinstance(v, np.ndarray))
    report.lines.append(f"oracle: spec.flash_attention({shown}, ...)")
    lse = None if outcome.lse is None else to_numpy(outcome.lse)
    made = FlashCall(to_numpy(outcome.tensor), None if lse is None else np.where(np.isposinf(lse), -np.inf, lse),
                     outcome.tensor, outcome.inputs, call,
                     None if lse is None else str(outcome.lse.dtype).removeprefix("torch."),
                     None if outcome.probs is None else to_numpy(outcome.probs))
    checks = _report_checks(target, case, call, made, ref)
    for check in checks:
        try:
            check()
        except PropertyFailure as exc:
            report.finding(str(exc))
    out = made.output if call.samples == 1 else made.output.reshape(call.samples, *ref.output.shape).mean(0)
    if call.samples > 1:
        report.lines.append(f"the output below is the mean of the {call.samples} copies")
    diff = np.abs(out - ref.output)[np.isfinite(out) & np.isfinite(ref.output)]
    report.max_difference = float(diff.max()) if diff.size else 0.0
    report.lines.append(f"max |out - oracle| = {report.max_difference:.6g}")
    return report


def _report_checks(target: Target, case: FlashCase, call: FlashCallSpec, made: FlashCall,
                   ref: spec.FlashResult) -> list[Any]:
    """The checks of a remade call, as its property made them: an FP8 call by its own bound,
    a dropout call by the mean of its copies or by the pattern it returned, else the output,
    the LSE and the gradients against the oracle."""
    if case.fp8 is not None:
        return [lambda: check_fp8(target, case, made)]
    if call.dropout_p:
        if call.samples > 1:
            return [lambda: check_dropout_mean(target, case, made)]
        if made.probs is None:
            return []
        keep = dropout_pattern_of(case, made)
        with_pattern = oracle(case, dropout_p=call.dropout_p, dropout_mask=keep)
        checks = [lambda: check_output(target, case, made.output, ref=with_pattern,
                                       allowed=allowed_output(target, case, ref) / (1 - call.dropout_p))]
        if call.grad:
            checks.append(lambda: compare_dropout_gradients(target, call, made.inputs, keep))
        return checks
    checks = [lambda: check_output(target, case, made.output, ref=ref)]
    if made.lse is not None:
        checks.append(lambda: check_lse(target, case, made.lse, ref=ref, stored=made.lse_dtype))
    if call.grad:
        checks.append(lambda: compare_gradients(target, call, made.inputs))
    return checks


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
    if case.fp8 is not None:
        for name in ("query", "key", "value"):
            if not spec.fp8.representable(getattr(case, name), case.fp8).all():
                raise ValueError(f"{name} holds values that are not {case.fp8} values")
    spec.flash_attention(case.query, case.key, case.value, **case.options())


# The level's entries of conformance.core.levels (what the shared machinery reads).
Case = FlashCase
CallSpec = FlashCallSpec
ATTRIBUTES = FLASH_ATTRIBUTES
report_call = report_flash_call
SHOW = "show_flash_call"
