"""spec.variants at the sharded level: each variant against arithmetic worked by hand on the
smallest case of its bug, ``rank`` puts it first on its own output (or level with a variant
that gives the very same output there), and a variant that does not apply is the oracle."""

from __future__ import annotations

import numpy as np
import pytest

from spec import SpecError, sharding
from spec import variants as V


def _softmax_rows(scores: np.ndarray) -> np.ndarray:
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _problem(L: int, *, N: int = 1, E: int = 2, seed: int = 0, **kwargs) -> V.ShardedProblem:
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, N, L, E)) for _ in range(3))
    return V.ShardedProblem(q, k, v, **kwargs)


def _attend(p: V.ShardedProblem, row: int, keys: list[int], zeros: int = 0) -> np.ndarray:
    """Output row ``row`` attending ``keys`` of the sequence and ``zeros`` zero keys."""
    q, k, v = p.query[0, 0], p.key[0, 0], p.value[0, 0]
    scale = 1 / np.sqrt(q.shape[-1])
    scores = np.concatenate([scale * k[keys] @ q[row], np.zeros(zeros)])
    values = np.concatenate([v[keys], np.zeros((zeros, v.shape[-1]))])
    return _softmax_rows(scores) @ values


def _output(p: V.ShardedProblem, variant: str) -> np.ndarray:
    return V.VARIANTS[variant].compute(p).output[0, 0]


def test_causal_local_masks_every_block_with_its_own_triangle():
    # W=2, L=2: rank 0 holds position 0 and, in rank 1's block, key 1 sits at index 0 <= 0
    p = _problem(2, world_size=2, causal=True)
    got = _output(p, "sharded_causal_local")
    np.testing.assert_allclose(got[0], _attend(p, 0, [0, 1]))
    np.testing.assert_allclose(got[1], _attend(p, 1, [0, 1]))
    np.testing.assert_allclose(V.reference(p).output[0, 0, 0], _attend(p, 0, [0]))


def test_window_local_places_the_window_from_the_index_in_the_shard():
    # W=2, L=2, window (0, 0): rank 1's query (position 1, index 0) is given key 0
    p = _problem(2, world_size=2, window=(0, 0))
    got = _output(p, "sharded_window_local")
    np.testing.assert_allclose(got, p.value[0, 0][[0, 0]])
    np.testing.assert_allclose(V.reference(p).output[0, 0], p.value[0, 0])


def test_zigzag_swapped_masks_each_row_as_the_other_chunk():
    # W=1, L=2, zigzag: chunks 0 and 1 read in the other order, so row 0 is masked as
    # position 1 (attends both) and row 1 as position 0 (attends the key at label 0: itself)
    p = _problem(2, world_size=1, layout="zigzag", causal=True)
    got = _output(p, "sharded_zigzag_swapped")
    np.testing.assert_allclose(got[0], _attend(p, 0, [0, 1]))
    np.testing.assert_allclose(got[1], p.value[0, 0, 1])


def test_last_step_skipped_drops_the_block_of_the_next_rank():
    one = _problem(1, world_size=1)
    np.testing.assert_array_equal(_output(one, "sharded_last_step_skipped"), 0)   # no block at all
    p = _problem(3, world_size=3)
    got = _output(p, "sharded_last_step_skipped")
    for row, kept in enumerate(([0, 2], [0, 1], [1, 2])):                          # rank r skips r+1
        np.testing.assert_allclose(got[row], _attend(p, row, kept))


def test_padding_attended_attends_the_zero_keys():
    # W=1 zigzag pads L=1 to 2: the query attends itself and one zero key (score 0, value 0)
    p = _problem(1, world_size=1, layout="zigzag")
    assert p.padded_length == 2
    np.testing.assert_allclose(_output(p, "sharded_padding_attended")[0], _attend(p, 0, [0], zeros=1))
    np.testing.assert_allclose(V.reference(p).output[0, 0, 0], p.value[0, 0, 0])


def test_heads_reversed_swaps_the_head_groups():
    p = _problem(2, N=4, world_size=2)
    out, ref = V.VARIANTS["sharded_heads_reversed"].compute(p).output, V.reference(p).output
    np.testing.assert_array_equal(out[:, :2], ref[:, 2:])
    np.testing.assert_array_equal(out[:, 2:], ref[:, :2])


@pytest.mark.parametrize("dtype, threshold", [("float64", 709.8), ("float32", 88.8)])
def test_merge_without_max_overflows_past_the_dtypes_exp_limit(dtype, threshold):
    # one query, one key, W=1: lse = the logit; exp(lse) overflows beyond the threshold
    below, above = threshold - 5, threshold + 5
    for logit, overflows in ((below, False), (above, True)):
        q, k = np.full((1, 1, 1, 1), logit), np.ones((1, 1, 1, 1))
        v = np.full((1, 1, 1, 1), 0.5)
        p = V.ShardedProblem(q, k, v, scale=1.0, dtype=dtype)
        out = V.VARIANTS["sharded_merge_no_max"].compute(p).output
        assert np.isnan(out).all() if overflows else np.allclose(out, 0.5), (logit, out)


def _random_problems(count: int = 40):
    rng = np.random.default_rng(7)
    for i in range(count):
        W = int(rng.integers(1, 5))
        layout = str(rng.choice(sharding.LAYOUTS))
        L = int(rng.integers(1, 3 * sharding.divisor(layout, W) + 1))
        N = W * int(rng.integers(1, 3))
        window = (int(rng.integers(-1, L + 1)), int(rng.integers(-1, L + 1))) if i % 2 else (-1, -1)
        yield _problem(L, N=N, E=int(rng.integers(1, 4)), seed=i, world_size=W, layout=layout,
                       causal=bool(rng.integers(0, 2)), window=window)


def test_each_variant_is_the_oracle_where_it_does_not_apply_and_ranks_itself_where_it_differs():
    differed = set()
    for p in _random_problems():
        ref = V.reference(p).output
        assert V.rank(ref, p) == []
        for variant in V.SHARDED_VARIANTS:
            out = variant.compute(p).output
            assert out.shape == ref.shape
            if not variant.applies(p):
                np.testing.assert_allclose(out, ref, atol=1e-12)
                continue
            if np.isfinite(out).all() and np.abs(out - ref).max() > 1e-9:
                differed.add(variant.id)
                matched = V.rank(out, p)
                assert variant.id in [m.variant_id for m in matched], (variant.id, matched)
                assert matched[0].fit == 0.0
    # the merge without the max is the oracle on values this small; these problems have
    # K = N and Ev = E (GQA and Ev != E: tests/spec/test_variants.py's cases)
    assert differed == {v.id for v in V.SHARDED_VARIANTS} - {"sharded_merge_no_max", "sharded_gqa_tiled",
                                                               "sharded_scale_value_dim"}


def test_the_sharded_problem_names_bad_input():
    q = np.zeros((1, 1, 3, 2))
    with pytest.raises(SpecError, match="layout=.*must be one of"):
        V.ShardedProblem(q, q, q, layout="striped")
    with pytest.raises(SpecError, match=r"window\[1\]="):
        V.ShardedProblem(q, q, q, window=(0, -3))
    with pytest.raises(SpecError, match="key=.*query's length"):
        V.ShardedProblem(q, np.zeros((1, 1, 2, 2)), np.zeros((1, 1, 2, 2)))
    assert {v.level for v in V.SHARDED_VARIANTS} == {"sharded"}


def test_sdpa_variants_over_the_whole_sequence():
    """``as_sdpa`` states the whole sequence as one SDPA call (window and padding as a
    mask, causal as the upper-left flag), and a lifted variant is the SDPA variant on it:
    ``sharded_gqa_tiled`` reads kv head h % K for query head h, worked by hand."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 4, 3, 2)), rng.standard_normal((1, 2, 3, 2)), rng.standard_normal((1, 2, 3, 2))
    p = V.ShardedProblem(q, k, v, world_size=2, causal=True)     # L = 3 padded to 4
    s = V.sharded.as_sdpa(p)
    assert s.key.shape[2] == 4 and s.causal == "upper_left" and not s.attend_mask[:, 3].any()
    got = V.VARIANTS["sharded_gqa_tiled"].compute(p).output
    for h in range(4):
        one = V.ShardedProblem(q[:, h:h + 1], k[:, h % 2:h % 2 + 1], v[:, h % 2:h % 2 + 1], world_size=2, causal=True)
        np.testing.assert_allclose(got[:, h:h + 1], V.reference(one).output, atol=1e-12)
    assert V.rank(got, p)[0].variant_id == "sharded_gqa_tiled"
