"""Which wrong conventions explain an observed output, best first."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, NamedTuple, Union

import dataclasses

import numpy as np

from . import _attention, flash, kvcache, mha, sharded, varlen
from ._core import FLASH_FAMILY, UNIT_ROUNDOFF, Problem, SDPAProblem, ShardedProblem, Variant, VariantResult
from .registry import VARIANTS, lookup

__all__ = ["Match", "Allowed", "Observed", "DEFAULT_ULPS", "COARSE_ERROR_FLOOR", "default_allowed", "fit", "rank",
           "reference",
           "correct_fit", "precision_factor", "variant_fit", "partition", "finite_evidence", "as_correct",
           "CONCRETE_POLICIES"]

#: The policies a variant is computed under when the problem's is "unspecified": a
#: variant that empties a row the correct convention does not may fill it any way
#: the implementation does (its own policy is free), so each is tried.
CONCRETE_POLICIES = ("zero", "nan", "uniform")

#: An output, an ``(output, weights)`` pair (weights None when there are none), or a dict
#: of the parts a call returned (a subset of :data:`PARTS`; None values are left out).
Observed = Union[np.ndarray, tuple, dict]
#: The parts of a result an observation may be compared on, in the order they are compared.
PARTS = ("output", "weights", "lse", "k_cache", "v_cache")
#: Each FlashAttention level's module (its reference, live rows).
_FAMILY = {"flash": flash, "varlen": varlen, "kvcache": kvcache}
#: Allowed absolute error: a scalar or array for the output, or a callable
#: ``allowed(part, result)`` with ``part`` one of :data:`PARTS` and ``result`` the
#: :class:`VariantResult` being compared against, returning a scalar or array.
Allowed = Union[float, np.ndarray, Callable[[str, VariantResult], Any]]

#: Ulps of the problem's dtype the fallback rule allows, relative to 1 + |expected|.
DEFAULT_ULPS = 16

#: A variant computed in a coarser precision than the problem's explains an observation
#: only when the observation is as wrong as that precision makes it: its largest error
#: against the oracle at least this fraction of the variant's own. Measured: a float64
#: attention whose softmax is torch's float32 one against the model's float32 rounding,
#: 2,262 random small cases, smallest ratio 1/630 (0.1% of them below 1/30); a float64
#: kernel that soft-caps its logits, on a near-tie case, 1/2,500 (an error of 7e-12 where
#: a float32 softmax errs by 2e-8): a small systematic error is not a coarse precision.
COARSE_ERROR_FLOOR = 2.0**-10


class Match(NamedTuple):
    """A variant that explains the observation, and how well: worst error / allowed."""

    variant_id: str
    fit: float


def reference(problem: Problem) -> VariantResult:
    """The correct convention on ``problem`` (:func:`spec.sdpa`, :func:`spec.mha_forward`,
    full-sequence attention for a sharded problem, :func:`spec.flash_attention`,
    :func:`spec.varlen_attention` or :func:`spec.kvcache_attention` with the LSE and caches)."""
    if isinstance(problem, ShardedProblem):
        return sharded.reference(problem)
    if problem.level in FLASH_FAMILY:
        return _FAMILY[problem.level].reference(problem)
    return _attention.reference(problem) if isinstance(problem, SDPAProblem) else mha.reference(problem)


def default_allowed(problem: Problem) -> Callable[[str, VariantResult], np.ndarray]:
    """A fallback tolerance: ``DEFAULT_ULPS`` unit roundoffs of the problem's dtype times
    1 + |expected|, elementwise. The conformance runner passes its own rule instead."""
    unit = UNIT_ROUNDOFF[problem.dtype]

    def allowed(part: str, result: VariantResult) -> np.ndarray:
        expected = getattr(result, part)
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
    with np.errstate(invalid="ignore", over="ignore"):      # inf - inf where not compared
        error = np.abs(actual - expected)[compared]
    bound = np.broadcast_to(np.asarray(allowed, dtype=np.float64), actual.shape)[compared]
    if error.size == 0:
        return 0.0
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ratios = np.where(error == 0, 0.0, error / bound)
    return float(np.nan_to_num(ratios, nan=np.inf).max())


def _family_rows(problem: Problem, part: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """The FlashAttention levels' compared elements: the caches' rows a call must leave
    defined (each sequence's valid rows, the rows no sequence names); the output's rows that
    attend no key only where they are declared zero (and, at the flash level, NaN), as the
    runner compares them; None: everywhere."""
    if part in ("k_cache", "v_cache"):
        rows = kvcache.compared_cache_rows(problem)
    elif part == "output" and not (problem.fully_masked == "zero"
                                   or problem.fully_masked == "nan" and problem.level == "flash"):
        rows = _FAMILY[problem.level].live_rows(problem)
    else:
        return None
    try:
        return np.broadcast_to(rows, shape)
    except ValueError:
        return None                                                       # another shape: shapes decide


def _compared_rows(problem: Problem, part: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """Where a declared "unspecified" policy leaves the output defined: bool, or None (everywhere)."""
    if problem.level in FLASH_FAMILY:
        return _family_rows(problem, part, shape)
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


def _split(observed: Observed) -> dict[str, np.ndarray]:
    """The observed parts by name (:data:`PARTS`), each an array; absent ones left out."""
    if isinstance(observed, dict):
        unknown = set(observed) - set(PARTS)
        if unknown:
            raise ValueError(f"observed parts {sorted(unknown)} are not among {PARTS}")
        return {part: np.asarray(value) for part, value in observed.items() if value is not None}
    if isinstance(observed, tuple):
        output, weights = observed
        parts = {"output": np.asarray(output)}
        if weights is not None:
            parts["weights"] = np.asarray(weights)
        return parts
    return {"output": np.asarray(observed)}


def _part_fit(problem: Problem, part: str, actual: np.ndarray, result: VariantResult,
              allowed: Callable[[str, VariantResult], Any], factor: float = 1.0) -> float:
    expected = getattr(result, part)
    bound = factor * np.asarray(allowed(part, result), dtype=np.float64)
    if part == "output":
        bound = bound + np.asarray(result.slack, dtype=np.float64)
    return fit(actual, expected, bound, _compared_rows(problem, part, np.shape(expected)))


def precision_factor(variant: Variant, problem: Problem) -> float:
    """How much coarser the variant's own precision is than the problem's dtype
    (``UNIT_ROUNDOFF`` ratio; 1 for a variant without ``precision`` or not coarser)."""
    if variant.precision is None:
        return 1.0
    return max(1.0, UNIT_ROUNDOFF[variant.precision] / UNIT_ROUNDOFF[problem.dtype])


def _too_fine_for(observed: np.ndarray, result: VariantResult, correct: VariantResult) -> bool:
    """Whether ``observed``'s output is far closer to the oracle than a coarse-precision
    variant's (:data:`COARSE_ERROR_FLOOR`), over the elements finite on every side."""
    output, model, right = (np.asarray(x, dtype=np.float64) for x in (observed, result.output, correct.output))
    if not output.shape == model.shape == right.shape:
        return False
    finite = np.isfinite(output) & np.isfinite(model) & np.isfinite(right)
    if not finite.any():
        return False
    own = float(np.abs(model - right)[finite].max())
    seen = float(np.abs(output - right)[finite].max())
    return own > 0 and seen < COARSE_ERROR_FLOOR * own


def _parts(observed: dict[str, np.ndarray], result: VariantResult, correct: VariantResult) -> list[str]:
    """The parts compared: the output, and each other part (weights, LSE, caches) that the
    observation, the result and the correct convention all have."""
    return ["output"] + [part for part in PARTS[1:] if part in observed and getattr(result, part) is not None
                         and getattr(correct, part) is not None]


def correct_fit(observed: Observed, problem: Problem, allowed: Allowed | None = None) -> float:
    """Worst error/allowed of ``observed`` against the correct convention (the oracle):
    <= 1 means the observation is right on this problem, and no variant explains it.
    Same staging, parts and rows as :func:`rank`."""
    return _correct_fit(observed, problem, _as_callable(allowed, problem), reference(problem))


def _correct_fit(observed: Observed, problem: Problem, bound: Callable[[str, VariantResult], Any],
                 correct: VariantResult) -> float:
    """:func:`correct_fit` with the allowed error and the oracle's result already made."""
    parts = _split(observed)
    return max(_part_fit(problem, part, parts[part], correct, bound) for part in _parts(parts, correct, correct))


def _as_callable(allowed: Allowed | None, problem: Problem) -> Callable[[str, VariantResult], Any]:
    fallback = default_allowed(problem)
    if allowed is None:
        return fallback
    if callable(allowed):
        return allowed
    return lambda part, result: allowed if part == "output" else fallback(part, result)


def _results(variant: Variant, problem: Problem) -> list[VariantResult]:
    """What ``variant`` outputs on ``problem``: one result, or, under the policy
    "unspecified", one per :data:`CONCRETE_POLICIES` (rows the variant empties get any
    policy; rows the correct convention empties are not compared anyway)."""
    if problem.fully_masked != "unspecified":
        return [variant.compute(problem)]
    return [variant.compute(dataclasses.replace(problem, fully_masked=policy)) for policy in CONCRETE_POLICIES]


def as_correct(level: str) -> Variant:
    """The correct convention as a pseudo-variant (id ``"correct"``) of ``level``: what
    :func:`partition` groups with the variants to find a case where a variant's
    prediction differs from the oracle's."""
    return Variant(id="correct", level=level, summary="the correct convention", models="",
                   applies=lambda p: False, compute=reference)


def finite_evidence(observed: Observed, problem: Problem, variant: Variant | str,
                    allowed: Allowed | None = None) -> bool:
    """Whether ``variant`` explains ``observed`` on finite, nonzero values: some element
    where the observation is finite, the variant's prediction is finite and not zero
    (beyond the allowed error), and it differs from the oracle's beyond the allowed error
    (or the oracle is not finite there). False when the variant and the oracle differ
    only where the variant predicts NaN, inf or zero: agreeing NaN positions are weak
    evidence, many bugs make NaN (an overflow, exp(-inf - -inf), 0 * inf), and so are
    agreeing zeros, which every bug that reads no key (or returns a zeroed or stale
    buffer) makes; ``conformance.diagnosis.diagnose`` names such a variant only when
    another case confirms it."""
    variant = lookup(variant) if isinstance(variant, str) else variant
    if variant.compute is None or variant.level != problem.level:
        return False
    observed_parts = _split(observed)
    bound = _as_callable(allowed, problem)
    correct = reference(problem)
    for result in _results(variant, problem):
        for part in _parts(observed_parts, result, correct):
            seen = np.asarray(observed_parts[part], dtype=np.float64)
            predicted = np.asarray(getattr(result, part), dtype=np.float64)
            right = np.asarray(getattr(correct, part), dtype=np.float64)
            if not seen.shape == predicted.shape == right.shape:
                continue
            limit = np.broadcast_to(np.asarray(bound(part, result), dtype=np.float64), predicted.shape)
            rows = _compared_rows(problem, part, predicted.shape)
            with np.errstate(all="ignore"):
                differs = ~np.isfinite(right) | (np.abs(predicted - right) > limit)
            with np.errstate(all="ignore"):
                nonzero = np.abs(predicted) > limit
            telling = np.isfinite(seen) & np.isfinite(predicted) & nonzero & differs
            if rows is not None:
                telling &= rows
            if telling.any():
                return True
    return False


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
    skipped when its result and the correct one are each within the other's allowed
    error (it could not explain a failure); it matches when ``observed`` is within the allowed error
    of its result, with ``fit`` the worst error/allowed ratio. Nothing matches an
    observation within the allowed error of the correct output (:func:`correct_fit`).

    A variant with a ``precision`` coarser than the problem's dtype is matched with the
    allowed error scaled by :func:`precision_factor` (its slack is not needed then):
    "differs from the oracle beyond the problem's precision, and agrees with the model
    within the tolerance of the model's precision", and only when the observation's
    largest error is at least :data:`COARSE_ERROR_FLOOR` of the model's own (an error far
    below what that precision makes is some other, smaller mistake). Such a coarse match
    is weaker evidence than a match at the problem's own precision, so it is listed after
    those.

    Returns the matches as ``Match(variant_id, fit)``, sorted by (coarse, fit); ties
    keep the table's order. Pure NumPy on the problem's arrays: no implementation is
    called.
    """
    observed_parts = _split(observed)
    output = observed_parts["output"]
    bound = _as_callable(allowed, problem)
    correct = reference(problem)
    if _correct_fit(observed, problem, bound, correct) <= 1.0:
        return []                                                         # the correct convention explains it
    matches = []
    for variant in _selected(variants, problem.level):
        if not variant.applies(problem):
            continue
        best = None
        for result in _results(variant, problem):
            parts = _parts(observed_parts, result, correct)
            # each within the other's allowed error (the variant's own may be far wider)
            distance = max(max(_part_fit(problem, part, getattr(correct, part), result, bound),
                               _part_fit(problem, part, getattr(result, part), correct, bound)) for part in parts)
            if distance <= 1.0:
                continue                                                  # indistinguishable here
            factor = precision_factor(variant, problem)
            if factor > 1.0 and _too_fine_for(output, result, correct):
                continue                                                  # wrong, but not that coarse
            observed_fit = max(_part_fit(problem, part, observed_parts[part], result, bound, factor)
                               for part in parts)
            if observed_fit <= 1.0 and (best is None or observed_fit < best[1].fit):
                best = (factor > 1.0, Match(variant.id, observed_fit))
        if best is not None:
            matches.append(best)
    return [match for _, match in sorted(matches, key=lambda item: (item[0], item[1].fit))]


def variant_fit(observed: Observed, problem: Problem, variant: Variant | str,
                allowed: Allowed | None = None) -> float:
    """Worst error/allowed of ``observed`` against what ``variant`` outputs on
    ``problem`` (``fit`` <= 1: the variant explains the observation here).

    Unlike :func:`rank`, the variant is compared even where it does not apply or
    its output equals the correct one: that is its prediction there too. Used to
    tell apart variants that ``rank`` matched equally on one case, on another case
    where their outputs differ (:func:`partition`). Same parts, rows and precision
    scaling as :func:`rank`, and the same floor on a wrong observation's error for a
    coarse variant; ``inf`` for a variant without ``compute``."""
    variant = lookup(variant) if isinstance(variant, str) else variant
    if variant.compute is None or variant.level != problem.level:
        return float("inf")
    observed_parts = _split(observed)
    output = observed_parts["output"]
    bound = _as_callable(allowed, problem)
    correct = reference(problem)
    factor = precision_factor(variant, problem)
    wrong = factor > 1.0 and _correct_fit(observed, problem, bound, correct) > 1.0
    best = float("inf")
    for result in _results(variant, problem):
        if wrong and _too_fine_for(output, result, correct):
            continue                                                      # wrong, but not that coarse
        parts = _parts(observed_parts, result, correct)
        best = min(best, max(_part_fit(problem, part, observed_parts[part], result, bound, factor)
                             for part in parts))
    return best


def partition(problem: Problem, variants: Iterable[Variant | str],
              allowed: Allowed | None = None, outputs_only: bool = False,
              parts: Iterable[str] | None = None) -> list[list[str]]:
    """``variants`` (deterministic ones of the problem's level) grouped by output on
    ``problem``: two variants are in one group when their results are each within
    the other's allowed error. More than one group: an observation on ``problem``
    can tell the groups apart. Groups and their members keep the given order.
    ``outputs_only``: compare the outputs alone (an observation without weights);
    ``parts``: compare those parts (:data:`PARTS`) where the results have them (what
    the observation will hold)."""
    bound = _as_callable(allowed, problem)
    chosen = [lookup(v) if isinstance(v, str) else v for v in variants]
    chosen = [v for v in chosen if v.compute is not None and v.level == problem.level]
    correct = reference(problem)
    results = {v.id: v.compute(problem) for v in chosen}
    groups: list[list[str]] = []
    for v in chosen:
        mine = results[v.id]
        for group in groups:
            other = results[group[0]]
            mine_parts = {part: getattr(mine, part) for part in (PARTS if parts is None else parts)
                          if getattr(mine, part) is not None}
            compared = ["output"] if outputs_only else _parts(mine_parts, other, correct)
            close = max(max(_part_fit(problem, part, getattr(mine, part), other, bound),
                            _part_fit(problem, part, getattr(other, part), mine, bound)) for part in compared)
            if close <= 1.0:
                group.append(v.id)
                break
        else:
            groups.append([v.id])
    return groups
