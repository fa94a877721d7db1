"""Diagnosis: the probable cause of a failure, and the failures of a run grouped by cause.

A failing property says *that* an implementation is wrong; ``spec.variants`` holds the
known ways of being wrong (the other causal alignment, tiled GQA heads, a float32
softmax, ...), each computed in float64 on the case's own inputs. On a failure the
runner calls :func:`annotate`, which adds one line to the failure message::

    probable cause: causal_lower_right — the causal flag applies the lower-right triangle ...
    probable cause: unknown — no variant of spec.variants matches the output on the shrunk case

and records the matches on the property's ``runner.Record`` (``causes``), from which the
certificate groups the failures of a run by cause (:func:`cause_groups`).

Where the output comes from, cheapest first:

1. While a property runs, ``calls.run_sdpa`` and ``mha_calls.run_mha`` hand each
   output to :func:`observe_sdpa` / :func:`observe_mha`, which keep it in the list of the
   current example (the runner starts a fresh list per example, :func:`start_example`):
   one list append per call, nothing else, so a passing run is not slowed.
2. On a failure, the calls of the final (shrunk) example are read in order; for each
   whose output disagrees with the oracle under the tolerance rule,
   :func:`spec.variants.rank` lists the variants it matches, and the first such call
   with a match gives the verdict. The implementation is not called again.
3. Only when the property made no observable call (it compares gradients, or expects
   an error) is the implementation called once more, on the shrunk case, through the
   runner's guarded path.
4. Where several variants match equally (a directed example is not shrunk, and a small
   case often fits several conventions), the property's failing case before shrinking
   orders them, then at most :data:`MAX_DISCRIMINATING` cases derived from the failing
   one on which the tied variants' outputs differ, each called once (:func:`_separate`).

Everything runs inside a guard: a diagnosis error becomes the line
``probable cause: (diagnosis failed: ...)`` and never hides the failure itself.
The allowed error is the runner's tolerance rule (``calls`` and ``mha_calls``), applied to
each variant's own weights. docs/DIAGNOSIS.md says how to read the result.
"""

from __future__ import annotations

import math
import zlib
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from spec import variants as V

__all__ = [
    "UNKNOWN",
    "Verdict",
    "start_example",
    "observe_sdpa",
    "observe_mha",
    "annotate",
    "diagnose",
    "cause_line",
    "cause_groups",
    "cause_lines",
    "cause_markdown",
]

#: The group id of failures that no variant explains.
UNKNOWN = "unknown"
#: Matches named on one failure line (the rest are in the record).
SHOWN = 3
#: MHA forward arguments a call may override and a problem can describe.
_MHA_OVERRIDES = frozenset({"need_weights", "average_attn_weights", "is_causal"})
#: The MHA variant whose output is random; it shows as two eval-mode calls that differ.
_RANDOM_IN_EVAL = "mha_dropout_in_eval"
#: Extra calls of an eval-mode module whose output is wrong and matches no variant,
#: looking for that sign (only then; every other diagnosis calls at most once).
RECALLS = 3
#: Cases derived from a failing case that the implementation is called on, at most,
#: to tell apart variants that match the failing case equally (:func:`_separate`).
MAX_DISCRIMINATING = 2


# --------------------------------------------------------------------------- observing calls


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
    """``calls.run_sdpa`` called the implementation on ``case`` (as called: causal
    folded into the mask unless the flag was used) and got ``output`` (float64)."""
    example = _EXAMPLE.get()
    if example is not None:
        example.calls.append(_Call("sdpa", case, output, dropout_p=dropout_p))


def observe_mha(case: Any, output: np.ndarray, weights: np.ndarray | None, *, module: Any,
                overrides: dict[str, Any]) -> None:
    """``mha_calls.run_mha`` called ``module`` on ``case`` with forward arguments
    ``overrides`` replaced and got ``output`` and ``weights`` (float64, or None)."""
    example = _EXAMPLE.get()
    if example is not None:
        example.calls.append(_Call("mha", case, output, weights, overrides=dict(overrides), module=module))


# --------------------------------------------------------------------------- diagnosing a failure


@dataclass(frozen=True)
class Verdict:
    """What the diagnosis found: the matches (dicts as recorded) and the message line;
    ``call``: the observed call they were matched on (None when there is none)."""

    causes: list[dict[str, Any]]
    line: str
    call: Any = field(default=None, compare=False, repr=False)


def annotate(exc: BaseException, target: Any, record: Any) -> None:
    """Diagnose the failure ``exc`` of ``record`` (its ``failing_case`` is the shrunk
    case): set ``record.causes`` and add the ``probable cause:`` line to ``exc``.
    Never raises."""
    try:
        verdict = diagnose(target, record, exc)
    except Exception as err:  # noqa: BLE001 - a diagnosis must never mask the failure
        verdict = Verdict([], f"probable cause: (diagnosis failed: {type(err).__name__}: {err})")
    try:
        record.causes = verdict.causes
        if hasattr(exc, "add_note"):
            exc.add_note(verdict.line)
    except Exception:  # noqa: BLE001 - same: the failure itself must come through
        pass


def diagnose(target: Any, record: Any, exc: BaseException | None = None) -> Verdict:
    """The probable cause of ``record``'s failure on its shrunk case (see the module doc).

    Where several variants match the shrunk case, those that also match the property's
    first failing example (the case before shrinking, usually larger) come first."""
    case = record.failing_case
    if case is None:
        return _unknown("no shrunk case was kept")
    if target.level not in ("sdpa", "mha"):  # varlen / kvcache: no spec.variants model them yet
        return _unknown(f"spec.variants has no {target.level}-level variants")
    example = _EXAMPLE.get()
    calls = list(example.calls) if example is not None and example.case is case else []
    if not calls:
        if exc is not None and _implementation_broke(exc):
            return _unknown("the implementation raised or hung, so there is no output to compare")
        calls = [_call_once(target, case)]
    verdict = _verdict(target, calls)
    first = _FIRST_FAILURE.get()
    if first is None or first.record is not record or first.case is case:
        first = None
    if len(verdict.causes) > 1:
        verdict = _separate(target, verdict, first)
    if not verdict.causes:
        # A random output can look deterministic on one case: two equal samples.
        random = (_random_in_eval(first.calls) if first is not None else None) or _random_on_recall(target, calls)
        verdict = random or verdict
    return verdict


def _verdict(target: Any, calls: list[_Call]) -> Verdict:
    random = _random_in_eval(calls)
    if random is not None:
        return random
    wrong = False
    for call in calls:
        found = _diagnose_call(target, call)
        if isinstance(found, Verdict):
            return found
        wrong = wrong or found
    if wrong:
        return _unknown("no variant of spec.variants matches the output on the shrunk case")
    return _unknown("every output on the shrunk case agrees with the oracle; the property fails on "
                    "something else (a relation between calls, gradients, an error)")


def _separate(target: Any, verdict: Verdict, first: _Example | None) -> Verdict:
    """``verdict``'s causes ordered by how many other cases they also explain.

    Several variants often match one small case equally (with one query, ignoring the
    causal flag and aligning it lower-right attend the same keys). The evidence, cheapest
    first: the property's failing case before shrinking (its calls are kept; no call);
    then, while the leaders still tie, up to :data:`MAX_DISCRIMINATING` discriminating
    cases derived from the failing call's case, on which the tied variants' outputs
    differ (chosen in pure NumPy), each called once through the guarded path. A
    cause's rank is the number of these cases it fits; equal counts keep ``rank``'s
    order (fit, then the table's). Each cause's note names the cases it fits."""
    ids = [c["variant"] for c in verdict.causes]
    fits: dict[str, list[str]] = {v: [] for v in ids}
    if first is not None:
        also = {c["variant"] for c in _verdict(target, first.calls).causes}
        for v in ids:
            if v in also:
                fits[v].append("the failing case before shrinking")
    best = max(len(f) for f in fits.values())
    leaders = [v for v in ids if len(fits[v]) == best]
    if len(leaders) > 1 and verdict.call is not None:
        for description, call in _discriminating_calls(target, verdict.call, leaders):
            prepared = _sdpa_problem(target, call)
            if prepared is None:
                continue
            problem, observed, allowed = prepared
            for v in ids:
                if V.variant_fit(observed, problem, v, allowed) <= 1.0:
                    fits[v].append(description)
    order = sorted(range(len(ids)), key=lambda i: -len(fits[ids[i]]))     # stable: rank's order on ties
    causes = [dict(verdict.causes[i], note=_fits_note(fits[ids[i]])) for i in order]
    return Verdict(causes, _line(causes), verdict.call)


def _fits_note(cases: list[str]) -> str:
    return "also fits " + " and ".join(cases) if cases else ""


def _implementation_broke(exc: BaseException) -> bool:
    from conformance.runner import ImplementationHung, ImplementationRaised

    if isinstance(exc, (ImplementationHung, ImplementationRaised)):
        return True
    return isinstance(exc, BaseExceptionGroup) and any(_implementation_broke(e) for e in exc.exceptions)


def _call_once(target: Any, case: Any) -> _Call:
    """The implementation's plain output on ``case``: one guarded call (it is observed)."""
    example = _EXAMPLE.get()
    if example is None or example.case is not case:
        start_example(case)
    if target.level == "mha":
        from conformance.mha_calls import run_mha

        run_mha(target, case)
    else:
        from conformance.calls import run_sdpa

        run_sdpa(target, case)
    return _EXAMPLE.get().calls[-1]


def _diagnose_call(target: Any, call: _Call) -> Verdict | bool:
    """A verdict when the call's output disagrees with the oracle and matches variants;
    else whether it disagrees (True: wrong, but no variant matches)."""
    prepared = _sdpa_problem(target, call) if call.level == "sdpa" else _mha_problem(target, call)
    if prepared is None:
        return False
    problem, observed, allowed = prepared
    if V.correct_fit(observed, problem, allowed) <= 1.0:
        return False
    matches = V.rank(observed, problem, allowed=allowed)
    if not matches:
        return True
    relative = _relative_error(observed, V.reference(problem))
    causes = [_cause(m.variant_id, m.fit, relative) for m in matches]
    return Verdict(causes, _line(causes), call)


def _cause(variant_id: str, fit: float | None, relative: float | None, note: str = "") -> dict[str, Any]:
    return {"variant": variant_id, "summary": V.VARIANTS[variant_id].summary,
            "fit": None if fit is None else float(fit), "relative_error": relative, "note": note}


def _line(causes: list[dict[str, Any]]) -> str:
    named = [f"{c['variant']} — {c['summary']}" + (f" ({c['note']})" if c["note"] else "")
             for c in causes[:SHOWN]]
    more = f"; and {len(causes) - SHOWN} more" if len(causes) > SHOWN else ""
    return "probable cause: " + "; or ".join(named) + more


def _unknown(why: str) -> Verdict:
    return Verdict([], f"probable cause: {UNKNOWN} — {why}")


def _relative_error(observed: Any, correct: V.VariantResult) -> float | None:
    """max |observed - oracle| / max |oracle| over the output elements finite in both;
    None when NaN or inf appear where the oracle has none (or the shapes differ)."""
    output = np.asarray(observed[0] if isinstance(observed, tuple) else observed, dtype=np.float64)
    expected = np.asarray(correct.output, dtype=np.float64)
    if output.shape != expected.shape:
        return None
    if (np.isfinite(output) != np.isfinite(expected)).any():
        return None
    finite = np.isfinite(expected)
    if not finite.any():
        return None
    error = float(np.abs(output - expected)[finite].max())
    size = float(np.abs(expected[finite]).max())
    return error / size if size > 0 else error


# --------------------------------------------------------------------------- discriminating cases


def _discriminating_calls(target: Any, call: _Call, tied: list[str]) -> list[tuple[str, _Call]]:
    """The implementation called on up to :data:`MAX_DISCRIMINATING` cases derived from
    ``call``'s case on which the ``tied`` variants' outputs differ (most pairs told
    apart first; the variants are computed, not the implementation, to choose them),
    as ``(description, observed call)``. Only a deterministic SDPA call, and only cases
    the target claims (``directed.admitted``); a call that raises is left out."""
    from conformance.calls import run_sdpa
    from conformance.directed import admitted

    if call.level != "sdpa" or call.dropout_p > 0:
        return []
    apart: set[frozenset[str]] = set()
    chosen: list[tuple[str, Any]] = []
    candidates = [(d, c) for d, c in _derived_cases(call.case) if admitted(target, c)]
    while len(chosen) < MAX_DISCRIMINATING and candidates:
        scored = []
        for index, (description, case) in enumerate(candidates):
            groups = V.partition(V.SDPAProblem.from_case(case, fully_masked=target.caps.fully_masked), tied)
            pairs = {frozenset((a, b)) for g in groups for h in groups if g is not h for a in g for b in h}
            scored.append((len(pairs - apart), -index, description, case, pairs))
        gained, _, description, case, pairs = max(scored, key=lambda item: item[:2])
        if not gained:
            break
        apart |= pairs
        chosen.append((description, case))
        candidates = [(d, c) for d, c in candidates if d != description]
    if _EXAMPLE.get() is None:
        start_example(call.case)
    out = []
    for description, case in chosen:
        start = len(_EXAMPLE.get().calls)
        try:
            run_sdpa(target, case)
        except Exception:  # noqa: BLE001, S112 - no output on this case: it tells nothing
            continue
        out.append((f"a discriminating case ({description})", _EXAMPLE.get().calls[start]))
    return out


def _derived_cases(case: Any) -> list[tuple[str, Any]]:
    """Small changes of ``case`` that separate the usual ties: one or two more queries
    or keys (causal alignments, a one-query shortcut), a key block more (a ragged last
    block), another explicit scale (a falsy or ignored scale), one more batch item.
    The new entries are seeded normal values rounded to the dtype; new mask entries
    attend. Contiguous, so any target that claims the sizes takes them."""
    from spec.emulate import round_to

    B, L, S = case.B, case.L, case.S
    sizes = [(B, L + 1, S + 1), (B, L + 1, S + 2), (B, L + 2, S + 1), (B, L + 1, S), (B, L, S + 1),
             (B, L, S + V.KERNEL_BLOCK), (B, L, S + V.KERNEL_BLOCK + 1), (B + 1, L, S)]
    rng = np.random.default_rng(zlib.crc32(f"diagnosis/{case.dtype}".encode()))

    def grown(x: np.ndarray | None, new: tuple[int, ...], fill: Any = None) -> np.ndarray | None:
        """``x`` grown to ``new`` at the end of each axis: new values drawn, or ``fill``
        for a mask (whose axes of size 1 broadcast and stay)."""
        if x is None:
            return None
        for axis, n in zip(range(-len(new), 0), new, strict=True):
            if -axis > x.ndim or x.shape[axis] == n or fill is not None and x.shape[axis] == 1:
                continue
            shape = list(x.shape)
            shape[axis] = n - x.shape[axis]
            extra = round_to(rng.standard_normal(shape), case.dtype) if fill is None else np.full(shape, fill)
            x = np.concatenate([x, extra.astype(x.dtype)], axis=axis)
        return x

    out = []
    for b, l, s in sizes:
        q = grown(case.query, (b, case.N, l, case.E))
        k, v = grown(case.key, (b, case.K, s, case.E)), grown(case.value, (b, case.K, s, case.Ev))
        mask_shape = (b, case.N, l, s)
        out.append((f"B={b}, L={l}, S={s}", case.replace(
            query=q, key=k, value=v, attend_mask=grown(case.attend_mask, mask_shape, True),
            additive_mask=grown(case.additive_mask, mask_shape, 0.0), layout="contiguous", notes=())))
    default = 1.0 / math.sqrt(case.E)
    for scale in (None, 1.5 * default):
        if scale != case.scale:
            out.append((f"scale={scale!r}", case.replace(scale=scale, layout="contiguous", notes=())))
    return out


# --------------------------------------------------------------------------- problems and bounds


def _sdpa_problem(target: Any, call: _Call) -> tuple[Any, Any, Callable] | None:
    from conformance import calls as C
    from conformance import tolerance

    case, observed = call.case, call.output
    # The case as passed: causality still in it only when the flag carries it alone.
    kind = "causal" if case.causal is not None and case.mask_kind == "none" else \
        "additive" if case.additive_mask is not None else "bool"
    policy = target.caps.fully_masked_policy(kind)
    if call.dropout_p > 0:
        stacked = _unstacked(case, observed)
        if stacked is None:
            return None                                          # one random sample: nothing to compare
        case, observed, samples = stacked
    problem = V.SDPAProblem.from_case(case, fully_masked=policy, dropout_p=call.dropout_p)
    ref = C.oracle(case)
    naive = C.naive_error(case, ref.output, C.valid_rows(case))

    def allowed(part: str, result: V.VariantResult) -> np.ndarray:
        weights = ref.weights if result.weights is None else result.weights
        weights = np.nan_to_num(weights, nan=0.0, posinf=0.0, neginf=0.0)
        magnitude = C.magnitude(case, weights)
        if call.dropout_p > 0:
            c = magnitude / (1 - call.dropout_p)
            return tolerance.sdpa_dropout_allowed(c, samples, observed.size)
        return tolerance.sdpa_allowed(case.dtype, naive, magnitude, tf32=target.tf32,
                                      logit_scale=C.logit_scale(case, SimpleNamespace(weights=weights)))

    return problem, observed, allowed


def _unstacked(case: Any, output: np.ndarray) -> tuple[Any, np.ndarray, int] | None:
    """A dropout call on M stacked copies of one problem (along the batch): that problem,
    the mean of the M outputs, and M; None for any other dropout call."""
    example = _EXAMPLE.get()
    B = getattr(example.case, "B", 0) if example is not None else 0   # the drawn case's batch
    if not B or case.B <= B or case.B % B:
        return None
    M = case.B // B

    def copies(x: np.ndarray | None) -> bool:
        if x is None or x.ndim < 4 or x.shape[0] == 1:
            return True
        stacked = x.reshape(M, B, *x.shape[1:])
        return bool((stacked == stacked[:1]).all())

    if not all(copies(x) for x in (case.query, case.key, case.value, case.attend_mask, case.additive_mask)):
        return None

    def first(x: np.ndarray | None) -> np.ndarray | None:
        return x if x is None or x.ndim < 4 or x.shape[0] == 1 else x[:B]

    single = case.replace(query=case.query[:B], key=case.key[:B], value=case.value[:B],
                          attend_mask=first(case.attend_mask), additive_mask=first(case.additive_mask))
    mean = output.reshape(M, B, *output.shape[1:]).mean(axis=0)
    return single, mean, M


def _mha_problem(target: Any, call: _Call) -> tuple[Any, Any, Callable] | None:
    from conformance import mha_bounds
    from conformance import mha_calls as MC

    if getattr(call.module, "training", False) or set(call.overrides) - _MHA_OVERRIDES:
        return None                                              # random, or not a problem we can state
    case = call.case.replace(**call.overrides) if call.overrides else call.case
    problem = V.MHAProblem.from_case(case, fully_masked=MC.fully_masked_policy(target, case))
    weights = call.weights if MC.has_feature(target, "need_weights") else None
    output_allowed, weights_allowed = mha_bounds.allowed_error(case, tf32=target.tf32)

    def allowed(part: str, result: V.VariantResult) -> np.ndarray:
        return output_allowed if part == "output" else weights_allowed

    return problem, (call.output, weights), allowed


def _random_in_eval(calls: list[_Call]) -> Verdict | None:
    """Two eval-mode calls of one module on the same inputs that differ: the output is
    random, the sign of the one variant that has no ``compute``."""
    seen: dict[tuple[int, tuple], np.ndarray] = {}
    for call in calls:
        if call.level != "mha" or call.module is None or getattr(call.module, "training", True):
            continue
        key = (id(call.module), tuple(sorted(call.overrides.items())), id(call.case))
        if key in seen:
            if not np.array_equal(np.nan_to_num(seen[key], nan=7.0), np.nan_to_num(call.output, nan=7.0)):
                cause = _cause(_RANDOM_IN_EVAL, None, None, "two eval-mode calls on the same inputs differ")
                return Verdict([cause], _line([cause]))
        else:
            seen[key] = call.output
    return None


def _random_on_recall(target: Any, calls: list[_Call]) -> Verdict | None:
    """Call the module of the first eval-mode MHA call whose output is wrong again on the
    same inputs, up to RECALLS times (guarded calls), each time with torch's generator
    seeded differently; an output that changes is the sign of the random variant (an
    eval-mode module must not depend on the generator). The runner seeds dropout from
    the case's contents, so a plain second call would draw the same sample."""
    from conformance import replay
    from conformance.runner import call_guarded
    from conformance.tensors import to_numpy

    for call in calls:
        if call.level != "mha" or call.module is None or getattr(call.module, "training", True):
            continue
        if _diagnose_call(target, call) is not True:
            continue
        for seed in range(RECALLS):
            spec = replay.MHACallSpec(call.case, dropout=call.module.dropout, training=False,
                                      dropout_seed=zlib.crc32(f"diagnosis/recall/{seed}".encode()))
            outcome = replay.run_mha_call(target.impl, spec, invoke=partial(call_guarded, target),
                                          module=call.module.module)
            again = _Call("mha", call.case, to_numpy(outcome.output), module=call.module)
            random = _random_in_eval([call, again])
            if random is not None:
                return random
        return None
    return None


# --------------------------------------------------------------------------- the certificate


def cause_line(result: dict[str, Any]) -> str | None:
    """The probable cause of one failed result, for the certificate's failure lines
    (None for results without a diagnosis)."""
    if result.get("outcome") != "failed" or "causes" not in result:
        return None
    causes = result["causes"] or []
    if not causes:
        return f"probable cause: {UNKNOWN}"
    return "probable cause: " + ", ".join(c["variant"] for c in causes[:SHOWN])


def cause_groups(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The failed results grouped by their first-ranked cause (``unknown`` for none),
    largest group first: variant id, summary, count, properties, dtypes, devices and
    the range of relative errors (None where the output was not finite)."""
    from implementations.base import ALL_DTYPES

    groups: dict[str, dict[str, Any]] = {}
    for r in results:
        if r.get("outcome") != "failed" or "causes" not in r:
            continue
        first = (r["causes"] or [None])[0]
        variant = first["variant"] if first else UNKNOWN
        group = groups.setdefault(variant, {
            "variant": variant,
            "summary": first["summary"] if first else "no variant of spec.variants explains the output",
            "count": 0, "properties": set(), "dtypes": set(), "devices": set(), "errors": []})
        group["count"] += 1
        group["properties"].add(r["property"])
        group["dtypes"].add(r["dtype"])
        group["devices"].add(r["device"])
        if first and first.get("relative_error") is not None:
            group["errors"].append(first["relative_error"])
    out = []
    for g in groups.values():
        errors = g.pop("errors")
        g["properties"] = sorted(g["properties"])
        g["dtypes"] = sorted(g["dtypes"], key=lambda d: ALL_DTYPES.index(d) if d in ALL_DTYPES else 9)
        g["devices"] = sorted(g["devices"])
        g["relative_error"] = [min(errors), max(errors)] if errors else None
        out.append(g)
    return sorted(out, key=lambda g: (g["variant"] == UNKNOWN, -g["count"], g["variant"]))


def _order(x: float) -> str:
    """``1e-7``: the power of ten nearest to ``x``."""
    return "0" if x <= 0 else f"1e{round(math.log10(x))}"


def _spread(group: dict[str, Any]) -> str:
    dtypes = group["dtypes"]
    parts = [f"{dtypes[0]} only" if len(dtypes) == 1 else ", ".join(dtypes)]
    if len(group["devices"]) > 1:
        parts.append("/".join(group["devices"]))
    if group["relative_error"]:
        low, high = (_order(x) for x in group["relative_error"])
        parts.append(f"relative error ~{low}" if low == high else f"relative error {low} to {high}")
    return "; ".join(parts)


def cause_lines(cert: dict[str, Any]) -> list[str]:
    """The certificate's cause table, one entry per group (empty when nothing failed)::

        probable causes (spec.variants, docs/DIAGNOSIS.md):
          softmax_float32: 11 failures (float64 only; relative error ~1e-7) — float64 inputs ...
              forward_agreement, key_permutation, ...
    """
    groups = cert.get("causes") or []
    if not groups:
        return []
    lines = ["probable causes (spec.variants, docs/DIAGNOSIS.md):"]
    for g in groups:
        n = g["count"]
        lines.append(f"  {g['variant']}: {n} failure{'s' if n != 1 else ''} ({_spread(g)}) — {g['summary']}")
        lines.append("      " + ", ".join(g["properties"]))
    return lines


def cause_markdown(cert: dict[str, Any]) -> list[str]:
    """The cause table as Markdown lines (a heading and a table; empty when nothing failed)."""
    groups = cert.get("causes") or []
    if not groups:
        return []
    lines = ["", "## Probable causes", "",
             "Failures grouped by the variant of `spec.variants` their output matches "
             "(docs/DIAGNOSIS.md).", "",
             "| cause | failures | spread | properties | what the implementation does |", "|---|---|---|---|---|"]
    for g in groups:
        lines.append(f"| `{g['variant']}` | {g['count']} | {_spread(g)} | {', '.join(g['properties'])} | "
                     f"{g['summary']} |")
    return lines
