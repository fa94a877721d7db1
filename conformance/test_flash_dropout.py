"""Flash level, dropout (spec.flash_attention with ``dropout_p`` and a pattern):
``flash_attn_func(dropout_p=p)`` keeps the expectation (statistically, as the SDPA level's
``dropout_expectation``), and, where ``return_attn_probs=True`` returns FlashAttention-2's
``S_dmask`` (negative where a weight was dropped), the output and the gradients are
exactly those of the returned pattern.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conformance.calls.declarations import fit_head_dims, fit_lengths
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
from conformance.calls.call_specs import case_rng
from conformance.core.target import Target
from conformance.directed.helpers import skip_unless
from conformance.harness.runner import conformance_property
from conformance.strategies.flash import flash_cases
from spec.emulate import round_to

#: Dropout samples per example, as copies along the batch dimension (as at the SDPA level).
DROPOUT_SAMPLES = 1024
#: The dropout probability both properties use: forgetting the 1/(1 - p) rescale halves the mean.
DROPOUT_P = 0.5


def _cases(target: Target, **kwargs: Any) -> Any:
    return flash_cases(dtype=target.dtype, device=target.device, caps=target.caps, shape_budget=target.shape_budget,
                       window=None, softcap=None, alibi=None, sinks=None, max_L=4, max_S=8, regimes=("normal",),
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
        out.append(FlashCase(q, k, v, causal=causal, dtype=target.dtype, device=target.device, notes=("directed",)))
    return out


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
