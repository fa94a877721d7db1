"""The varlen / kvcache levels: the ``varlen-reference`` built-in agrees with the spec and
its claims are true, and FlashAttention's signatures are recognised with no adapter."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

import spec
from implementations import registry
from implementations.builtins.references.varlen_reference import (
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)

DTYPE_TOLERANCE = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-2, "bfloat16": 5e-2}


def _packed(rng, lengths, N=4, K=2, E=3, Ev=5):
    T_q, T_k = sum(L for L, _ in lengths), sum(S for _, S in lengths)
    return (rng.standard_normal((T_q, N, E)), rng.standard_normal((T_k, K, E)), rng.standard_normal((T_k, K, Ev)),
            np.cumsum([0] + [L for L, _ in lengths]), np.cumsum([0] + [S for _, S in lengths]))


@pytest.mark.parametrize("dtype", sorted(DTYPE_TOLERANCE))
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_agrees_with_the_spec(dtype, causal):
    rng = np.random.default_rng(1)
    lengths = [(2, 3), (0, 2), (1, 0), (3, 1), (1, 1)]       # empty queries, no keys, L > S
    q, k, v, cu_q, cu_k = _packed(rng, lengths)
    t = getattr(torch, dtype)
    args = [torch.tensor(x).to(t) for x in (q, k, v)]
    got = flash_attn_varlen_func(*args, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32),
                                 3, 3, softmax_scale=0.7, causal=causal)
    assert got.dtype == t and got.shape == (q.shape[0], 4, 5)
    stored = [x.double().numpy() for x in args]
    want = spec.varlen_attention(*stored, cu_q, cu_k, causal=causal, scale=0.7)
    np.testing.assert_allclose(got.double().numpy(), want, atol=DTYPE_TOLERANCE[dtype], rtol=DTYPE_TOLERANCE[dtype])


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_agrees_with_the_spec_and_appends_in_place(paged, causal):
    rng = np.random.default_rng(2)
    B, L, N, K, E, Ev, new, page_size = 3, 2, 4, 2, 3, 3, 2, 3
    seqlens = np.array([0, 4, 7])
    q = rng.standard_normal((B, L, N, E))
    table = None
    if paged:
        table = rng.permutation(B * 3 + 2)[:B * 3].reshape(B, 3)              # shuffled, 2 spare pages
        shape = (B * 3 + 2, page_size)
    else:
        shape = (B, 9)
    k_cache, v_cache = rng.standard_normal((*shape, K, E)), rng.standard_normal((*shape, K, Ev))
    k_new, v_new = rng.standard_normal((B, new, K, E)), rng.standard_normal((B, new, K, Ev))
    want = spec.kvcache_attention(q, k_cache, v_cache, cache_seqlens=seqlens, k=k_new, v=v_new,
                                  block_table=table, causal=causal)
    k_t, v_t = torch.tensor(k_cache), torch.tensor(v_cache)
    got = flash_attn_with_kvcache(torch.tensor(q), k_t, v_t, torch.tensor(k_new), torch.tensor(v_new),
                                  cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
                                  block_table=None if table is None else torch.tensor(table, dtype=torch.int32),
                                  causal=causal)
    np.testing.assert_allclose(got.numpy(), want.output, atol=1e-12, rtol=1e-12)
    assert np.array_equal(k_t.numpy(), want.k_cache) and np.array_equal(v_t.numpy(), want.v_cache)


def test_options_it_does_not_implement_raise():
    rng = np.random.default_rng(3)
    q, k, v, cu_q, cu_k = (torch.tensor(x) for x in _packed(rng, [(1, 1)]))
    with pytest.raises(NotImplementedError, match="block_table"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 1, block_table=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 1, dropout_p=1.0)
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 1, window_size=(-2, 0))
    with pytest.raises(ValueError, match="softcap"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 1, softcap=-1.0)
    cache = torch.zeros(1, 2, 2, 3)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(torch.zeros(1, 1, 4, 3), cache, cache, torch.zeros(1, 1, 2, 3), torch.zeros(1, 1, 2, 3),
                                cache_seqlens=torch.tensor([2], dtype=torch.int32))


def test_builtin_declares_both_levels_only():
    impl = registry.resolve("varlen-reference")
    assert impl.varlen is flash_attn_varlen_func and impl.kvcache is flash_attn_with_kvcache
    assert impl.sdpa is None and impl.mha is None
    c = impl.capabilities
    assert (c.causal, c.fully_masked, c.gqa, c.different_v_dim, c.kv_paged, c.kv_append) == (
        "lower_right", "zero", True, True, True, True)
    assert impl.not_supported_reasons({"level": "sdpa"}) == ["varlen-reference has no SDPA-level callable"]
    assert impl.not_supported_reasons({"level": "kvcache", "kv_paged": True, "dtype": "float16"}) == []


FLASH_SOURCE = textwrap.dedent(
    """
    from implementations.builtins.references.varlen_reference import flash_attn_varlen_func as _varlen
    from implementations.builtins.references.varlen_reference import flash_attn_with_kvcache as _kvcache

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False):
        return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       softmax_scale=softmax_scale, causal=causal)

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                                block_table=None, softmax_scale=None, causal=False):
        return _kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                        block_table=block_table, softmax_scale=softmax_scale, causal=causal)

    def decode_only(q, k_cache, v_cache, cache_seqlens=None):
        return _kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens)
    """
)


def test_flash_signatures_are_recognised_without_an_adapter(tmp_path):
    path = tmp_path / "user_flash.py"
    path.write_text(FLASH_SOURCE)
    varlen = registry.resolve(f"{path}:flash_attn_varlen_func")
    assert varlen.varlen.__name__ == "flash_attn_varlen_func" and varlen.kvcache is None and varlen.sdpa is None
    kvcache = registry.resolve(f"{path}:flash_attn_with_kvcache")
    assert kvcache.kvcache.__name__ == "flash_attn_with_kvcache" and kvcache.varlen is None
    assert (kvcache.capabilities.causal, kvcache.capabilities.kv_paged, kvcache.capabilities.kv_append) == (
        "lower_right", True, True)
    assert varlen.capabilities.varlen_features == {"dropout"}          # its dropout_p parameter
    assert kvcache.capabilities.varlen_features == frozenset()
    declared = registry.resolve(f"{path}:flash_attn_varlen_func", {"varlen_features": "window"})
    assert declared.capabilities.varlen_features == {"window"}
    bare = registry.resolve(f"{path}:decode_only")
    c = bare.capabilities
    assert (c.causal, c.custom_scale, c.kv_paged, c.kv_append) == (None, False, False, False)
    overridden = registry.resolve(f"{path}:decode_only", {"kv_paged": "true"})
    assert overridden.capabilities.kv_paged is True


def test_varlen_dropout_draws_a_pattern_per_sequence_and_keeps_the_lse():
    rng = np.random.default_rng(5)
    q, k, v, cu_q, cu_k = _packed(rng, [(2, 6), (2, 6)])
    v = np.abs(v) + 0.5
    q[2:], k[6:], v[6:] = q[:2], k[:6], v[:6]                        # two identical sequences
    args = [torch.tensor(x) for x in (q, k, v)] + [torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k)]
    torch.manual_seed(0)
    out, lse, _ = flash_attn_varlen_func(*args, 2, 6, dropout_p=0.5, return_attn_probs=True)
    _, plain_lse, _ = flash_attn_varlen_func(*args, 2, 6, return_attn_probs=True)
    assert not torch.equal(out[:2], out[2:]), "two identical packed sequences dropped the same weights"
    assert torch.equal(lse, plain_lse), "dropout changed the LSE (it acts after the softmax)"
    torch.manual_seed(0)
    again = flash_attn_varlen_func(*args, 2, 6, dropout_p=0.5)
    assert torch.equal(out, again), "the pattern does not follow torch's generator"


def test_varlen_dropout_returns_each_sequences_pattern_at_its_own_row():
    """S_dmask (B, N, max_seqlen_q, max_seqlen_k): sequence b's weights at [b, :, :L_b, :S_b],
    negated where dropped, 0 in the padding; the output is exactly that pattern's; without
    dropout the third result is None."""
    rng = np.random.default_rng(7)
    lengths = [(2, 5), (0, 3), (3, 2), (1, 0)]                       # empty queries, no keys, L > S
    q, k, v, cu_q, cu_k = _packed(rng, lengths)
    args = [torch.tensor(x) for x in (q, k, v)] + [torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k)]
    torch.manual_seed(3)
    out, _, s_dmask = flash_attn_varlen_func(*args, 3, 5, dropout_p=0.5, return_attn_probs=True, causal=True)
    assert tuple(s_dmask.shape) == (4, 4, 3, 5) and s_dmask.dtype == out.dtype
    probs = s_dmask.numpy()
    dropped = 0
    for b, (L, S) in enumerate(lengths):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        padding = np.ones(probs.shape[1:], dtype=bool)
        padding[:, :L, :S] = False
        assert not probs[b][padding].any(), f"sequence {b}: S_dmask's padding is not 0"
        if L == 0 or S == 0:
            continue
        problem = spec.flash.prepare(q[None, rows], k[None, keys], v[None, keys], causal=True)
        weights = spec.flash.attend(problem).weights[0]                                # (N, L, S)
        np.testing.assert_allclose(np.abs(probs[b, :, :L, :S]), weights, atol=1e-15)
        keep = ~(probs[b, :, :L, :S] < 0)
        dropped += int((~keep).sum())
        want = spec.flash_attention(q[None, rows], k[None, keys], v[None, keys], causal=True, dropout_p=0.5,
                                    dropout_mask=keep[None])[0]
        np.testing.assert_allclose(out.numpy()[rows], want, atol=1e-12)
    assert dropped, "no weight was dropped with dropout_p=0.5"
    assert flash_attn_varlen_func(*args, 3, 5, return_attn_probs=True)[2] is None


def test_the_varlen_dropout_pattern_is_declared_not_read_from_the_signature(tmp_path):
    """FlashAttention-2's own signature (dropout_p and return_attn_probs) claims dropout, not
    the pattern: its docstring calls return_attn_probs "for testing only"; declared, it is."""
    path = tmp_path / "user_flash.py"
    path.write_text(textwrap.dedent(
        """
        from implementations.builtins.references.varlen_reference import flash_attn_varlen_func as _varlen

        def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   dropout_p=0.0, softmax_scale=None, causal=False, return_attn_probs=False):
            return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=dropout_p,
                           softmax_scale=softmax_scale, causal=causal, return_attn_probs=return_attn_probs)
        """))
    assert "dropout_pattern" in registry.resolve("varlen-reference").caps("varlen").varlen_features
    recognised = registry.resolve(f"{path}:flash_attn_varlen_func")
    assert recognised.capabilities.varlen_features == {"dropout"}
    declared = registry.resolve(f"{path}:flash_attn_varlen_func", {"varlen_features": "dropout,dropout_pattern"})
    assert declared.capabilities.varlen_features == {"dropout", "dropout_pattern"}


FP8_KVCACHE_SOURCE = textwrap.dedent(
    """
    from implementations.builtins.references.varlen_reference import flash_attn_with_kvcache as _kvcache

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, q_descale=None,
                                k_descale=None, v_descale=None, softmax_scale=None, causal=False):
        return _kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, q_descale=q_descale,
                        k_descale=k_descale, v_descale=v_descale, softmax_scale=softmax_scale, causal=causal)
    """
)


def test_kvcache_descale_parameters_claim_fp8(tmp_path):
    """FlashAttention-3's descale parameters at the kvcache level claim 'fp8' in e4m3 with
    none or (B, K) descales (its contract); without them, no FP8 is claimed."""
    path = tmp_path / "user_fa3.py"
    path.write_text(FP8_KVCACHE_SOURCE)
    c = registry.resolve(f"{path}:flash_attn_with_kvcache").capabilities
    assert "fp8" in c.kvcache_features and c.fp8_dtypes == ("float8_e4m3fn",)
    assert set(c.fp8_descales) == {"none", "per_head"}
    path.with_name("user_fa2.py").write_text(FLASH_SOURCE)
    plain = registry.resolve(f"{path.with_name('user_fa2.py')}:flash_attn_with_kvcache").capabilities
    assert "fp8" not in plain.kvcache_features and plain.fp8_dtypes == ()


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_fp8_dequantises_row_b_for_cached_and_appended_keys(paged):
    """FP8 q, caches and new keys with (B, K) descales: the bfloat16 output equals
    spec.kvcache_attention with those descales, and the caches hold the stored new keys."""
    rng = np.random.default_rng(9)
    fmt, B, K = "float8_e4m3fn", 2, 2
    q, k_cache, v_cache, k_new, v_new = (spec.fp8.quantize(rng.standard_normal(s) * 4, fmt) for s in
                                         ((B, 2, 4, 3), (B, 4, K, 3), (B, 4, K, 2), (B, 1, K, 3), (B, 1, K, 2)))
    descales = {n: 2.0 ** rng.integers(-3, 3, (B, K)).astype(float) for n in ("q_descale", "k_descale", "v_descale")}
    seqlens = np.array([2, 0])
    table = np.array([[3, 0], [1, 2]]) if paged else None
    want = spec.kvcache_attention(q, k_cache, v_cache, cache_seqlens=seqlens, k=k_new, v=v_new, causal=True,
                                  **descales)
    f8 = torch.float8_e4m3fn
    caches = [torch.tensor(x).to(f8) for x in (k_cache, v_cache)]
    if paged:
        caches = [torch.tensor(np.concatenate([x[0, 2:], x[1, :2], x[1, 2:], x[0, :2]]).reshape(4, 2, K, -1)).to(f8)
                  for x in (k_cache, v_cache)]
    out = flash_attn_with_kvcache(torch.tensor(q).to(f8), *caches, torch.tensor(k_new).to(f8),
                                  torch.tensor(v_new).to(f8), cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
                                  block_table=None if table is None else torch.tensor(table, dtype=torch.int32),
                                  causal=True, **{n: torch.tensor(d, dtype=torch.float32) for n, d in descales.items()})
    assert out.dtype == torch.bfloat16
    np.testing.assert_allclose(out.double().numpy(), want.output, rtol=2.0 ** -7, atol=1e-6)
    logical = [c.double().numpy() if not paged else spec.gather_pages(c.double().numpy(), table) for c in caches]
    np.testing.assert_array_equal(logical[0], want.k_cache)
    np.testing.assert_array_equal(logical[1], want.v_cache)
    with pytest.raises(ValueError, match="rotary"):
        flash_attn_with_kvcache(torch.tensor(q).to(f8), *caches, torch.tensor(k_new).to(f8), torch.tensor(v_new).to(f8),
                                rotary_cos=torch.ones(8, 1), rotary_sin=torch.zeros(8, 1),
                                cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
                                block_table=None if table is None else torch.tensor(table, dtype=torch.int32))
