"""What a diagnosis reads: the calls of the implementation in the example being checked.

While a property runs, ``calls.sdpa.run_sdpa``, ``calls.mha.run_mha``, ``sharded.cases.run_sharded``
and the FlashAttention levels' calls (``calls.flash.run_flash``, ``calls.varlen.run_varlen``,
``calls.kvcache.run_kvcache``) hand each output to :func:`observe_sdpa`, :func:`observe_mha`,
:func:`observe_sharded`, :func:`observe_flash`, :func:`observe_varlen` or
:func:`observe_kvcache`, which append it to the current example's list (the runner starts a fresh list per example, :func:`start_example`): one list
append per call, so a passing run is not slowed. ``conformance.diagnosis.diagnose`` reads the
lists on a failure and re-exports these names.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["start_example", "observe_sdpa", "observe_mha", "observe_sharded", "observe_flash", "observe_varlen",
           "observe_kvcache"]


@dataclass
class _Call:
    """One call of the implementation: the case as it received it and what it returned."""

    level: str
    case: Any
    output: np.ndarray
    weights: np.ndarray | None = None
    dropout_p: float = 0.0
    overrides: dict[str, Any] = field(default_factory=dict)
    module: Any = None
    #: The FlashAttention levels' other returns: ``lse`` and ``lse_dtype`` (when asked for),
    #: ``k_cache``/``v_cache`` after the call and ``paged`` (kvcache).
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Example:
    case: Any
    record: Any = None
    calls: list[_Call] = field(default_factory=list)


#: The example the runner is checking now and the calls it made. Scratch space of one
#: example (reset by the runner for every example), so a context variable rather than
#: session state: it never outlives the next example.
_EXAMPLE: ContextVar[_Example | None] = ContextVar("conformance_diagnosis_example", default=None)
#: The first failing example of the property test running now (before Hypothesis shrank
#: it): it breaks ties between variants that the shrunk case cannot tell apart.
_FIRST_FAILURE: ContextVar[_Example | None] = ContextVar("conformance_diagnosis_first_failure", default=None)


def start_example(case: Any, record: Any = None) -> None:
    """The runner starts checking ``case`` for ``record``: forget the previous example's
    calls, unless it was the record's first failing example (then keep that one).
    Two attribute checks and one allocation: it runs on every example."""
    previous = _EXAMPLE.get()
    if record is not None and previous is not None and previous.record is record \
            and previous.case is record.failing_case:
        first = _FIRST_FAILURE.get()
        if first is None or first.record is not record:
            _FIRST_FAILURE.set(previous)
    _EXAMPLE.set(_Example(case, record))


def observe_sdpa(case: Any, output: np.ndarray, *, dropout_p: float = 0.0) -> None:
    """``calls.sdpa.run_sdpa`` called the implementation on ``case`` (as called: causal
    folded into the mask unless the flag was used) and got ``output`` (float64)."""
    example = _EXAMPLE.get()
    if example is not None:
        example.calls.append(_Call("sdpa", case, output, dropout_p=dropout_p))


def observe_mha(case: Any, output: np.ndarray, weights: np.ndarray | None, *, module: Any,
                overrides: dict[str, Any]) -> None:
    """``calls.mha.run_mha`` called ``module`` on ``case`` with forward arguments
    ``overrides`` replaced and got ``output`` and ``weights`` (float64, or None)."""
    example = _EXAMPLE.get()
    if example is not None:
        example.calls.append(_Call("mha", case, output, weights, overrides=dict(overrides), module=module))


def observe_sharded(case: Any, output: np.ndarray) -> None:
    """``sharded.cases.run_sharded`` called the implementation on every rank of ``case``
    and got ``output`` (the ranks' shards put back in global order, float64)."""
    example = _EXAMPLE.get()
    if example is not None:
        example.calls.append(_Call("sharded", case, output))


def observe_flash(case: Any, output: np.ndarray, lse: np.ndarray | None = None, lse_dtype: str | None = None) -> None:
    """``calls.flash.run_flash`` called ``flash_attn_func`` on ``case`` and got ``output``
    (B, L, N, Ev) and, when asked for, ``lse`` (B, N, L; +inf read as -inf), float64, the
    LSE returned in ``lse_dtype``."""
    example = _EXAMPLE.get()
    if example is not None:
        example.calls.append(_Call("flash", case, output, extra={"lse": lse, "lse_dtype": lse_dtype}))


def observe_varlen(case: Any, output: np.ndarray, lse: np.ndarray | None = None, lse_dtype: str | None = None) -> None:
    """``calls.varlen`` called ``flash_attn_varlen_func`` on ``case`` and got ``output``
    (T_q, N, Ev) and, when asked for, ``lse`` (N, T_q) returned in ``lse_dtype``."""
    example = _EXAMPLE.get()
    if example is not None:
        example.calls.append(_Call("varlen", case, output, extra={"lse": lse, "lse_dtype": lse_dtype}))


def observe_kvcache(case: Any, output: np.ndarray, *, paged: bool, k_cache: np.ndarray, v_cache: np.ndarray,
                    lse: np.ndarray | None = None, lse_dtype: str | None = None) -> None:
    """``calls.kvcache.run_kvcache`` called ``flash_attn_with_kvcache`` on ``case`` (its caches
    as pages when ``paged``) and got ``output`` (B, L, N, Ev), the caches after the call in
    the logical layout, and, when asked for, ``lse`` (B, N, L) returned in ``lse_dtype``."""
    example = _EXAMPLE.get()
    if example is not None:
        example.calls.append(_Call("kvcache", case, output, extra={"paged": paged, "k_cache": k_cache,
                                                                   "v_cache": v_cache, "lse": lse,
                                                                   "lse_dtype": lse_dtype}))


# --------------------------------------------------------------------------- diagnosing a failure
