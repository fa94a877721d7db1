"""``varlen_cases`` and ``kvcache_cases`` reach the cases their properties need (empty and
one-token sequences, page sizes that do and do not divide the lengths, shuffled pages,
room past the valid rows) and stay inside the declared capabilities."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from conformance.strategies.varlen import kvcache_cases, varlen_cases
from implementations.base import Capabilities

NARROW = Capabilities(gqa=False, different_v_dim=False, causal=None, kv_paged=False, kv_append=False,
                      custom_scale=False)


def _collect(strategy, n: int = 300) -> list:
    seen: list = []

    @settings(max_examples=n, deadline=None, database=None)
    @given(strategy)
    def collect(case) -> None:
        seen.append(case)

    collect()
    return seen


def test_varlen_cases_reach_empty_and_one_token_sequences():
    seen = _collect(varlen_cases())
    lengths = [pair for case in seen for pair in case.lengths()]
    assert any(L == 0 for L, _ in lengths) and any(S == 0 for _, S in lengths), "no empty sequence"
    assert any(L == 1 for L, _ in lengths) and any(S == 1 for _, S in lengths), "no one-token sequence"
    assert any(L > S for L, S in lengths) and any(L < S for L, S in lengths)
    assert any(case.B >= 3 for case in seen) and any(case.causal for case in seen)
    assert any(case.K < case.N for case in seen) and any(case.E != case.Ev for case in seen)
    for case in seen:
        assert case.cu_seqlens_q[0] == 0 and case.cu_seqlens_q[-1] == case.query.shape[0]
        assert case.cu_seqlens_k[-1] == case.key.shape[0] == case.value.shape[0]


def test_kvcache_cases_reach_pages_that_do_and_do_not_divide_the_lengths():
    seen = _collect(kvcache_cases(paged=True))
    divides = [S % case.page_size == 0 for case in seen for S in case.valid_lengths() if S]
    assert any(divides) and not all(divides)
    assert any(list(case.page_order) != sorted(case.page_order) for case in seen), "pages never shuffled"
    assert any(len(case.page_order) > case.B * (case.S_cache // case.page_size) for case in seen), "no spare page"
    assert any(0 in case.cache_seqlens for case in seen) and any(case.S_new for case in seen)
    assert any(case.S_cache > max(case.valid_lengths()) for case in seen), "no room past the valid rows"
    for case in seen:
        assert case.S_cache % case.page_size == 0 and max(case.valid_lengths()) <= case.S_cache
        assert sorted(case.page_order) == list(range(len(case.page_order)))


def test_cases_stay_inside_narrow_capabilities():
    for case in _collect(varlen_cases(caps=NARROW), 100):
        assert case.K == case.N and case.E == case.Ev and not case.causal and case.scale is None
    for case in _collect(kvcache_cases(caps=NARROW), 100):
        assert case.K == case.N and case.E == case.Ev and not case.causal and case.k_new is None
        assert not case.paged


def test_impossible_arguments_raise_at_once():
    with pytest.raises(InvalidArgument, match="kv_paged"):
        kvcache_cases(caps=NARROW, paged=True)
    with pytest.raises(InvalidArgument, match="kv_append"):
        kvcache_cases(caps=NARROW, append=True)
    with pytest.raises(InvalidArgument, match="causal=True"):
        varlen_cases(caps=NARROW, causal=True)
    with pytest.raises(InvalidArgument, match="max_batch"):
        varlen_cases(max_batch=0)


@given(st.data())
@settings(max_examples=20, deadline=None, database=None)
def test_values_are_stored_in_the_dtype(data):
    import numpy as np

    from spec.emulate import round_to

    case = data.draw(varlen_cases(dtype="bfloat16"))
    assert np.array_equal(case.query, round_to(case.query, "bfloat16"))
