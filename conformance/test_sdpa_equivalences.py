"""Equivalent spellings of one problem give one answer (spec.masks, GQA, layouts),
and dropout keeps the expectation."""

from __future__ import annotations

import numpy as np

import spec
from conformance.calls.equivalence import compare_equivalent, sdpa_side
from conformance.calls.sdpa import (
    allowed_for,
    check_against_oracle,
    check_dropout_mean,
    run_sdpa,
    valid_rows,
)
from conformance.core.cases import SDPACase
from conformance.core.target import Target
from conformance.directed.helpers import (
    cases_for,
    directed_for,
    needs_separate_values,
    skip_unless,
)
from conformance.harness.reporting import probe_saw
from conformance.harness.runner import conformance_property
from spec.emulate import round_to


@conformance_property(
    "bool_additive_equivalence", level="sdpa", section="spec.masks (to_additive)",
    cases=lambda t: cases_for(t, layouts=("contiguous",), mask_kinds=("bool",)),
    directed=lambda t: directed_for(t, layouts=("contiguous",), mask_kinds=("bool",)),
    skip_reason=lambda t: skip_unless({"bool", "additive"} <= set(t.caps.mask_kinds),
                                   "needs both bool and additive masks"),
)
def test_bool_additive_equivalence(target: Target, case: SDPACase) -> float:
    """A bool mask (True = may attend) and the additive mask 0 / -inf made from
    it give the same output, and that output is the oracle's."""
    additive = case.replace(attend_mask=None, additive_mask=spec.masks.to_additive(case.attend_mask))
    out_bool = run_sdpa(target, case).output
    out_add = run_sdpa(target, additive).output
    allowed, _ = allowed_for(target, case)
    ratio = compare_equivalent(
        "output with the additive 0/-inf form of the bool mask",
        sdpa_side(target, "the additive-mask call", additive, out_add, path="additive mask path"),
        sdpa_side(target, "the bool-mask call", case, out_bool, path="bool mask path"),
        2 * allowed, where=valid_rows(case)).ratio
    return max(ratio, check_against_oracle(target, case, out_bool, what="output with the bool mask").ratio)


@conformance_property(
    "causal_flag_equivalence", level="sdpa", section="spec.masks (causal_mask)",
    cases=lambda t: cases_for(t, layouts=("contiguous",), mask_kinds=("none",),
                              causal=(t.caps.causal,),
                              length_relations=("L=S", "L=1<S", "1<L<S", "L>S")),
    directed=lambda t: directed_for(t, layouts=("contiguous",), mask_kinds=("none",),
                                 causal=(t.caps.causal,),
                                 length_relations=("L=S", "L=1<S", "1<L<S", "L>S")),
    skip_reason=lambda t: skip_unless(t.caps.causal is not None, "no causal flag declared" + "".join(
        f" (probe: {note.split(': ', 1)[-1].split(';')[0]})" for note in t.caps.probe_notes
        if note.startswith("causal:"))),
)
def test_causal_flag_equivalence(target: Target, case: SDPACase) -> float:
    """is_causal=True equals the explicit causal mask of the declared alignment
    (upper_left: tril(ones(L, S)); lower_right: tril(ones(L, S), S - L)), for
    L < S, L = S and L > S, and agrees with the oracle."""
    with probe_saw(target, "causal"):
        return _causal_flag_equivalence(target, case)


def _causal_flag_equivalence(target: Target, case: SDPACase) -> float:
    flagged = run_sdpa(target, case).output
    explicit_mask = spec.masks.causal_mask(case.L, case.S, case.causal)  # (L, S)
    if "bool" in target.caps.mask_kinds:
        explicit = case.replace(causal=None, attend_mask=explicit_mask)
    else:
        explicit = case.replace(causal=None, additive_mask=spec.masks.to_additive(explicit_mask))
    ratio = check_against_oracle(target, case, flagged,
                                 what=f"output with is_causal=True ({case.causal}, L={case.L}, S={case.S})").ratio
    if set(target.caps.mask_kinds) - {"none"}:
        by_mask = run_sdpa(target, explicit).output
        allowed, _ = allowed_for(target, case)
        ratio = max(ratio, compare_equivalent(
            "output with is_causal=True vs the explicit causal mask",
            sdpa_side(target, "the is_causal=True call", case, flagged, path="causal flag"),
            sdpa_side(target, "the explicit-mask call", explicit, by_mask, path="masked path"),
            2 * allowed, where=valid_rows(case)).ratio)
    return ratio


@conformance_property(
    "gqa_equivalence", level="sdpa", section="spec.sdpa (GQA, repeat_interleave)",
    cases=lambda t: cases_for(t, layouts=("contiguous",), gqa=True),
    directed=lambda t: directed_for(t, layouts=("contiguous",), gqa=True),
    requires=("gqa",),
)
def test_gqa_equivalence(target: Target, case: SDPACase) -> float:
    """K < N kv heads with enable_gqa equals repeating each kv head N/K times in
    place (repeat_interleave: query head h uses kv head h // (N/K))."""
    group = case.N // case.K
    repeated = case.replace(key=np.repeat(case.key, group, axis=1), value=np.repeat(case.value, group, axis=1))
    grouped = run_sdpa(target, case).output
    expanded = run_sdpa(target, repeated).output
    allowed, _ = allowed_for(target, case)
    ratio = compare_equivalent(
        f"output with K={case.K} kv heads vs the same heads repeated to N={case.N}",
        sdpa_side(target, f"the grouped call (K={case.K}, enable_gqa=True)", case, grouped,
                  path="grouped-query path"),
        sdpa_side(target, f"the call with the kv heads repeated (K={case.N})", repeated, expanded,
                  path="path without grouping"),
        2 * allowed, where=valid_rows(case)).ratio
    return max(ratio, check_against_oracle(target, case, grouped).ratio)


@conformance_property(
    "layout_independence", level="sdpa", section="docs/DESIGN.md#memory-layout",
    cases=lambda t: cases_for(t, layouts=("transposed", "stride0", "poisoned")),
    directed=lambda t: directed_for(t, layouts=("transposed", "stride0", "poisoned")),
    requires=("non_contiguous",),
)
def test_layout_independence(target: Target, case: SDPACase) -> float:
    """Non-contiguous, stride-0 and transposed inputs, and slices of buffers
    poisoned with NaN past the logical end, give the contiguous result."""
    strided = run_sdpa(target, case).output
    contiguous = run_sdpa(target, case.replace(layout="contiguous")).output
    allowed, _ = allowed_for(target, case)
    plain = case.replace(layout="contiguous")
    ratio = compare_equivalent(
        f"output with layout={case.layout} vs contiguous",
        sdpa_side(target, f"the layout={case.layout} call", case, strided,
                  path=f"handling of {case.layout} inputs"),
        sdpa_side(target, "the contiguous call", plain, contiguous, path="contiguous path"),
        2 * allowed, where=valid_rows(case)).ratio
    return max(ratio, check_against_oracle(target, case, strided, what=f"output with layout={case.layout}").ratio)


#: Dropout samples per example, as copies along the batch dimension.
DROPOUT_SAMPLES = 1024


@conformance_property(
    "dropout_expectation", level="sdpa", section="docs/KNOWN_BUGS.md#7-dropout-in-eval (dropout keeps the expectation)",
    cases=lambda t: cases_for(t, layouts=("contiguous",), max_L=4, max_S=8, regimes=("normal",)),
    directed=lambda t: directed_for(t, layouts=("contiguous",), max_L=4, max_S=8, regimes=("normal",)),
    requires=("dropout",),
    skip_reason=lambda t: skip_unless(t.dtype in ("float32", "float64"), "checked in float32/float64 (a statistical bound)")
    or needs_separate_values(t),
    examples_factor=0.2,
)
def test_dropout_expectation(target: Target, case: SDPACase) -> float:
    """With dropout_p = p the mean of many dropout outputs is the dropout-free
    output, their standard deviation is what dropping each weight independently gives,
    and no sample is NaN (not even next to -inf mask entries).

    V is made positive, so each sample of an output element lies in [0, c] with
    c = Σ w|v| / (1 - p); Hoeffding's inequality bounds the mean of M samples
    within t = c·sqrt(ln(2/δ) / 2M) with probability 1 - δ, δ = 1e-7 / (#elements):
    a false-alarm rate below 1e-7 per example (``tolerance.sdpa_dropout_allowed``). Forgetting the 1/(1 - p) rescale
    moves the mean by p·mean, beyond t for p = 0.5 and M = 1024.

    The mean alone passes a dropout_p that is ignored, one mask shared by every sample,
    or dropout applied to the output: each sample's standard deviation must be
    sqrt(p/(1-p)·Σ w²v²), within Maurer and Pontil's bound c·sqrt(2 ln(2/δ)/(M-1))
    (``tolerance.dropout_spread_allowed``), and samples all identical are named as such.
    """
    p = 0.5
    positive = case.replace(value=round_to(np.abs(case.value) + 0.5, case.dtype))
    out = run_sdpa(target, positive, dropout_p=p, samples=DROPOUT_SAMPLES).output
    return check_dropout_mean(target, positive, out, p, DROPOUT_SAMPLES)
