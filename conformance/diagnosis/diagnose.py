"""Diagnosis: the probable cause of a failure, and the failures of a run grouped by cause.

A failing property says *that* an implementation is wrong; ``spec.variants`` holds the
known ways of being wrong (the other causal alignment, tiled GQA heads, a float32
softmax, ...), each computed in float64 on the case's own inputs. On a failure the
runner calls :func:`annotate`, which adds one line to the failure message::

    probable cause: causal_lower_right — the causal flag applies the lower-right triangle ...
    probable cause: unknown — no variant of spec.variants matches the output on the reported case

and records the matches on the property's ``registry.Record`` (``causes``), from which the
certificate groups the failures of a run by cause (:func:`cause_groups`).

Where the output comes from, cheapest first:

1. While a property runs, ``calls.sdpa.run_sdpa``, ``calls.mha.run_mha`` and the other
   levels' calls (sharded, flash, varlen, kvcache) hand each output (with the LSE and the
   caches after the call where the call returns them) to ``core.observe``, which keeps it
   in the list of the current example (the runner starts a fresh list per example, :func:`start_example`):
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

5. The naming rule (:func:`_named`): a variant is named only when it explains the
   call on more than NaN positions (or another case confirms it) and fits strictly
   more of the other cases than every other candidate; otherwise the line is
   ``probable cause: unknown — closest, not confirmed: X, Y``. A named convention a
   user may intend carries its declaration (``Variant.declaration``).
6. A failure that a built-in's expected-failures entry covers (same property, same
   call attributes, matched as ``--xfail-file`` entries are) says which known
   deviation it is and how to excuse it (:func:`_with_known_deviations`): a plain
   wrapper of PyTorch's SDPA inherits ``implementations/xfail/sdpa.toml``'s.

Everything runs inside a guard: a diagnosis error becomes the line
``probable cause: (diagnosis failed: ...)`` and never hides the failure itself.
The allowed error is the runner's tolerance rule (``calls`` and ``mha_calls``), applied to
each variant's own weights. docs/DIAGNOSIS.md says how to read the result.

The parts: ``core.observe`` (the calls kept per example), ``ties`` (the discriminating
cases of step 4), ``causes`` (the certificate's cause table), ``verdict`` (a verdict and
its line), ``deviations`` (the built-ins' known deviations, step 6) and ``randomness``
(a random output's sign); their public names are importable from here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conformance.core.observe import (
    _EXAMPLE,
    _FIRST_FAILURE,
    _Call,
    _Example,
    observe_mha,
    observe_sdpa,
    start_example,
)
from conformance.diagnosis.causes import (
    SHOWN,
    UNKNOWN,
    _order,  # noqa: F401 - diagnosis._order, as before the split
    cause_groups,
    cause_line,
    cause_lines,
    cause_markdown,
)
from conformance.diagnosis.derived import derived_from_sdpa, lifted_variant, lifted_variants, through_derivation
from conformance.diagnosis.deviations import KNOWN_DEVIATION, _with_known_deviations  # noqa: F401 - as before the split
from conformance.diagnosis.problems import problem_of, sdpa_mask_kind
from conformance.diagnosis.randomness import RECALLS, _random_in_eval, _random_on_recall  # noqa: F401 - as before the split
from conformance.diagnosis.ties import (
    MAX_DISCRIMINATING,  # noqa: F401 - diagnosis.MAX_DISCRIMINATING, as before the split
    _discriminating_calls,
    _finite_nonzero,
)
from conformance.diagnosis.verdict import Verdict, _cause, _line, _unknown
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



def annotate(exc: BaseException, target: Any, record: Any, *, property_id: str = "",
             isolation: Any = None) -> None:
    """Diagnose the failure ``exc`` of ``record`` (its ``failing_case`` is the shrunk
    case): set ``record.causes`` and add the ``probable cause:`` line to ``exc``.
    Never raises. With ``isolation`` (the implementation's isolated worker, which alone
    may call it) the worker checks the shrunk case of ``property_id`` again, diagnoses
    it and picks the reproducer's call (``isolation.supervisor.Worker.annotate``), unless the
    implementation raised, hung or crashed (no output to diagnose, nothing called)."""
    if isolation is not None and record.failing_case is not None and not _implementation_broke(exc):
        first = _FIRST_FAILURE.get()
        first_case = (first.case if first is not None and first.record is record
                      and first.case is not record.failing_case else None)
        line = isolation.annotate(property_id, target, record, first_case)
    else:
        try:
            verdict = diagnose(target, record, exc)
        except Exception as err:  # noqa: BLE001 - a diagnosis must never mask the failure
            verdict = Verdict([], f"probable cause: (diagnosis failed: {type(err).__name__}: {err})")
        line = verdict.line
        try:
            record.causes = verdict.causes
        except Exception:  # noqa: BLE001 - same: the failure itself must come through
            pass
    try:
        if hasattr(exc, "add_note"):
            exc.add_note(line)
    except Exception:  # noqa: BLE001 - same: the failure itself must come through
        pass


def diagnose(target: Any, record: Any, exc: BaseException | None = None) -> Verdict:
    """The probable cause of ``record``'s failure on its shrunk case (see the module doc).

    Where several variants match the shrunk case, those that also match the property's
    first failing example (the case before shrinking, usually larger) come first."""
    case = record.failing_case
    if case is None:
        return _unknown("no shrunk case was kept")
    if target.level not in V.LEVELS:  # a level no spec.variants problem describes
        return _unknown(f"spec.variants has no {target.level}-level variants")
    if target.level == "sdpa" and getattr(case, "sinks", None) is not None:  # SDPA problems carry no sinks
        return _unknown("spec.variants has no SDPA-level variants with learned sinks")
    example = _EXAMPLE.get()
    calls = list(example.calls) if example is not None and example.case is case else []
    if not calls:
        if exc is not None and _implementation_broke(exc):
            return _unknown("the implementation raised, hung or crashed, so there is no output to compare")
        once = _call_once(target, case)
        if once is None:  # the call is not observed: FP8 inputs or dropout, which no variant models
            return _unknown("spec.variants has no variants of this call (FP8 inputs or dropout)")
        calls = [once]
    if derived_from_sdpa(target):  # diagnosed through the derivation by the SDPA level's variants
        base = _through_derivation(target, case)
        if base is not None:
            return _with_known_deviations(target, record, base)
    verdict = _verdict(target, calls)
    if not verdict.causes and _AGREES in verdict.line and _mismatch(exc):
        verdict = _unknown(f"the property's comparison fails (worst error/allowed {exc.ratio:.3g}: a "  # type: ignore[union-attr]
                           "mismatch) while the output of each call, read on its own, is within the "
                           "diagnosis' tolerance of the oracle; no variant can be told apart at that margin")
    first = _FIRST_FAILURE.get()
    if first is None or first.record is not record or first.case is case:
        first = None
    if verdict.causes and (len(verdict.causes) > 1 or not _evidence(verdict.causes[0])):
        verdict = _separate(target, verdict, first)
    if verdict.causes and verdict.causes[0].get("confirmed") is None:
        verdict = _named(verdict)
    if not verdict.causes:
        # A random output can look deterministic on one case: two equal samples.
        random = (_random_in_eval(first.calls) if first is not None else None) or _random_on_recall(target, calls, _diagnose_call)
        verdict = random or verdict
    return _with_known_deviations(target, record, verdict)


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
        return _unknown("no variant of spec.variants matches the output on the reported case")
    return _unknown(_AGREES + "; the property fails on "
                    "something else (a relation between calls, gradients, an error)")


#: The unknown verdict's words when no output read on its own is wrong.
_AGREES = "every output on the reported case agrees with the oracle"


def _mismatch(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a value mismatch (a failure past its tolerance: ratio > 1)."""
    ratio = getattr(exc, "ratio", None)
    return ratio is not None and ratio > 1.0


def _through_derivation(target: Any, case: Any) -> Verdict | None:
    """The verdict of the SDPA level's variants on the SDPA call a derived flash level makes
    on ``case`` (``derived``), when they name a cause; None otherwise (the flash level's own
    verdict stands)."""
    try:
        found = through_derivation(target, case, _call_once)
        if found is None:
            return None
        base, call, note = found
        verdict = _verdict(base, [call])
        if verdict.causes and (len(verdict.causes) > 1 or not _evidence(verdict.causes[0])):
            verdict = _separate(base, verdict, None)
        if verdict.causes and verdict.causes[0].get("confirmed") is None:
            verdict = _named(verdict)
    except Exception:  # noqa: BLE001 - the flash level's own diagnosis then stands
        return None
    if not verdict.causes or not verdict.causes[0].get("confirmed"):
        return None
    return Verdict(verdict.causes, verdict.line + note, verdict.call)


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
    telling: dict[str, int] = dict.fromkeys(ids, 0)        # fitted cases where the output is wrong
    if first is not None:
        earlier = _verdict(target, first.calls)
        also = {c["variant"]: c for c in earlier.causes}
        for v in ids:
            if v in also:
                fits[v].append("the failing case before shrinking")
                telling[v] += also[v].get("finite_evidence", True) or _partly_nonzero(earlier.call)
    best = max(len(f) for f in fits.values())
    leaders = [v for v in ids if len(fits[v]) == best]
    weak = [c["variant"] for c in verdict.causes if c["variant"] in leaders and not _evidence(c)
            and not telling[c["variant"]]]
    if verdict.call is not None and (len(leaders) > 1 or weak):
        # a weak leader is told apart from the correct convention too: a case where its
        # prediction differs from the oracle's, to see whether the output follows it there
        tied = [*leaders, V.as_correct(verdict.call.level)] if weak else leaders
        for description, call in _discriminating_calls(target, verdict.call, tied, weak):
            prepared = problem_of(target, call)
            if prepared is None:
                continue
            problem, observed, allowed = prepared
            # wrong there, and not all NaN or zero: an all-NaN output agrees with any NaN
            # prediction, an all-zero one with any variant that reads no key
            wrong = V.correct_fit(observed, problem, allowed) > 1.0 and _partly_nonzero(call)
            for v in ids:
                if V.variant_fit(observed, problem, lifted_variant(target.level, v), allowed) <= 1.0:
                    fits[v].append(description)
                    telling[v] += wrong
    order = sorted(range(len(ids)), key=lambda i: -len(fits[ids[i]]))     # stable: rank's order on ties
    causes = [dict(verdict.causes[i], note=_fits_note(fits[ids[i]]), fitted=len(fits[ids[i]]),
                   telling=telling[ids[i]]) for i in order]
    return _named(Verdict(causes, "", verdict.call))


def _evidence(cause: dict[str, Any]) -> bool:
    """Whether a match is more than agreeing NaN positions: it predicts a wrong finite
    value the output has, or it names what fully masked rows output (``row_policy``:
    NaN there is the behaviour it names, not a mechanism guessed from NaN)."""
    if cause.get("finite_evidence", True):
        return True
    variant = V.VARIANTS.get(cause["variant"])
    return variant is not None and variant.row_policy is not None


def _partly_nonzero(call: Any) -> bool:
    """Whether a call's output has a finite element that is not zero (an output of NaN
    and zeros confirms nothing: many bugs make it)."""
    output = getattr(call, "output", None)
    return output is not None and _finite_nonzero(output)


def _named(verdict: Verdict) -> Verdict:
    """The naming rule: ``verdict``'s causes marked ``confirmed`` (at most one, first)
    and its line.

    A variant is named only when

    1. it explains the failing call: every compared output (and weight) within the
       tolerance rule of its prediction, NaN and inf where it predicts them (``rank``);
    2. the agreement is not NaN-only (or zero-only): it predicts some finite nonzero value
       that differs from the oracle's and the output has it (``V.finite_evidence``), or it
       names what fully masked rows output (``row_policy``: their NaN is the behaviour
       named), or, where it differs only by NaN, inf or zero, it also fits another case on
       which the output is wrong and not all NaN or zero (the failing case before
       shrinking, or a case derived from the failing one: many bugs make NaN, and every
       bug that reads no key makes zeros, so agreeing NaN or zero positions
       alone are weak evidence);
    3. it is distinguishable from the other candidates on the evidence gathered: it
       fits strictly more of the other cases (before shrinking, discriminating) than
       every other variant that explains the failing call.

    Otherwise the cause is unknown and the candidates that fit the most cases are
    listed as closest, not confirmed."""
    causes = [dict(c) for c in verdict.causes]
    if not causes:
        return verdict
    for c in causes:
        c.setdefault("fitted", 0)
        c.setdefault("telling", 0)
        c["confirmed"] = False
    best = max(c["fitted"] for c in causes)
    leaders = [c for c in causes if c["fitted"] == best]
    lead = leaders[0]
    if len(leaders) == 1 and (_evidence(lead) or lead["telling"] > 0):
        lead["confirmed"] = True
        return Verdict(causes, _line(causes), verdict.call)
    if len(leaders) > 1:
        why = ("they explain the failing call equally and no case gathered tells them apart"
               if best == 0 else f"each also fits the same {best} other case(s)")
    else:
        why = ("it agrees only where it predicts NaN, inf or zero, and no other case where the output "
               "is wrong confirms it")
    closest = ", ".join(c["variant"] for c in leaders[:SHOWN]) + (
        f" and {len(leaders) - SHOWN} more" if len(leaders) > SHOWN else "")
    line = f"probable cause: {UNKNOWN} — closest, not confirmed: {closest} ({why})"
    return Verdict(causes, line, verdict.call)


def _mask_kind(call: _Call) -> str:
    """The fully-masked-row kind of a call (``Capabilities.fully_masked_policy``)."""
    case = call.case
    if call.level in ("sharded", *V.FLASH_FAMILY):
        return "causal"                                    # no mask: only causal or a window empties rows
    if call.level == "mha":
        floats = [m for m in (case.key_padding_mask, case.attn_mask) if m is not None and m.dtype != np.bool_]
        return "additive" if floats else "bool"
    return sdpa_mask_kind(case)


def _fits_note(cases: list[str]) -> str:
    return "also fits " + " and ".join(cases) if cases else ""


def _implementation_broke(exc: BaseException) -> bool:
    """The implementation raised, hung or crashed its worker: there is no output to read."""
    from conformance.core.target import (
        ImplementationCrashed,
        ImplementationHung,
        ImplementationRaised,
    )

    if isinstance(exc, (ImplementationHung, ImplementationRaised, ImplementationCrashed)):
        return True
    return isinstance(exc, BaseExceptionGroup) and any(_implementation_broke(e) for e in exc.exceptions)


def _call_once(target: Any, case: Any) -> _Call | None:
    """The implementation's plain output on ``case``: one guarded call (it is observed)."""
    example = _EXAMPLE.get()
    if example is None or example.case is not case:
        start_example(case)
    if target.level == "mha":
        from conformance.calls.mha import run_mha

        run_mha(target, case)
    elif target.level == "sharded":
        from conformance.sharded.cases import run_sharded

        run_sharded(target, case)
    elif target.level == "flash":
        from conformance.calls.flash import run_flash

        run_flash(target, case)
    elif target.level == "varlen":
        from conformance.calls.varlen import run_varlen

        run_varlen(target, case)
    elif target.level == "kvcache":
        from conformance.calls.kvcache import run_kvcache

        run_kvcache(target, case)
    else:
        from conformance.calls.sdpa import run_sdpa

        run_sdpa(target, case)
    calls = _EXAMPLE.get().calls
    return calls[-1] if calls else None


def _diagnose_call(target: Any, call: _Call) -> Verdict | bool:
    """A verdict when the call's output disagrees with the oracle and matches variants;
    else whether it disagrees (True: wrong, but no variant matches)."""
    prepared = problem_of(target, call)
    if prepared is None:
        return False
    problem, observed, allowed = prepared
    if V.correct_fit(observed, problem, allowed) <= 1.0:
        return False
    matches = V.rank(observed, problem, variants=lifted_variants(target.level), allowed=allowed)
    if not matches:
        return True
    relative = _relative_error(observed, V.reference(problem))
    causes = [dict(_cause(m.variant_id, m.fit, relative),
                   finite_evidence=V.finite_evidence(observed, problem, lifted_variant(target.level, m.variant_id),
                                                     allowed),
                   kind=_mask_kind(call)) for m in matches]
    return Verdict(causes, _line(causes), call)


def _relative_error(observed: Any, correct: V.VariantResult) -> float | None:
    """max |observed - oracle| / max |oracle| over the output elements finite in both;
    None when NaN or inf appear where the oracle has none (or the shapes differ)."""
    if isinstance(observed, dict):
        observed = observed["output"]
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


