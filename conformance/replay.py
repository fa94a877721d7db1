"""One call into an implementation, as data: what the runner calls, what a failure
saves, what its reproducer re-runs.

A property often calls the implementation on something other than the case
Hypothesis drew (V = identity, permuted keys, an invalid variant, large logits,
the case tiled into dropout samples, a module in train mode), and the runner hands
the case over in one particular way (causality as ``is_causal=True`` or folded
into ``attn_mask``, a memory layout, dropout, autograd). :class:`SDPACallSpec` and
:class:`MHACallSpec` hold exactly that: the case as called and every argument.

There is one path from a call spec to the implementation: ``calls.run_sdpa`` and
``mha_calls.run_mha`` make every call of the properties through
:func:`run_sdpa_call` / :func:`run_mha_call`, and a failure's reproducer snippet
runs the same functions through :func:`show_sdpa_call` / :func:`show_mha_call`,
which also print how the result differs from the oracle for the case as called.

Every random draw of a call that is not Hypothesis' own (dropout masks, upstream
gradients) is seeded from the case's contents (:func:`content_seed`), never from
Python's salted ``hash()``: a replay, another process or an xdist worker draws the
same.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

import spec
from conformance.cases import MHACase, SDPACase
from conformance.compare import PropertyFailure, fail

__all__ = [
    "Invoke",
    "SDPACallSpec",
    "MHACallSpec",
    "CallLog",
    "SDPAOutcome",
    "MHAOutcome",
    "CallReport",
    "fold_causal",
    "tile_sdpa_case",
    "tile_mha_case",
    "mha_output_shape",
    "content_seed",
    "run_sdpa_call",
    "build_module",
    "run_mha_call",
    "report_sdpa_call",
    "report_mha_call",
    "show_sdpa_call",
    "show_mha_call",
    "first_failing_call",
]

#: How a call is made: ``invoke(fn, *args, **kwargs)``. The runner passes
#: ``functools.partial(runner.call_guarded, target)``; a reproducer calls directly.
Invoke = Callable[..., Any]


def _direct(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def content_seed(salt: str, *arrays: np.ndarray | None, extra: str = "") -> int:
    """A 63-bit seed from the bytes of ``arrays`` (and ``extra``): the same in every
    process, whatever ``PYTHONHASHSEED`` is."""
    h = hashlib.blake2b(salt.encode(), digest_size=8)
    for a in arrays:
        if a is not None:
            a = np.ascontiguousarray(a)
            h.update(str((a.dtype.str, a.shape)).encode())
            h.update(a.tobytes())
    h.update(extra.encode())
    return int.from_bytes(h.digest(), "little") >> 1


def _mha_arrays(case: MHACase) -> list[np.ndarray | None]:
    p = case.params
    return [p.in_proj_weight, p.q_proj_weight, p.k_proj_weight, p.v_proj_weight, p.in_proj_bias,
            p.out_proj_weight, p.out_proj_bias, p.bias_k, p.bias_v,
            case.query, case.key, case.value, case.key_padding_mask, case.attn_mask]


def mha_content_seed(case: MHACase, salt: str) -> int:
    """:func:`content_seed` of every array of an MHA case and its forward options."""
    return content_seed(salt, *_mha_arrays(case), extra=case.describe())


@contextmanager
def _seeded(seed: int | None, device: str) -> Iterator[None]:
    """torch's generators seeded with ``seed`` inside, restored after (no-op for None)."""
    if seed is None:
        yield
        return
    import torch

    devices = [torch.cuda.current_device()] if device == "cuda" and torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


# -- SDPA ---------------------------------------------------------------------


def fold_causal(case: SDPACase) -> SDPACase:
    """The same problem with the causal constraint written into an explicit mask."""
    if case.causal is None:
        return case
    causal = spec.masks.causal_mask(case.L, case.S, case.causal)  # (L, S), True = may attend
    if case.additive_mask is not None:
        add = case.additive_mask + np.where(causal, 0.0, -np.inf)
        return case.replace(additive_mask=add, causal=None)
    if case.attend_mask is not None:
        return case.replace(attend_mask=case.attend_mask & causal, causal=None)
    return case.replace(attend_mask=causal, causal=None)


def _tile_mask(mask: np.ndarray | None, samples: int) -> np.ndarray | None:
    if mask is None:
        return None
    m4 = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    return np.tile(m4, (samples, 1, 1, 1)) if m4.shape[0] > 1 else m4


def tile_sdpa_case(case: SDPACase, samples: int) -> SDPACase:
    """``samples`` copies of ``case`` along the batch dim (B -> samples·B)."""
    if samples == 1:
        return case
    return case.replace(
        query=np.tile(case.query, (samples, 1, 1, 1)),
        key=np.tile(case.key, (samples, 1, 1, 1)),
        value=np.tile(case.value, (samples, 1, 1, 1)),
        attend_mask=_tile_mask(case.attend_mask, samples),
        additive_mask=_tile_mask(case.additive_mask, samples),
    )


@dataclass(frozen=True, eq=False)
class SDPACallSpec:
    """One call of ``impl.sdpa``, exactly as made.

    ``case``: the problem as called (``causal`` is the alignment it asks for).
    ``is_causal``: the flag passed; when False and ``case.causal`` is set, the causal
    constraint is folded into ``attn_mask`` (:func:`fold_causal`). ``dropout_p`` with
    ``dropout_seed`` (torch's generator is seeded with it for the call).
    ``grad_output``: the upstream gradient backpropagated after the call (None: no
    autograd); ``mask_grad``: the additive mask requires grad too. ``samples``: the
    call is made on ``samples`` copies of ``case`` along the batch (dropout
    expectation); the report compares their mean.
    """

    case: SDPACase
    is_causal: bool = False
    dropout_p: float = 0.0
    dropout_seed: int | None = None
    grad_output: np.ndarray | None = None
    mask_grad: bool = False
    samples: int = 1

    @property
    def level(self) -> str:
        return "sdpa"

    @property
    def grad(self) -> bool:
        return self.grad_output is not None

    @property
    def enable_gqa(self) -> bool:
        return self.case.K != self.case.N

    @cached_property
    def called_case(self) -> SDPACase:
        """The case whose tensors are handed over (before folding causality)."""
        return tile_sdpa_case(self.case, self.samples)

    @cached_property
    def passed_case(self) -> SDPACase:
        """:attr:`called_case` with causality folded into the mask unless the flag carries it."""
        called = self.called_case
        return called if (self.is_causal or called.causal is None) else fold_causal(called)

    def attrs(self) -> dict[str, Any]:
        """The case's attributes plus the call's: ``is_causal`` (the flag), ``dropout_p``, ``grad``."""
        return self.case.attrs(is_causal=self.is_causal, dropout_p=self.dropout_p, grad=self.grad)

    def arguments(self) -> str:
        """The call's arguments besides the tensors, as written in the call."""
        mask = self.passed_case.mask_kind
        folded = " (causal folded in)" if self.case.causal is not None and not self.is_causal else ""
        text = (f"attn_mask={'None' if mask == 'none' else mask + folded}, dropout_p={self.dropout_p}, "
                f"is_causal={self.is_causal}, scale={self.case.scale!r}, enable_gqa={self.enable_gqa}")
        extras = [f"layout={self.case.layout}"]
        if self.samples > 1:
            extras.append(f"{self.samples} copies along the batch")
        if self.grad:
            extras.append("backward with a seeded upstream gradient" + (" (mask grad too)" if self.mask_grad else ""))
        return f"{text}; {', '.join(extras)}"

    def describe(self) -> str:
        return f"{self.case.describe()}; {self.arguments()}"

    def same_as(self, case: Any) -> bool:
        """Whether this call is the plain call of ``case`` (same case object, no
        dropout, no autograd, one copy)."""
        return (self.case is case and not self.dropout_p and not self.grad and self.samples == 1)


@dataclass
class SDPAOutcome:
    tensor: Any  # what impl.sdpa returned
    inputs: dict[str, Any]  # the tensors handed over (their .grad filled after backward)


def run_sdpa_call(impl: Any, call: SDPACallSpec, *, invoke: Invoke = _direct,
                  inputs: dict[str, Any] | None = None, check_output: bool = True) -> SDPAOutcome:
    """Make ``call`` on ``impl.sdpa`` (through ``invoke``), then, with ``check_output``,
    check that a tensor of shape (B, N, L, Ev) came back, and backpropagate the
    call's ``grad_output`` when it has one.

    ``inputs``: the tensors to hand over (``tensors.sdpa_inputs`` of the passed
    case), when the caller keeps them to inspect afterwards.
    """
    __tracebackhide__ = True
    import torch

    from conformance.tensors import dtype_of, sdpa_inputs

    case = call.called_case
    tensors = inputs if inputs is not None else sdpa_inputs(call.passed_case, requires_grad=call.grad)
    mask = tensors["attn_mask"]
    if mask is not None and mask.requires_grad and not call.mask_grad:
        tensors = dict(tensors, attn_mask=mask.detach())

    def forward() -> Any:
        with _seeded(call.dropout_seed, case.device):
            return impl.sdpa(tensors["query"], tensors["key"], tensors["value"],
                             attn_mask=tensors["attn_mask"], dropout_p=call.dropout_p,
                             is_causal=call.is_causal, scale=case.scale, enable_gqa=call.enable_gqa)

    out = invoke(forward)
    if check_output:
        if not isinstance(out, torch.Tensor):
            fail(f"output type={type(out).__name__}, but should be torch.Tensor (SDPA returns one tensor)")
        expected_shape = (case.B, case.N, case.L, case.Ev)
        if tuple(out.shape) != expected_shape:
            fail(f"output shape={tuple(out.shape)}, but should be {expected_shape} (B, N, L, Ev)")
    if call.grad_output is not None:
        g = torch.from_numpy(call.grad_output).to(dtype_of(case.dtype)).to(out.device)
        invoke(out.backward, g)
    return SDPAOutcome(out, tensors)


# -- MHA ----------------------------------------------------------------------


def tile_mha_case(case: MHACase, samples: int) -> MHACase:
    """``samples`` copies of a batched ``case`` along the batch (B -> samples·B),
    keeping self-attention (``query is key is value``) as it is."""
    if samples == 1:
        return case
    if case.unbatched:
        raise ValueError("an unbatched MHA case (L, D) has no batch to tile; draw batched cases")
    axis = 0 if case.batch_first else 1
    reps = [1, 1, 1]
    reps[axis] = samples
    query = np.tile(case.query, reps)
    key = query if case.key is case.query else np.tile(case.key, reps)
    value = query if case.value is case.query else key if case.value is case.key else np.tile(case.value, reps)
    kpm, mask = case.key_padding_mask, case.attn_mask
    return case.replace(
        query=query, key=key, value=value,
        key_padding_mask=None if kpm is None else np.tile(kpm, (samples, 1)),
        attn_mask=mask if mask is None or mask.ndim == 2 else np.tile(mask, (samples, 1, 1)),
    )


def mha_output_shape(case: MHACase) -> tuple[int, ...]:
    """(L, D) unbatched, (B, L, D) batch_first, else (L, B, D)."""
    if case.unbatched:
        return (case.L, case.D)
    return (case.B, case.L, case.D) if case.batch_first else (case.L, case.B, case.D)


@dataclass(frozen=True, eq=False)
class MHACallSpec:
    """One forward call of a module built by ``impl.mha``, exactly as made.

    ``case``: the module's weights and options and the forward arguments as called
    (``need_weights``, ``average_attn_weights``, ``is_causal`` included). The module
    is built with ``dropout`` and put in train mode when ``training``. ``grad``: the
    inputs require grad and autograd is on; otherwise the call runs under
    ``torch.no_grad()``, as inference does (which lets nn.MultiheadAttention take
    its fast path). ``grad_output``: the upstream gradient backpropagated after the
    call. ``dropout_seed`` seeds torch's generator for the call. ``samples``: the
    call is made on that many copies of ``case`` along the batch.
    """

    case: MHACase
    dropout: float = 0.0
    training: bool = False
    grad: bool = False
    grad_output: np.ndarray | None = None
    dropout_seed: int | None = None
    samples: int = 1

    @property
    def level(self) -> str:
        return "mha"

    @cached_property
    def called_case(self) -> MHACase:
        return tile_mha_case(self.case, self.samples)

    def attrs(self) -> dict[str, Any]:
        """The case's attributes plus the call's: ``grad``, ``dropout_p`` (the module's
        dropout), ``training``."""
        return self.case.attrs(grad=self.grad, dropout_p=self.dropout, training=self.training)

    def arguments(self) -> str:
        c = self.case
        text = (f"module(dropout={self.dropout}, {'train' if self.training else 'eval'} mode), "
                f"need_weights={c.need_weights}, average_attn_weights={c.average_attn_weights}, "
                f"is_causal={c.is_causal}, {'autograd on' if self.grad else 'under torch.no_grad()'}")
        if self.grad_output is not None:
            text += ", backward with a seeded upstream gradient"
        if self.samples > 1:
            text += f", {self.samples} copies along the batch"
        return text

    def describe(self) -> str:
        return f"{self.case.describe()}; {self.arguments()}"

    def same_as(self, case: Any) -> bool:
        return (self.case is case and not self.dropout and not self.training and not self.grad
                and self.samples == 1)


@dataclass
class MHAOutcome:
    output: Any  # the output tensor
    weights: Any  # the weights tensor or None
    inputs: dict[str, Any]  # the forward keyword arguments handed over
    module: Any  # the module called


def build_module(impl: Any, call: MHACallSpec, *, invoke: Invoke = _direct) -> Any:
    """The implementation's module with the call's options, weights and mode."""
    __tracebackhide__ = True
    from conformance.tensors import dtype_of

    case = call.case
    p = case.params

    def make() -> Any:
        module = impl.mha(
            p.embed_dim, p.num_heads, dropout=call.dropout, bias=p.in_proj_bias is not None,
            add_bias_kv=p.bias_k is not None, add_zero_attn=bool(p.add_zero_attn),
            kdim=p.kdim, vdim=p.vdim, batch_first=case.batch_first,
            device=case.device, dtype=dtype_of(case.dtype),
        )
        impl.load_weights(module, p)
        module.train(call.training)
        return module

    return invoke(make)


def run_mha_call(impl: Any, call: MHACallSpec, *, invoke: Invoke = _direct, module: Any = None,
                 inputs: dict[str, Any] | None = None) -> MHAOutcome:
    """Make ``call``: build the module (unless ``module`` is given: one built with
    the call's options), call it on the case's inputs (``inputs`` when given), check
    that it returned (output, weights), and backpropagate ``grad_output``."""
    __tracebackhide__ = True
    import torch

    from conformance.tensors import mha_inputs

    case = call.called_case
    module = module if module is not None else build_module(impl, call, invoke=invoke)
    kwargs = dict(inputs) if inputs is not None else mha_inputs(case, requires_grad=call.grad)

    def forward() -> Any:
        with torch.set_grad_enabled(call.grad), _seeded(call.dropout_seed, case.device):
            return module(**kwargs)

    result = invoke(forward)
    if not isinstance(result, tuple) or len(result) != 2:
        fail(f"forward returned {type(result).__name__}, but should return (output, weights) "
             "as nn.MultiheadAttention does")
    out, weights = result
    if call.grad_output is not None:
        shape = mha_output_shape(case)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape:
            fail(f"output shape={tuple(getattr(out, 'shape', ()))}, but should be {shape}")
        invoke(out.backward, torch.from_numpy(call.grad_output).to(out.dtype).to(out.device))
    return MHAOutcome(out, weights, kwargs, module)


# -- reports: what a reproducer prints ----------------------------------------


@dataclass
class CallReport:
    """How one call's result differs from what it should be (:func:`report_sdpa_call`)."""

    call: Any
    lines: list[str] = field(default_factory=list)  # what :meth:`text` prints, findings included
    findings: list[str] = field(default_factory=list)  # each way the result is wrong
    max_difference: float | None = None  # max |out - oracle| where both are finite

    @property
    def shows_failure(self) -> bool:
        return bool(self.findings)

    def finding(self, message: str) -> None:
        self.findings.append(message)
        self.lines.append("FAILS: " + message.replace("\n", "\n       "))

    def text(self) -> str:
        verdict = (f"=> this call shows the failure ({len(self.findings)} finding(s))" if self.findings
                   else "=> this call alone agrees with the oracle; the property compares several "
                        "calls (see --replay)")
        return "\n".join([*self.lines, verdict])


def _raised(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def _untouched(report: CallReport, handed: dict[str, Any], fresh: dict[str, Any]) -> None:
    """Inputs handed over must come back unchanged (compared with a fresh copy)."""
    import torch

    for name, old in fresh.items():
        now = handed.get(name)
        if not isinstance(old, torch.Tensor) or not isinstance(now, torch.Tensor):
            continue
        now, old = now.detach(), old.detach()
        same = torch.equal(now, old) if old.dtype == torch.bool else torch.equal(
            torch.nan_to_num(now), torch.nan_to_num(old))
        if not same:
            report.finding(f"input {name} was modified in place by the call, but should be left unchanged")


def _difference_line(report: CallReport, out: np.ndarray, ref: np.ndarray,
                     where: np.ndarray | None = None) -> None:
    if out.shape != ref.shape:
        return
    sel = np.ones(out.shape, bool) if where is None else np.broadcast_to(where, out.shape)
    both = sel & np.isfinite(out) & np.isfinite(ref)
    bad = sel & (np.isfinite(ref) != np.isfinite(out))
    diff = np.where(both, np.abs(out - ref), 0.0)
    report.max_difference = float(diff.max()) if diff.size else 0.0
    extra = f"; non-finite where the oracle is finite (or the reverse): {int(bad.sum())}" if bad.any() else ""
    report.lines.append(f"max |out - oracle| = {report.max_difference:.6g}{extra}")


def report_sdpa_call(impl: Any, call: SDPACallSpec, *, invoke: Invoke = _direct) -> CallReport:
    """Make ``call`` and compare its result with what the spec says: the oracle for
    the case as called (under the declared fully-masked-row policy and the
    tolerance rule), a raise for an input the spec calls invalid, the output
    contract, the gradients, the inputs left untouched, and for ``samples`` copies
    with dropout the mean against its Hoeffding bound."""
    from conformance import calls
    from conformance.runner import ImplementationRaised, Target
    from conformance.tensors import sdpa_inputs, to_numpy

    case = call.case
    target = Target(impl, "sdpa", case.dtype, case.device)
    report = CallReport(call, [f"call: impl.sdpa(query, key, value, {call.arguments()})",
                               f"case as called: {case.describe()}"])
    try:
        ref = calls.oracle(case)
        invalid = None
    except (spec.SpecError, ValueError) as err:
        ref, invalid = None, str(err).strip().splitlines()[0]
        report.lines.append(f"the spec calls this input invalid: {invalid}")
    try:
        outcome = run_sdpa_call(impl, call, invoke=invoke, check_output=invalid is None)
    except ImplementationRaised as exc:
        if invalid is None:
            report.finding(str(exc))
        else:
            report.lines.append(f"raised, as it should: {exc}")
        return report
    except PropertyFailure as exc:
        report.finding(str(exc))
        return report
    except Exception as exc:  # noqa: BLE001 - the implementation's own error, called directly
        if invalid is None:
            report.finding(f"raised on a case it claims to support: {_raised(exc)}")
        else:
            report.lines.append(f"raised, as it should: {_raised(exc)}")
        return report
    if invalid is not None:
        shape = tuple(getattr(outcome.tensor, "shape", ()))
        report.finding(f"returned a result of shape {shape}, but should raise an error "
                       f"(the input is invalid per the spec: {invalid})")
        return report
    out = to_numpy(outcome.tensor)
    for check in (
        lambda: calls.assert_output_contract(target, call.called_case, calls.SDPACall(out, outcome.tensor)),
    ):
        try:
            check()
        except PropertyFailure as exc:
            report.finding(str(exc))
    if call.samples > 1 and call.dropout_p > 0:
        try:
            ratio = calls.check_dropout_mean(target, case, out, call.dropout_p, call.samples)
            report.lines.append(f"mean of {call.samples} dropout samples: worst error/allowed = {ratio:.3g}")
        except PropertyFailure as exc:
            report.finding(str(exc))
    elif call.dropout_p > 0:
        report.lines.append(f"dropout_p={call.dropout_p}: one random sample, not compared with the oracle")
    else:
        report.lines.append(f"oracle: spec.sdpa(causal={case.causal!r}, scale={case.scale!r}, "
                            f"fully_masked={target.caps.fully_masked!r})")
        for check in (lambda: calls.check_against_oracle(target, case, out),
                      lambda: calls.check_fully_masked_policy(target, case, out)):
            try:
                check()
            except PropertyFailure as exc:
                report.finding(str(exc))
        _difference_line(report, out, ref.output, calls.valid_rows(case))
    if call.grad:
        try:
            calls.compare_gradients(target, call, outcome.inputs)
        except PropertyFailure as exc:
            report.finding(str(exc))
    _untouched(report, outcome.inputs, sdpa_inputs(call.passed_case))
    return report


def report_mha_call(impl: Any, call: MHACallSpec, *, invoke: Invoke = _direct) -> CallReport:
    """Like :func:`report_sdpa_call` for a module call: the oracle
    (``spec.mha_forward``) for output and weights, the output contract, parameter
    and input gradients, inputs untouched, dropout means."""
    from conformance import mha_calls
    from conformance.compare import assert_contract
    from conformance.runner import ImplementationRaised, Target
    from conformance.tensors import dtype_of, mha_inputs, to_numpy

    case = call.case
    target = Target(impl, "mha", case.dtype, case.device)
    policy = target.caps.fully_masked
    report = CallReport(call, [f"call: module(query, key, value, ...) with {call.arguments()}",
                               f"case as called: {case.describe()}"])
    try:
        mha_calls.oracle(case)
        invalid = None
    except (spec.SpecError, ValueError) as err:
        invalid = str(err).strip().splitlines()[0]
        report.lines.append(f"the spec calls this input invalid: {invalid}")
    try:
        outcome = run_mha_call(impl, call, invoke=invoke)
    except ImplementationRaised as exc:
        (report.finding(str(exc)) if invalid is None else report.lines.append(f"raised, as it should: {exc}"))
        return report
    except PropertyFailure as exc:
        report.finding(str(exc))
        return report
    except Exception as exc:  # noqa: BLE001 - the implementation's own error, called directly
        if invalid is None:
            report.finding(f"raised on a case it claims to support: {_raised(exc)}")
        else:
            report.lines.append(f"raised, as it should: {_raised(exc)}")
        return report
    if invalid is not None:
        report.finding("returned a result, but should raise an error (the input is invalid per the spec: "
                       f"{invalid})")
        return report
    called = call.called_case
    try:
        assert_contract("output", outcome.output, shape=mha_output_shape(called),
                        dtype=dtype_of(case.dtype), device=case.device)
        if not case.need_weights and outcome.weights is not None:
            fail("weights returned with need_weights=False, but should be None")
    except PropertyFailure as exc:
        report.finding(str(exc))
        return report
    result = mha_calls.MHACall(to_numpy(outcome.output),
                               None if outcome.weights is None else to_numpy(outcome.weights),
                               outcome.output, outcome.weights, outcome.inputs, outcome.module)
    if call.dropout and call.training:
        if call.samples > 1:
            try:
                ratio = mha_calls.check_dropout_mean(target, case, result.output, call.dropout, call.samples)
                report.lines.append(f"mean of {call.samples} train-mode samples: worst error/allowed = {ratio:.3g}")
            except PropertyFailure as exc:
                report.finding(str(exc))
        else:
            report.lines.append(f"train mode with dropout={call.dropout}: one random sample, not compared")
    else:
        fully_masked = "zero" if policy == "unspecified" else policy
        report.lines.append(f"oracle: spec.mha_forward(need_weights={case.need_weights}, "
                            f"is_causal={case.is_causal}, fully_masked={fully_masked!r})")
        try:
            mha_calls.check_mha(target, case, result, fully_masked=fully_masked,
                                include_dead=policy != "unspecified")
        except PropertyFailure as exc:
            report.finding(str(exc))
        _difference_line(report, result.output, mha_calls.oracle(case, fully_masked=fully_masked)[0])
    if call.grad_output is not None:
        try:
            mha_calls.check_parameter_grads(outcome.module)
            mha_calls.check_input_derivative(target, case, outcome.inputs, call.grad_output)
        except PropertyFailure as exc:
            report.finding(str(exc))
    _untouched(report, outcome.inputs, mha_inputs(called))
    return report


def show_sdpa_call(impl: Any, call: SDPACallSpec) -> CallReport:
    """Make ``call`` in this interpreter and print how it differs from the oracle."""
    report = report_sdpa_call(impl, call)
    print(report.text())
    return report


def show_mha_call(impl: Any, call: MHACallSpec) -> CallReport:
    """Make ``call`` in this interpreter and print how it differs from the oracle."""
    report = report_mha_call(impl, call)
    print(report.text())
    return report


def first_failing_call(impl: Any, calls: Sequence[Any], *, invoke: Invoke = _direct
                       ) -> tuple[Any, CallReport] | None:
    """The first of ``calls`` (as a property made them) whose result alone shows a
    failure when made again, with its report; None when none does (the property
    compares calls with each other, or the implementation is not deterministic)."""
    from conformance import levels

    for call in calls:
        report_call = {"sdpa": report_sdpa_call, "mha": report_mha_call}.get(call.level)
        report_call = report_call or levels.module(call.level).report_call
        report = report_call(impl, call, invoke=invoke)
        if report.shows_failure:
            return call, report
    return None


@dataclass
class CallLog:
    """The calls one example made, in order (the runner gives each example a fresh
    one on its :class:`~conformance.runner.Target`), and the options each module
    was built with (by ``id``)."""

    calls: list[Any] = field(default_factory=list)
    modules: dict[int, tuple[float, bool]] = field(default_factory=dict)
