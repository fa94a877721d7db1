"""spec.variants at the flash, varlen and kvcache levels: the step-switched kernel with no
switch is the spec; each variant reproduces, brute force, its bug-zoo mutant run through
torch (on the mutant's smallest case and on random problems: output, LSE and the caches
after the call); a few are worked out by hand; ``rank`` names each first on its mutant's
output and nothing on a correct one; a variant that does not apply is the oracle.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import spec
from flash_variant_cases import MUTANT_OF, observed_parts, run_mutant, smallest_problem
from spec import variants as V

FAMILY_IDS = [v.id for v in (*V.FLASH_VARIANTS, *V.VARLEN_VARIANTS, *V.KVCACHE_VARIANTS)]
#: Variants with exactly the same output as the key's on its mutant's smallest case.
TIES: dict[str, set[str]] = {
    # L = 2 queries, one valid key after a pad of 1, causal: a diagonal moved right by the pad
    # is the top-left one (query 0 sees the key); a case where L != the pad + 1 tells them apart
    "kvcache_leftpad_causal_offset": {"kvcache_causal_upper_left"},
}


def assert_parts_equal(got: dict, want: V.VariantResult, what: str, tol: float = 1e-12) -> None:
    for part, value in got.items():
        expected = getattr(want, part)
        assert expected is not None and expected.shape == value.shape, (what, part)
        np.testing.assert_allclose(value, expected, rtol=tol, atol=tol, equal_nan=True, err_msg=f"{what}: {part}")


def differs_from_reference(got: dict, problem) -> bool:
    ref = V.reference(problem)
    return any(not np.allclose(value, getattr(ref, part), rtol=1e-9, atol=1e-9, equal_nan=True)
               for part, value in got.items())


# --------------------------------------------------------------------------- the table


def test_every_family_variant_has_a_mutant_case_and_the_level_prefix():
    assert set(FAMILY_IDS) == set(MUTANT_OF)
    for variant_id in FAMILY_IDS:
        variant = V.VARIANTS[variant_id]
        assert variant.id.startswith(variant.level + "_") and variant.deterministic
        assert variant.level in V.FLASH_FAMILY


# --------------------------------------------------------------------------- the mutants, brute force


@pytest.mark.parametrize("variant_id", FAMILY_IDS)
def test_the_variant_is_its_mutant_on_the_mutants_smallest_case(variant_id):
    problem, variant = smallest_problem(variant_id), V.VARIANTS[variant_id]
    got = run_mutant(MUTANT_OF[variant_id], problem)
    assert differs_from_reference(got, problem), "the smallest case does not expose the bug"
    assert variant.applies(problem)
    assert_parts_equal(got, variant.compute(problem), variant_id)


@pytest.mark.parametrize("variant_id", FAMILY_IDS)
def test_rank_names_the_variant_first_on_its_mutants_output(variant_id):
    problem = smallest_problem(variant_id)
    matches = V.rank(run_mutant(MUTANT_OF[variant_id], problem), problem)
    assert matches, variant_id
    best = {m.variant_id for m in matches if m.fit == matches[0].fit}
    assert variant_id in best and best - {variant_id} <= TIES.get(variant_id, set()), matches


def _random_flash(rng: np.random.Generator) -> V.FlashProblem:
    B, L, S, K = (int(x) for x in (rng.integers(1, 3), rng.integers(1, 5), rng.integers(1, 6), rng.integers(1, 3)))
    N, E, Ev = K * int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.integers(1, 4))

    def float32(x):
        return x.astype(np.float32).astype(np.float64)

    q, k, v = rng.standard_normal((B, L, N, E)), rng.standard_normal((B, S, K, E)), rng.standard_normal((B, S, K, Ev))
    return V.FlashProblem(q, k, v, causal=bool(rng.integers(2)),
                          window=(int(rng.integers(-1, 3)), int(rng.integers(-1, 3))),
                          softcap=float(rng.choice([0.0, 0.5, 2.0])),
                          alibi_slopes=float32(rng.standard_normal(N)) if rng.integers(2) else None,
                          scale=None if rng.integers(2) else 0.7,
                          sinks=float32(rng.standard_normal(N)) if rng.integers(2) else None)


def _random_varlen(rng: np.random.Generator) -> V.VarlenProblem:
    B, K = int(rng.integers(1, 4)), int(rng.integers(1, 3))
    N, E, Ev = K * int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.integers(1, 4))
    Ls, Ss = rng.integers(0, 4, B), rng.integers(0, 5, B)
    Ls[0] = max(Ls[0], 1)
    cu_q = tuple(int(x) for x in np.concatenate([[0], np.cumsum(Ls)]))
    cu_k = tuple(int(x) for x in np.concatenate([[0], np.cumsum(Ss)]))
    q, k = rng.standard_normal((cu_q[-1], N, E)), rng.standard_normal((cu_k[-1], K, E))
    return V.VarlenProblem(q, k, rng.standard_normal((cu_k[-1], K, Ev)), cu_q, cu_k, causal=bool(rng.integers(2)),
                           window=(int(rng.integers(-1, 3)), int(rng.integers(-1, 3))),
                           softcap=float(rng.choice([0.0, 0.5, 2.0])),
                           alibi_slopes=rng.standard_normal(N).astype(np.float32).astype(float)
                           if rng.integers(2) else None, scale=None if rng.integers(2) else 0.7)


def _random_kvcache(rng: np.random.Generator, huge: bool = False) -> V.KVCacheProblem:
    B, K = int(rng.integers(1, 4)), int(rng.integers(1, 3))
    N, E, Ev = K * int(rng.integers(1, 3)), 2 * int(rng.integers(1, 3)), int(rng.integers(1, 4))
    L, new = int(rng.integers(1, 4)), int(rng.integers(0, 3))
    S_cache = int(rng.integers(new + 1, 7))
    seqlens = tuple(int(x) for x in rng.integers(0, S_cache - new + 1, B))
    options: dict = {}
    table = None
    if rng.integers(2):
        size = int(rng.choice([d for d in range(1, S_cache + 1) if S_cache % d == 0]))
        pages = B * (S_cache // size) + int(rng.integers(0, 3))
        table = rng.permutation(pages)[:B * (S_cache // size)].reshape(B, -1)
        rows = (pages, size)
    else:
        rows = (B + int(rng.integers(0, 2)), S_cache)
        if rows[0] > B or rng.integers(2):
            options["cache_batch_idx"] = tuple(int(x) for x in rng.permutation(rows[0])[:B])
        if rng.integers(2):
            options["cache_leftpad"] = tuple(int(rng.integers(0, n + 1)) for n in seqlens)
    spread = 60.0 if huge else 1.0                         # huge: logits far beyond exp's range
    k_cache = spread * rng.standard_normal((*rows, K, E))
    if new and rng.integers(2):
        angle = rng.uniform(0, 6, (S_cache + L + 2, int(rng.integers(1, E // 2 + 1))))
        options.update(rotary_cos=np.cos(angle), rotary_sin=np.sin(angle), rotary_interleaved=bool(rng.integers(2)))
    return V.KVCacheProblem(
        spread * rng.standard_normal((B, L, N, E)), k_cache, rng.standard_normal((*rows, K, Ev)), seqlens,
        k_new=rng.standard_normal((B, new, K, E)) if new else None,
        v_new=rng.standard_normal((B, new, K, Ev)) if new else None, block_table=table,
        num_splits=int(rng.integers(0, 4)) if (huge or rng.integers(2)) else None, causal=bool(rng.integers(2)),
        window=(int(rng.integers(-1, 3)), int(rng.integers(-1, 3))),
        softcap=0.0 if huge else float(rng.choice([0.0, 0.5, 2.0])),
        alibi_slopes=rng.standard_normal(N).astype(np.float32).astype(float) if rng.integers(2) else None,
        scale=None if rng.integers(2) else 0.7, **options)


RANDOM = {"flash": _random_flash, "varlen": _random_varlen, "kvcache": _random_kvcache}


@pytest.mark.parametrize("variant_id", FAMILY_IDS)
def test_the_variant_is_its_mutant_on_random_problems(variant_id):
    """On 12 random problems, half of them drawn again until the variant applies (the
    contract mutant's function has no sinks: none drawn for it; the merge without the max
    gets logits beyond exp's range half the time)."""
    variant = V.VARIANTS[variant_id]
    name = MUTANT_OF[variant_id]
    rng = np.random.default_rng(sum(map(ord, variant_id)))

    def draw(i: int):
        if variant_id == "kvcache_split_merge_without_max":
            return RANDOM[variant.level](rng, huge=not i % 2)
        return RANDOM[variant.level](rng)

    shown = 0
    for i in range(12):
        problem = draw(i)
        for _ in range(100 if i % 2 == 0 else 0):
            if variant.applies(problem):
                break
            problem = draw(i)
        if name.startswith("contract_") and problem.sinks is not None:
            problem = V.FlashProblem(problem.query, problem.key, problem.value, causal=problem.causal,
                                     window=problem.window, softcap=problem.softcap,
                                     alibi_slopes=problem.alibi_slopes, scale=problem.scale)
        got = run_mutant(name, problem)
        assert_parts_equal(got, variant.compute(problem), f"{variant_id} on random problem {i}", tol=1e-10)
        if differs_from_reference(got, problem):
            shown += 1
            assert variant.applies(problem), f"{variant_id} differs on random problem {i} where it does not apply"
    assert shown, f"no random problem shows {variant_id}"


# --------------------------------------------------------------------------- the oracle


def test_the_reference_is_the_spec_on_random_problems():
    rng = np.random.default_rng(11)
    for _ in range(40):
        p = _random_flash(rng)
        ref, want = V.reference(p), spec.flash_attention(p.query, p.key, p.value, causal=p.causal, window=p.window,
                                                         softcap=p.softcap, alibi_slopes=p.alibi_slopes,
                                                         scale=p.scale, sinks=p.sinks, return_lse=True)
        np.testing.assert_allclose(ref.output, want.output, rtol=1e-13, atol=1e-13)
        np.testing.assert_array_equal(np.isneginf(ref.lse), np.isneginf(want.lse))
        np.testing.assert_allclose(ref.lse[np.isfinite(want.lse)], want.lse[np.isfinite(want.lse)], rtol=1e-13)
        p = _random_varlen(rng)
        ref = V.reference(p)
        want = spec.varlen_attention(p.query, p.key, p.value, p.cu_seqlens_q, p.cu_seqlens_k, causal=p.causal,
                                     window=p.window, softcap=p.softcap, alibi_slopes=p.alibi_slopes, scale=p.scale,
                                     return_lse=True)
        np.testing.assert_allclose(ref.output, want.output, rtol=1e-13, atol=1e-13)
        np.testing.assert_array_equal(np.isneginf(ref.lse), np.isneginf(want.lse))
        p = _random_kvcache(rng)
        ref, want = V.reference(p), spec.kvcache_attention(**p.spec_arguments())
        np.testing.assert_allclose(ref.output, want.output, rtol=1e-12, atol=1e-13)
        np.testing.assert_array_equal(np.isneginf(ref.lse), np.isneginf(want.lse))
        k_after, v_after = want.k_cache, want.v_cache
        if p.block_table is not None:
            k_after, v_after = spec.gather_pages(k_after, p.block_table), spec.gather_pages(v_after, p.block_table)
        np.testing.assert_allclose(ref.k_cache, k_after, rtol=1e-13, atol=1e-14)
        np.testing.assert_array_equal(ref.v_cache, v_after)


def test_a_variant_that_does_not_apply_is_the_oracle_and_nothing_fits_a_correct_call():
    rng = np.random.default_rng(12)
    for i in range(60):
        level = V.FLASH_FAMILY[i % 3]
        p = RANDOM[level](rng)
        ref = V.reference(p)
        assert V.rank(observed_parts(ref), p) == [], (level, i)
        for variant in V.VARIANTS.values():
            if variant.level == level and not variant.applies(p):
                assert_parts_equal(observed_parts(variant.compute(p)), ref, f"{variant.id} on {level} problem {i}",
                                   tol=1e-12)


# --------------------------------------------------------------------------- by hand


def _softmax(scores: np.ndarray) -> np.ndarray:
    e = np.exp(scores - scores.max())
    return e / e.sum()


def test_flash_variants_by_hand():
    # one query, two keys, causal: bottom-right sees both keys, top-left only key 0
    p = smallest_problem("flash_causal_upper_left")
    q, k, v = p.query[0, 0, 0], p.key[0, :, 0], p.value[0, :, 0]
    np.testing.assert_allclose(V.VARIANTS["flash_causal_upper_left"].compute(p).output[0, 0, 0], v[0])
    np.testing.assert_allclose(V.reference(p).output[0, 0, 0], _softmax(k @ q) @ v)
    # the LSE in base 2 is the natural one over ln 2
    p = smallest_problem("flash_lse_log2")
    ref = V.reference(p)
    np.testing.assert_allclose(V.VARIANTS["flash_lse_log2"].compute(p).lse, ref.lse / math.log(2.0))
    # a kept sink weight is added to every feature; with a value, the first key's value
    p = smallest_problem("flash_sink_weight_kept")
    q, k, v, sink = p.query[0, 0, 0], p.key[0, :, 0], p.value[0, :, 0], p.sinks[0]
    scores = k @ q
    total = np.exp(scores).sum() + np.exp(sink)
    right = (np.exp(scores) / total) @ v
    np.testing.assert_allclose(V.reference(p).output[0, 0, 0], right)
    np.testing.assert_allclose(V.VARIANTS["flash_sink_weight_kept"].compute(p).output[0, 0, 0],
                               right + np.exp(sink) / total)
    np.testing.assert_allclose(V.VARIANTS["flash_sink_with_value"].compute(p).output[0, 0, 0],
                               right + np.exp(sink) / total * v[0])
    # soft-capping before the scale: scale · c·tanh(q·k / c)
    p = smallest_problem("flash_softcap_before_scale")
    q, k, v = p.query[0, 0, 0], p.key[0, :, 0], p.value[0, :, 0]
    c, scale = p.softcap, 1 / math.sqrt(q.shape[-1])
    np.testing.assert_allclose(V.VARIANTS["flash_softcap_before_scale"].compute(p).output[0, 0, 0],
                               _softmax(scale * c * np.tanh(k @ q / c)) @ v)


def test_varlen_and_kvcache_variants_by_hand():
    # sequence 0 (1 query, 1 key) also reads the key of sequence 1 (no queries)
    p = smallest_problem("varlen_neighbour_key")
    q, k, v = p.query[0, 0], p.key[:, 0], p.value[:, 0]
    np.testing.assert_allclose(V.VARIANTS["varlen_neighbour_key"].compute(p).output[0, 0], _softmax(k @ q) @ v)
    np.testing.assert_allclose(V.reference(p).output[0, 0], v[0])
    # the default scale 1/E
    p = smallest_problem("varlen_scale_over_e")
    q, k, v = p.query[0, 0], p.key[:, 0], p.value[:, 0]
    np.testing.assert_allclose(V.VARIANTS["varlen_scale_over_e"].compute(p).output[0, 0],
                               _softmax(k @ q / q.shape[-1]) @ v)
    # one stale row past the valid key (cache_seqlens 0, no new keys, one row of room)
    p = smallest_problem("kvcache_seqlens_off_by_one")
    assert V.reference(p).output[0, 0, 0, 0] == 0.0                     # no key: 0
    np.testing.assert_allclose(V.VARIANTS["kvcache_seqlens_off_by_one"].compute(p).output[0, 0, 0], p.v_cache[0, 0, 0])
    # the new key written at row 0 (over the cached one) and row 1 attended stale
    p = smallest_problem("kvcache_append_at_start")
    result = V.VARIANTS["kvcache_append_at_start"].compute(p)
    np.testing.assert_array_equal(result.k_cache[0, 0], p.k_new[0, 0])
    np.testing.assert_array_equal(result.k_cache[0, 1], p.k_cache[0, 1])
    np.testing.assert_array_equal(V.VARIANTS["kvcache_append_not_written"].compute(p).k_cache, p.k_cache)
    # a split merge without its max: e^900 overflows, inf / inf = NaN
    p = smallest_problem("kvcache_split_merge_without_max")
    assert np.isnan(V.VARIANTS["kvcache_split_merge_without_max"].compute(p).output).all()
    assert np.isfinite(V.reference(p).output).all()


def test_the_problems_name_bad_input():
    q = np.zeros((1, 2, 1, 2))
    with pytest.raises(spec.SpecError, match=r"window\[0\]="):
        V.FlashProblem(q, q, q, window=(-2, 0))
    with pytest.raises(spec.SpecError, match="sinks="):
        V.FlashProblem(q, q, q, sinks=[0.0, 1.0])
    packed = np.zeros((3, 1, 2))
    with pytest.raises(spec.SpecError, match="cu_seqlens_q="):
        V.VarlenProblem(packed, packed, packed, (0, 2), (0, 3))
    cache = np.zeros((1, 2, 1, 2))
    with pytest.raises(spec.SpecError, match="cache_seqlens="):
        V.KVCacheProblem(np.zeros((1, 1, 1, 2)), cache, cache, (3,))
    with pytest.raises(spec.SpecError, match="block_table="):
        V.KVCacheProblem(np.zeros((1, 1, 1, 2)), cache, cache, (1,), block_table=np.zeros((1, 1)))
