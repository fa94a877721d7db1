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
from implementations.builtins.varlen_reference import flash_attn_varlen_func, flash_attn_with_kvcache

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
    assert impl.caps("varlen").varlen_features == {"window", "softcap", "alibi", "lse"}
    assert {"window", "softcap", "alibi", "lse"} <= impl.caps("kvcache").kvcache_features
    assert Capabilities().varlen_features == frozenset() and Capabilities().kvcache_features == frozenset()
    reasons = impl.not_supported_reasons({"level": "varlen", "varlen_features": {"window"}})
    assert reasons == []
    import dataclasses

    plain = dataclasses.replace(impl, capabilities=impl.capabilities.replace(varlen_features=frozenset()))
    assert plain.not_supported_reasons({"level": "varlen", "varlen_features": {"window"}}) == [
        "varlen features not supported: ['window']"]
