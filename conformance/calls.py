"""Calling an implementation on a case, and what the oracle says of that case.

Everything that crosses into the implementation goes through
``runner.call_guarded`` so that its exceptions and hangs become property
failures, never a crashed run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import spec
from conformance import tolerance
from conformance.cases import SDPACase
from conformance.compare import Comparison, assert_contract, compare_values, fail
from conformance.runner import Target, call_guarded
from conformance.tensors import dtype_of, sdpa_inputs, to_numpy

__all__ = [
    "SDPACall",
    "fold_causal",
    "oracle",
    "run_sdpa",
    "magnitude",
    "naive_error",
    "check_against_oracle",
    "valid_rows",
]


def fold_causal(case: SDPACase) -> SDPACase:
    """The same problem with the causal constraint written into an explicit mask."""
    if case.causal is None:
        return case
    L, S = case.L, case.S
    causal = spec.masks.causal_mask(L, S, case.causal)  # (L, S), True = may attend
    if case.additive_mask is not None:
        add = case.additive_mask + np.where(causal, 0.0, -np.inf)
        return case.replace(additive_mask=add, causal=None)
    if case.attend_mask is not None:
        return case.replace(attend_mask=case.attend_mask & causal, causal=None)
    return case.replace(attend_mask=causal, causal=None)


def oracle(case: SDPACase, **overrides: Any) -> spec.SDPAResult:
    """The float64 oracle on the case's stored values (fully-masked rows -> 0)."""
    args = dict(
        attend_mask=case.attend_mask,
        additive_mask=case.additive_mask,
        causal=case.causal,
        scale=case.scale,
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
        causal=case.causal, scale=case.scale, fully_masked="zero",
    )
    diff = np.where(rows, np.abs(emulated - reference), 0.0)
    finite = np.isfinite(diff)
    return float(diff[finite].max()) if finite.any() else 0.0


def uses_causal_flag(target: Target, case: SDPACase) -> bool:
    """Whether the case's causality goes over as ``is_causal=True`` (the flag means
    the case's alignment and no mask comes with it) rather than folded into a mask."""
    return case.causal is not None and case.causal == target.caps.causal and case.mask_kind == "none"


def allowed_error(target: Target, case: SDPACase, ref: spec.SDPAResult) -> np.ndarray:
    """Elementwise allowed error of ``case``'s output under the tolerance rule."""
    return tolerance.sdpa_allowed(
        case.dtype, naive_error(case, ref.output, valid_rows(case)), magnitude(case, ref.weights),
        tf32=target.tf32, logit_scale=logit_scale(case, ref),
    )


@dataclass
class SDPACall:
    output: np.ndarray  # float64 copy of the implementation's output
    tensor: Any  # the output tensor itself
    inputs: dict[str, Any]  # the tensors handed over


def run_sdpa(
    target: Target,
    case: SDPACase,
    *,
    requires_grad: bool = False,
    dropout_p: float = 0.0,
    use_causal_flag: bool = True,
    inputs: dict[str, Any] | None = None,
) -> SDPACall:
    """Call ``target.impl.sdpa`` on ``case`` (causal folded into the mask unless
    the implementation's flag means the case's alignment and no mask is given)."""
    flag = use_causal_flag and uses_causal_flag(target, case)
    call_case = case if (flag or case.causal is None) else fold_causal(case)
    tensors = inputs if inputs is not None else sdpa_inputs(call_case, requires_grad=requires_grad)
    out = call_guarded(
        target,
        target.impl.sdpa,
        tensors["query"],
        tensors["key"],
        tensors["value"],
        attn_mask=tensors["attn_mask"],
        dropout_p=dropout_p,
        is_causal=bool(flag),
        scale=case.scale,
        enable_gqa=case.K != case.N,
    )
    import torch

    if not isinstance(out, torch.Tensor):
        fail(f"output type={type(out).__name__}, but should be torch.Tensor (SDPA returns one tensor)")
    expected_shape = (case.B, case.N, case.L, case.Ev)
    if tuple(out.shape) != expected_shape:
        fail(f"output shape={tuple(out.shape)}, but should be {expected_shape} (B, N, L, Ev)")
    return SDPACall(to_numpy(out), out, tensors)


def check_against_oracle(
    target: Target,
    case: SDPACase,
    actual: np.ndarray,
    *,
    what: str = "output",
    reference: spec.SDPAResult | None = None,
    rows: np.ndarray | None = None,
    extra_allowed: float | np.ndarray = 0.0,
) -> Comparison:
    """Compare an SDPA output with the oracle under the tolerance rule."""
    ref = reference if reference is not None else oracle(case)
    rows = valid_rows(case) if rows is None else rows
    allowed = allowed_error(target, case, ref) + extra_allowed
    return compare_values(what, actual, ref.output, allowed, where=rows)


def assert_output_contract(target: Target, case: SDPACase, call: SDPACall) -> None:
    shape = (case.B, case.N, case.L, case.Ev)
    assert_contract("output", call.tensor, shape=shape, dtype=dtype_of(case.dtype), device=target.device)
