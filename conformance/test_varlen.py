"""Packed variable-length attention and KV-cache decoding (spec.varlen, spec.kvcache).

The varlen level is FlashAttention's ``flash_attn_varlen_func``; the kvcache level its
``flash_attn_with_kvcache`` (``implementations.base``). How a case is called and bounded
is in ``conformance.calls.varlen`` and ``conformance.calls.kvcache``; the cases come from
``conformance.strategies.varlen``.
"""

from __future__ import annotations

import numpy as np

from conformance.calls.cache_options import check_lse_against_oracle
from conformance.directed.helpers import skip_unless
from conformance.core.target import Target
from conformance.harness.runner import conformance_property
from conformance.strategies.varlen import (
    kvcache_cases,
    kvcache_directed,
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
            variants += [{"window": (0, 0)}, {"window": (1, 0)}]
        if "softcap" in features:
            variants.append({"softcap": 0.125})
        if "alibi" in features:
            variants.append({"alibi_slopes": np.array([0.5, -0.25, 1.0, 0.125] * N)[:N]})
        out += [case.replace(**changes) for changes in variants]
    return out


def _varlen_directed(target: Target) -> list[VarlenCase]:
    return varlen_directed(dtype=target.dtype, device=target.device, caps=target.caps)


def _kvcache_directed(target: Target, paged: bool = False) -> list[KVCacheCase]:
    return kvcache_directed(dtype=target.dtype, device=target.device, caps=target.caps, paged=paged)


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
                      cases=lambda t: _kvcache(t, **DRAWN), directed=_kvcache_directed)
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
                      directed=lambda t: _kvcache_directed(t, paged=True),
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
                      directed=lambda t: _with_options(_kvcache_directed(t), t.caps.kvcache_features),
                      skip_reason=lambda t: _declared_options(t.caps.kvcache_features, "kvcache"))
def test_kvcache_feature_agreement(target: Target, case: KVCacheCase) -> float:
    """With window_size, softcap or alibi_slopes the decoding output equals
    spec.kvcache_attention: sequence b is spec.flash_attention on its first cache_seqlens[b]
    + S_new keys, the window and ALiBi aligned at p_i = i + S_b - L (the valid length, not
    the capacity nor the appended keys alone), the cap before bias and masks."""
    return check_kvcache_against_oracle(target, case, run_kvcache(target, case).output)


@conformance_property("kvcache_lse_agreement", level="kvcache", section="spec.kvcache_attention (LSE)",
                      cases=lambda t: _kvcache(t, **DRAWN),
                      directed=_kvcache_directed,
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
