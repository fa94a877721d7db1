"""Which wrong conventions explain an observed output, best first."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, NamedTuple, Union

import numpy as np

from . import _attention, mha
from ._core import UNIT_ROUNDOFF, Problem, SDPAProblem, Variant, VariantResult
from .registry import VARIANTS, lookup

__all__ = ["Match", "Allowed", "Observed", "DEFAULT_ULPS", "default_allowed", "fit", "rank", "reference"]

#: An output, or an ``(output, weights)`` pair (weights None when there are none).
Observed = Union[np.ndarray, tuple]
#: Allowed absolute error: a scalar or array for the output, or a callable
#: ``allowed(part, result)`` with ``part`` "output" or "weights" and ``result`` the
#: :class:`VariantResult` being compared against, returning a scalar or array.
Allowed = Union[float, np.ndarray, Callable[[str, VariantResult], Any]]

#: Ulps of the problem's dtype the fallback rule allows, relative to 1 + |expected|.
DEFAULT_ULPS = 16


class Match(NamedTuple):
    """A variant that explains the observation, and how well: worst error / allowed."""

    variant_id: str
    fit: float


def reference(problem: Problem) -> VariantResult:
    """The correct convention on ``problem`` (:func:`spec.sdpa` or :func:`spec.mha_forward`)."""
    return _attention.reference(problem) if isinstance(problem, SDPAProblem) else mha.reference(problem)


def default_allowed(problem: Problem) -> Callable[[str, VariantResult], np.ndarray]:
    """A fallback tolerance: ``DEFAULT_ULPS`` unit roundoffs of the problem's dtype times
    1 + |expected|, elementwise. The conformance runner passes its own rule instead."""
    unit = UNIT_ROUNDOFF[problem.dtype]

    def allowed(part: str, result: VariantResult) -> np.ndarray:
        expected = result.output if part == "output" else result.weights
        return DEFAULT_ULPS * unit * (1.0 + np.nan_to_num(np.abs(expected), nan=0.0, posinf=0.0))

    return allowed


def fit(actual: Any, expected: Any, allowed: Any, where: Any = None) -> float:
    """Worst ``|actual - expected| / allowed`` over the compared elements (``where``).

    Staged like an assert_close: another shape, NaN where the other is not, or an inf
    not matched by the same inf gives ``inf``; equal elements count 0 even where the
    allowed error is 0. A fit <= 1 means "within the allowed error".
    """
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        return float("inf")
    selected = np.ones(actual.shape, dtype=bool) if where is None else np.broadcast_to(where, actual.shape)
    nan_actual, nan_expected = np.isnan(actual), np.isnan(expected)
    if (selected & (nan_actual != nan_expected)).any():
        return float("inf")
    infinite = (np.isinf(actual) | np.isinf(expected)) & ~nan_actual & ~nan_expected
    if (selected & infinite & (actual != expected)).any():
        return float("inf")
    compared = selected & np.isfinite(actual) & np.isfinite(expected)
    error = np.abs(actual - expected)[compared]
    bound = np.broadcast_to(np.asarray(allowed, dtype=np.float64), actual.shape)[compared]
    if error.size == 0:
        return 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(error == 0, 0.0, error / bound)
    return float(np.nan_to_num(ratios, nan=np.inf).max())


def _compared_rows(problem: Problem, part: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """Where a declared "unspecified" policy leaves the output defined: bool, or None (everywhere)."""
    if problem.fully_masked != "unspecified":
        return None
    if isinstance(problem, SDPAProblem):
        rows = _attention.valid_rows(problem)                                  # (B, N, L, 1)
    else:
        blocked = mha._blocked_rows(problem)                              # (B, N, L)
        per_head = part == "weights" and not problem.average_attn_weights
        rows = ~blocked if per_head else ~blocked.any(axis=1)             # (B, N, L) or (B, L)
        if part == "output" and not problem.unbatched and not problem.batch_first:
            rows = rows.T                                                 # (B, L) -> (L, B)
        rows = (rows[0] if problem.unbatched else rows)[..., None]
    try:
        return np.broadcast_to(rows, shape)
    except ValueError:
        return None                                                       # another layout: shapes decide


def _split(observed: Observed) -> tuple[np.ndarray, np.ndarray | None]:
    if isinstance(observed, tuple):
        output, weights = observed
        return np.asarray(output), (None if weights is None else np.asarray(weights))
    return np.asarray(observed), None


def _part_fit(problem: Problem, part: str, actual: np.ndarray, result: VariantResult,
              allowed: Callable[[str, VariantResult], Any]) -> float:
    expected = result.output if part == "output" else result.weights
    bound = np.asarray(allowed(part, result), dtype=np.float64)
    if part == "output":
        bound = bound + np.asarray(result.slack, dtype=np.float64)
    return fit(actual, expected, bound, _compared_rows(problem, part, np.shape(expected)))


def _as_callable(allowed: Allowed | None, problem: Problem) -> Callable[[str, VariantResult], Any]:
    fallback = default_allowed(problem)
    if allowed is None:
        return fallback
    if callable(allowed):
        return allowed
    return lambda part, result: allowed if part == "output" else fallback(part, result)


def _selected(variants: Iterable[Variant | str] | Mapping[str, Variant] | None, level: str) -> list[Variant]:
    if variants is None:
        variants = VARIANTS.values()
    elif isinstance(variants, Mapping):
        variants = variants.values()
    chosen = [lookup(v) if isinstance(v, str) else v for v in variants]
    return [v for v in chosen if v.level == level and v.compute is not None]


def rank(observed: Observed, problem: Problem,
         variants: Iterable[Variant | str] | Mapping[str, Variant] | None = None,
         allowed: Allowed | None = None) -> list[Match]:
    """The variants that explain ``observed`` on ``problem``, best fit first.

    ``observed``: the implementation's output (SDPA (B, N, L, Ev); MHA as
    :func:`spec.mha_forward` returns it), or ``(output, weights)``; weights are
    compared only when both sides have them. ``variants``: Variant objects or ids
    (default: all of the problem's level). ``allowed``: the allowed absolute error
    (see :data:`Allowed`; default :func:`default_allowed`), to which each variant's
    own ``slack`` is added.

    A variant is tried when it is deterministic and ``applies(problem)``; it is
    skipped when its result is within the allowed error of the correct one (it could
    not explain a failure); it matches when ``observed`` is within the allowed error
    of its result, with ``fit`` the worst error/allowed ratio. Returns the matches as
    ``Match(variant_id, fit)``, sorted by fit; ties keep the table's order. Pure
    NumPy on the problem's arrays: no implementation is called.
    """
    output, weights = _split(observed)
    bound = _as_callable(allowed, problem)
    correct = reference(problem)
    matches = []
    for variant in _selected(variants, problem.level):
        if not variant.applies(problem):
            continue
        result = variant.compute(problem)
        parts = ["output"]
        if weights is not None and result.weights is not None and correct.weights is not None:
            parts.append("weights")
        distance = max(_part_fit(problem, part, getattr(correct, part), result, bound) for part in parts)
        if distance <= 1.0:
            continue                                                      # indistinguishable here
        observed_fit = max(_part_fit(problem, part, {"output": output, "weights": weights}[part], result, bound)
                           for part in parts)
        if observed_fit <= 1.0:
            matches.append(Match(variant.id, observed_fit))
    return sorted(matches, key=lambda match: match.fit)
