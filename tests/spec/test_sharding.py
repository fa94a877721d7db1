"""spec.sharding: the position maps of the contiguous and zigzag layouts, and their inverse."""

from __future__ import annotations

import numpy as np
import pytest

from spec import SpecError, sharding


def test_contiguous_positions():
    assert [sharding.positions(6, 3, r).tolist() for r in range(3)] == [[0, 1], [2, 3], [4, 5]]


def test_zigzag_gives_rank_r_chunks_r_and_2w_minus_1_minus_r():
    # W = 2: 4 chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert sharding.positions(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]
    assert sharding.positions(8, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]
    assert sharding.positions(2, 1, 0, "zigzag").tolist() == [0, 1]
    assert sharding.rank_of(6, 3, "zigzag").tolist() == [0, 1, 2, 2, 1, 0]


@pytest.mark.parametrize("layout", sharding.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_positions_partition_the_sequence_and_unshard_inverts_shard(layout, world):
    L = 3 * sharding.divisor(layout, world)
    everything = np.concatenate([sharding.positions(L, world, r, layout) for r in range(world)])
    assert sorted(everything.tolist()) == list(range(L))
    x = np.random.default_rng(0).standard_normal((2, 3, L, 4))
    shards = [sharding.shard(x, world, r, layout) for r in range(world)]
    assert all(s.shape == (2, 3, L // world, 4) for s in shards)
    np.testing.assert_array_equal(sharding.unshard(shards, layout), x)


def test_bad_input_names_the_argument_and_the_fix():
    with pytest.raises(SpecError, match=r"length=.*multiple of 4 under the 'zigzag' layout"):
        sharding.positions(6, 2, 0, "zigzag")
    with pytest.raises(SpecError, match="layout=.*must be one of"):
        sharding.positions(4, 2, 0, "striped")
    with pytest.raises(SpecError, match="rank=.*must be in 0..1"):
        sharding.positions(4, 2, 2)


@pytest.mark.parametrize("layout", sharding.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [1, 5, 7])
def test_padding_pads_at_the_end_and_unshard_drops_it(layout, world, length):
    total = sharding.padded_length(length, world, layout)
    assert total % sharding.divisor(layout, world) == 0 and length <= total < length + sharding.divisor(layout, world)
    x = np.random.default_rng(1).standard_normal((1, 2, length, 3))
    shards = [sharding.shard(x, world, r, layout, pad=True) for r in range(world)]
    assert all(s.shape == (1, 2, total // world, 3) for s in shards)
    # the padding rows are zeros at positions >= length, in whichever rank holds them
    for r, s in enumerate(shards):
        pads = sharding.positions(total, world, r, layout) >= length
        assert (s[:, :, pads] == 0).all()
    np.testing.assert_array_equal(sharding.unshard(shards, layout, length=length), x)
    with pytest.raises(SpecError, match="length=.*unpadded length"):
        sharding.unshard(shards, layout, length=total + 1)


def test_allowed_is_causal_window_and_padding_over_global_positions():
    q, k = [2, 3], [0, 1, 2, 3, 4, 5]
    assert sharding.allowed(q, k).all()
    assert sharding.allowed(q, k, causal=True).astype(int).tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]]
    assert sharding.allowed(q, k, window=(1, 1)).astype(int).tolist() == [[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0]]
    # causal sets the right side to 0; -1 leaves a side unbounded
    assert sharding.allowed(q, k, causal=True, window=(1, 3)).astype(int).tolist() == \
        [[0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0]]
    assert sharding.allowed(q, k, window=(-1, 0)).tolist() == sharding.allowed(q, k, causal=True).tolist()
    assert sharding.allowed(q, k, length=3).astype(int).tolist() == [[1, 1, 1, 0, 0, 0]] * 2
    # the whole-sequence mask is spec.flash's window mask (L == S: the alignments coincide)
    from spec import flash

    for window, causal in (((2, 1), False), ((1, 4), True), ((-1, -1), True), ((0, 0), False)):
        np.testing.assert_array_equal(sharding.attend_mask(7, causal=causal, window=window),
                                      flash.window_mask(7, 7, window, causal=causal))
    with pytest.raises(SpecError, match=r"window\[0\]=.*int >= -1"):
        sharding.allowed(q, k, window=(-2, 0))
