"""Flash level (spec.flash): FlashAttention's ``flash_attn_func`` against the float64
oracle, feature by feature: forward and gradients, the sliding window, soft-capping,
ALiBi, the log-sum-exp, and the merge of two key splits by their LSEs.

Each property calls the implementation through ``conformance.calls.flash`` (guarded,
logged, reproducible) and compares under the SDPA tolerance rule: k × the error of a
naive same-precision computation of the same case plus a rounding floor.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import spec
from conformance.calls.declarations import fit_head_dims, fit_lengths, outside_declarations
from conformance.calls.equivalence import Side, compare_equivalent
from conformance.calls.flash import (
    FlashCase,
    allowed_lse,
    allowed_output,
    assert_output_contract,
    check_gradients,
    check_lse,
    check_output,
    oracle,
    run_flash,
)
from conformance.core.compare import compare_values
from conformance.core.target import Target
from conformance.directed.helpers import backward_target, flash_named, skip_unless
from conformance.directed.shrink import remember_arguments
from conformance.harness.reporting import probe_saw
from conformance.harness.runner import conformance_property
from conformance.strategies.flash import GEMMA_SOFTCAP, exact_sinks, flash_cases
from spec.emulate import round_to


def _cases(target: Target, **kwargs: Any) -> Any:
    return flash_cases(dtype=target.dtype, device=target.device, caps=target.caps,
                       shape_budget=target.shape_budget, **kwargs)


def _directed(target: Target, *, window: bool | None = False, softcap: bool | None = False,
              alibi: bool | None = False, split: bool = False, sinks: bool = False,
              **_: Any) -> list[FlashCase]:
    """The smallest case of each bug class the strategy could draw: L = 1 < S and L > S
    (lower-right alignment: rows emptied by causal or a window), GQA, Ev != E, and the
    feature at its edges (window sides 0 and S, a cap far below the logits, ALiBi with
    L != S and slopes of both signs)."""
    caps, dtype, device = target.caps, target.dtype, target.device
    rng = np.random.default_rng(13)
    causal_ok = caps.causal == "lower_right"
    shapes = [(1, 2, 2, 1, 3, 2, 2), (1, 2, 1, 4, 2, 2, 3), (1, 1, 1, 3, 5, 3, 3)]
    if not caps.gqa:
        shapes = [(B, N, N, L, S, E, Ev) for B, N, _, L, S, E, Ev in shapes]
    if not caps.different_v_dim:
        shapes = [(B, N, K, L, S, E, E) for B, N, K, L, S, E, _ in shapes]
    out = []
    for B, N, K, L, S, E, Ev in shapes:
        # Inside the declared bounds: L == S only (e.g. derived from such an SDPA), the
        # lengths under max_seq_len, the head dims in [min_head_dim, max_head_dim].
        lengths, dims = fit_lengths(caps, L, S), fit_head_dims(caps, E, Ev)
        if lengths is None or dims is None:
            continue
        (L, S), (E, Ev) = lengths, dims
        q, k, v = (round_to(rng.standard_normal(s), dtype)
                   for s in ((B, L, N, E), (B, S, K, E), (B, S, K, Ev)))
        base = FlashCase(q, k, v, dtype=dtype, device=device, notes=("directed",))
        variants = []
        if window:
            variants += [{"window": (0, 0)}, {"window": (1, S), "causal": causal_ok}, {"window": (S, 0)}]
        elif softcap:
            logits = np.abs(q).max() * np.abs(k).max() * E / np.sqrt(E)
            variants += [{"softcap": float(np.float32(max(logits, 1e-3) / 20))},
                         {"softcap": GEMMA_SOFTCAP, "causal": causal_ok}]
        elif alibi:
            slopes = np.array([0.5, -0.25, 1.0, 0.125][:N], dtype=np.float32).astype(np.float64)
            variants += [{"alibi_slopes": slopes}, {"alibi_slopes": slopes, "causal": causal_ok}]
        elif sinks:
            # sinks that differ per head, one far above every score (it takes the mass and
            # overflows exp(sink - key max) unless it joins the max), causal rows with no key
            varied = exact_sinks(np.array([0.5, -1.0, 2.0, 0.0][:N]))
            variants += [{"sinks": varied}, {"sinks": varied, "causal": causal_ok},
                         {"sinks": exact_sinks(np.full(N, 1000.0))}]
        else:
            variants += [{}, {"causal": causal_ok}]
        for changes in variants:
            if split and S < 2 * (caps.seq_multiple or 1):
                continue
            if caps.causal_only:
                changes = {**changes, "causal": True}
            if "window" not in caps.flash_features and "window" in changes:
                continue
            out.append(flash_named(base, changes))
    # for directed.shrink: the property's strategy arguments (its features, a split case)
    return remember_arguments(out, {"window": window, "softcap": softcap, "alibi": alibi, "split": split,
                                    "sinks": sinks})


def _grads_too(target: Target) -> bool:
    return target.caps.autograd and target.dtype in ("float64", "float32")


@conformance_property(
    "flash_agreement", level="flash", section="spec.flash_attention",
    cases=lambda t: _cases(t),
    directed=lambda t: _directed(t),
    examples_factor=2.0,
)
def test_flash_agreement(target: Target, case: FlashCase) -> float:
    """The output (B, L, N, Ev) equals spec.flash_attention (causal lower-right, GQA, Ev != E)
    within k × the naive same-precision error plus a rounding floor; rows attending no key
    (causal with L > S) follow the declared policy."""
    call = run_flash(target, case)
    assert_output_contract(target, case, call)
    if not case.causal:
        return check_output(target, case, call.output).ratio
    with probe_saw(target, "causal"):
        return check_output(target, case, call.output).ratio


@conformance_property(
    "flash_gradients", level="flash", section="spec.flash_attention_vjp",
    cases=lambda t: _cases(backward_target(t)),
    directed=lambda t: _directed(backward_target(t)),
    requires=("autograd",),
    examples_factor=0.5,
)
def test_flash_gradients(target: Target, case: FlashCase) -> float:
    """dq, dk, dv of a seeded upstream gradient equal spec.flash_attention_vjp (dk, dv summed
    over each GQA group; rows attending no key get 0) within the gradient rounding floor."""
    return check_gradients(target, case)


@conformance_property(
    "window_equivalence", level="flash", section="spec.flash (window_mask)",
    cases=lambda t: _cases(t, window=True),
    directed=lambda t: _directed(t, window=True),
    requires=("flash:window",),
)
def test_window_equivalence(target: Target, case: FlashCase) -> float:
    """window_size=(left, right) (causal: right = 0) equals spec.sdpa with the explicit band
    mask spec.window_mask (query i attends key j iff p_i - left <= j <= p_i + right,
    p_i = i + S - L); through the same function, causal=True equals window (left, 0), and a
    side of L + S or more equals that side unbounded (-1); gradients (float64/32) equal the VJP."""
    with probe_saw(target, "window"):
        return _window_equivalence(target, case)


def _window_equivalence(target: Target, case: FlashCase) -> float:
    heads_first = case.heads_first()
    masked = spec.sdpa(heads_first.query, heads_first.key, heads_first.value,
                       attend_mask=heads_first.attend_mask, scale=case.scale).output.transpose(0, 2, 1, 3)
    call = run_flash(target, case)
    rows = ~case.empty_rows()
    where = rows[None, :, None, None]
    ratio = compare_values("output with window_size", call.output, masked,
                           allowed_output(target, case), where=where).ratio
    ratio = max(ratio, check_output(target, case, call.output).ratio)
    left, right = case.window
    if case.causal and not target.caps.causal_only:
        same = case.replace(causal=False, window=(left, 0))
        ratio = max(ratio, check_output(target, same, run_flash(target, same).output,
                                        what=f"output with causal=False, window_size={same.window}").ratio)
    wide = case.L + case.S
    widened = case.replace(window=(wide if left == -1 else left, right if right >= 0 or case.causal else wide))
    if widened.window != case.window:
        ratio = max(ratio, check_output(target, widened, run_flash(target, widened).output,
                                        what=f"output with window_size={widened.window} (a side >= L + S "
                                             "is unbounded)").ratio)
    if _grads_too(target):
        ratio = max(ratio, check_gradients(target, case))
    return ratio


@conformance_property(
    "softcap_agreement", level="flash", section="spec.flash (softcap)",
    cases=lambda t: _cases(t, softcap=True),
    directed=lambda t: _directed(t, softcap=True),
    requires=("flash:softcap",),
)
def test_softcap_agreement(target: Target, case: FlashCase) -> float:
    """With softcap=c the scaled logits s become c·tanh(s / c) before bias and masks: the
    output equals spec.flash_attention for caps far below, near and far above the logits;
    gradients (float64/32, through 1 - tanh²(s / c)) equal spec.flash_attention_vjp."""
    with probe_saw(target, "softcap"):
        return _softcap_agreement(target, case)


def _softcap_agreement(target: Target, case: FlashCase) -> float:
    call = run_flash(target, case)
    ratio = check_output(target, case, call.output).ratio
    if _grads_too(target):
        ratio = max(ratio, check_gradients(target, case))
    return ratio


@conformance_property(
    "alibi_equivalence", level="flash", section="spec.flash (alibi_bias)",
    cases=lambda t: _cases(t, alibi=True),
    directed=lambda t: _directed(t, alibi=True),
    requires=("flash:alibi",),
)
def test_alibi_equivalence(target: Target, case: FlashCase) -> float:
    """alibi_slopes (N,) or (B, N) equal their additive bias -slope_h·|p_i - j| (p_i = i + S - L)
    added to the scaled scores: the output equals spec.sdpa with spec.alibi_bias as the
    additive mask; gradients (float64/32) equal the VJP (the bias is a constant)."""
    with probe_saw(target, "alibi"):
        return _alibi_equivalence(target, case)


def _alibi_equivalence(target: Target, case: FlashCase) -> float:
    heads_first = case.heads_first()
    biased = spec.sdpa(heads_first.query, heads_first.key, heads_first.value,
                       additive_mask=heads_first.additive_mask, scale=case.scale).output.transpose(0, 2, 1, 3)
    call = run_flash(target, case)
    where = ~case.empty_rows()[None, :, None, None]
    ratio = compare_values("output with alibi_slopes", call.output, biased, allowed_output(target, case),
                           where=where).ratio
    ratio = max(ratio, check_output(target, case, call.output).ratio)
    if _grads_too(target):
        ratio = max(ratio, check_gradients(target, case))
    return ratio


@conformance_property(
    "lse_agreement", level="flash", section="spec.flash (LSE)",
    cases=lambda t: _cases(t, window=None, softcap=None, alibi=None),
    directed=lambda t: _directed(t),
    requires=("flash:lse",),
)
def test_lse_agreement(target: Target, case: FlashCase) -> float:
    """return_attn_probs=True returns (output, softmax_lse (B, N, L), ...): the LSE equals the
    oracle's natural-log log Σ_j exp(score_ij) over the attended keys (capped, biased scores)
    within k × the naive same-precision error plus a floor at the row's largest score (and the
rounding of the dtype it is returned in: FlashAttention-2's is float32); -inf
    (FlashAttention-2's +inf is read as -inf) in rows attending no key; the output is the oracle's."""
    call = run_flash(target, case, lse=True)
    ratio = check_output(target, case, call.output).ratio
    return max(ratio, check_lse(target, case, call.lse, stored=call.lse_dtype).ratio)


@conformance_property(
    "split_merge", level="flash", section="spec.merge_partials",
    cases=lambda t: _cases(t, causal=False, softcap=None, split=True),
    directed=lambda t: _directed(t, split=True),
    requires=("flash:lse",),
    skip_reason=lambda t: skip_unless(not t.caps.self_attention_lengths, "self_attention_lengths declares L == S only, and "
                   "each key split has fewer keys than queries")
    or skip_unless(not t.caps.causal_only, "causal_only declares causal calls only, and the merge of key "
                   "splits is checked without causal"),
)
def test_split_merge(target: Target, case: FlashCase) -> float:
    """Attention over keys [0, t) and [t, S) (t drawn from the case), merged with their LSEs
    by spec.merge_partials (lse = log(e^lse1 + e^lse2), out = Σ e^(lse_i - lse)·out_i), equals
    attention over all S keys: output and LSE (no causal, window or ALiBi: they depend on S)."""
    case = case.replace(causal=False, window=(-1, -1), alibi_slopes=None)
    m = target.caps.seq_multiple or 1  # lengths a multiple of a block: cut between blocks
    t = m * (1 + int(np.abs(case.key).sum() * 1e3) % (case.S // m - 1))
    parts = [case.replace(key=case.key[:, :t], value=case.value[:, :t]),
             case.replace(key=case.key[:, t:], value=case.value[:, t:])]
    calls = [run_flash(target, part, lse=True) for part in parts]
    merged = spec.merge_partials(calls[0].output, calls[0].lse, calls[1].output, calls[1].lse)
    ref = oracle(case)
    refs = [oracle(part) for part in parts]
    # An output error e_i and an LSE error d_i of part i move the merged output by about
    # w_i·e_i + w_i·|out_i|·(d_1 + d_2), w_i = exp(lse_i - lse) its share of the mass.
    shares = [np.exp(r.lse - ref.lse).transpose(0, 2, 1)[..., None] for r in refs]   # (B, L, N, 1)
    stored = [c.lse_dtype for c in calls]
    lse_err = sum(allowed_lse(target, p, r, stored=d) for p, r, d in zip(parts, refs, stored, strict=True))
    lse_err = lse_err.transpose(0, 2, 1)[..., None]
    allowed = sum(w * (allowed_output(target, p, r) + np.abs(r.output) * lse_err)
                  for w, p, r in zip(shares, parts, refs, strict=True))
    ratio = compare_values(f"merged output of key splits [0, {t}) and [{t}, {case.S})", merged.output,
                           ref.output, allowed).ratio
    lse_allowed = sum(np.exp(r.lse - ref.lse) * allowed_lse(target, p, r, stored=d)
                      for p, r, d in zip(parts, refs, stored, strict=True))
    return max(ratio, compare_values("merged softmax_lse", merged.lse, ref.lse, lse_allowed).ratio)


def _with_sinks(target: Target, **kwargs: Any) -> Any:
    return _cases(target, sinks=True, **kwargs)


@conformance_property(
    "sink_agreement", level="flash", section="spec.flash (sinks)",
    cases=lambda t: _with_sinks(t, window=None, softcap=None, alibi=None),
    directed=lambda t: _directed(t, sinks=True),
    requires=("flash:sinks",),
)
def test_sink_agreement(target: Target, case: FlashCase) -> float:
    """sinks (N,), one learned logit per query head, join every row's softmax denominator
    and carry no value: the output equals spec.flash_attention(sinks=...) (weights
    exp(s_ij) / (exp(sink_h) + Σ_j exp(s_ij)), the sink compared with the final scores,
    window, softcap and ALiBi drawn too); a row attending no key gives 0 (all its weight is
    on the sink); sinks far above the scores stay finite; gradients (float64/32) equal the VJP."""
    with probe_saw(target, "sinks"):
        ratio = check_output(target, case, run_flash(target, case).output).ratio
        if _grads_too(target):
            ratio = max(ratio, check_gradients(target, case))
        return ratio


def _sink_as_key(case: FlashCase, scale: float) -> FlashCase:
    """The same problem with each sink as a key prepended at index 0: one more head dim
    (q' = [q, 1], k' = [k, 0], k_sink = [0, sink_h / scale]), kv heads repeated to N (one
    sink key per query head), a zero value; prepending keeps the bottom-right causal rule."""
    B, L, N, E = case.query.shape
    group = N // case.K
    key = np.repeat(case.key, group, axis=2)                                   # (B, S, N, E)
    value = np.repeat(case.value, group, axis=2)                               # (B, S, N, Ev)
    sink_key = np.zeros((B, 1, N, E + 1))
    sink_key[..., E] = case.sinks / scale
    query = np.concatenate([case.query, np.ones((B, L, N, 1))], axis=-1)
    key = np.concatenate([sink_key, np.concatenate([key, np.zeros((*key.shape[:3], 1))], axis=-1)], axis=1)
    value = np.concatenate([np.zeros((B, 1, N, case.Ev)), value], axis=1)
    if case.Ev == E:  # keep Ev == E: a zero value column, dropped from the output
        value = np.concatenate([value, np.zeros((*value.shape[:3], 1))], axis=-1)
    return case.replace(query=query, key=key, value=value, sinks=None, scale=scale,
                        notes=(*case.notes, "sinks as a leading key"))


@conformance_property(
    "sink_equivalence", level="flash", section="spec.flash (sinks)",
    cases=lambda t: _with_sinks(t),
    directed=lambda t: _directed(t, sinks=True),
    requires=("flash:sinks",),
    skip_reason=lambda t: skip_unless(t.caps.custom_scale, "the sink key's logit needs an explicit softmax_scale"),
)
def test_sink_equivalence(target: Target, case: FlashCase) -> float:
    """A sink is an extra key with a zero value and a fixed logit: the output with sinks
    equals the implementation's own output without sinks on keys with one key prepended
    (one more head dim: q' = [q, 1], k_sink = [0, sink_h / scale], kv heads repeated, value
    0; softmax_scale a power of two so sink_h / scale is exact; no window, softcap or ALiBi:
    they would move or bend that key). Rows that see no key are 0 either way."""
    scale = float(2.0 ** round(np.log2(1.0 / np.sqrt(case.E))))
    case = case.replace(scale=scale)
    call = run_flash(target, case)
    ratio = check_output(target, case, call.output).ratio
    extra = _sink_as_key(case, scale)
    if np.abs(extra.key).max() > 60000 or outside_declarations(target, extra):
        return ratio                                       # the sink key is not expressible here
    other = run_flash(target, extra)
    other_output = other.output[..., :case.Ev]
    rows = np.ones(case.L, dtype=bool)
    if case.causal:
        rows[: max(case.L - case.S - 1, 0)] = False        # no key in either spelling: 0 in both
    where = np.broadcast_to(rows[None, :, None, None], call.output.shape)
    mine, theirs = oracle(case).output, oracle(extra).output[..., :case.Ev]
    allowed_extra = allowed_output(target, extra)[..., :case.Ev]
    sides = [Side("the call with sinks", call.output, mine, allowed_output(target, case), where, "sinks argument"),
             Side("the call with the sinks as a leading key", other_output, theirs, allowed_extra, where,
                  "plain attention")]
    allowed = allowed_output(target, case) + allowed_extra
    return max(ratio, compare_equivalent("output with sinks vs the sinks as a leading key (value 0)",
                                         *sides, allowed, where=where).ratio)
