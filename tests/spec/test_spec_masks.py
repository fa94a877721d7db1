"""spec.masks: builders, converters and their round trips (spec section: masks)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

import spec
from spec import masks


def test_causal_masks_by_hand():
    np.testing.assert_array_equal(masks.causal_mask(2, 3, "upper_left"), [[1, 0, 0], [1, 1, 0]])
    np.testing.assert_array_equal(masks.causal_mask(2, 3, "lower_right"), [[1, 1, 0], [1, 1, 1]])
    np.testing.assert_array_equal(masks.causal_mask(3, 2, "upper_left"), [[1, 0], [1, 1], [1, 1]])
    # L > S lower_right: the first L - S queries see nothing
    np.testing.assert_array_equal(masks.causal_mask(3, 2, "lower_right"), [[0, 0], [1, 0], [1, 1]])


@given(st.integers(0, 6), st.integers(0, 6))
def test_causal_masks_are_tril(L, S):
    np.testing.assert_array_equal(masks.causal_mask(L, S, "upper_left"), np.tril(np.ones((L, S), bool)))
    np.testing.assert_array_equal(masks.causal_mask(L, S, "lower_right"), np.tril(np.ones((L, S), bool), S - L))


def test_padding_mask():
    np.testing.assert_array_equal(masks.padding_mask([2, 0, 3], 3), [[1, 1, 0], [0, 0, 0], [1, 1, 1]])


def test_sliding_window_masks():
    # window 1: the query itself and one key before it
    np.testing.assert_array_equal(masks.sliding_window_mask(3, 3, 1),
                                  [[1, 0, 0], [1, 1, 0], [0, 1, 1]])
    # (1, 1): a band around the diagonal
    np.testing.assert_array_equal(masks.sliding_window_mask(3, 3, (1, 1)),
                                  [[1, 1, 0], [1, 1, 1], [0, 1, 1]])
    # lower_right, L=2, S=4: query 0 is aligned with key 2
    np.testing.assert_array_equal(masks.sliding_window_mask(2, 4, 1, "lower_right"),
                                  [[0, 1, 1, 0], [0, 0, 1, 1]])
    # a window as long as the sequence is the causal mask
    np.testing.assert_array_equal(masks.sliding_window_mask(4, 6, 10, "lower_right"),
                                  masks.causal_mask(4, 6, "lower_right"))


bool_masks = arrays(bool, array_shapes(min_dims=1, max_dims=4, max_side=4))


@settings(max_examples=50)
@given(bool_masks)
def test_round_trips(attend):
    np.testing.assert_array_equal(masks.from_mha_bool(masks.to_mha_bool(attend)), attend)
    np.testing.assert_array_equal(masks.from_keep_int(masks.to_keep_int(attend)), attend)
    np.testing.assert_array_equal(masks.from_additive(masks.to_additive(attend)), attend)
    for convention in ("attend_bool", "mha_bool", "keep_int"):
        converted = masks.from_canonical(attend, None, convention)
        back, additive = masks.to_canonical(converted, convention)
        assert additive is None
        np.testing.assert_array_equal(back, attend)
    for convention in ("additive", "mha_float"):
        converted = masks.from_canonical(attend, None, convention)
        attend_back, additive = masks.to_canonical(converted, convention)
        assert attend_back is None
        np.testing.assert_array_equal(masks.from_additive(additive), attend)


def test_polarities_in_words():
    attend = np.array([True, False])
    np.testing.assert_array_equal(masks.to_mha_bool(attend), [False, True])      # MHA: True = blocked
    np.testing.assert_array_equal(masks.to_keep_int(attend), [1, 0])            # 1 = keep
    np.testing.assert_array_equal(masks.to_additive(attend), [0.0, -np.inf])    # -inf = blocked


def test_every_convention_gives_the_same_attention():
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 5, 4)), rng.normal(size=(2, 5, 3))
    attend = rng.random((2, 3, 5)) < 0.6
    expected = spec.sdpa(q, k, v, attend_mask=attend).output
    for convention in masks.CONVENTIONS:
        attend_mask, additive_mask = masks.to_canonical(masks.from_canonical(attend, None, convention), convention)
        got = spec.sdpa(q, k, v, attend_mask=attend_mask, additive_mask=additive_mask).output
        np.testing.assert_array_equal(got, expected)


def test_from_canonical_merges_both_masks():
    attend = np.array([[True, False, True]])
    additive = np.array([[0.5, 0.0, -np.inf]])
    np.testing.assert_array_equal(masks.from_canonical(attend, additive, "additive"), [[0.5, -np.inf, -np.inf]])
    with pytest.raises(spec.SpecError, match="other than 0 and -inf"):
        masks.from_canonical(attend, additive, "mha_bool")
    np.testing.assert_array_equal(masks.from_canonical(attend, np.array([[0.0, 0.0, -np.inf]]), "mha_bool"),
                                  [[False, True, True]])
    assert masks.from_canonical(None, None, "keep_int") is None


def test_merge_key_padding_like_multihead_attention():
    B, N, L, S = 2, 3, 2, 4
    rng = np.random.default_rng(1)
    kpm = rng.random((B, S)) < 0.3                          # True = padded
    attn_3d = rng.normal(size=(B * N, L, S))                # row b*N + n
    merged = masks.merge_key_padding(kpm, attn_3d, num_heads=N)
    assert merged.shape == (B, N, L, S)
    for b in range(B):
        for n in range(N):
            expected = attn_3d[b * N + n] + np.where(kpm[b], -np.inf, 0.0)[None, :]
            np.testing.assert_array_equal(merged[b, n], expected)
    attn_2d = rng.random((L, S)) < 0.3
    merged_2d = masks.merge_key_padding(None, attn_2d)
    assert merged_2d.shape == (1, 1, L, S)
    np.testing.assert_array_equal(merged_2d[0, 0], np.where(attn_2d, -np.inf, 0.0))
    float_kpm = np.where(kpm, -np.inf, 0.0)                 # float kpm = bool kpm (#92554)
    np.testing.assert_array_equal(masks.merge_key_padding(float_kpm, None), masks.merge_key_padding(kpm, None))
    assert masks.merge_key_padding(None, None) is None


def test_fully_masked_rows_from_every_source():
    shape = (1, 3, 4)                                        # (N, L, S)
    attend = np.ones((3, 4), bool)
    attend[0] = False
    additive = np.zeros((3, 4))
    additive[1] = -np.inf
    rows = masks.fully_masked_rows(shape, attend, additive, None)
    np.testing.assert_array_equal(rows, [[True, True, False]])
    # lower_right with L > S blocks the first L - S queries
    np.testing.assert_array_equal(masks.fully_masked_rows((1, 3, 1), causal="lower_right"), [[True, True, False]])


def test_streaming_mask_is_the_sink_tokens_plus_the_window():
    """StreamingLLM: keys 0..n-1 always (causally) visible, plus the causal window."""
    got = masks.streaming_mask(5, 5, sink_tokens=1, window=1, alignment="upper_left")
    np.testing.assert_array_equal(got, [[1, 0, 0, 0, 0],
                                        [1, 1, 0, 0, 0],
                                        [1, 1, 1, 0, 0],
                                        [1, 0, 1, 1, 0],
                                        [1, 0, 0, 1, 1]])
    # bottom-right aligned (decoding: 2 queries against 6 keys), 2 sink tokens, window 1
    got = masks.streaming_mask(2, 6, sink_tokens=2, window=1)
    np.testing.assert_array_equal(got, [[1, 1, 0, 1, 1, 0], [1, 1, 0, 0, 1, 1]])
    # brute force over sizes: key j visible iff in the window or (j < n and j <= p_i)
    for L, S, n, w in [(3, 7, 2, 2), (6, 4, 1, 0), (4, 4, 0, 1), (1, 9, 3, 3)]:
        for alignment in ("upper_left", "lower_right"):
            got = masks.streaming_mask(L, S, sink_tokens=n, window=w, alignment=alignment)
            for i in range(L):
                p = i if alignment == "upper_left" else i + S - L
                for j in range(S):
                    assert got[i, j] == (p - w <= j <= p or (j < n and j <= p)), (L, S, n, w, alignment, i, j)
    with pytest.raises(spec.SpecError, match="sink_tokens"):
        masks.streaming_mask(2, 2, sink_tokens=-1, window=1)
