"""FlashAttention's features in the oracle against brute-force loops (spec section: FlashAttention features).

Covers spec.flash (window, soft-capping, ALiBi, LSE, merge rule, gradients), spec.varlen
and spec.kvcache. Every reference here is written from the definitions in spec/README.md,
one scalar at a time, independently of spec/.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import spec
from spec_test_cases import assert_close

LENGTHS = [(2, 5), (4, 4), (5, 2), (1, 3), (3, 1)]                # L < S, L = S, L > S, one row, one key
WINDOWS = [(-1, -1), (0, 0), (1, 0), (0, 1), (1, 1), (-1, 1), (2, -1), (0, -1), (6, 6)]  # 6 >= every S
ALIGNMENTS = ("lower_right", "upper_left")


def brute_force_allowed(i, j, L, S, window, causal, alignment):
    left, right = window
    if causal:
        right = 0
    position = i + S - L if alignment == "lower_right" else i
    return (left == -1 or j >= position - left) and (right == -1 or j <= position + right)


def brute_force_flash(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, slopes=None,
                      scale=None, alignment="lower_right", fully_masked="zero"):
    """FlashAttention by its definition: (output (B, L, N, Ev), lse (B, N, L))."""
    B, L, N, E = q.shape
    S, K, Ev = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    output, lse = np.zeros((B, L, N, Ev)), np.full((B, N, L), -math.inf)
    for b in range(B):
        for h in range(N):
            kv = h // (N // K)
            for i in range(L):
                position = i + S - L if alignment == "lower_right" else i
                scores = {}
                for j in range(S):
                    if not brute_force_allowed(i, j, L, S, window, causal, alignment):
                        continue
                    s = scale * sum(q[b, i, h, e] * k[b, j, kv, e] for e in range(E))
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        slope = slopes[h] if slopes.ndim == 1 else slopes[b, h]
                        s -= slope * abs(position - j)
                    scores[j] = s
                if not scores:
                    if fully_masked == "nan":
                        output[b, i, h] = math.nan
                    elif fully_masked == "uniform":
                        output[b, i, h] = [sum(v[b, j, kv, c] for j in range(S)) / S for c in range(Ev)]
                    continue
                top = max(scores.values())
                total = sum(math.exp(s - top) for s in scores.values())
                lse[b, h, i] = top + math.log(total)
                for c in range(Ev):
                    output[b, i, h, c] = sum(math.exp(s - top) / total * v[b, j, kv, c] for j, s in scores.items())
    return output, lse


def assert_lse_close(got, expected, **kwargs):
    """-inf in the same rows, the finite rest close."""
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(expected), err_msg=kwargs.get("call", ""))
    assert_close("lse", np.where(np.isneginf(got), 0.0, got), np.where(np.isneginf(expected), 0.0, expected), **kwargs)


def random_qkv(rng, B=2, L=3, S=4, N=4, K=2, E=3, Ev=2, magnitude=1.0):
    return (rng.normal(0, magnitude, (B, L, N, E)), rng.normal(0, magnitude, (B, S, K, E)),
            rng.normal(size=(B, S, K, Ev)))


# ---------------------------------------------------------------- masks and bias

@pytest.mark.parametrize("alignment", ALIGNMENTS)
@pytest.mark.parametrize("causal", [False, True])
def test_window_mask_matches_definition(causal, alignment):
    for L in range(5):
        for S in range(5):
            for window in [(a, b) for a in (-1, 0, 1, 2, 5) for b in (-1, 0, 1, 2, 5)]:
                got = spec.window_mask(L, S, window, causal=causal, alignment=alignment)
                expected = [[brute_force_allowed(i, j, L, S, window, causal, alignment) for j in range(S)]
                            for i in range(L)]
                np.testing.assert_array_equal(got, np.array(expected, dtype=bool).reshape(L, S),
                                              err_msg=f"L={L} S={S} window={window}")
                if min(window) >= 0 and not causal:               # the older non-negative builder agrees
                    np.testing.assert_array_equal(got, spec.masks.sliding_window_mask(L, S, window, alignment))


def test_causal_window_is_the_causal_mask():
    for L, S in LENGTHS:
        for alignment in ALIGNMENTS:
            np.testing.assert_array_equal(spec.window_mask(L, S, causal=True, alignment=alignment),
                                          spec.masks.causal_mask(L, S, alignment))


@pytest.mark.parametrize("alignment", ALIGNMENTS)
def test_alibi_bias_matches_definition(alignment):
    rng = np.random.default_rng(0)
    for L, S in LENGTHS:
        for slopes in (rng.random(3), rng.random((2, 3))):
            got = spec.alibi_bias(L, S, slopes, alignment=alignment)
            assert got.shape == (*slopes.shape, L, S)
            for index in np.ndindex(*got.shape):
                *bh, i, j = index
                position = i + S - L if alignment == "lower_right" else i
                assert got[index] == -slopes[tuple(bh)] * abs(position - j)


# ---------------------------------------------------------------- forward and LSE

@pytest.mark.parametrize("alignment", ALIGNMENTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("L,S", LENGTHS)
def test_flash_attention_equals_brute_force(L, S, window, causal, alignment):
    rng = np.random.default_rng(L * 100 + S)
    q, k, v = random_qkv(rng, L=L, S=S)                                  # GQA: N=4, K=2
    slopes = rng.random(4)
    for options in (dict(), dict(softcap=1.5, slopes=slopes), dict(softcap=0.7, scale=-0.8)):
        result = spec.flash_attention(q, k, v, causal=causal, window=window, alignment=alignment,
                                      softcap=options.get("softcap", 0.0), alibi_slopes=options.get("slopes"),
                                      scale=options.get("scale"), return_lse=True)
        output, lse = brute_force_flash(q, k, v, causal=causal, window=window, alignment=alignment, **options)
        call = f"[L={L} S={S} window={window} causal={causal} {alignment} {sorted(options)}]"
        assert_close("output", result.output, output, call=call)
        assert_lse_close(result.lse, lse, call=call)


@st.composite
def flash_cases(draw):
    """Random small FlashAttention calls: every option, E != Ev, (B, N) slopes, each policy.

    Shrinks towards one batch, one head, short sequences and no options.
    """
    K = draw(st.integers(1, 2))
    shape = dict(B=draw(st.integers(1, 2)), L=draw(st.integers(0, 4)), S=draw(st.integers(0, 4)),
                 K=K, N=K * draw(st.integers(1, 2)), E=draw(st.integers(1, 3)), Ev=draw(st.integers(1, 3)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, k, v = random_qkv(rng, magnitude=draw(st.sampled_from([0.3, 1.0, 4.0])), **shape)
    slopes = draw(st.sampled_from([None, "N", "BN"]))
    if slopes is not None:
        slopes = rng.normal(0, 0.5, (shape["N"],) if slopes == "N" else (shape["B"], shape["N"]))
    side = st.integers(-1, 5)
    return dict(q=q, k=k, v=v, causal=draw(st.booleans()), window=(draw(side), draw(side)),
                softcap=draw(st.sampled_from([0.0, 0.5, 5.0])), slopes=slopes,
                scale=draw(st.one_of(st.none(), st.floats(-2, 2))),
                alignment=draw(st.sampled_from(ALIGNMENTS)),
                fully_masked=draw(st.sampled_from(("zero", "nan") if shape["S"] == 0 else ("zero", "nan", "uniform"))))


def _flash_call(case, **extra):
    options = {name: case[name] for name in ("causal", "window", "softcap", "scale", "alignment")}
    return spec.flash_attention(case["q"], case["k"], case["v"], alibi_slopes=case["slopes"], **options, **extra)


@settings(deadline=None, max_examples=120)
@given(flash_cases())
def test_random_flash_calls_equal_brute_force(case):
    result = _flash_call(case, return_lse=True, fully_masked=case["fully_masked"])
    output, lse = brute_force_flash(**case)
    assert_close("output", result.output, output)
    assert_lse_close(result.lse, lse)


@settings(deadline=None, max_examples=80)
@given(flash_cases())
def test_without_softcap_equals_sdpa_with_window_mask_and_alibi_bias(case):
    """flash_attention(softcap=0) = spec.sdpa(attend_mask=window_mask, additive_mask=alibi_bias), to float64 rounding."""
    if case["k"].shape[1] == 0:
        return                                                           # sdpa needs S >= 1
    case = {**case, "softcap": 0.0}
    L, S = case["q"].shape[1], case["k"].shape[1]
    heads_first = [np.swapaxes(x, 1, 2) for x in (case["q"], case["k"], case["v"])]  # (B, L|S, ·, ·) -> (B, ·, L|S, ·)
    bias = None if case["slopes"] is None else spec.alibi_bias(L, S, case["slopes"], alignment=case["alignment"])
    expected = spec.sdpa(*heads_first, scale=case["scale"], additive_mask=bias, fully_masked=case["fully_masked"],
                         attend_mask=spec.window_mask(L, S, case["window"], causal=case["causal"],
                                                      alignment=case["alignment"]))
    got = _flash_call(case, fully_masked=case["fully_masked"])
    # Equal up to the order of float64 roundings (bit-equal on most draws, not all).
    np.testing.assert_allclose(got, np.swapaxes(expected.output, 1, 2), rtol=1e-13, atol=1e-300)


def test_causal_sets_the_right_side_to_zero():
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, L=4, S=6)
    for left in (-1, 0, 2):
        for right in (-1, 0, 3):
            for alignment in ALIGNMENTS:
                causal = spec.flash_attention(q, k, v, causal=True, window=(left, right), alignment=alignment)
                window = spec.flash_attention(q, k, v, window=(left, 0), alignment=alignment)
                np.testing.assert_array_equal(causal, window)


def test_rows_attending_no_key_have_lse_minus_infinity_and_follow_the_policy():
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, L=5, S=2)
    result = spec.flash_attention(q, k, v, causal=True, return_lse=True)   # rows 0..2 see no key
    assert np.isneginf(result.lse[:, :, :3]).all() and np.isfinite(result.lse[:, :, 3:]).all()
    assert (result.output[:, :3] == 0).all()
    assert np.isnan(spec.flash_attention(q, k, v, causal=True, fully_masked="nan")[:, :3]).all()
    empty = spec.flash_attention(q, k[:, :0], v[:, :0], return_lse=True)   # S = 0
    assert (empty.output == 0).all() and np.isneginf(empty.lse).all()


def test_softcap_bounds_the_scores():
    """With huge logits a cap c keeps every score in (-c, c): LSE <= c + log S."""
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, L=3, S=5, magnitude=30.0)
    lse = spec.flash_attention(q, k, v, softcap=2.0, return_lse=True).lse
    assert (lse <= 2.0 + math.log(5)).all() and (lse >= -2.0).all()


def fa2_kernel_window(L, S, window, causal):
    """FlashAttention-2's window as its C++ entry point rewrites it and its kernel applies it."""
    left, right = window
    left, right = (-1 if left >= S else left), (-1 if right >= S else right)
    right = 0 if causal else right
    if left < 0 and right < 0:
        return np.ones((L, S), dtype=bool)
    left, right = (S if left < 0 else left), (S if right < 0 else right)
    rows, keys = np.arange(L)[:, None], np.arange(S)[None, :]
    return (keys < np.minimum(S, rows + 1 + S - L + right)) & (keys >= np.maximum(0, rows + S - L - left))


def test_flashattention2_window_rewrites_change_nothing_unless_L_exceeds_S_plus_1():
    """Pins the README's claim on FlashAttention-2 rewriting window sides >= S and -1."""
    differs = set()
    for L in range(1, 8):
        for S in range(1, 5):
            for window in [(a, b) for a in (-1, 0, 1, 3, 6) for b in (-1, 0, 1, 3, 6)]:
                for causal in (False, True):
                    same = (spec.window_mask(L, S, window, causal=causal) == fa2_kernel_window(L, S, window, causal)).all()
                    if not same:
                        differs.add((L, S))
    assert differs and all(L > S + 1 for L, S in differs)


def test_causal_alibi_in_flashattention2_form_shifts_only_the_lse():
    """FlashAttention-2 adds slope·j under causal: same output, LSE larger by slope·p_i."""
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, L=3, S=5)
    slopes = rng.random(4)
    ours = spec.flash_attention(q, k, v, causal=True, alibi_slopes=slopes, return_lse=True)
    heads_first = [np.swapaxes(x, 1, 2) for x in (q, k, v)]            # (B, L|S, ·, ·) -> (B, ·, L|S, ·)
    kernel_bias = slopes[:, None, None] * np.arange(5.0)                # (N, 1, S): slope·j
    theirs = spec.sdpa(*heads_first, causal="lower_right", additive_mask=kernel_bias)
    assert_close("output", ours.output, np.swapaxes(theirs.output, 1, 2), atol=1e-14)
    scores = theirs.logits + kernel_bias                                 # (B, N, L, S)
    kernel_lse = np.log(np.where(spec.masks.causal_mask(3, 5, "lower_right"), np.exp(scores), 0).sum(-1))
    positions = np.arange(3) + 5 - 3                                     # p_i = i + S - L
    assert_close("lse", ours.lse + slopes[:, None] * positions, kernel_lse, atol=1e-13)


# ---------------------------------------------------------------- packed variable-length batches

SEQUENCES = [([3, 0, 1, 4], [2, 3, 0, 4]), ([1], [1]), ([0, 2], [3, 0]), ([5, 2], [2, 5])]


def _cumulative(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@pytest.mark.parametrize("lengths_q,lengths_k", SEQUENCES)
def test_varlen_equals_one_call_per_sequence(lengths_q, lengths_k):
    rng = np.random.default_rng(sum(lengths_q) * 10 + sum(lengths_k))
    N, K, E, Ev, B = 4, 2, 3, 2, len(lengths_q)
    q = rng.normal(size=(sum(lengths_q), N, E))
    k, v = rng.normal(size=(sum(lengths_k), K, E)), rng.normal(size=(sum(lengths_k), K, Ev))
    cu_q, cu_k = _cumulative(lengths_q), _cumulative(lengths_k)
    slopes = rng.random((B, N))
    for options in (dict(), dict(causal=True, window=(1, -1), softcap=2.0, alibi_slopes=slopes),
                    dict(window=(0, 1), alignment="upper_left", fully_masked="nan")):
        got = spec.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, **options)
        assert got.output.shape == (len(q), N, Ev) and got.lse.shape == (N, len(q))
        for b in range(B):
            rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            single = {**options, "alibi_slopes": slopes[b] if "alibi_slopes" in options else None}
            policy = single.pop("fully_masked", "zero")
            output, lse = brute_force_flash(q[None, rows], k[None, keys], v[None, keys], fully_masked=policy,
                                            **{("slopes" if n == "alibi_slopes" else n): x for n, x in single.items()})
            assert_close("output", got.output[rows], output[0], call=f"[sequence {b}, {options.keys()}]")
            assert_lse_close(got.lse[:, rows], lse[0], call=f"[sequence {b}]")


@pytest.mark.parametrize("lengths_q,lengths_k", SEQUENCES)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_equals_packed_sdpa_with_document_mask(lengths_q, lengths_k, causal):
    rng = np.random.default_rng(4)
    q = rng.normal(size=(sum(lengths_q), 2, 3))
    k, v = rng.normal(size=(sum(lengths_k), 1, 3)), rng.normal(size=(sum(lengths_k), 1, 2))
    cu_q, cu_k = _cumulative(lengths_q), _cumulative(lengths_k)
    mask = spec.document_mask(cu_q, cu_k, causal=causal, window=(2, -1))
    got = spec.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, window=(2, -1))
    if len(k) == 0:
        assert (got == 0).all()
        return
    expected = spec.sdpa(np.swapaxes(q, 0, 1), np.swapaxes(k, 0, 1), np.swapaxes(v, 0, 1), attend_mask=mask)
    assert_close("output", got, np.swapaxes(expected.output, 0, 1))    # (N, T, Ev) -> (T, N, Ev)


def test_document_mask_matches_definition():
    cu_q, cu_k = _cumulative([3, 0, 2]), _cumulative([2, 2, 3])
    mask = spec.document_mask(cu_q, cu_k, causal=True, window=(1, -1))
    for t in range(5):
        for u in range(7):
            b = int(np.searchsorted(cu_q, t, side="right") - 1)
            c = int(np.searchsorted(cu_k, u, side="right") - 1)
            L, S = cu_q[b + 1] - cu_q[b], cu_k[c + 1] - cu_k[c]
            expected = b == c and brute_force_allowed(t - cu_q[b], u - cu_k[c], L, S, (1, -1), True, "lower_right")
            assert mask[t, u] == expected, (t, u)


# ---------------------------------------------------------------- KV cache, contiguous and paged

def _kvcache_problem(rng, cache_seqlens=(0, 2, 5), S_cache=8, S_new=2, L=2):
    B, N, K, E, Ev = len(cache_seqlens), 4, 2, 3, 2
    return dict(query=rng.normal(size=(B, L, N, E)), k_cache=rng.normal(size=(B, S_cache, K, E)),
                v_cache=rng.normal(size=(B, S_cache, K, Ev)), cache_seqlens=np.array(cache_seqlens),
                k=rng.normal(size=(B, S_new, K, E)) if S_new else None,
                v=rng.normal(size=(B, S_new, K, Ev)) if S_new else None)


KV_OPTIONS = [dict(), dict(causal=True), dict(causal=True, window=(2, 0), softcap=3.0, alibi_slopes=[.1, .2, .3, .4]),
              dict(window=(0, 1), alignment="upper_left")]


@pytest.mark.parametrize("options", KV_OPTIONS)
@pytest.mark.parametrize("S_new,L", [(2, 2), (0, 1), (1, 3)])
def test_kvcache_equals_attention_over_the_valid_prefix(options, S_new, L):
    rng = np.random.default_rng(5)
    problem = _kvcache_problem(rng, S_new=S_new, L=L)
    before = {name: x.copy() for name, x in problem.items() if isinstance(x, np.ndarray)}
    result = spec.kvcache_attention(**problem, **options)
    for b, length in enumerate(problem["cache_seqlens"]):
        keys, values = problem["k_cache"][b, :length], problem["v_cache"][b, :length]
        if S_new:
            keys = np.concatenate([keys, problem["k"][b]])              # (S_b, K, E)
            values = np.concatenate([values, problem["v"][b]])
        expected = spec.flash_attention(problem["query"][b:b + 1], keys[None], values[None], return_lse=True, **options)
        np.testing.assert_array_equal(result.output[b], expected.output[0])
        np.testing.assert_array_equal(result.lse[b], expected.lse[0])
        np.testing.assert_array_equal(result.k_cache[b, :length + S_new], keys)
        np.testing.assert_array_equal(result.v_cache[b, length + S_new:], problem["v_cache"][b, length + S_new:])
    for name, x in before.items():
        np.testing.assert_array_equal(problem[name], x, err_msg=f"{name} was modified")


def test_kvcache_without_seqlens_uses_the_whole_cache_and_empty_caches_attend_nothing():
    rng = np.random.default_rng(6)
    problem = _kvcache_problem(rng, S_new=0)
    whole = spec.kvcache_attention(problem["query"], problem["k_cache"], problem["v_cache"])
    np.testing.assert_array_equal(whole.output, spec.flash_attention(problem["query"], problem["k_cache"],
                                                                     problem["v_cache"]))
    empty = spec.kvcache_attention(problem["query"], problem["k_cache"], problem["v_cache"], cache_seqlens=0)
    assert (empty.output == 0).all() and np.isneginf(empty.lse).all()


def _paged(rng, caches, page_size, spare_pages=2):
    """Split each (B, S_cache, ...) cache into the same shuffled pages; S_cache % page_size == 0."""
    B, S_cache = caches[0].shape[:2]
    per_sequence = S_cache // page_size
    order = rng.permutation(B * per_sequence + spare_pages)
    table = order[:B * per_sequence].reshape(B, per_sequence)
    paged = []
    for cache in caches:
        pages = rng.normal(size=(len(order), page_size, *cache.shape[2:]))  # spare pages hold noise
        for b in range(B):
            for m in range(per_sequence):
                pages[table[b, m]] = cache[b, m * page_size:(m + 1) * page_size]
        paged.append(pages)
    return paged, table


@pytest.mark.parametrize("page_size", [1, 2, 3, 4])                      # valid lengths 2, 4, 7: some divide, some not
@pytest.mark.parametrize("options", KV_OPTIONS[1:3])
def test_paged_cache_equals_contiguous_cache(page_size, options):
    rng = np.random.default_rng(page_size)
    problem = _kvcache_problem(rng, S_cache=12)
    contiguous = spec.kvcache_attention(**problem, **options)
    (k_pages, v_pages), table = _paged(rng, (problem["k_cache"], problem["v_cache"]), page_size)
    np.testing.assert_array_equal(spec.gather_pages(k_pages, table), problem["k_cache"])
    paged = spec.kvcache_attention(**{**problem, "k_cache": k_pages, "v_cache": v_pages}, block_table=table, **options)
    np.testing.assert_array_equal(paged.output, contiguous.output)
    np.testing.assert_array_equal(paged.lse, contiguous.lse)
    np.testing.assert_array_equal(spec.gather_pages(paged.k_cache, table), contiguous.k_cache)
    np.testing.assert_array_equal(spec.gather_pages(paged.v_cache, table), contiguous.v_cache)
    spare = np.setdiff1d(np.arange(len(k_pages)), table)
    np.testing.assert_array_equal(paged.k_cache[spare], k_pages[spare])   # pages outside the table untouched


# ---------------------------------------------------------------- merge rule

@pytest.mark.parametrize("seed", range(6))
def test_merging_two_key_sets_equals_attention_over_their_union(seed):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, L=3, S=6, magnitude=2.0)
    in_first = rng.random(6) < [0.0, 0.5, 0.5, 0.5, 0.5, 1.0][seed]    # seed 0: all keys in the second set
    options = dict(softcap=[0.0, 2.0][seed % 2], alibi_slopes=None, return_lse=True)
    first = spec.flash_attention(q, k[:, in_first], v[:, in_first], fully_masked="nan", **options)
    second = spec.flash_attention(q, k[:, ~in_first], v[:, ~in_first], fully_masked="nan", **options)
    merged = spec.merge_partials(first.output, first.lse, second.output, second.lse)
    whole = spec.flash_attention(q, k, v, **options)
    assert_close("output", merged.output, whole.output)
    assert_lse_close(merged.lse, whole.lse)


def test_merge_of_two_empty_partials_is_empty_and_packed_layout_works():
    rng = np.random.default_rng(7)
    out = rng.normal(size=(5, 2, 3))                                     # packed (T, N, Ev)
    lse = np.full((2, 5), -np.inf)
    lse[0, 1] = 0.3
    merged = spec.merge_partials(out, lse, np.full((5, 2, 3), np.nan), np.full((2, 5), -np.inf))
    expected = np.zeros((5, 2, 3))
    expected[1, 0] = out[1, 0]
    np.testing.assert_array_equal(merged.output, expected)
    np.testing.assert_array_equal(merged.lse, lse)


# ---------------------------------------------------------------- gradients

GRADIENT_CONFIGS = [dict(), dict(causal=True), dict(window=(1, 1)), dict(softcap=1.2),
                    dict(alibi_slopes=[0.3, 0.8]), dict(causal=True, window=(1, -1), softcap=0.8,
                                                       alibi_slopes=[[0.5, 0.1]], scale=1.3, alignment="upper_left")]


def _central_difference(f, x, step=1e-6):
    grad = np.zeros_like(x)
    for index in np.ndindex(*x.shape):
        plus, minus = x.copy(), x.copy()
        plus[index] += step
        minus[index] -= step
        grad[index] = (f(plus) - f(minus)) / (2 * step)
    return grad


@pytest.mark.parametrize("options", GRADIENT_CONFIGS)
@pytest.mark.parametrize("L,S", [(3, 4), (4, 2)])
def test_vjp_matches_central_differences(options, L, S):
    rng = np.random.default_rng(8)
    q, k, v = random_qkv(rng, B=1, L=L, S=S, N=2, K=1, E=2, Ev=2, magnitude=1.5)
    upstream = rng.normal(size=(1, L, 2, 2))
    grads = spec.flash_attention_vjp(q, k, v, upstream, **options)

    def loss(q, k, v):
        return float((spec.flash_attention(q, k, v, **options) * upstream).sum())

    expected = (_central_difference(lambda x: loss(x, k, v), q), _central_difference(lambda x: loss(q, x, v), k),
                _central_difference(lambda x: loss(q, k, x), v))
    for name, got, want in zip(("dquery", "dkey", "dvalue"), grads, expected, strict=True):
        assert_close(name, got, want, atol=1e-7, rtol=1e-6, call=str(options))


def test_vjp_without_softcap_equals_sdpa_vjp():
    rng = np.random.default_rng(9)
    q, k, v = random_qkv(rng, L=4, S=3)
    upstream = rng.normal(size=(2, 4, 4, 2))
    slopes = rng.random(4)
    grads = spec.flash_attention_vjp(q, k, v, upstream, causal=True, window=(1, -1), alibi_slopes=slopes)
    heads_first = [np.swapaxes(x, 1, 2) for x in (q, k, v, upstream)]  # (B, L|S, ·, ·) -> (B, ·, L|S, ·)
    expected = spec.sdpa_vjp(*heads_first, attend_mask=spec.window_mask(4, 3, (1, -1), causal=True),
                             additive_mask=spec.alibi_bias(4, 3, slopes))
    for got, want in zip(grads, expected[:3], strict=True):
        assert_close("grad", got, np.swapaxes(want, 1, 2), atol=1e-15, rtol=1e-14)


# ---------------------------------------------------------------- invalid inputs

rng = np.random.default_rng(10)
Q, K, V = random_qkv(rng)
CU = np.array([0, 1, 3])
INVALID_CALLS = [
    (lambda: spec.flash_attention(Q, K, V, window=(-2, 0)), "window[0]=-2", ">= -1"),
    (lambda: spec.flash_attention(Q, K, V, window=3), "window=3", "(left, right) pair"),
    (lambda: spec.flash_attention(Q, K, V, causal="lower_right"), "causal='lower_right'", "alignment="),
    (lambda: spec.flash_attention(Q, K, V, alignment="bottom_right"), "alignment='bottom_right'", "'upper_left'"),
    (lambda: spec.flash_attention(Q, K, V, softcap=-1.0), "softcap=-1.0", ">= 0"),
    (lambda: spec.flash_attention(Q, K, V, alibi_slopes=np.ones(3)), "alibi_slopes=<array shape=(3,)", "(N,) = (4,)"),
    (lambda: spec.flash_attention(Q[0], K[0], V[0]), "query=", "rank 4"),
    (lambda: spec.flash_attention(Q[:, :, :3], K, V), "key=", "multiple of kv heads"),
    (lambda: spec.flash_attention(Q, K[..., :2], V), "key=", "must equal query's E=3"),
    (lambda: spec.flash_attention(Q, K[:, :0], V[:, :0], fully_masked="uniform"), "fully_masked='uniform'", "S=0"),
    (lambda: spec.flash_attention_vjp(Q, K, V, np.zeros((2, 3, 4, 3))), "grad_output=", "output's shape"),
    (lambda: spec.varlen_attention(Q[0], K[0], V[0], [1, 3], [0, 4]), "cu_seqlens_q=[1, 3]", "start at 0"),
    (lambda: spec.varlen_attention(Q[0], K[0], V[0], [0, 2, 1, 3], [0, 1, 2, 4]), "cu_seqlens_q=[0, 2, 1, 3]", "non-decreasing"),
    (lambda: spec.varlen_attention(Q[0], K[0], V[0], CU, [0, 1, 2]), "cu_seqlens_k=[0, 1, 2]", "total_k=4"),
    (lambda: spec.varlen_attention(Q[0], K[0], V[0], CU, [0, 4]), "cu_seqlens_k=[0, 4]", "as many entries"),
    (lambda: spec.varlen_attention(Q[0], K[0], V[0], [0.0, 3.0], [0, 4]), "cu_seqlens_q=", "ints"),
    (lambda: spec.varlen_attention(Q[0], K[0], V[0], [3], [4]), "cu_seqlens_q=[3]", "at least one sequence"),
    (lambda: spec.kvcache_attention(Q, K, V, cache_seqlens=3, k=K[:, :2], v=V[:, :2]), "cache_seqlens=[3, 3]", "capacity=4"),
    (lambda: spec.kvcache_attention(Q, K, V, cache_seqlens=1, k=K[:, :2]), "v=None", "together"),
    (lambda: spec.kvcache_attention(Q, K, V, k=K[:, :1], v=V[:, :1]), "cache_seqlens=None", "must be given"),
    (lambda: spec.kvcache_attention(Q, K, V, block_table=[[0, 9], [1, 2]]), "block_table=", "num_pages=2"),
    (lambda: spec.kvcache_attention(Q, K[:1], V[:1], block_table=[[0], [0]], cache_seqlens=[0, 0], k=K[:, :1],
                                    v=V[:, :1]), "block_table=", "both write page 0 slot 0"),
    (lambda: spec.merge_partials(Q, np.zeros((2, 4, 3)), Q, np.full((2, 4, 3), np.inf)), "lse2=", "+inf"),
    (lambda: spec.merge_partials(Q, np.zeros((2, 3, 4)), Q, np.zeros((2, 3, 4))), "lse1=", "(2, 4, 3)"),
]


@pytest.mark.parametrize("call,shown,rule", INVALID_CALLS, ids=[c[1] + " " + c[2] for c in INVALID_CALLS])
def test_invalid_inputs_raise_spec_error(call, shown, rule):
    with pytest.raises(spec.SpecError) as info:
        call()
    message = str(info.value)
    assert shown in message and rule in message and "Fix:" in message, message
