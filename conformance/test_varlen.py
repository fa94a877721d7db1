"""Packed variable-length attention and KV-cache decoding (spec.varlen, spec.kvcache).

The varlen level is FlashAttention's ``flash_attn_varlen_func``; the kvcache level its
``flash_attn_with_kvcache`` (``implementations.base``). How a case is called and bounded
is in ``conformance.calls.varlen`` and ``conformance.calls.kvcache``; the cases come from
``conformance.strategies.varlen``.
"""

from __future__ import annotations

import numpy as np

from spec.emulate import round_to
from conformance.calls.cache_options import (
    cache_rows,
    check_cache_after,
    check_lse_against_oracle,
    rotated_new_keys,
    rotated_query,
)
from conformance.directed.helpers import skip_unless
from conformance.directed.shrink import remember_arguments
from conformance.core.target import Target
from conformance.harness.runner import conformance_property
from conformance.strategies.kvcache_features import kvcache_feature_directed, rotary_multiple
from conformance.strategies.varlen import (
    kvcache_cases,
    kvcache_directed,
    kvcache_head_dims,
    varlen_cases,
    varlen_directed,
)
from conformance.calls.kvcache import (
    KVCacheCase,
    assert_same_cache,
    check_kvcache_against_oracle,
    kvcache_bounds,
    kvcache_lse_bounds,
    run_kvcache,
)
from conformance.calls.varlen import (
    VarlenCase,
    check_varlen_against_oracle,
    compare_pair,
    run_varlen,
    run_varlen_lse,
    varlen_bounds,
    varlen_lse_bounds,
)

#: FlashAttention's options drawn half the time where declared (window, softcap, ALiBi).
DRAWN = {"window": None, "softcap": None, "alibi": None}
OPTIONS = ("window", "softcap", "alibi")


def _varlen(target: Target, **kwargs: object) -> object:
    return varlen_cases(dtype=target.dtype, device=target.device, caps=target.caps, **kwargs)


def _kvcache(target: Target, **kwargs: object) -> object:
    return kvcache_cases(dtype=target.dtype, device=target.device, caps=target.caps, **kwargs)


def _declared_options(features: frozenset[str], level: str) -> str | None:
    return skip_unless(bool(set(OPTIONS) & set(features)),
                       f"none of window, softcap, alibi declared at the {level} level ({level}_features)")


def _with_options(cases: list, features: frozenset[str]) -> list:
    """The directed cases with each declared option at its edge: window (0, 0) and (1, 0),
    a cap far below the logits, ALiBi slopes of both signs (N,)."""
    out = []
    for case in cases:
        N = case.N
        variants = []
        if "window" in features:
            variants += [({"window": (0, 0)}, "window (0, 0)"), ({"window": (1, 0)}, "window (1, 0)")]
        if "softcap" in features:
            variants.append(({"softcap": 0.125}, "softcap 0.125"))
        if "alibi" in features:
            variants.append(({"alibi_slopes": np.array([0.5, -0.25, 1.0, 0.125] * N)[:N]}, "ALiBi slopes"))
        for changes, what in variants:  # a case's name says which option it adds
            out.append(case.replace(**changes, notes=case.named_with(what)))
    return remember_arguments(out, {}) if out and isinstance(out[0], VarlenCase) else out


def _varlen_directed(target: Target) -> list[VarlenCase]:
    # for directed.shrink: the varlen strategy's bounds (batch, lengths)
    return remember_arguments(varlen_directed(dtype=target.dtype, device=target.device, caps=target.caps), {})


def _kvcache_directed(target: Target, paged: bool = False, **arguments: object) -> list[KVCacheCase]:
    # for directed.shrink: the property's kvcache_cases arguments (``arguments``, pages or not)
    return remember_arguments(kvcache_directed(dtype=target.dtype, device=target.device, caps=target.caps,
                                               paged=paged), {"paged": paged, **arguments})


@conformance_property("varlen_agreement", level="varlen", section="spec.varlen_attention",
                      cases=_varlen, directed=_varlen_directed)
def test_varlen_agreement(target: Target, case: VarlenCase) -> float:
    """The packed output equals spec.varlen_attention (each sequence its own problem:
    its own L and S, bottom-right causal, empty and one-token sequences included) under
    the tolerance rule applied sequence by sequence."""
    return check_varlen_against_oracle(target, case, run_varlen(target, case))


@conformance_property("varlen_equivalence", level="varlen", section="spec.varlen_attention (packing)",
                      cases=lambda t: _varlen(t, **DRAWN), directed=_varlen_directed)
def test_varlen_equivalence(target: Target, case: VarlenCase) -> float:
    """Packing changes nothing: each sequence's rows of the packed output equal the
    implementation's output for that sequence called alone (cu_seqlens [0, L_b], [0,
    S_b]); a query that reads a neighbour's keys differs from its call alone. Each call
    is within the tolerance rule of the oracle, so they may differ by twice it."""
    packed = run_varlen(target, case)
    expected, allowed, live = varlen_bounds(target, case)
    worst = 0.0
    for b, (rows, _) in enumerate(case.sequences()):
        if rows.stop == rows.start:
            continue
        alone = run_varlen(target, case.alone(b))
        worst = max(worst, compare_pair(target, f"sequence {b} packed vs alone", packed[rows], alone,
                                        allowed[rows], live[rows], expected=expected[rows],
                                        names=("the packed call", f"the call of sequence {b} alone"),
                                        paths=("packing (cu_seqlens)", "single-sequence call")))
    return worst


@conformance_property("kvcache_agreement", level="kvcache", section="spec.kvcache_attention",
                      cases=lambda t: _kvcache(t), directed=_kvcache_directed)
def test_kvcache_agreement(target: Target, case: KVCacheCase) -> float:
    """The output with a contiguous cache, cache_seqlens and appended keys equals
    spec.kvcache_attention (sequence b attends its first cache_seqlens[b] + S_new keys,
    bottom-right causal at that length) under the tolerance rule."""
    return check_kvcache_against_oracle(target, case, run_kvcache(target, case).output)


@conformance_property("kvcache_equivalence", level="kvcache", section="spec.kvcache_attention (cache_seqlens)",
                      cases=lambda t: _kvcache(t, **DRAWN), directed=lambda t: _kvcache_directed(t, **DRAWN))
def test_kvcache_equivalence(target: Target, case: KVCacheCase) -> float:
    """A cache with cache_seqlens is plain attention over its valid prefix: each
    sequence's output equals the implementation's output for that sequence alone with a
    cache of exactly its cache_seqlens[b] + S_new valid rows (no cache_seqlens, nothing
    appended), and the appended keys and values land at rows cache_seqlens[b] ..
    cache_seqlens[b] + S_new - 1 of the cache (written in place, exactly)."""
    call = run_kvcache(target, case)
    ref = case.oracle()
    valid = case.valid_lengths()
    assert_same_cache("k_cache after the call", call.k_cache, ref.k_cache, valid)
    assert_same_cache("v_cache after the call", call.v_cache, ref.v_cache, valid)
    expected, allowed, live = kvcache_bounds(target, case)
    worst = 0.0
    for b, S_b in enumerate(valid):
        prefix = case.replace(query=case.query[b:b + 1], k_cache=ref.k_cache[b:b + 1, :S_b],
                              v_cache=ref.v_cache[b:b + 1, :S_b], cache_seqlens=(S_b,),
                              k_new=None, v_new=None, page_size=None, page_order=None,
                              alibi_slopes=case.sequence_slopes(b))
        alone = run_kvcache(target, prefix).output
        worst = max(worst, compare_pair(target, f"sequence {b} with cache_seqlens vs its valid prefix alone",
                                        call.output[b:b + 1], alone, allowed[b:b + 1], live[b:b + 1],
                                        expected=expected[b:b + 1],
                                        names=("the call with cache_seqlens", f"the call of sequence {b}'s "
                                               "valid prefix alone"),
                                        paths=("cache_seqlens (and append) handling", "plain cache call")))
    return worst


@conformance_property("paged_equivalence", level="kvcache", section="spec.kvcache_attention (block_table)",
                      cases=lambda t: _kvcache(t, paged=True, **DRAWN),
                      directed=lambda t: _kvcache_directed(t, paged=True, **DRAWN),
                      skip_reason=lambda t: skip_unless(t.caps.kv_paged, "paged cache (kv_paged) not declared"))
def test_paged_equivalence(target: Target, case: KVCacheCase) -> float:
    """A paged cache is the contiguous one re-indexed: for any block table (pages
    shuffled, spare pages in between, page sizes that do and do not divide the lengths)
    the output equals the contiguous call's, and the appended keys land in the same
    logical rows (read back through the block table, exactly)."""
    paged = run_kvcache(target, case, paged=True)
    contiguous = run_kvcache(target, case, paged=False)
    valid = case.valid_lengths()
    assert_same_cache("paged k_cache after the call (logical rows)", paged.k_cache, contiguous.k_cache, valid)
    assert_same_cache("paged v_cache after the call (logical rows)", paged.v_cache, contiguous.v_cache, valid)
    expected, allowed, live = kvcache_bounds(target, case)
    return compare_pair(target, "paged output vs contiguous", paged.output, contiguous.output, allowed, live,
                        expected=expected, names=("the paged call", "the contiguous call"),
                        paths=("paged cache (block_table) path", "contiguous cache path"))



@conformance_property("varlen_feature_agreement", level="varlen", section="spec.varlen_attention (options)",
                      cases=lambda t: _varlen(t, **DRAWN, at_least_one=True),
                      directed=lambda t: _with_options(_varlen_directed(t), t.caps.varlen_features),
                      skip_reason=lambda t: _declared_options(t.caps.varlen_features, "varlen"))
def test_varlen_feature_agreement(target: Target, case: VarlenCase) -> float:
    """With window_size, softcap or alibi_slopes ((N,) or (B, N): row b for sequence b) the
    packed output equals spec.varlen_attention: each sequence is spec.flash_attention on its
    slices, the window and ALiBi at its own aligned position p_i = i + S_b - L_b, the cap
    before bias and masks; the flash level's tolerance rule, sequence by sequence."""
    return check_varlen_against_oracle(target, case, run_varlen(target, case))


@conformance_property("varlen_lse_agreement", level="varlen", section="spec.varlen_attention (LSE)",
                      cases=lambda t: _varlen(t, **DRAWN),
                      directed=_varlen_directed,
                      skip_reason=lambda t: skip_unless("lse" in t.caps.varlen_features,
                                                        "LSE output (varlen_features lse) not declared"))
def test_varlen_lse_agreement(target: Target, case: VarlenCase) -> float:
    """return_attn_probs=True returns (output, softmax_lse (N, T_q), ...): each sequence's
    rows hold the natural-log LSE over that sequence's attended keys only (capped, biased
    scores), -inf (FlashAttention-2's +inf read as -inf) in rows attending no key; the
    output is the oracle's."""
    output, lse, stored = run_varlen_lse(target, case)
    ratio = check_varlen_against_oracle(target, case, output)
    return max(ratio, check_lse_against_oracle("softmax_lse (N, T_q)", lse, *varlen_lse_bounds(target, case, stored)))


@conformance_property("kvcache_feature_agreement", level="kvcache", section="spec.kvcache_attention (options)",
                      cases=lambda t: _kvcache(t, **DRAWN, at_least_one=True),
                      directed=lambda t: remember_arguments(_with_options(_kvcache_directed(t), t.caps.kvcache_features),
                                                            {**DRAWN, "at_least_one": True}),
                      skip_reason=lambda t: _declared_options(t.caps.kvcache_features, "kvcache"))
def test_kvcache_feature_agreement(target: Target, case: KVCacheCase) -> float:
    """With window_size, softcap or alibi_slopes the decoding output equals
    spec.kvcache_attention: sequence b is spec.flash_attention on its first cache_seqlens[b]
    + S_new keys, the window and ALiBi aligned at p_i = i + S_b - L (the valid length, not
    the capacity nor the appended keys alone), the cap before bias and masks."""
    return check_kvcache_against_oracle(target, case, run_kvcache(target, case).output)


@conformance_property("kvcache_lse_agreement", level="kvcache", section="spec.kvcache_attention (LSE)",
                      cases=lambda t: _kvcache(t, **DRAWN),
                      directed=lambda t: _kvcache_directed(t, **DRAWN),
                      skip_reason=lambda t: skip_unless("lse" in t.caps.kvcache_features,
                                                        "LSE output (kvcache_features lse) not declared"))
def test_kvcache_lse_agreement(target: Target, case: KVCacheCase) -> float:
    """return_softmax_lse=True returns (output, softmax_lse (B, N, L)): the natural-log LSE
    over each sequence's valid keys only (stale cache rows past cache_seqlens[b] + S_new
    excluded), -inf in rows attending no key; the output is the oracle's."""
    call = run_kvcache(target, case, lse=True)
    ratio = check_kvcache_against_oracle(target, case, call.output)
    return max(ratio, check_lse_against_oracle("softmax_lse (B, N, L)", call.lse,
                                               *kvcache_lse_bounds(target, case, call.lse_dtype)))


# -- the KV cache's own options: rotary, cache_batch_idx, cache_leftpad, num_splits ----------

#: The cache options drawn half the time where declared (each property forces its own).
CACHE_DRAWN = {"rotary": None, "cache_batch_idx": None, "cache_leftpad": None, "num_splits": None}


def _cache_cases(target: Target, feature: str) -> object:
    return _kvcache(target, **DRAWN, **{**CACHE_DRAWN, feature: True})


def _cache_directed(target: Target, feature: str) -> list[KVCacheCase]:
    # for directed.shrink: the arguments of _cache_cases
    return remember_arguments(kvcache_feature_directed(feature, dtype=target.dtype, device=target.device,
                                                       caps=target.caps), {**DRAWN, **CACHE_DRAWN, feature: True})


def _cache_feature_missing(target: Target, feature: str) -> str | None:
    """Why ``feature`` cannot be drawn for ``target`` (None: it can)."""
    caps = target.caps
    if feature not in caps.kvcache_features:
        return f"{feature} not declared at the kvcache level (kvcache_features)"
    if feature == "rotary":
        if not caps.kv_append:
            return "rotary applies only with appended keys, and kv_append is not declared"
        if max(kvcache_head_dims(caps)) < rotary_multiple(caps):
            return f"no declared head dim holds a rotary dim (a multiple of {rotary_multiple(caps)})"
    return None


def _cache_checked(target: Target, case: KVCacheCase) -> float:
    """The call against spec.kvcache_attention: the output, then both caches."""
    call = run_kvcache(target, case)
    ratio = check_kvcache_against_oracle(target, case, call.output)
    ref = case.oracle()
    check_cache_after("k_cache after the call", call.k_cache, ref.k_cache, case, keys=True)
    check_cache_after("v_cache after the call", call.v_cache, ref.v_cache, case, keys=False)
    return ratio


@conformance_property("kvcache_rotary_agreement", level="kvcache", section="spec.kvcache_attention (rotary)",
                      cases=lambda t: _cache_cases(t, "rotary"), directed=lambda t: _cache_directed(t, "rotary"),
                      skip_reason=lambda t: _cache_feature_missing(t, "rotary"))
def test_kvcache_rotary_agreement(target: Target, case: KVCacheCase) -> float:
    """With rotary_cos/rotary_sin (rotary_interleaved True: pairs (2j, 2j + 1); False: (j,
    j + R/2)) q and the appended keys are rotated at their cache positions before the
    attention: new key i at cache_seqlens[b] + i, query i there too when causal or local,
    else every query at cache_seqlens[b]; the output equals spec.kvcache_attention under
    the tolerance rule, and the cache holds the rotated keys (within a rotation's
    rounding) and the values as given."""
    return _cache_checked(target, case)


@conformance_property("kvcache_rotary_equivalence", level="kvcache",
                      section="spec.kvcache_attention (rotary positions)",
                      cases=lambda t: _cache_cases(t, "rotary"), directed=lambda t: _cache_directed(t, "rotary"),
                      skip_reason=lambda t: _cache_feature_missing(t, "rotary"))
def test_kvcache_rotary_equivalence(target: Target, case: KVCacheCase) -> float:
    """Rotary in the call equals rotating before it: the output with rotary_cos/rotary_sin
    equals the implementation's output for the same step without them, its q and new
    keys rotated beforehand by spec.apply_rotary at the positions the contract gives
    (rounded to the dtype), within twice the tolerance rule."""
    plain = case.replace(query=round_to(rotated_query(case), case.dtype),
                         k_new=round_to(rotated_new_keys(case), case.dtype), rotary_cos=None, rotary_sin=None)
    rotated = run_kvcache(target, case).output
    beforehand = run_kvcache(target, plain).output
    expected, allowed, live = kvcache_bounds(target, case)
    return compare_pair(target, "rotary in the call vs q and k rotated before it", rotated, beforehand, allowed,
                        live, expected=expected,
                        names=("the call with rotary_cos/rotary_sin", "the call with q and k rotated beforehand"),
                        paths=("rotary embedding in the call", "plain decoding call"))


@conformance_property("kvcache_batch_idx_agreement", level="kvcache",
                      section="spec.kvcache_attention (cache_batch_idx)",
                      cases=lambda t: _cache_cases(t, "cache_batch_idx"),
                      directed=lambda t: _cache_directed(t, "cache_batch_idx"),
                      skip_reason=lambda t: _cache_feature_missing(t, "cache_batch_idx"))
def test_kvcache_batch_idx_agreement(target: Target, case: KVCacheCase) -> float:
    """With cache_batch_idx, sequence b reads and writes cache row cache_batch_idx[b] of a
    cache holding more rows than sequences: the output equals spec.kvcache_attention, the
    appended keys and values land in the named rows at cache_seqlens[b] (exactly; rotated
    keys within a rotation's rounding), and the rows no sequence names are untouched."""
    return _cache_checked(target, case)


@conformance_property("kvcache_leftpad_agreement", level="kvcache", section="spec.kvcache_attention (cache_leftpad)",
                      cases=lambda t: _cache_cases(t, "cache_leftpad"),
                      directed=lambda t: _cache_directed(t, "cache_leftpad"),
                      skip_reason=lambda t: _cache_feature_missing(t, "cache_leftpad"))
def test_kvcache_leftpad_agreement(target: Target, case: KVCacheCase) -> float:
    """With cache_leftpad, sequence b attends only its keys cache_leftpad[b] ..
    cache_seqlens[b] + S_new - 1, and nothing else moves: the bottom-right diagonal, the
    window and ALiBi stay in cache indices (p_i = S_b - L + i), the new keys go to
    cache_seqlens[b]; the output equals spec.kvcache_attention and the caches the spec's."""
    return _cache_checked(target, case)


@conformance_property("kvcache_leftpad_equivalence", level="kvcache",
                      section="spec.kvcache_attention (cache_leftpad)",
                      cases=lambda t: _cache_cases(t, "cache_leftpad"),
                      directed=lambda t: _cache_directed(t, "cache_leftpad"),
                      skip_reason=lambda t: _cache_feature_missing(t, "cache_leftpad"))
def test_kvcache_leftpad_equivalence(target: Target, case: KVCacheCase) -> float:
    """A left pad of a is a cache that starts a rows later: each sequence's output equals
    the implementation's output for that sequence alone, its cache row rolled up by a
    (the pad moved past the capacity), cache_seqlens[b] - a, no pad, and the rotary
    tables rolled up by a as well, within twice the tolerance rule."""
    call = run_kvcache(target, case)
    expected, allowed, live = kvcache_bounds(target, case)
    worst = 0.0
    pads = case.cache_leftpad or (0,) * case.B
    for b, row in enumerate(cache_rows(case)):
        a = pads[b]
        tables = {}
        if case.rotary_cos is not None:
            tables = {"rotary_cos": np.roll(case.rotary_cos, -a, axis=0),
                      "rotary_sin": np.roll(case.rotary_sin, -a, axis=0)}
        alone = case.replace(
            query=case.query[b:b + 1], k_cache=np.roll(case.k_cache[row:row + 1], -a, axis=1),
            v_cache=np.roll(case.v_cache[row:row + 1], -a, axis=1), cache_seqlens=(case.cache_seqlens[b] - a,),
            k_new=None if case.k_new is None else case.k_new[b:b + 1],
            v_new=None if case.v_new is None else case.v_new[b:b + 1], cache_batch_idx=None, cache_leftpad=None,
            alibi_slopes=case.sequence_slopes(b), **tables)
        output = run_kvcache(target, alone).output
        worst = max(worst, compare_pair(target, f"sequence {b} with cache_leftpad={a} vs its cache rolled up by {a}",
                                        call.output[b:b + 1], output, allowed[b:b + 1], live[b:b + 1],
                                        expected=expected[b:b + 1],
                                        names=("the call with cache_leftpad", f"the call of sequence {b} with its "
                                               "cache starting at the pad"),
                                        paths=("cache_leftpad handling", "plain cache call")))
    return worst


@conformance_property("kvcache_num_splits_equivalence", level="kvcache",
                      section="spec.kvcache_attention (num_splits)",
                      cases=lambda t: _cache_cases(t, "num_splits"),
                      directed=lambda t: _cache_directed(t, "num_splits"),
                      skip_reason=lambda t: _cache_feature_missing(t, "num_splits"))
def test_kvcache_num_splits_equivalence(target: Target, case: KVCacheCase) -> float:
    """Split-KV decoding changes nothing: the output with num_splits = n (2 to 4: the keys
    in n chunks, the partials merged by their LSEs) equals the implementation's output
    with num_splits = 1 within twice the tolerance rule, logits beyond exp's range
    included; with the LSE declared, the returned LSEs agree too."""
    lse = "lse" in target.caps.kvcache_features
    split = run_kvcache(target, case, lse=lse)
    whole = run_kvcache(target, case.replace(num_splits=1), lse=lse)
    expected, allowed, live = kvcache_bounds(target, case)
    ratio = compare_pair(target, f"num_splits={case.num_splits} vs num_splits=1", split.output, whole.output,
                         allowed, live, expected=expected,
                         names=(f"the call with num_splits={case.num_splits}", "the call with num_splits=1"),
                         paths=("split-KV merge", "unsplit decoding"))
    if not lse:
        return ratio
    expected_lse, allowed_lse = kvcache_lse_bounds(target, case, split.lse_dtype)
    check_lse_against_oracle(f"softmax_lse with num_splits={case.num_splits}", split.lse, expected_lse, allowed_lse)
    whole_lse = np.where(np.isposinf(whole.lse), -np.inf, whole.lse)
    return max(ratio, check_lse_against_oracle(f"softmax_lse with num_splits={case.num_splits} vs num_splits=1",
                                               split.lse, whole_lse, 2 * allowed_lse))
