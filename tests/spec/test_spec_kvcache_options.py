"""The KV cache's own options in the oracle against brute-force loops: rotary embeddings
(``rotary_cos``/``rotary_sin``/``rotary_interleaved``), ``cache_batch_idx``,
``cache_leftpad`` and ``num_splits`` (spec section: FlashAttention features, KV cache).

Every reference here is written from spec/README.md's definitions, one scalar at a time,
in **cache indices** (query i of sequence b sits at ``S_b - L + i``, the attended keys are
``cache_leftpad[b] .. S_b - 1``), independently of spec/.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import spec
from spec_test_cases import assert_close


def brute_rotate(x, cos, sin, position, interleaved):
    """One vector x (E,) at ``position``, pair by pair."""
    out = list(x)
    half = cos.shape[1]
    for j in range(half):
        a, b = (2 * j, 2 * j + 1) if interleaved else (j, j + half)
        c, s = cos[position, j], sin[position, j]
        out[a] = x[a] * c - x[b] * s
        out[b] = x[b] * c + x[a] * s
    return np.array(out)


def brute_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new, *, rotary=None, interleaved=True, batch_idx=None,
                  leftpad=None, causal=False, window=(-1, -1), softcap=0.0, slopes=None, chunk=None):
    """(output, lse, k_cache after, v_cache after) by the definitions, in cache indices;
    ``chunk`` (lo, hi): attend only the valid keys with lo <= j < hi (a split-KV partial)."""
    B, L, N, E = q.shape
    K, Ev = k_cache.shape[2], v_cache.shape[3]
    S_new = 0 if k_new is None else k_new.shape[1]
    rows = list(range(B)) if batch_idx is None else list(batch_idx)
    pads = [0] * B if leftpad is None else list(leftpad)
    keys, values = k_cache.copy(), v_cache.copy()
    output, lse = np.zeros((B, L, N, Ev)), np.full((B, N, L), -math.inf)
    left, right = window
    if causal:
        right = 0
    local = tuple(window) != (-1, -1)
    scale = 1.0 / math.sqrt(E)
    for b in range(B):
        r, n = rows[b], seqlens[b]
        for i in range(S_new):
            for h in range(K):
                key = k_new[b, i, h]
                if rotary is not None:
                    key = brute_rotate(key, *rotary, n + i, interleaved)
                keys[r, n + i, h] = key
                values[r, n + i, h] = v_new[b, i, h]
        S_b = n + S_new
        for i in range(L):
            position = S_b - L + i                                    # a cache index
            for h in range(N):
                query = q[b, i, h]
                if rotary is not None:
                    query = brute_rotate(query, *rotary, n + i if (causal or local) else n, interleaved)
                kv = h // (N // K)
                scores = {}
                lo, hi = chunk or (0, S_b)
                for j in range(max(pads[b], lo), min(S_b, hi)):
                    if (left != -1 and j < position - left) or (right != -1 and j > position + right):
                        continue
                    s = scale * float(np.dot(query, keys[r, j, kv]))
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        s -= slopes[h] * abs(position - j)
                    scores[j] = s
                if not scores:
                    continue
                top = max(scores.values())
                total = sum(math.exp(s - top) for s in scores.values())
                lse[b, h, i] = top + math.log(total)
                output[b, i, h] = sum(math.exp(s - top) / total * values[r, j, kv] for j, s in scores.items())
    return output, lse, keys, values


def _problem(rng, *, B=3, B_cache=3, L=2, S_cache=7, S_new=1, N=4, K=2, E=6, Ev=3, seqlens=(0, 2, 5)):
    return dict(query=rng.normal(size=(B, L, N, E)), k_cache=rng.normal(size=(B_cache, S_cache, K, E)),
                v_cache=rng.normal(size=(B_cache, S_cache, K, Ev)), cache_seqlens=np.array(seqlens),
                k=rng.normal(size=(B, S_new, K, E)) if S_new else None,
                v=rng.normal(size=(B, S_new, K, Ev)) if S_new else None)


def _table(rng, rows, rotary_dim):
    angle = rng.uniform(0, 2 * math.pi, (rows, rotary_dim // 2))
    return np.cos(angle), np.sin(angle)


# ---------------------------------------------------------------- the rotation itself


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotary_dim", [2, 4, 6])
def test_apply_rotary_is_the_pair_formula(interleaved, rotary_dim):
    rng = np.random.default_rng(rotary_dim)
    x = rng.normal(size=(2, 3, 2, 6))                                  # (B, T, H, E)
    cos, sin = rng.normal(size=(9, rotary_dim // 2)), rng.normal(size=(9, rotary_dim // 2))  # any table
    positions = rng.integers(0, 9, (2, 3))
    got = spec.apply_rotary(x, cos, sin, positions, interleaved=interleaved)
    for b, t, h in itertools.product(range(2), range(3), range(2)):
        np.testing.assert_allclose(got[b, t, h], brute_rotate(x[b, t, h], cos, sin, positions[b, t], interleaved),
                                   rtol=0, atol=1e-15)
    np.testing.assert_array_equal(got[..., rotary_dim:], x[..., rotary_dim:])   # dims past R untouched


def test_the_two_layouts_differ_unless_one_pair_is_rotated():
    rng = np.random.default_rng(1)
    x, positions = rng.normal(size=(1, 2, 1, 4)), np.array([[0, 1]])
    two = _table(rng, 2, 2)
    assert np.array_equal(spec.apply_rotary(x, *two, positions, interleaved=True),
                          spec.apply_rotary(x, *two, positions, interleaved=False))
    four = _table(rng, 2, 4)
    assert not np.allclose(spec.apply_rotary(x, *four, positions, interleaved=True),
                           spec.apply_rotary(x, *four, positions, interleaved=False))


@pytest.mark.parametrize("causal,window,per_row", [(False, (-1, -1), False), (True, (-1, -1), True),
                                                    (False, (2, 0), True), (False, (-1, 3), True)])
def test_query_positions_follow_causal_or_local(causal, window, per_row):
    q_pos, k_pos = spec.rotary_positions([0, 4], 3, 2, causal=causal, window=window)
    np.testing.assert_array_equal(k_pos, [[0, 1], [4, 5]])
    np.testing.assert_array_equal(q_pos, [[0, 1, 2], [4, 5, 6]] if per_row else [[0, 0, 0], [4, 4, 4]])


# ---------------------------------------------------------------- the options against brute force


OPTIONS = [dict(), dict(causal=True), dict(window=(1, 0)), dict(window=(0, 2), softcap=2.0),
           dict(causal=True, window=(2, -1), slopes=np.array([0.3, -0.2, 0.5, 0.0]))]
FEATURES = [dict(rotary=True), dict(rotary=True, interleaved=False), dict(rotary=True, rotary_dim=2),
            dict(batch_idx=True), dict(leftpad=True), dict(rotary=True, batch_idx=True, leftpad=True)]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("features", FEATURES, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("L,S_new", [(2, 1), (3, 2), (1, 1)])
def test_kvcache_options_equal_brute_force(options, features, L, S_new):
    rng = np.random.default_rng(L * 10 + S_new)
    B_cache = 5 if features.get("batch_idx") else 3
    problem = _problem(rng, B_cache=B_cache, L=L, S_new=S_new)
    before = {name: x.copy() for name, x in problem.items() if isinstance(x, np.ndarray)}
    extra, brute = {}, {}
    if features.get("rotary"):
        cos, sin = _table(rng, 9, features.get("rotary_dim", 4))
        extra.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=features.get("interleaved", True))
        brute.update(rotary=(cos, sin), interleaved=features.get("interleaved", True))
    if features.get("batch_idx"):
        extra["cache_batch_idx"] = brute["batch_idx"] = np.array([4, 0, 2])
    if features.get("leftpad"):
        extra["cache_leftpad"] = brute["leftpad"] = np.array([0, 1, 3])
    slopes = options.get("slopes")
    spec_options = {k: v for k, v in options.items() if k != "slopes"}
    got = spec.kvcache_attention(**problem, **extra, **spec_options, alibi_slopes=slopes)
    want = brute_kvcache(problem["query"], problem["k_cache"], problem["v_cache"], problem["cache_seqlens"],
                         problem["k"], problem["v"], slopes=slopes, **brute, **spec_options)
    assert_close("output", got.output, want[0])
    np.testing.assert_array_equal(np.isneginf(got.lse), np.isneginf(want[1]))
    assert_close("lse", np.where(np.isinf(got.lse), 0, got.lse), np.where(np.isinf(want[1]), 0, want[1]))
    assert_close("k_cache", got.k_cache, want[2])
    np.testing.assert_array_equal(got.v_cache, want[3])
    for name, x in before.items():
        np.testing.assert_array_equal(problem[name], x, err_msg=f"{name} was modified")


def test_the_cache_stores_the_rotated_keys_and_unnamed_rows_stay():
    rng = np.random.default_rng(2)
    problem = _problem(rng, B_cache=5, S_new=2)
    cos, sin = _table(rng, 9, 4)
    got = spec.kvcache_attention(**problem, rotary_cos=cos, rotary_sin=sin, cache_batch_idx=[4, 0, 2])
    for b, (row, n) in enumerate(zip([4, 0, 2], problem["cache_seqlens"], strict=True)):
        rotated = spec.apply_rotary(problem["k"][b:b + 1], cos, sin, np.array([[n, n + 1]]))[0]
        np.testing.assert_array_equal(got.k_cache[row, n:n + 2], rotated)
        np.testing.assert_array_equal(got.v_cache[row, n:n + 2], problem["v"][b])      # values never rotated
    for row in (1, 3):
        np.testing.assert_array_equal(got.k_cache[row], problem["k_cache"][row])


# ---------------------------------------------------------------- equivalences the decisions imply


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_leftpad_is_a_cache_that_starts_at_the_pad(options):
    """Sequence b with cache_leftpad[b] = a equals the cache with its first a rows removed,
    cache_seqlens[b] - a, and the rotary tables from row a on: nothing but the keys moves."""
    rng = np.random.default_rng(3)
    problem = _problem(rng, L=3, S_new=1)
    cos, sin = _table(rng, 9, 4)
    pads = np.array([0, 2, 4])
    slopes = options.get("slopes")
    spec_options = {k: v for k, v in options.items() if k != "slopes"}
    padded = spec.kvcache_attention(**problem, rotary_cos=cos, rotary_sin=sin, cache_leftpad=pads,
                                    alibi_slopes=slopes, **spec_options)
    for b, a in enumerate(pads):
        alone = spec.kvcache_attention(problem["query"][b:b + 1], problem["k_cache"][b:b + 1, a:],
                                       problem["v_cache"][b:b + 1, a:], cache_seqlens=[problem["cache_seqlens"][b] - a],
                                       k=problem["k"][b:b + 1], v=problem["v"][b:b + 1], rotary_cos=cos[a:],
                                       rotary_sin=sin[a:], alibi_slopes=slopes, **spec_options)
        np.testing.assert_array_equal(padded.output[b], alone.output[0])
        np.testing.assert_array_equal(padded.lse[b], alone.lse[0])
        np.testing.assert_array_equal(padded.k_cache[b, a:], alone.k_cache[0])


def test_batch_idx_is_the_gathered_cache():
    rng = np.random.default_rng(4)
    problem = _problem(rng, B_cache=5, L=2, S_new=1)
    idx = np.array([3, 1, 4])
    indexed = spec.kvcache_attention(**problem, cache_batch_idx=idx, causal=True)
    gathered = spec.kvcache_attention(**{**problem, "k_cache": problem["k_cache"][idx],
                                         "v_cache": problem["v_cache"][idx]}, causal=True)
    np.testing.assert_array_equal(indexed.output, gathered.output)
    np.testing.assert_array_equal(indexed.k_cache[idx], gathered.k_cache)


@pytest.mark.parametrize("num_splits", [0, 1, 2, 3, 7])
def test_num_splits_changes_nothing_and_chunks_merge_to_the_whole(num_splits):
    rng = np.random.default_rng(5)
    problem = _problem(rng, L=2, S_new=1)
    options = dict(causal=True, window=(3, 0), softcap=4.0)
    whole = spec.kvcache_attention(**problem, **options)
    split = spec.kvcache_attention(**problem, num_splits=num_splits, **options)
    np.testing.assert_array_equal(split.output, whole.output)
    np.testing.assert_array_equal(split.lse, whole.lse)
    # split-KV by hand: chunks of the valid keys (some empty, some fully masked), merged
    pieces = max(num_splits, 1)
    for b, n in enumerate(problem["cache_seqlens"]):
        size = -(-(n + 1) // pieces)
        merged = spec.FlashResult(np.zeros((1, 2, 4, 3)), np.full((1, 4, 2), -np.inf))
        for c in range(pieces):
            out, lse, _, _ = brute_kvcache(problem["query"][b:b + 1], problem["k_cache"][b:b + 1],
                                           problem["v_cache"][b:b + 1], [n], problem["k"][b:b + 1],
                                           problem["v"][b:b + 1], chunk=(c * size, (c + 1) * size), **options)
            merged = spec.merge_partials(merged.output, merged.lse, out, lse)
        assert_close("merged output", merged.output[0], whole.output[b])
        np.testing.assert_array_equal(np.isneginf(merged.lse[0]), np.isneginf(whole.lse[b]))
        assert_close("merged lse", np.where(np.isinf(merged.lse[0]), 0, merged.lse[0]),
                     np.where(np.isinf(whole.lse[b]), 0, whole.lse[b]))


# ---------------------------------------------------------------- invalid inputs

RNG = np.random.default_rng(9)
P = _problem(RNG, B_cache=3)
COS, SIN = _table(RNG, 9, 4)
INVALID = [
    (lambda: spec.kvcache_attention(**{**P, "k": None, "v": None}, rotary_cos=COS, rotary_sin=SIN),
     "rotary_cos=", "only with new keys"),
    (lambda: spec.kvcache_attention(**P, rotary_cos=COS), "rotary_sin=None", "together"),
    (lambda: spec.kvcache_attention(**P, rotary_cos=np.ones((9, 4)), rotary_sin=np.ones((9, 4))),
     "rotary_cos=", "must be <= the head dim E=6"),
    (lambda: spec.kvcache_attention(**P, rotary_cos=COS[:5], rotary_sin=SIN[:5]), "rotary_cos=", "seqlen_ro=5"),
    (lambda: spec.kvcache_attention(**P, rotary_cos=COS, rotary_sin=SIN[:, :1]), "rotary_sin=", "rotary_cos's shape"),
    (lambda: spec.kvcache_attention(**P, rotary_cos=COS, rotary_sin=SIN, rotary_interleaved="yes"),
     "rotary_interleaved='yes'", "bool"),
    (lambda: spec.kvcache_attention(**P, cache_batch_idx=[0, 0, 1]), "cache_batch_idx=[0, 0, 1]", "distinct"),
    (lambda: spec.kvcache_attention(**P, cache_batch_idx=[0, 3, 1]), "cache_batch_idx=[0, 3, 1]", "[0, 3)"),
    (lambda: spec.kvcache_attention(**P, cache_batch_idx=[0, 1]), "cache_batch_idx=[0, 1]", "shape (3,)"),
    (lambda: spec.kvcache_attention(**P, cache_leftpad=[0, 3, 0]), "cache_leftpad=[0, 3, 0]", "[0, cache_seqlens[b]]"),
    (lambda: spec.kvcache_attention(**P, num_splits=-1), "num_splits=-1", ">= 0"),
    (lambda: spec.kvcache_attention(P["query"][:1], P["k_cache"][:2, :4], P["v_cache"][:2, :4], block_table=[[0, 1]],
                                    cache_batch_idx=[0]), "cache_batch_idx=[0]", "block_table"),
    (lambda: spec.kvcache_attention(P["query"][:1], P["k_cache"][:2, :4], P["v_cache"][:2, :4], block_table=[[0, 1]],
                                    cache_seqlens=[1], cache_leftpad=[1]), "cache_leftpad=[1]", "block_table"),
]


@pytest.mark.parametrize("call,shown,rule", INVALID, ids=[c[1] + " " + c[2] for c in INVALID])
def test_invalid_options_raise_spec_error(call, shown, rule):
    with pytest.raises(spec.SpecError) as info:
        call()
    message = str(info.value)
    assert shown in message and rule in message and "Fix:" in message, message


def test_duplicate_rows_may_be_read_without_an_append():
    rng = np.random.default_rng(6)
    problem = _problem(rng, B_cache=2, S_new=0)
    got = spec.kvcache_attention(**problem, cache_batch_idx=[1, 1, 0])
    want = spec.kvcache_attention(**{**problem, "k_cache": problem["k_cache"][[1, 1, 0]],
                                     "v_cache": problem["v_cache"][[1, 1, 0]]})
    np.testing.assert_array_equal(got.output, want.output)
