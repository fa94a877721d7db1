"""Learned attention sinks at the SDPA level (spec.sdpa(sinks=)): an SDPA-signature
function taking ``sinks`` (N,) (or ``s_aux``, ``learnable_sink``) against the oracle, and
a sink as an extra key with a zero value, through the implementation's own masks. The
flash level's ``sink_agreement`` and ``sink_equivalence`` are the model; here the sink
meets SDPA's bool and additive masks and its upper-left causal flag.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

import spec
from conformance.calls.call_specs import fold_causal
from conformance.calls.equivalence import compare_equivalent, sdpa_side
from conformance.calls.sdpa import check_against_oracle, check_gradients, run_sdpa
from conformance.core.cases import SDPACase
from conformance.core.compare import fail
from conformance.core.target import Target
from conformance.directed.admission import MAX_DIRECTED, producible_regimes
from conformance.directed.helpers import cases_for, skip_unless
from conformance.directed.shrink import remember_arguments
from conformance.harness.runner import conformance_property
from implementations.capabilities import length_allowed
from conformance.strategies._drawing import draw_seed
from conformance.strategies.flash import exact_sinks, sink_logits
from conformance.strategies.values import sdpa_values
from spec.emulate import round_to


def _with_sinks(target: Target, **kwargs: Any) -> Any:
    """SDPA cases within the target's claims, each with sinks (N,) drawn relative to its
    largest |score| (zero, around the scores, far above and below, 1000 above)."""
    base = cases_for(target, layouts=("contiguous",), **kwargs)

    @st.composite
    def with_sinks(draw: st.DrawFn) -> SDPACase:
        case = draw(base)
        ref = spec.sdpa(case.query, case.key, case.value, attend_mask=case.attend_mask,
                        additive_mask=case.additive_mask, causal=case.causal, scale=case.scale)
        scores = np.abs(ref.logits)
        if case.additive_mask is not None:
            scores = scores + np.where(np.isfinite(case.additive_mask), np.abs(case.additive_mask), 0.0)
        finite = scores[np.isfinite(scores)]
        return case.replace(sinks=sink_logits(draw, draw_seed(draw), case.N, float(finite.max()) if finite.size else 1.0))

    strategy = with_sinks()
    strategy.case_arguments = base.case_arguments
    return strategy


def _directed(target: Target) -> list[SDPACase]:
    """Sinks that differ per head, one far above every score (overflows exp(sink - key
    max) unless it joins the max), a bool mask blocking a whole row (all its weight on the
    sink: 0), an additive mask, the causal flag; the cases' values in turn take each
    value regime the property's strategy can draw (the ci profile reaches every one)."""
    caps = target.caps
    rng = np.random.default_rng(29)
    N, K = (2, 1) if caps.gqa else (2, 2)
    E = max(caps.min_head_dim or 2, 2) if caps.head_dims is None else caps.head_dims[0]
    L, S = (2, 3) if not caps.self_attention_lengths else (3, 3)
    m = caps.seq_multiple or 1
    L, S = L * m, S * m
    if not (length_allowed(caps, L) and length_allowed(caps, S)):
        return []
    varied = exact_sinks(np.array([0.5, -1.0]))
    blocked = np.ones((L, S), bool)
    blocked[0] = False
    # (name, changes): each feature's case carries its name
    features: list[tuple[str, dict[str, Any]]] = [
        ("sinks that differ per head", {"sinks": varied}),
        ("a sink far above every score", {"sinks": exact_sinks(np.full(N, 1000.0))})]
    if "bool" in caps.mask_kinds:
        features.append(("a bool mask blocking a whole row: all its weight on the sink",
                         {"sinks": varied, "attend_mask": blocked}))
    if "additive" in caps.mask_kinds:
        features.append(("sinks with an additive mask",
                         {"sinks": varied, "additive_mask": round_to(rng.standard_normal((L, S)), target.dtype)}))
    if caps.causal is not None:
        features.append(("sinks with the causal flag", {"sinks": varied, "causal": caps.causal}))
    regimes = [r for r in producible_regimes(target, layouts=("contiguous",)) if r != "normal"]
    regimes = ["normal", *regimes]
    sizes = {"B": 1, "N": N, "K": K, "L": L, "S": S, "E": E, "Ev": E}
    out = []
    for j in range(min(max(len(features), len(regimes)), MAX_DIRECTED)):
        regime = regimes[j % len(regimes)]
        q, k, v = sdpa_values(np.random.default_rng(29 + j), sizes, regime, target.dtype, None, [])
        if caps.shared_kv:
            v = k
        name, changes = features[j % len(features)]
        case = SDPACase(q, k, v, dtype=target.dtype, device=target.device, regime=regime,
                        notes=(f"directed: {name}, values {regime}",))
        out.append(case.replace(**changes))
    if caps.causal_only:
        out = [c.replace(causal=caps.causal, attend_mask=None, additive_mask=None) for c in out]
    return remember_arguments(out, {"layouts": ("contiguous",)})  # for directed.shrink


def _rows_without_keys_are_zero(case: SDPACase, output: np.ndarray) -> None:
    __tracebackhide__ = True
    dead = case.fully_masked_rows()                                        # (B, N, L)
    if dead.any() and not (output[dead] == 0).all():
        fail(f"output of rows attending no key = {output[dead].ravel()[:4]}, but should be 0 (with sinks such a "
             "row puts all its weight on the sink, which carries no value)")


@conformance_property(
    "sdpa_sink_agreement", level="sdpa", section="spec.sdpa (sinks)",
    cases=lambda t: _with_sinks(t),
    directed=_directed,
    skip_reason=lambda t: skip_unless(t.caps.sdpa_sinks, "learned sinks not declared (sdpa_sinks: a parameter "
                                      "named sinks, s_aux or learnable_sink is probed)"),
)
def test_sdpa_sink_agreement(target: Target, case: SDPACase) -> float:
    """sinks (N,), one learned logit per query head, join every row's softmax denominator
    and carry no value: the output equals spec.sdpa(sinks=...) (weights exp(s_ij) /
    (exp(sink_h) + Σ_j exp(s_ij)), the sink compared with the scores after the masks)
    with bool and additive masks and the causal flag; a row every mask blocks gives 0
    whatever the fully-masked policy (its weight is on the sink); sinks far above the
    scores stay finite; gradients (float64/32) equal spec.sdpa_vjp(sinks=...)."""
    call = run_sdpa(target, case)
    ratio = check_against_oracle(target, case, call.output, what="output with sinks").ratio
    _rows_without_keys_are_zero(case, call.output)
    if target.caps.autograd and target.dtype in ("float64", "float32"):
        ratio = max(ratio, check_gradients(target, case))
    return ratio


def _sink_as_key(case: SDPACase, scale: float) -> SDPACase:
    """The same problem with each sink as a key prepended at index 0: one more head dim
    (q' = [q, 1], k' = [k, 0], k_sink = [0, sink_h / scale]), kv heads repeated to N (one sink
    key per query head), a zero value, causality folded into the mask and the mask given
    a leading column that attends (bool True, additive 0)."""
    case = fold_causal(case)
    B, N, L, E = case.query.shape
    group = N // case.K
    key = np.repeat(case.key, group, axis=1)                                   # (B, N, S, E)
    value = np.repeat(case.value, group, axis=1)                               # (B, N, S, Ev)
    sink_key = np.zeros((B, N, 1, E + 1))
    sink_key[..., E] = (case.sinks / scale)[None, :, None]
    query = np.concatenate([case.query, np.ones((B, N, L, 1))], axis=-1)
    key = np.concatenate([sink_key, np.concatenate([key, np.zeros((B, N, case.S, 1))], axis=-1)], axis=2)
    value = np.concatenate([np.zeros((B, N, 1, case.Ev)), value], axis=2)
    if case.Ev == E:  # keep Ev == E: a zero value column, dropped from the output
        value = np.concatenate([value, np.zeros((*value.shape[:3], 1))], axis=-1)
    full = (B, N, L, case.S)
    attend = additive = None
    if case.attend_mask is not None:
        attend = np.concatenate([np.ones((B, N, L, 1), bool), np.broadcast_to(case.attend_mask, full)], axis=-1)
    if case.additive_mask is not None:
        additive = np.concatenate([np.zeros((B, N, L, 1)), np.broadcast_to(case.additive_mask, full)], axis=-1)
    return case.replace(query=query, key=key, value=value, attend_mask=attend, additive_mask=additive, sinks=None,
                        scale=scale, notes=(*case.notes, "sinks as a leading key"))


@conformance_property(
    "sdpa_sink_equivalence", level="sdpa", section="spec.sdpa (sinks)",
    cases=lambda t: _with_sinks(t),
    directed=_directed,
    skip_reason=lambda t: skip_unless(t.caps.sdpa_sinks, "learned sinks not declared (sdpa_sinks)")
    or skip_unless(t.caps.custom_scale, "the sink key's logit needs an explicit scale")
    or skip_unless(not t.caps.self_attention_lengths, "the sink key makes S = L + 1 (self_attention_lengths)"),
)
def test_sdpa_sink_equivalence(target: Target, case: SDPACase) -> float:
    """A sink is an extra key with a zero value and a fixed logit: the output with sinks
    equals the implementation's own output without sinks on keys with one key prepended
    (one more head dim: q' = [q, 1], k_sink = [0, sink_h / scale], kv heads repeated, value
    0; scale a power of two so sink_h / scale is exact; causality folded into the mask, the
    mask given a leading column that attends). Rows every mask blocks are 0 with sinks and
    see only the sink key without them: 0 either way."""
    scale = float(2.0 ** round(np.log2(1.0 / np.sqrt(case.E))))
    case = case.replace(scale=scale)
    call = run_sdpa(target, case)
    ratio = check_against_oracle(target, case, call.output, what="output with sinks").ratio
    extra = _sink_as_key(case, scale)
    caps = target.caps
    needs = extra.mask_kind
    if (np.abs(extra.key).max() > 60000 or needs not in caps.mask_kinds or extra.N != extra.K and not caps.gqa
            or extra.Ev != extra.E and not caps.different_v_dim
            or caps.max_head_dim is not None and extra.E > caps.max_head_dim
            or caps.head_dims is not None and extra.E not in caps.head_dims
            or not length_allowed(caps, extra.S) or caps.seq_multiple):
        return ratio                                       # the sink key is not expressible here
    other = run_sdpa(target, extra).output[..., :case.Ev]
    where = np.broadcast_to(np.ones((1, 1, case.L, 1), bool), call.output.shape)
    mine = sdpa_side(target, "the call with sinks", case, call.output, path="sinks argument")
    theirs = sdpa_side(target, "the call with the sinks as a leading key", extra, other,
                       path="plain attention", view=lambda a: a[..., :case.Ev])
    allowed = mine.allowed + theirs.allowed
    return max(ratio, compare_equivalent("output with sinks vs the sinks as a leading key (value 0)", mine, theirs,
                                         allowed, where=where).ratio)
