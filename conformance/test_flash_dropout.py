"""Flash and varlen levels, dropout (spec.flash_attention with ``dropout_p`` and a pattern):
``flash_attn_func(dropout_p=p)`` keeps the expectation (statistically, as the SDPA level's
``dropout_expectation``), and, where ``return_attn_probs=True`` returns FlashAttention-2's
``S_dmask`` (negative where a weight was dropped), the output and the gradients are
exactly those of the returned pattern.

At the varlen level, ``flash_attn_varlen_func(dropout_p=p)`` keeps the expectation of
each packed sequence (statistically, as the flash level's ``flash_dropout_expectation``),
each sequence dropping with a pattern of its own.

Where ``return_attn_probs=True`` returns FlashAttention-2's varlen ``S_dmask``
(num_sequences, N, >= max_seqlen_q, >= max_seqlen_k; sequence b's weights at
``[b, :, :L_b, :S_b]``, negative where dropped; ``varlen_features`` ``dropout_pattern``),
each sequence's output is exactly that of its returned pattern
(``varlen_dropout_pattern_agreement``).

The copies are **extra packed sequences of the same call**: the case's B sequences
repeated M times (B·M sequences, one ``cu_seqlens`` pair). That is the form that reaches
the varlen kernel's own dropout bookkeeping: each packed sequence must draw a pattern of
its own (FlashAttention-2 derives it from the batch index in the Philox stream), so a
pattern shared by the sequences, or an offset not advanced from one sequence to the next,
makes the copies identical, which their spread shows. Repeated calls would instead draw
a new seed each time and pass such a kernel. The bounds are the flash level's
(``flash_dropout_expectation``), sequence by sequence.

Dimension letters: B batch (varlen: sequences), N query heads, L query length, S key
length, Ev value head dim, T_q packed query length, M copies.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from conformance.calls.cache_options import (
    check_lse_against_oracle,
    flash_options,
    sequence_flash_case,
    slopes_row,
)
from conformance.calls.call_specs import case_rng, content_seed
from conformance.calls.declarations import fit_head_dims, fit_lengths, require_inside
from conformance.calls.flash import (
    FlashCase,
    allowed_output,
    check_dropout_mean,
    check_lse,
    check_output,
    compare_dropout_gradients,
    dropout_pattern_of,
    oracle,
    run_flash,
)
from conformance.calls.sdpa import check_dropout_spread
from conformance.calls.varlen import VarlenCallSpec, VarlenCase, run_varlen_call, varlen_lse_bounds
from conformance.core import tolerance
from conformance.core.compare import compare_values, fail
from conformance.core.target import Target, call_guarded
from conformance.core.tensors import to_numpy
from conformance.directed.helpers import flash_named, skip_unless
from conformance.directed.shrink import remember_arguments
from conformance.harness.runner import conformance_property
from conformance.strategies.flash import flash_cases
from conformance.strategies.varlen import varlen_cases, varlen_directed
from spec import flash as spec_flash
from spec.emulate import round_to

#: Dropout samples per example, as copies along the batch dimension (as at the SDPA level).
DROPOUT_SAMPLES = 1024
#: The dropout probability both properties use: forgetting the 1/(1 - p) rescale halves the mean.
DROPOUT_P = 0.5


#: The flash dropout properties' bounds on the lengths (their strategy's, and their directed
#: cases' when shrunk).
_LENGTHS = {"max_L": 4, "max_S": 8}


def _cases(target: Target, **kwargs: Any) -> Any:
    return flash_cases(dtype=target.dtype, device=target.device, caps=target.caps, shape_budget=target.shape_budget,
                       window=None, softcap=None, alibi=None, sinks=None, regimes=("normal",), **_LENGTHS,
                       **kwargs)


def _directed(target: Target) -> list[FlashCase]:
    """One key and several (a dropout that is a no-op when one key takes all the weight,
    or that acts before the softmax), GQA, causal rows with L > S."""
    caps = target.caps
    rng = np.random.default_rng(23)
    shapes = [(1, 1, 1, 1, 2, 2, 2), (1, 2, 1, 2, 3, 2, 3), (1, 1, 1, 3, 2, 2, 2)]
    if not caps.gqa:
        shapes = [(B, N, N, L, S, E, Ev) for B, N, _, L, S, E, Ev in shapes]
    if not caps.different_v_dim:
        shapes = [(B, N, K, L, S, E, E) for B, N, K, L, S, E, _ in shapes]
    out = []
    for B, N, K, L, S, E, Ev in shapes:
        lengths, dims = fit_lengths(caps, L, S), fit_head_dims(caps, E, Ev)
        if lengths is None or dims is None:
            continue
        (L, S), (E, Ev) = lengths, dims
        q, k, v = (round_to(rng.standard_normal(s), target.dtype) for s in ((B, L, N, E), (B, S, K, E), (B, S, K, Ev)))
        causal = caps.causal_only or (L > S and caps.causal == "lower_right")
        out.append(flash_named(FlashCase(q, k, v, dtype=target.dtype, device=target.device), {"causal": causal}))
    return remember_arguments(out, _LENGTHS)  # for directed.shrink: the strategy's bounds


@conformance_property(
    "flash_dropout_expectation", level="flash", section="spec.flash_attention (dropout: the expectation)",
    cases=lambda t: _cases(t),
    directed=_directed,
    skip_reason=lambda t: skip_unless(t.caps.dropout, "dropout not declared at the flash level"),
    examples_factor=0.2,
)
def test_flash_dropout_expectation(target: Target, case: FlashCase) -> float:
    """With dropout_p = p the mean of many dropout outputs (copies along the batch) is
    spec.flash_attention without dropout, and no sample is NaN; the LSE returned with
    them (when declared) is the dropout-free one (dropout acts after the softmax).

    V is made positive, so each sample of an output element lies in [0, c] with
    c = Σ w|v| / (1 - p); Hoeffding's inequality bounds the mean of M = 1024 samples
    within c·sqrt(ln(2/δ) / 2M), δ = 1e-7 / (#elements), plus each sample's own rounding
    (the no-dropout bound / (1 - p)) (``tolerance.flash_dropout_allowed``). Forgetting the
    1/(1 - p) rescale moves the mean by p·mean; dropping logits before the softmax moves it
    too."""
    positive = case.replace(value=round_to(np.abs(case.value) + 0.5, case.dtype))
    lse = "lse" in target.caps.flash_features
    call = run_flash(target, positive, dropout_p=DROPOUT_P, samples=DROPOUT_SAMPLES, lse=lse)
    ratio = check_dropout_mean(target, positive, call)
    if call.lse is not None:
        ref = oracle(positive)
        for copy in (0, DROPOUT_SAMPLES - 1):  # every copy's LSE is the same, dropout or not
            rows = call.lse.reshape(DROPOUT_SAMPLES, *ref.lse.shape)[copy]
            ratio = max(ratio, check_lse(target, positive, rows, ref=ref, stored=call.lse_dtype).ratio)
    return ratio


@conformance_property(
    "dropout_pattern_agreement", level="flash", section="spec.flash_attention (dropout with a pattern)",
    cases=lambda t: _cases(t),
    directed=_directed,
    skip_reason=lambda t: skip_unless(t.caps.dropout, "dropout not declared at the flash level")
    or skip_unless("dropout_pattern" in t.caps.flash_features,
                   "dropout_pattern not declared (return_attn_probs=True returns no S_dmask with the dropout "
                   "pattern; flash_dropout_expectation certifies dropout statistically)"),
)
def test_dropout_pattern_agreement(target: Target, case: FlashCase) -> float:
    """return_attn_probs=True with dropout_p = p returns (output, softmax_lse, S_dmask),
    S_dmask (B, N, >= L, >= S) negative where a weight was dropped (FlashAttention-2's
    contract): the output equals spec.flash_attention with that pattern, Σ_j keep_ij·w_ij·v_j
    / (1 - p), within the tolerance rule at 1/(1 - p) times the magnitude; the LSE (when
    declared) is the dropout-free one; gradients (float64/32, autograd) equal the VJP with
    the same pattern (the backward must drop what the forward dropped)."""
    grads = target.caps.autograd and target.dtype in ("float64", "float32")
    grad_out = None
    if grads:
        grad_out = round_to(case_rng(case, "grad").standard_normal((case.B, case.L, case.N, case.Ev)), case.dtype)
    call = run_flash(target, case, lse=True, dropout_p=DROPOUT_P, grad_output=grad_out)
    keep = dropout_pattern_of(case, call)
    ref = oracle(case)
    with_pattern = oracle(case, dropout_p=DROPOUT_P, dropout_mask=keep)
    ratio = check_output(target, case, call.output, ref=with_pattern, what="output with its returned dropout pattern",
                         allowed=allowed_output(target, case, ref) / (1 - DROPOUT_P)).ratio
    if "lse" in target.caps.flash_features:
        ratio = max(ratio, check_lse(target, case, call.lse, ref=ref, stored=call.lse_dtype).ratio)
    if grads:
        ratio = max(ratio, compare_dropout_gradients(target, call.spec, call.inputs, keep))
    return ratio


# --------------------------------------------------------------------------- varlen level

#: Copies of the packed case per example (the flash level's 1024 samples).
DROPOUT_COPIES = 1024
#: The dropout probability: forgetting the 1/(1 - p) rescale halves the mean.
DROPOUT_P = 0.5


def packed_copies(case: VarlenCase, copies: int) -> VarlenCase:
    """``case``'s sequences packed ``copies`` times one after the other (B·copies sequences;
    per-sequence ALiBi slopes (B, N) tiled with them)."""
    lengths = case.lengths() * copies
    slopes = case.alibi_slopes
    if slopes is not None and np.ndim(slopes) == 2:
        slopes = np.tile(slopes, (copies, 1))
    return case.replace(query=np.tile(case.query, (copies, 1, 1)), key=np.tile(case.key, (copies, 1, 1)),
                        value=np.tile(case.value, (copies, 1, 1)),
                        cu_seqlens_q=tuple(int(x) for x in np.cumsum([0] + [L for L, _ in lengths])),
                        cu_seqlens_k=tuple(int(x) for x in np.cumsum([0] + [S for _, S in lengths])),
                        alibi_slopes=slopes)


def run_varlen_dropout(target: Target, case: VarlenCase, *, dropout_p: float, copies: int,
                       lse: bool) -> tuple[np.ndarray, np.ndarray | None, str | None]:
    """One call on ``copies`` packed copies of ``case`` with ``dropout_p`` (logged): (outputs
    (M, T_q, N, Ev), with ``lse`` the LSE (M, N, T_q) and the dtype it came back in)."""
    __tracebackhide__ = True
    call = VarlenCallSpec(packed_copies(case, copies), lse=lse, dropout_p=dropout_p)
    require_inside(target, call)
    if target.log is not None:
        target.log.calls.append(call)
    result = run_varlen_call(target.impl, call, invoke=partial(call_guarded, target))
    T, N = case.query.shape[0], case.N
    if not lse:
        return to_numpy(result).reshape(copies, T, N, case.Ev), None, None
    out, rows = result
    stored = str(rows.dtype).removeprefix("torch.")
    lse_rows = to_numpy(rows).reshape(N, copies, T).transpose(1, 0, 2)
    return to_numpy(out).reshape(copies, T, N, case.Ev), lse_rows, stored


def _sequence_statistics(target: Target, case: VarlenCase, p: float) -> dict[str, np.ndarray]:
    """Per packed row (T_q, N, Ev), from each sequence as a flash case: the dropout-free
    ``expected`` output, the width ``c`` = Σ w|v| / (1 - p) of a sample, its standard
    deviation ``sigma`` when each weight is dropped independently, the ``rounding`` of one
    sample (the no-dropout bound / (1 - p)); ``live`` (T_q, N, 1): rows attending a key."""
    T, N, Ev = case.query.shape[0], case.N, case.Ev
    out = {name: np.zeros((T, N, Ev)) for name in ("expected", "c", "sigma", "rounding")}
    out["live"] = np.zeros((T, N, 1), dtype=bool)
    options = flash_options(case)
    for b, (rows, keys) in enumerate(case.sequences()):
        if rows.stop == rows.start or keys.stop == keys.start:
            continue
        if options.get("alibi_slopes") is not None:
            options["alibi_slopes"] = slopes_row(case.alibi_slopes, b)
        flash_case = sequence_flash_case(case.query[rows], case.key[keys], case.value[keys], causal=case.causal,
                                         scale=case.scale, dtype=case.dtype, device=case.device, options=options)
        ref = oracle(flash_case)
        problem = spec_flash.prepare(flash_case.query, flash_case.key, flash_case.value, **flash_case.options())
        weights = spec_flash.attend(problem).weights                                 # (1, N, L, S)
        t = (0, 2, 1, 3)
        out["expected"][rows] = ref.output[0]
        out["c"][rows] = (weights @ np.abs(problem.value)).transpose(t)[0] / (1 - p)
        out["sigma"][rows] = np.sqrt(p / (1 - p) * (weights ** 2 @ problem.value ** 2)).transpose(t)[0]
        out["rounding"][rows] = allowed_output(target, flash_case, ref)[0] / (1 - p)
        out["live"][rows] = ~flash_case.empty_rows()[:, None, None]
    return out


def check_varlen_dropout(target: Target, case: VarlenCase, samples: np.ndarray, p: float) -> float:
    """``samples`` (M, T_q, N, Ev): the outputs of M packed copies of ``case`` (V >= 0) with
    ``dropout_p`` = p. No NaN in rows attending a key; their mean is
    ``spec.varlen_attention`` without dropout within Hoeffding's bound plus each sample's
    rounding (``tolerance.flash_dropout_allowed``), and their standard deviation is that of
    dropping each weight independently (``calls.sdpa.check_dropout_spread``)."""
    __tracebackhide__ = True
    stats = _sequence_statistics(target, case, p)
    live = stats["live"]
    if np.isnan(np.where(live[None], samples, 0.0)).any():
        fail(f"dropout output has NaN with dropout_p={p}")
    copies = samples.shape[0]
    mean = samples.mean(axis=0)
    bound = tolerance.flash_dropout_allowed(stats["c"], copies, mean.size, stats["rounding"])
    ratio = compare_values(f"mean of {copies} packed copies' dropout outputs (dropout_p={p})", mean,
                           stats["expected"], bound, where=live).ratio
    # The mean alone passes a dropout_p that is ignored or one pattern shared by every sequence.
    return max(ratio, check_dropout_spread(samples, stats["sigma"], stats["c"], stats["rounding"], live,
                                           f"dropout_p={p}, copies packed as sequences of one call"))


def _positive(case: VarlenCase) -> VarlenCase:
    """V made positive (|v| + 0.5): each sample then lies in [0, c] (Hoeffding's bound); a
    directed case's name says so."""
    return case.replace(value=round_to(np.abs(case.value) + 0.5, case.dtype), notes=case.named_with("V positive"))


#: The varlen dropout properties' bounds on the sequences (their strategy's, and their
#: directed cases' when shrunk).
_SEQUENCES = {"max_batch": 3, "max_len": 4}


def _varlen_cases(target: Target) -> Any:
    return varlen_cases(dtype=target.dtype, device=target.device, caps=target.caps, **_SEQUENCES,
                        window=None, softcap=None, alibi=None).map(_positive)


def _varlen_directed(target: Target) -> list[VarlenCase]:
    """The varlen level's directed layouts (a one-key sequence next to its neighbour, empty
    and one-token sequences side by side, causal with L > S and L < S), V positive (a
    shrunk one too: ``positive_values``, as the strategy draws them)."""
    cases = [_positive(case) for case in varlen_directed(dtype=target.dtype, device=target.device, caps=target.caps)]
    return remember_arguments(cases, {**_SEQUENCES, "positive_values": True})


@conformance_property(
    "varlen_dropout_expectation", level="varlen", section="spec.varlen_attention (dropout: the expectation)",
    cases=_varlen_cases,
    directed=_varlen_directed,
    skip_reason=lambda t: skip_unless("dropout" in t.caps.varlen_features,
                                      "dropout not declared at the varlen level (varlen_features; a dropout_p "
                                      "parameter of flash_attn_varlen_func's signature claims it)"),
    examples_factor=0.2,
)
def test_varlen_dropout_expectation(target: Target, case: VarlenCase) -> float:
    """With dropout_p = p, the case's sequences packed M = 1024 times in one call: the mean
    of each row's M outputs is spec.varlen_attention without dropout and no sample is NaN,
    within Hoeffding's bound (V positive, each sample in [0, c], c = Σ w|v| / (1 - p),
    δ = 1e-7 / #elements) plus each sample's rounding (``tolerance.flash_dropout_allowed``);
    their standard deviation is that of dropping each weight independently (a pattern
    shared by the packed sequences, or an offset not advanced from one to the next, makes
    the copies identical); the LSE (when declared) is the dropout-free one. Forgetting the
    1/(1 - p) rescale moves the mean by p·mean."""
    lse = "lse" in target.caps.varlen_features
    samples, lse_rows, stored = run_varlen_dropout(target, case, dropout_p=DROPOUT_P, copies=DROPOUT_COPIES,
                                                   lse=lse)
    ratio = check_varlen_dropout(target, case, samples, DROPOUT_P)
    if lse_rows is not None:
        expected, allowed = varlen_lse_bounds(target, case, stored)
        for copy in (0, DROPOUT_COPIES - 1):  # every copy's LSE is the dropout-free one
            ratio = max(ratio, check_lse_against_oracle(f"softmax_lse of copy {copy} with dropout_p={DROPOUT_P}",
                                                        lse_rows[copy], expected, allowed))
    return ratio


# --------------------------------------------------------------------------- varlen: the pattern


def varlen_dropout_pattern_of(case: VarlenCase, probs: np.ndarray | None, p: float) -> list[np.ndarray]:
    """Each packed sequence's dropout pattern (N, L_b, S_b), True = kept, read off
    ``return_attn_probs``' third element: FlashAttention-2's varlen S_dmask (num_sequences, N,
    >= max_seqlen_q, >= max_seqlen_k), one row per sequence, its pattern top-left
    (``[b, :, :L_b, :S_b]``), negative where dropped; the padding (FlashAttention-2 rounds
    the last two sizes up to multiples of 128) is not read."""
    __tracebackhide__ = True
    lengths = case.lengths()
    B, N = case.B, case.N
    L, S = max([0] + [n for n, _ in lengths]), max([0] + [m for _, m in lengths])
    if probs is None or probs.ndim != 4 or probs.shape[:2] != (B, N) or probs.shape[2] < L or probs.shape[3] < S:
        shape = None if probs is None else probs.shape
        fail(f"return_attn_probs=True with dropout_p={p} returned S_dmask of shape {shape}, but should return "
             f"(output, softmax_lse, S_dmask (num_sequences, N, >= max_seqlen_q, >= max_seqlen_k) = ({B}, {N}, "
             f">= {L}, >= {S})) as flash_attn_varlen_func does (varlen_features dropout_pattern declared)")
    return [~(probs[b, :, :n, :m] < 0) for b, (n, m) in enumerate(lengths)]


def _pattern_bounds(target: Target, case: VarlenCase, keeps: list[np.ndarray],
                    p: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(expected (T_q, N, Ev): each sequence's spec.flash_attention with its pattern, allowed:
    the tolerance rule at 1/(1 - p) times the magnitude, live rows (T_q, N, 1))."""
    T, N, Ev = case.query.shape[0], case.N, case.Ev
    expected, allowed = np.zeros((T, N, Ev)), np.zeros((T, N, Ev))
    live = np.zeros((T, N, 1), dtype=bool)
    options = flash_options(case)
    for b, (rows, keys) in enumerate(case.sequences()):
        if rows.stop == rows.start or keys.stop == keys.start:
            continue
        if options.get("alibi_slopes") is not None:
            options["alibi_slopes"] = slopes_row(case.alibi_slopes, b)
        flash_case = sequence_flash_case(case.query[rows], case.key[keys], case.value[keys], causal=case.causal,
                                         scale=case.scale, dtype=case.dtype, device=case.device, options=options)
        ref = oracle(flash_case)
        expected[rows] = oracle(flash_case, dropout_p=p, dropout_mask=keeps[b][None]).output[0]
        allowed[rows] = allowed_output(target, flash_case, ref)[0] / (1 - p)
        live[rows] = ~flash_case.empty_rows()[:, None, None]
    return expected, allowed, live


def _pattern_cases(target: Target) -> Any:
    return varlen_cases(dtype=target.dtype, device=target.device, caps=target.caps, **_SEQUENCES,
                        window=None, softcap=None, alibi=None)


@conformance_property(
    "varlen_dropout_pattern_agreement", level="varlen", section="spec.varlen_attention (dropout with a pattern)",
    cases=_pattern_cases,
    directed=lambda t: remember_arguments(varlen_directed(dtype=t.dtype, device=t.device, caps=t.caps), _SEQUENCES),
    skip_reason=lambda t: skip_unless("dropout" in t.caps.varlen_features,
                                      "dropout not declared at the varlen level (varlen_features; a dropout_p "
                                      "parameter of flash_attn_varlen_func's signature claims it)")
    or skip_unless("dropout_pattern" in t.caps.varlen_features,
                   "dropout_pattern not declared at the varlen level (varlen_features; return_attn_probs=True "
                   "returns no S_dmask with the dropout pattern; varlen_dropout_expectation certifies dropout "
                   "statistically)"),
)
def test_varlen_dropout_pattern_agreement(target: Target, case: VarlenCase) -> float:
    """return_attn_probs=True with dropout_p = p returns (output, softmax_lse (N, T_q), S_dmask),
    S_dmask (num_sequences, N, >= max_seqlen_q, >= max_seqlen_k) holding packed sequence b's
    weights at [b, :, :L_b, :S_b], negative where a weight was dropped (FlashAttention-2's
    contract): each sequence's output equals spec.flash_attention with its pattern,
    Σ_j keep_ij·w_ij·v_j / (1 - p), within the tolerance rule at 1/(1 - p) times the
    magnitude (rows attending no key: the declared policy); the LSE (when declared) is the
    dropout-free one. A pattern written at another sequence's row, or an output computed from
    a mask other than the returned one, disagrees. torch's generator is seeded from the case's
    contents, so a replay draws the same pattern."""
    seed = content_seed("varlen-dropout", case.query, case.key, case.value, extra=case.describe())
    call = VarlenCallSpec(case, lse=True, dropout_p=DROPOUT_P, dropout_seed=seed)
    require_inside(target, call)
    if target.log is not None:
        target.log.calls.append(call)
    out, lse, probs = run_varlen_call(target.impl, call, invoke=partial(call_guarded, target), with_probs=True)
    keeps = varlen_dropout_pattern_of(case, None if probs is None else to_numpy(probs), DROPOUT_P)
    expected, allowed, live = _pattern_bounds(target, case, keeps, DROPOUT_P)
    where = None if target.caps.fully_masked == "zero" else live   # zero: rows with no key give exactly 0
    ratio = compare_values("packed output with its returned dropout pattern", to_numpy(out), expected, allowed,
                           where=where).ratio
    if "lse" in target.caps.varlen_features:
        stored = str(lse.dtype).removeprefix("torch.")
        ratio = max(ratio, check_lse_against_oracle(f"softmax_lse with dropout_p={DROPOUT_P}", to_numpy(lse),
                                                    *varlen_lse_bounds(target, case, stored)))
    return ratio
