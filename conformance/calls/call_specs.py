"""Making one call into an implementation from its description as data.

:class:`SDPACallSpec` / :class:`MHACallSpec` hold a call exactly as a property made
it (the case as called, the flag or folded mask, dropout and its seed, autograd,
samples); :func:`run_sdpa_call` / :func:`run_mha_call` make it. Both the runner
(``calls.sdpa.run_sdpa``, ``calls.mha.run_mha``) and a reproducer go through them, so a
replay makes the same call. Random draws that are not Hypothesis' own are seeded
from the case's contents (:func:`content_seed`), never from Python's salted
``hash()``. :mod:`conformance.calls.call_reports` compares a call's result with the
oracle; :mod:`conformance.calls.replay` re-exports both modules' public names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

import numpy as np

import spec
from conformance.core.cases import MHACase, SDPACase
from conformance.core.compare import fail

__all__ = [
    "Invoke",
    "call_directly",
    "SDPACallSpec",
    "MHACallSpec",
    "CallLog",
    "SDPAOutcome",
    "MHAOutcome",
    "fold_causal",
    "uses_causal_flag",
    "case_rng",
    "tile_sdpa_case",
    "tile_mha_case",
    "mha_output_shape",
    "content_seed",
    "mha_content_seed",
    "run_sdpa_call",
    "build_module",
    "run_mha_call",
]

#: How a call is made: ``invoke(fn, *args, **kwargs)``. The runner passes
#: ``functools.partial(core.target.call_guarded, target)``; a reproducer calls directly.
Invoke = Callable[..., Any]


def call_directly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
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


def case_rng(case: SDPACase, salt: str = "") -> np.random.Generator:
    """A generator seeded by the case's contents: replaying a case replays its draws."""
    h = hashlib.blake2b(salt.encode(), digest_size=8)
    for a in (case.query, case.key, case.value):
        h.update(np.ascontiguousarray(a).tobytes())
    return np.random.default_rng(int.from_bytes(h.digest(), "little"))


def uses_causal_flag(target: Any, case: SDPACase) -> bool:
    """Whether the case's causality goes over as ``is_causal=True`` (the flag means
    the case's alignment and no mask comes with it) rather than folded into a mask."""
    return case.causal is not None and case.causal == target.caps.causal and case.mask_kind == "none"


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


def run_sdpa_call(impl: Any, call: SDPACallSpec, *, invoke: Invoke = call_directly,
                  inputs: dict[str, Any] | None = None, check_output: bool = True) -> SDPAOutcome:
    """Make ``call`` on ``impl.sdpa`` (through ``invoke``), then, with ``check_output``,
    check that a tensor of shape (B, N, L, Ev) came back, and backpropagate the
    call's ``grad_output`` when it has one.

    ``inputs``: the tensors to hand over (``tensors.sdpa_inputs`` of the passed
    case), when the caller keeps them to inspect afterwards.
    """
    __tracebackhide__ = True
    import torch

    from conformance.core.tensors import dtype_of, sdpa_inputs

    case = call.called_case
    caps = impl.caps("sdpa")
    tensors = inputs if inputs is not None else sdpa_inputs(call.passed_case, requires_grad=call.grad)
    mask = tensors["attn_mask"]
    if mask is not None and mask.requires_grad and not call.mask_grad:
        tensors = dict(tensors, attn_mask=mask.detach())
    if caps.shared_kv and tensors["value"] is not tensors["key"]:
        if not np.array_equal(case.key, case.value):
            fail("the call has value != key, but the implementation declares shared_kv (key is "
                 "value): the suite should not make this call (please report it)")
        tensors = dict(tensors, value=tensors["key"])  # one tensor: its gradient is dk + dv
    sdpa = impl.sdpa if caps.batch_dims is None else partial(_call_4d, impl.sdpa)

    sinks = {} if tensors.get("sinks") is None else {"sinks": tensors["sinks"]}  # only when the case has them

    def forward() -> Any:
        with _seeded(call.dropout_seed, case.device):
            return sdpa(tensors["query"], tensors["key"], tensors["value"],
                        attn_mask=tensors["attn_mask"], dropout_p=call.dropout_p,
                        is_causal=call.is_causal, scale=case.scale, enable_gqa=call.enable_gqa, **sinks)

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


def _call_4d(sdpa: Callable[..., Any], query: Any, key: Any, value: Any, *, attn_mask: Any,
             **kwargs: Any) -> Any:
    """``sdpa`` that accepts exactly (B, N, L, E) (``Capabilities.batch_dims=1``) called on
    inputs of any rank: q, k, v with their leading batch dims flattened to one (a 3-D
    input gets a batch of 1), the mask broadcast to those dims and made 4-D, the output
    given back its leading dims."""
    lead = tuple(query.shape[:-3])

    def four(t: Any) -> Any:  # (*lead, H, T, F) -> (prod(lead), H, T, F)
        return t.reshape(-1, *t.shape[-3:]) if t.dim() >= 4 else t.reshape(1, *t.shape)

    if attn_mask is not None:
        full = len(lead) + 3
        if attn_mask.dim() < full:  # (L, S), (N, L, S), ...: broadcast's leading 1s written out
            attn_mask = attn_mask.reshape((1,) * (full - attn_mask.dim()) + tuple(attn_mask.shape))
        if len(lead) != 1:
            attn_mask = four(attn_mask.expand(*lead, *attn_mask.shape[-3:]))
    out = sdpa(four(query), four(key), four(value), attn_mask=attn_mask, **kwargs)
    return out.reshape(*lead, *out.shape[-3:]) if hasattr(out, "reshape") and out.dim() == 4 else out


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


def build_module(impl: Any, call: MHACallSpec, *, invoke: Invoke = call_directly) -> Any:
    """The implementation's module with the call's options, weights and mode."""
    __tracebackhide__ = True
    from conformance.core.tensors import dtype_of

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


def run_mha_call(impl: Any, call: MHACallSpec, *, invoke: Invoke = call_directly, module: Any = None,
                 inputs: dict[str, Any] | None = None) -> MHAOutcome:
    """Make ``call``: build the module (unless ``module`` is given: one built with
    the call's options), call it on the case's inputs (``inputs`` when given), check
    that it returned (output, weights), and backpropagate ``grad_output``."""
    __tracebackhide__ = True
    import torch

    from conformance.core.tensors import mha_inputs

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


@dataclass
class CallLog:
    """The calls one example made, in order (the runner gives each example a fresh
    one on its :class:`~conformance.core.target.Target`), and the options each module
    was built with (by ``id``)."""

    calls: list[Any] = field(default_factory=list)
    modules: dict[int, tuple[float, bool]] = field(default_factory=dict)
