"""``kvcache_cases`` draws the KV cache's own options (rotary tables, cache_batch_idx,
cache_leftpad, num_splits) only where declared and inside every declaration, in cases
the spec calls valid and FlashAttention would accept; the directed examples likewise."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis.errors import InvalidArgument

from conformance.strategies.kvcache_features import CACHE_FEATURES, LARGE_LOGITS, kvcache_feature_directed
from conformance.strategies.varlen import kvcache_cases
from implementations.base import Capabilities
from spec.emulate import round_to

ALL = Capabilities(causal="lower_right", kvcache_features=frozenset({"window", "softcap", "alibi", "lse",
                                                                      *CACHE_FEATURES}))
DRAWN = {name: None for name in ("window", "softcap", "alibi", "rotary", "cache_batch_idx", "cache_leftpad",
                                 "num_splits")}


def _collect(strategy, n: int = 200) -> list:
    seen: list = []

    @settings(max_examples=n, deadline=None, database=None)
    @given(strategy)
    def collect(case) -> None:
        seen.append(case)

    collect()
    return seen


@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_every_option_is_drawn_in_valid_cases(dtype):
    seen = _collect(kvcache_cases(caps=ALL, dtype=dtype, **DRAWN), 300)
    features = [case.attrs()["kvcache_features"] for case in seen]
    for name in CACHE_FEATURES:
        assert any(name in f for f in features), f"{name} never drawn"
    assert any({"rotary", "cache_batch_idx", "cache_leftpad"} <= f for f in features), "never combined"
    for case in seen:
        case.oracle()                                                  # the spec calls it valid
        if case.rotary_cos is not None:
            assert case.k_new is not None and 2 <= 2 * case.rotary_cos.shape[1] <= case.E
            assert case.rotary_cos.shape[0] >= case.S_cache            # FlashAttention: seqlen_ro >= capacity
            assert np.array_equal(case.rotary_cos, round_to(case.rotary_cos, dtype))   # handed over in the dtype
            if tuple(case.window) != (-1, -1):                         # FlashAttention keeps it local
                assert any(0 <= side < case.S_cache for side in case.window)
        if case.cache_batch_idx is not None:
            assert len(set(case.cache_batch_idx)) == case.B <= case.k_cache.shape[0] and not case.paged
        if case.cache_leftpad is not None:
            assert all(0 <= p <= n for p, n in zip(case.cache_leftpad, case.cache_seqlens, strict=True))
        if case.num_splits is not None:
            assert 2 <= case.num_splits <= 4
    assert any(c.num_splits is not None and np.abs(c.query).max() > LARGE_LOGITS for c in seen), "no large logits"
    assert any(c.rotary_cos is not None and c.rotary_interleaved for c in seen)
    assert any(c.rotary_cos is not None and not c.rotary_interleaved for c in seen)


def test_nothing_undeclared_or_unasked_is_drawn():
    plain = Capabilities(causal="lower_right", kvcache_features=frozenset({"window"}))
    for case in _collect(kvcache_cases(caps=plain, **DRAWN), 100):
        assert not case.attrs()["kvcache_features"] - {"window"}
    for case in _collect(kvcache_cases(caps=ALL), 100):              # the options' defaults: not drawn
        assert not case.attrs()["kvcache_features"] & set(CACHE_FEATURES)


def test_rotary_dims_follow_the_declared_multiple_and_need_a_wide_head():
    caps = ALL.replace(rotary_dim_multiple=4, head_dims=(2, 8))
    seen = _collect(kvcache_cases(caps=caps, rotary=True), 100)
    assert all(c.E == 8 and (2 * c.rotary_cos.shape[1]) % 4 == 0 for c in seen)
    assert {2 * c.rotary_cos.shape[1] for c in seen} == {4, 8}
    impl_reasons = ALL.replace(rotary_dim_multiple=16)
    from implementations.base import Implementation

    impl = Implementation(name="k", kvcache=lambda *a, **k: None, capabilities=impl_reasons)
    assert impl.not_supported_reasons({"level": "kvcache", "rotary_dim": 8}) == [
        "rotary_dim=8 is not a multiple of rotary_dim_multiple=16"]


def test_paged_cases_never_carry_batch_idx_or_leftpad():
    for case in _collect(kvcache_cases(caps=ALL, paged=True, **DRAWN), 100):
        assert case.cache_batch_idx is None and case.cache_leftpad is None
    with pytest.raises(InvalidArgument, match="pages neither"):
        kvcache_cases(caps=ALL, paged=True, cache_leftpad=True)


def test_rotary_needs_appended_keys():
    no_append = ALL.replace(kv_append=False)
    for case in _collect(kvcache_cases(caps=no_append, rotary=None), 60):
        assert case.rotary_cos is None and case.k_new is None


@pytest.mark.parametrize("feature", CACHE_FEATURES)
def test_directed_examples_use_their_option_inside_the_declarations(feature):
    cases = kvcache_feature_directed(feature, caps=ALL)
    assert cases and all(feature in c.attrs()["kvcache_features"] for c in cases)
    for case in cases:
        case.oracle()
    narrow = ALL.replace(causal_only=True, gqa=False, head_dims=(16,), rotary_dim_multiple=16)
    for case in kvcache_feature_directed(feature, caps=narrow):
        assert case.causal and case.N == case.K and case.E == 16
        assert case.rotary_cos is None or case.rotary_cos.shape[1] == 8


def test_the_split_example_overflows_exp_without_the_max():
    [huge, _] = kvcache_feature_directed("num_splits", caps=ALL)
    assert huge.oracle().lse.max() > 709                                # exp(lse) is inf in float64
