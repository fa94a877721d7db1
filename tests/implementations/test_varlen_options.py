"""FlashAttention's options at the varlen and kvcache levels: the ``varlen-reference``
built-in honours window_size, softcap, alibi_slopes and the LSE as spec.varlen_attention /
spec.kvcache_attention define them (packed and paged included) and declares them; a
default Capabilities claims none of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import spec
from implementations import registry
from implementations.base import Capabilities
from implementations.builtins.references.varlen_reference import flash_attn_varlen_func, flash_attn_with_kvcache

OPTIONS = [{"window": (1, 0)}, {"window": (0, 2), "causal": True}, {"softcap": 0.6},
           {"softcap": 0.8, "causal": True, "window": (2, -1)}, {"alibi_slopes": np.array([0.5, -0.25, 1.0, 0.0])},
           {"alibi_slopes": "per_batch", "causal": True}]


def _kwargs(options, slopes):
    kwargs = {"causal": options.get("causal", False), "window_size": options.get("window", (-1, -1)),
              "softcap": options.get("softcap", 0.0)}
    if slopes is not None:
        kwargs["alibi_slopes"] = torch.tensor(slopes)
    return kwargs


def _spec_options(options, slopes):
    return {"causal": options.get("causal", False), "window": options.get("window", (-1, -1)),
            "softcap": options.get("softcap", 0.0), "alibi_slopes": slopes}


def _slopes(options, rng, B):
    slopes = options.get("alibi_slopes")
    if isinstance(slopes, str):
        return rng.uniform(-1, 1, (B, 4))
    return slopes


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o))
def test_varlen_options_and_lse_agree_with_the_spec(options):
    rng = np.random.default_rng(2)
    lengths = [(2, 3), (0, 2), (1, 0), (3, 1), (2, 5)]
    T_q, T_k = sum(L for L, _ in lengths), sum(S for _, S in lengths)
    q, k, v = rng.standard_normal((T_q, 4, 3)), rng.standard_normal((T_k, 2, 3)), rng.standard_normal((T_k, 2, 3))
    cu_q, cu_k = np.cumsum([0] + [L for L, _ in lengths]), np.cumsum([0] + [S for _, S in lengths])
    slopes = _slopes(options, rng, len(lengths))
    want = spec.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, **_spec_options(options, slopes))
    out, lse, _ = flash_attn_varlen_func(torch.tensor(q), torch.tensor(k), torch.tensor(v),
                                         torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32),
                                         3, 5, return_attn_probs=True, **_kwargs(options, slopes))
    np.testing.assert_allclose(out.numpy(), want.output, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse.numpy()), np.isneginf(want.lse))
    finite = np.isfinite(want.lse)
    np.testing.assert_allclose(lse.numpy()[finite], want.lse[finite], atol=1e-12)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o))
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_options_and_lse_agree_with_the_spec(options, paged):
    rng = np.random.default_rng(3)
    B, L, S_cache, new = 3, 2, 6, 1
    seqlens = np.array([0, 3, 5])
    q = rng.standard_normal((B, L, 4, 3))
    if paged:  # pages of 2, in reverse order
        table = np.arange(B * 3)[::-1].reshape(B, 3).copy()
        k_cache, v_cache = rng.standard_normal((B * 3, 2, 2, 3)), rng.standard_normal((B * 3, 2, 2, 3))
    else:
        table = None
        k_cache, v_cache = rng.standard_normal((B, S_cache, 2, 3)), rng.standard_normal((B, S_cache, 2, 3))
    k_new, v_new = rng.standard_normal((B, new, 2, 3)), rng.standard_normal((B, new, 2, 3))
    slopes = _slopes(options, rng, B)
    want = spec.kvcache_attention(q, k_cache, v_cache, cache_seqlens=seqlens, k=k_new, v=v_new, block_table=table,
                                  **_spec_options(options, slopes))
    out, lse = flash_attn_with_kvcache(
        torch.tensor(q), torch.tensor(k_cache), torch.tensor(v_cache), torch.tensor(k_new), torch.tensor(v_new),
        cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
        block_table=None if table is None else torch.tensor(table, dtype=torch.int32), return_softmax_lse=True,
        **_kwargs(options, slopes))
    np.testing.assert_allclose(out.numpy(), want.output, atol=1e-12)
    finite = np.isfinite(want.lse)
    np.testing.assert_array_equal(np.isneginf(lse.numpy()), ~finite)
    np.testing.assert_allclose(lse.numpy()[finite], want.lse[finite], atol=1e-12)


def test_the_reference_declares_the_options_and_the_default_claims_none():
    impl = registry.resolve("varlen-reference")
    assert impl.caps("varlen").varlen_features == {"window", "softcap", "alibi", "lse", "dropout", "fp8",
                                                   "dropout_pattern"}
    assert {"window", "softcap", "alibi", "lse"} <= impl.caps("kvcache").kvcache_features
    assert Capabilities().varlen_features == frozenset() and Capabilities().kvcache_features == frozenset()
    reasons = impl.not_supported_reasons({"level": "varlen", "varlen_features": {"window"}})
    assert reasons == []
    import dataclasses

    plain = dataclasses.replace(impl, capabilities=impl.capabilities.replace(varlen_features=frozenset()))
    assert plain.not_supported_reasons({"level": "varlen", "varlen_features": {"window"}}) == [
        "varlen features not supported: ['window']"]


# -- the KV cache's own options: rotary, cache_batch_idx, cache_leftpad, num_splits -----------

CACHE_OPTIONS = [{"rotary": True}, {"rotary": False}, {"rotary": True, "causal": True},
                 {"rotary": True, "window": (1, 0)}, {"batch_idx": True}, {"leftpad": True, "causal": True},
                 {"leftpad": True, "window": (2, 1), "alibi_slopes": np.array([0.5, -0.25, 1.0, 0.0])},
                 {"num_splits": 3, "causal": True}, {"num_splits": 2, "softcap": 0.7},
                 {"rotary": True, "batch_idx": True, "leftpad": True, "num_splits": 4, "causal": True}]


def _cache_call(options, dtype, rng):
    """(spec's KVCacheResult on the values as stored, the reference's (out, lse), caches after)."""
    t = getattr(torch, dtype)
    B, L, new, N, K, E = 3, 2, 2, 4, 2, 6
    rows = 5 if options.get("batch_idx") else B
    seqlens = np.array([0, 3, 5])
    arrays = {"q": rng.standard_normal((B, L, N, E)), "k_cache": rng.standard_normal((rows, 8, K, E)),
              "v_cache": rng.standard_normal((rows, 8, K, 3)), "k": rng.standard_normal((B, new, K, E)),
              "v": rng.standard_normal((B, new, K, 3))}
    stored = {name: torch.tensor(a).to(t) for name, a in arrays.items()}
    values = {name: x.double().numpy() for name, x in stored.items()}
    spec_kw, call_kw = {}, {}
    if "rotary" in options:
        angle = rng.uniform(0, 2 * np.pi, (10, 2))
        cos, sin = torch.tensor(np.cos(angle)).to(t), torch.tensor(np.sin(angle)).to(t)
        spec_kw.update(rotary_cos=cos.double().numpy(), rotary_sin=sin.double().numpy(),
                       rotary_interleaved=options["rotary"])
        call_kw.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=options["rotary"])
    if options.get("batch_idx"):
        spec_kw["cache_batch_idx"], call_kw["cache_batch_idx"] = [4, 0, 2], torch.tensor([4, 0, 2], dtype=torch.int32)
    if options.get("leftpad"):
        spec_kw["cache_leftpad"], call_kw["cache_leftpad"] = [0, 2, 3], torch.tensor([0, 2, 3], dtype=torch.int32)
    if "num_splits" in options:
        spec_kw["num_splits"] = call_kw["num_splits"] = options["num_splits"]
    slopes = options.get("alibi_slopes")
    want = spec.kvcache_attention(values["q"], values["k_cache"], values["v_cache"], cache_seqlens=seqlens,
                                  k=values["k"], v=values["v"], **_spec_options(options, slopes), **spec_kw)
    got = flash_attn_with_kvcache(stored["q"], stored["k_cache"], stored["v_cache"], stored["k"], stored["v"],
                                  cache_seqlens=torch.tensor(seqlens, dtype=torch.int32), return_softmax_lse=True,
                                  **_kwargs(options, slopes), **call_kw)
    return want, got, stored


@pytest.mark.parametrize("options", CACHE_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("dtype,tolerance", [("float64", 1e-12), ("float16", 2e-2)])
def test_cache_options_agree_with_the_spec(options, dtype, tolerance):
    want, (out, lse), stored = _cache_call(options, dtype, np.random.default_rng(4))
    assert out.dtype == getattr(torch, dtype)
    np.testing.assert_allclose(out.double().numpy(), want.output, atol=tolerance, rtol=tolerance)
    finite = np.isfinite(want.lse)
    np.testing.assert_array_equal(np.isneginf(lse.numpy()), ~finite)
    np.testing.assert_allclose(lse.double().numpy()[finite], want.lse[finite], atol=tolerance, rtol=tolerance)
    np.testing.assert_allclose(stored["k_cache"].double().numpy(), want.k_cache, atol=tolerance, rtol=tolerance)
    np.testing.assert_array_equal(stored["v_cache"].double().numpy(), want.v_cache)


def test_cache_options_outside_the_contract_raise():
    rng = np.random.default_rng(5)
    q, cache = torch.tensor(rng.standard_normal((2, 1, 2, 4))), torch.tensor(rng.standard_normal((3, 4, 1, 4)))
    new = torch.tensor(rng.standard_normal((2, 1, 1, 4)))
    seqlens = torch.tensor([1, 2], dtype=torch.int32)
    table = torch.ones(6, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="only with new keys"):
        flash_attn_with_kvcache(q, cache[:2], cache[:2], rotary_cos=table, rotary_sin=table, cache_seqlens=seqlens)
    with pytest.raises(ValueError, match="rotary tables of 2 rows"):
        flash_attn_with_kvcache(q, cache[:2], cache[:2], new, new, rotary_cos=table[:2], rotary_sin=table[:2],
                                cache_seqlens=seqlens)
    with pytest.raises(ValueError, match="distinct"):
        flash_attn_with_kvcache(q, cache, cache, new, new, cache_seqlens=seqlens,
                                cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_leftpad"):
        flash_attn_with_kvcache(q, cache[:2], cache[:2], cache_seqlens=seqlens,
                                cache_leftpad=torch.tensor([2, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="num_splits"):
        flash_attn_with_kvcache(q, cache[:2], cache[:2], cache_seqlens=seqlens, num_splits=-1)


def test_the_reference_declares_the_cache_options_and_signatures_claim_theirs(tmp_path):
    impl = registry.resolve("varlen-reference")
    assert impl.caps("kvcache").kvcache_features == {"window", "softcap", "alibi", "lse", "rotary",
                                                     "cache_batch_idx", "cache_leftpad", "num_splits", "fp8"}
    source = tmp_path / "user_kvcache.py"
    source.write_text(
        "from implementations.builtins.references.varlen_reference import flash_attn_with_kvcache as _kv\n\n"
        "def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,\n"
        "                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,\n"
        "                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,\n"
        "                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,\n"
        "                            return_softmax_lse=False, q_descale=None, k_descale=None, v_descale=None):\n"
        "    return _kv(**locals())\n\n"
        "def only_cos(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, cache_seqlens=None, num_splits=0):\n"
        "    return _kv(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, num_splits=num_splits)\n")
    full = registry.resolve(f"{source}:flash_attn_with_kvcache")
    assert full.caps("kvcache").kvcache_features == impl.caps("kvcache").kvcache_features
    assert full.caps("kvcache").fp8_dtypes == ("float8_e4m3fn",)          # FlashAttention-3's descales
    partial = registry.resolve(f"{source}:only_cos")
    assert partial.caps("kvcache").kvcache_features == {"num_splits"}        # rotary needs both tables
    declared = registry.resolve(f"{source}:flash_attn_with_kvcache",
                                {"kvcache_features": "window,rotary", "rotary_dim_multiple": "16"})
    assert declared.caps("kvcache").kvcache_features == {"window", "rotary"}
    assert declared.caps("kvcache").rotary_dim_multiple == 16
    from implementations.registry.describing import describe

    assert "kvcache_features=rotary,window rotary_dim_multiple=16" in describe(declared)
    with pytest.raises(Exception, match="rotary_dim_multiple"):
        Capabilities(rotary_dim_multiple=3)
