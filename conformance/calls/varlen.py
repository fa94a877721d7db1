"""Packed variable-length calls: the cases, the calls, and what the oracle says.

The varlen level (``implementations.base``) takes FlashAttention's
``flash_attn_varlen_func`` convention; the oracle is ``spec.varlen_attention``. Every
call goes through ``core.target.call_guarded`` (:func:`run_varlen`, logged as a
:class:`VarlenCallSpec`, made by :func:`run_varlen_call`: the same code a failure's
reproducer runs through :func:`show_varlen_call`). The error bound is the SDPA rule
(``conformance.core.tolerance``, computed by ``conformance.calls.sdpa``) applied sequence by
sequence: each sequence of a packed batch is one SDPA problem of its own (B = 1, the
sequence's own L and S, FlashAttention's bottom-right causal); with a window, soft-capping
or ALiBi it is the flash level's rule (``conformance.calls.flash_bounds``) on the sequence
as a flash case, which also bounds the LSE. The kvcache level's calls
(``conformance.calls.kvcache``) share that rule, the tensors and the report with this level
(``conformance.calls.sequences``).

Dimension letters: B sequences, N query heads, K kv heads, L query length, S key length,
E q/k head dim, Ev value head dim, T packed total length.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

import spec
from conformance.calls.cache_options import (
    _DESCALES,
    check_lse_against_oracle,
    descale_forms,
    descale_kwargs,
    flash_options,
    float32_tensor,
    fp8_sequence_bounds,
    fp8_text,
    option_features,
    option_kwargs,
    option_text,
    split_lse,
)
from conformance.calls.call_reports import CallReport
from conformance.calls.call_specs import _seeded, call_directly
from conformance.calls.equivalence import Side, compare_equivalent
from conformance.calls.sequences.bounds import (
    compare_with_oracle,
    compared_rows,
    sequences_bounds,
    sequences_lse_bounds,
)
from conformance.calls.sequences.calling import (
    check_returned_output,
    int32,
    is_tensor,
    log_call,
    tensor,
)
from conformance.calls.sequences.cases import (
    fp8_meta,
    head_attrs,
    option_fields_from_meta,
    replace,
)
from conformance.calls.sequences.reports import report_against_oracle
from conformance.core.compare import compare_values
from conformance.core.observe import observe_varlen
from conformance.core.target import Target, call_guarded
from conformance.core.tensors import to_numpy

__all__ = [
    "ATTRIBUTES",
    "SHOW",
    "VARLEN_ATTRIBUTES",
    "CallSpec",
    "Case",
    "VarlenCallSpec",
    "VarlenCase",
    "case_from_meta",
    "case_meta",
    "check_lse_against_oracle",
    "check_varlen_against_oracle",
    "compare_pair",
    "report_call",
    "report_varlen_call",
    "run_varlen",
    "run_varlen_call",
    "run_varlen_lse",
    "show_varlen_call",
    "validate",
    "varlen_bounds",
    "varlen_lse_bounds",
]

#: Attributes of a varlen-level call (``VarlenCase.attrs()``; the call adds none): the
#: keys an expected failure's ``match`` may use at this level.
VARLEN_ATTRIBUTES = frozenset({
    "level", "device", "dtype", "causal", "scale", "scale_sign", "B", "N", "K", "L", "S", "E", "Ev",
    "gqa", "different_v_dim", "window", "softcap", "alibi", "varlen_features", "lse", "fp8", "descale_forms",
})


def _seqlens_text(cu_seqlens: tuple[int, ...]) -> str:
    """A cu_seqlens list as text, its middle elided past 12 entries (packed copies)."""
    values = [int(x) for x in cu_seqlens]
    if len(values) <= 12:
        return str(values)
    return f"[{', '.join(map(str, values[:5]))}, ..., {', '.join(map(str, values[-3:]))}] ({len(values)} entries)"


@dataclass(frozen=True, eq=False, repr=False)
class VarlenCase:
    """B sequences packed along one axis: query (T_q, N, E), key (T_k, K, E), value
    (T_k, K, Ev); sequence b owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key
    rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` (an empty sequence is allowed). ``causal``:
    FlashAttention's flag (bottom-right per sequence). ``notes``: labels that change no call
    (a directed case's ``directed: NAME``, which the report names it by)."""

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    cu_seqlens_q: tuple[int, ...]
    cu_seqlens_k: tuple[int, ...]
    causal: bool = False
    scale: float | None = None
    dtype: str = "float64"
    device: str = "cpu"
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: np.ndarray | None = None    # (N,) or (B, N), float32-exact
    #: FP8 inputs (FlashAttention-3): q, k, v hold values of this format, with descales
    #: None, (1,) or (B, K) (one row per sequence; ``spec.fp8.dequantize_varlen``).
    fp8: str | None = None
    q_descale: np.ndarray | None = None
    k_descale: np.ndarray | None = None
    v_descale: np.ndarray | None = None
    notes: tuple[str, ...] = ()

    @property
    def level(self) -> str:
        return "varlen"

    @property
    def B(self) -> int:
        return len(self.cu_seqlens_q) - 1

    @property
    def N(self) -> int:
        return int(self.query.shape[1])

    @property
    def K(self) -> int:
        return int(self.key.shape[1])

    @property
    def E(self) -> int:
        return int(self.query.shape[2])

    @property
    def Ev(self) -> int:
        return int(self.value.shape[2])

    def sequences(self) -> list[tuple[slice, slice]]:
        """(query rows, key rows) of each sequence in the packed arrays."""
        q, k = self.cu_seqlens_q, self.cu_seqlens_k
        return [(slice(q[b], q[b + 1]), slice(k[b], k[b + 1])) for b in range(self.B)]

    def lengths(self) -> list[tuple[int, int]]:
        """(L_b, S_b) of each sequence."""
        return [(r.stop - r.start, c.stop - c.start) for r, c in self.sequences()]

    def alone(self, b: int) -> VarlenCase:
        """Sequence b as a batch of its own."""
        rows, keys = self.sequences()[b]
        L, S = rows.stop - rows.start, keys.stop - keys.start
        slopes = self.alibi_slopes
        if slopes is not None and np.ndim(slopes) == 2:
            slopes = slopes[b:b + 1]
        descales = {n: d[b:b + 1] if d is not None and np.ndim(d) == 2 else d
                    for n, d in ((n, getattr(self, n)) for n in _DESCALES)}
        return replace(self, query=self.query[rows], key=self.key[keys], value=self.value[keys],
                       cu_seqlens_q=(0, L), cu_seqlens_k=(0, S), alibi_slopes=slopes, **descales)

    def attrs(self, **extra: Any) -> dict[str, Any]:
        """Attributes for capability checks (``Implementation.not_supported_reasons``)."""
        lengths = self.lengths() or [(0, 0)]
        out = head_attrs(self, L=max(L for L, _ in lengths), S=max(S for _, S in lengths))
        out.update({"window": tuple(self.window) != (-1, -1), "softcap": self.softcap,
                    "alibi": self.alibi_slopes is not None, "varlen_features": option_features(self),
                    "fp8": self.fp8, "descale_forms": descale_forms(self)})
        if self.fp8 is not None:
            out["varlen_features"] = out["varlen_features"] | {"fp8"}
        out.update(extra)
        return out

    def replace(self, **changes: Any) -> VarlenCase:
        return replace(self, **changes)

    def named_with(self, what: str) -> tuple[str, ...]:
        """``notes`` with ``what`` added to the directed case's name (a variant of it)."""
        return tuple(f"{note}, {what}" if note.startswith("directed: ") else note for note in self.notes)

    def describe(self) -> str:
        return (f"varlen B={self.B} N={self.N} K={self.K} E={self.E} Ev={self.Ev} "
                f"cu_seqlens_q={_seqlens_text(self.cu_seqlens_q)} cu_seqlens_k={_seqlens_text(self.cu_seqlens_k)} "
                f"causal={self.causal}{option_text(self)}{fp8_text(self)} scale={self.scale} dtype={self.dtype} "
                f"device={self.device}")

    def __repr__(self) -> str:
        return f"VarlenCase({self.describe()})"


# -- the tolerance rule, sequence by sequence ------------------------------------------


def varlen_bounds(target: Target, case: VarlenCase) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(expected (T_q, N, Ev) = ``spec.varlen_attention``, allowed, live rows (T_q, N, 1))."""
    if case.fp8 is not None:  # on the dequantised values, FP8's bound (for the bfloat16 output FA3 returns)
        return fp8_sequence_bounds(case, out_dtype="bfloat16")
    return sequences_bounds(target, case, _sequences(case), (case.query.shape[0], case.N, case.Ev))


def varlen_lse_bounds(target: Target, case: VarlenCase, stored: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(expected LSE (N, T_q) = ``spec.varlen_attention``'s, allowed error (N, T_q))."""
    return sequences_lse_bounds(target, case, _sequences(case, lse=True), (case.N, case.query.shape[0]), stored)


def _sequences(case: VarlenCase, *, lse: bool = False) -> Any:
    """Each sequence as ``(b, at, q, k, v)`` (``sequences.bounds``): its rows of the packed
    output (T_q, N, Ev), or with ``lse`` of the LSE (N, T_q)."""
    for b, (rows, keys) in enumerate(case.sequences()):
        yield b, ((slice(None), rows) if lse else rows), case.query[rows], case.key[keys], case.value[keys]


def compare_pair(target: Target, what: str, actual: np.ndarray, other: np.ndarray,
                 allowed: np.ndarray, live: np.ndarray, *, expected: np.ndarray | None = None,
                 names: tuple[str, str] = ("the first call", "the second call"),
                 paths: tuple[str, str] = ("", "")) -> float:
    """Two outputs of the implementation that must agree: each is within ``allowed`` of
    the oracle, so they may differ by twice that. With ``expected`` (the oracle's output,
    the same for both), a disagreement says which call (``names``; ``other`` is the
    reference side) disagrees with the spec, and so which path (``paths``) is wrong."""
    __tracebackhide__ = True
    where = compared_rows(target, live)
    if expected is None:
        return compare_values(what, actual, other, 2 * allowed, where=where).ratio
    sides = [Side(name, output, expected, allowed, where, path)
             for name, output, path in zip(names, (actual, other), paths, strict=True)]
    return compare_equivalent(what, *sides, 2 * allowed, where=where).ratio


def check_varlen_against_oracle(target: Target, case: VarlenCase, output: np.ndarray) -> float:
    __tracebackhide__ = True
    return compare_with_oracle(target, "packed output", output, varlen_bounds(target, case))


# -- calling the implementation ------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class VarlenCallSpec:
    """One call of ``impl.varlen`` exactly as made: the case (FlashAttention's arguments
    follow from it; ``grad_output`` is always None at this level)."""

    case: VarlenCase
    grad_output: np.ndarray | None = None
    lse: bool = False  # return_attn_probs=True: (output, softmax_lse (N, T_q), ...)
    dropout_p: float = 0.0  # passed only when > 0 (the varlen feature ``dropout``)
    dropout_seed: int | None = None  # torch's generators seeded with it around the call (None: not seeded)

    @property
    def level(self) -> str:
        return "varlen"

    def attrs(self) -> dict[str, Any]:
        attrs = self.case.attrs(lse=self.lse)
        if self.lse:
            attrs["varlen_features"] = attrs["varlen_features"] | {"lse"}
        if self.dropout_p:
            attrs["varlen_features"] = attrs["varlen_features"] | {"dropout"}
        return attrs

    def arguments(self) -> str:
        lengths = self.case.lengths() or [(0, 0)]
        options = "".join(f", {k}={v!r}" for k, v in option_kwargs(self.case, lambda a: "<float32 tensor>").items())
        return (f"cu_seqlens_q={_seqlens_text(self.case.cu_seqlens_q)}, "
                f"cu_seqlens_k={_seqlens_text(self.case.cu_seqlens_k)}, "
                f"max_seqlen_q={max(L for L, _ in lengths)}, max_seqlen_k={max(S for _, S in lengths)}, "
                f"softmax_scale={self.case.scale!r}, causal={self.case.causal!r}{options}"
                f"{f', dropout_p={self.dropout_p!r}' if self.dropout_p else ''}"
                f"{', return_attn_probs=True' if self.lse else ''}"
                f"{'' if self.dropout_seed is None else f'; torch seeded with {self.dropout_seed}'}")

    def describe(self) -> str:
        return f"{self.case.describe()}; {self.arguments()}"

    def same_as(self, case: Any) -> bool:
        return self.case is case and not self.lse and not self.dropout_p


def run_varlen_call(impl: Any, call: VarlenCallSpec, *, invoke: Any = call_directly, check_output: bool = True,
                    with_probs: bool = False) -> Any:
    """Make ``call`` on ``impl.varlen`` (through ``invoke``): fresh tensors of the case,
    FlashAttention's arguments; with ``check_output``, check what came back. The tensor
    (with ``call.lse``: the pair (output, softmax_lse); with ``with_probs`` too, the triple
    (output, softmax_lse, the third element if a tensor, else None): FlashAttention-2's
    S_dmask with dropout)."""
    __tracebackhide__ = True
    case = call.case
    lengths = case.lengths() or [(0, 0)]
    extra = option_kwargs(case, lambda a: float32_tensor(a, case))
    extra.update(descale_kwargs(case, lambda a: float32_tensor(a, case)))
    if call.lse:
        extra["return_attn_probs"] = True
    if call.dropout_p:
        extra["dropout_p"] = float(call.dropout_p)
    args = (tensor(case.query, case), tensor(case.key, case), tensor(case.value, case),
            int32(case.cu_seqlens_q, case.device), int32(case.cu_seqlens_k, case.device),
            max(L for L, _ in lengths), max(S for _, S in lengths))

    def forward() -> Any:
        with _seeded(call.dropout_seed, case.device):
            return impl.varlen(*args, softmax_scale=case.scale, causal=case.causal, **extra)

    out = invoke(forward)
    lse = probs = None
    if call.lse and check_output:
        if with_probs and isinstance(out, (tuple, list)) and len(out) > 2:
            probs = out[2] if is_tensor(out[2]) else None
        out, lse = split_lse(out, (case.N, case.query.shape[0]), "return_attn_probs", "(N, T_q)")
    if check_output:
        check_returned_output(out, case, (case.query.shape[0], case.N, case.Ev), "(T_q, N, Ev)")
    if with_probs and lse is not None:
        return out, lse, probs
    return out if lse is None else (out, lse)


def run_varlen(target: Target, case: VarlenCase) -> np.ndarray:
    """``target.impl.varlen`` on ``case`` through ``core.target.call_guarded``, the call logged;
    the output (T_q, N, Ev)."""
    __tracebackhide__ = True
    call = VarlenCallSpec(case)
    log_call(target, call)
    output = to_numpy(run_varlen_call(target.impl, call, invoke=partial(call_guarded, target)))
    observe_varlen(case, output)
    return output


def run_varlen_lse(target: Target, case: VarlenCase) -> tuple[np.ndarray, np.ndarray, str]:
    """The call with ``return_attn_probs=True``: (output (T_q, N, Ev), softmax_lse (N, T_q),
    the dtype the LSE came back in)."""
    __tracebackhide__ = True
    call = VarlenCallSpec(case, lse=True)
    log_call(target, call)
    out, lse = run_varlen_call(target.impl, call, invoke=partial(call_guarded, target))
    output, lse_values, stored = to_numpy(out), to_numpy(lse), str(lse.dtype).removeprefix("torch.")
    observe_varlen(case, output, np.where(np.isposinf(lse_values), -np.inf, lse_values), stored)
    return output, lse_values, stored


# -- saving and reproducing ------------------------------------------------------------------


_ARRAYS = ("query", "key", "value")


def case_meta(case: VarlenCase) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(meta, arrays)`` of a varlen case for ``conformance.reporting.failures`` (kind ``"varlen"``)."""
    meta = {"kind": "varlen", "cu_seqlens_q": [int(n) for n in case.cu_seqlens_q],
            "cu_seqlens_k": [int(n) for n in case.cu_seqlens_k], "causal": bool(case.causal),
            "scale": case.scale, "dtype": case.dtype, "device": case.device,
            "window": [int(x) for x in case.window], "softcap": float(case.softcap), "notes": list(case.notes)}
    arrays = {n: np.asarray(getattr(case, n)) for n in _ARRAYS}
    if case.alibi_slopes is not None:
        arrays["alibi_slopes"] = np.asarray(case.alibi_slopes)
    return fp8_meta(case, meta, arrays)


def case_from_meta(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> VarlenCase:
    return VarlenCase(**{n: arrays[n] for n in _ARRAYS}, cu_seqlens_q=tuple(int(n) for n in meta["cu_seqlens_q"]),
                      cu_seqlens_k=tuple(int(n) for n in meta["cu_seqlens_k"]), **option_fields_from_meta(meta, arrays),
                      notes=tuple(meta.get("notes", ())))  # absent in older files


def validate(case: VarlenCase) -> None:
    """ValueError (``spec.SpecError``) when the spec calls ``case`` invalid."""
    for name in _ARRAYS:
        if np.ndim(getattr(case, name)) != 3:
            raise ValueError(f"{name} has shape {np.shape(getattr(case, name))}, but should be 3-D (T, heads, dim)")
    spec.varlen_attention(case.query, case.key, case.value, case.cu_seqlens_q, case.cu_seqlens_k,
                          causal=case.causal, scale=case.scale, **flash_options(case))


def report_varlen_call(impl: Any, call: VarlenCallSpec, *, invoke: Any = call_directly) -> CallReport:
    """Make ``call`` and compare its output with ``spec.varlen_attention``, sequence by sequence."""
    case = call.case
    target = Target(impl, "varlen", case.dtype, case.device)
    report = CallReport(call, [f"call: impl.varlen(q, k, v, {call.arguments()})",
                               f"case as called: {case.describe()}"])

    def oracle(result: Any) -> str:
        options = "".join(f", {k}={v!r}" for k, v in flash_options(case).items() if k != "alibi_slopes")
        return (f"oracle: spec.varlen_attention(causal={case.causal!r}, scale={case.scale!r}{options}), "
                "tolerance rule per sequence")

    def checks(result: Any) -> list[Any]:
        out = to_numpy(result[0] if call.lse else result)
        found = [lambda: check_varlen_against_oracle(target, case, out)]
        if call.lse:
            stored = str(result[1].dtype).removeprefix("torch.")
            found.append(lambda: check_lse_against_oracle("softmax_lse", to_numpy(result[1]),
                                                          *varlen_lse_bounds(target, case, stored)))
        return found

    return report_against_oracle(
        report, validate=lambda: validate(case),
        run_unchecked=lambda: run_varlen_call(impl, call, invoke=invoke, check_output=False),
        run=lambda: run_varlen_call(impl, call, invoke=invoke),
        oracle=oracle,
        checks=checks, output=lambda result: to_numpy(result[0] if call.lse else result),
        expected=lambda: varlen_bounds(target, case)[0])


def show_varlen_call(impl: Any, call: VarlenCallSpec) -> CallReport:
    """Make ``call`` in this interpreter and print how it differs from ``spec.varlen_attention``."""
    report = report_varlen_call(impl, call)
    print(report.text())
    return report


# The level's entries of conformance.core.levels (what the shared machinery reads).
Case = VarlenCase
CallSpec = VarlenCallSpec
ATTRIBUTES = VARLEN_ATTRIBUTES
report_call = report_varlen_call
SHOW = "show_varlen_call"
