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
