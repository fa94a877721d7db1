"""What a diagnosis reads: the calls of the implementation in the example being checked.

While a property runs, ``calls.sdpa.run_sdpa`` and ``calls.mha.run_mha`` hand each output
to :func:`observe_sdpa` / :func:`observe_mha`, which append it to the current example's
list (the runner starts a fresh list per example, :func:`start_example`): one list
append per call, so a passing run is not slowed. ``conformance.diagnosis.diagnose`` reads the
lists on a failure and re-exports these names.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["start_example", "observe_sdpa", "observe_mha", "observe_sharded"]


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


# --------------------------------------------------------------------------- diagnosing a failure
