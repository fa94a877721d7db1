"""Learned attention sinks in the oracle against brute-force loops (spec/README.md: sinks).

A sink is one logit per query head that joins every row's softmax denominator and carries
no value: ``w_ij = exp(s_ij) / (exp(sink_h) + Σ_j exp(s_ij))``; its own weight is dropped.
Each reference here is written from that definition, one scalar at a time.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import spec
from spec_test_cases import assert_close

CONFIGS = [dict(), dict(causal=True), dict(window=(1, 0)), dict(softcap=0.7), dict(alibi_slopes=[0.5, -0.25]),
           dict(causal=True, window=(1, -1), softcap=0.9, alibi_slopes=[0.3, 0.1], scale=1.3)]


def _allowed(i, j, L, S, window, causal):
    left, right = window
    right = 0 if causal else right
    p = i + S - L
    return (left == -1 or j >= p - left) and (right == -1 or j <= p + right)


def brute_force_sinks(q, k, v, sinks, *, causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None,
                      scale=None):
    """(output (B, L, N, Ev), lse over the keys only (B, N, L)) by the definition, with math.exp
    of shifted logits (the shift cancels) so it never overflows."""
    B, L, N, E = q.shape
    S, K, Ev = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    out, lse = np.zeros((B, L, N, Ev)), np.full((B, N, L), -math.inf)
    for b in range(B):
        for h in range(N):
            kv = h // (N // K)
            for i in range(L):
                scores = {}
                for j in range(S):
                    if not _allowed(i, j, L, S, window, causal):
                        continue
                    s = scale * sum(q[b, i, h, e] * k[b, j, kv, e] for e in range(E))
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    if alibi_slopes is not None:
                        s -= alibi_slopes[h] * abs(i + S - L - j)
                    scores[j] = s
                top = max([sinks[h], *scores.values()])
                denominator = math.exp(sinks[h] - top) + sum(math.exp(s - top) for s in scores.values())
                for j, s in scores.items():
                    out[b, i, h] += math.exp(s - top) / denominator * v[b, j, kv]
                if scores:
                    key_top = max(scores.values())
                    lse[b, h, i] = key_top + math.log(sum(math.exp(s - key_top) for s in scores.values()))
    return out, lse


def _qkv(rng, B=2, L=3, S=4, N=2, K=1, E=3, Ev=2, magnitude=1.0):
    return (magnitude * rng.standard_normal((B, L, N, E)), magnitude * rng.standard_normal((B, S, K, E)),
            rng.standard_normal((B, S, K, Ev)))


@pytest.mark.parametrize("options", CONFIGS)
@pytest.mark.parametrize("L,S", [(3, 4), (4, 2), (1, 1)])
def test_sinks_equal_brute_force(options, L, S):
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, L=L, S=S)
    sinks = np.array([0.75, -2.0])
    got = spec.flash_attention(q, k, v, sinks=sinks, return_lse=True, **options)
    want_out, want_lse = brute_force_sinks(q, k, v, sinks, **{**options, "alibi_slopes": None if
                                           "alibi_slopes" not in options else np.array(options["alibi_slopes"])})
    assert_close("output", got.output, want_out, atol=1e-13, rtol=1e-12, call=str(options))
    assert_close("lse", got.lse, want_lse, atol=1e-13, rtol=1e-12, call=str(options))


def test_lse_is_the_keys_and_unchanged_by_the_sinks():
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng)
    with_sinks = spec.flash_attention(q, k, v, sinks=[3.0, -1.0], causal=True, return_lse=True)
    without = spec.flash_attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_array_equal(with_sinks.lse, without.lse)
    # and the output is the sink-free one scaled by the keys' share exp(lse) / (exp(lse) + exp(sink))
    share = 1.0 / (1.0 + np.exp(np.array([3.0, -1.0])[None, :, None] - without.lse))      # (B, N, L)
    assert_close("output", with_sinks.output, without.output * share.transpose(0, 2, 1)[..., None],
                 atol=1e-14, rtol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_a_sink_equals_a_leading_key_with_zero_value_and_a_fixed_logit(causal):
    """The key is prepended (index 0), with one extra head dim: q' = [q, 1], k' = [k, 0],
    k_sink = [0, sink_h / scale] (one kv head per query head), v_sink = 0. Prepending keeps
    the bottom-right causal rule of every original key (p_i and j both move by one)."""
    rng = np.random.default_rng(5)
    B, L, S, N, E = 2, 5, 3, 2, 3
    q, k, v = _qkv(rng, B=B, L=L, S=S, N=N, K=N, E=E)
    sinks, scale = np.array([0.4, 1.7]), 0.5
    got = spec.flash_attention(q, k, v, sinks=sinks, scale=scale, causal=causal)
    q2 = np.concatenate([q, np.ones((B, L, N, 1))], axis=-1)
    sink_key = np.zeros((B, 1, N, E + 1))
    sink_key[..., E] = sinks / scale
    k2 = np.concatenate([sink_key, np.concatenate([k, np.zeros((B, S, N, 1))], axis=-1)], axis=1)
    v2 = np.concatenate([np.zeros((B, 1, N, v.shape[-1])), v], axis=1)
    extra = spec.flash_attention(q2, k2, v2, scale=scale, causal=causal)
    rows = slice(L - S - 1, L) if causal else slice(None)  # earlier rows see no key either way: 0
    assert_close("output", got[:, rows], extra[:, rows], atol=1e-14, rtol=1e-12)
    assert (got[:, : L - S - 1] == 0).all() if causal else True


def test_rows_attending_no_key_put_their_weight_on_the_sink_and_give_zero():
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, L=4, S=1)
    for policy in ("zero", "nan", "uniform"):
        out = spec.flash_attention(q, k, v, sinks=[0.0, 5.0], causal=True, fully_masked=policy,
                                   return_lse=True)
        assert (out.output[:, :3] == 0).all(), policy                  # rows 0..2 attend no key
        assert np.isneginf(out.lse[:, :, :3]).all()
        assert np.isfinite(out.output).all()
    empty = spec.flash_attention(q, k[:, :0], v[:, :0], sinks=[1.0, 1.0])
    assert (empty == 0).all()


def test_large_logits_and_large_sinks_stay_finite():
    """The sink joins the row max: exp never overflows, whichever side is larger."""
    q = np.full((1, 2, 2, 2), 30.0)
    k = np.full((1, 3, 1, 2), 30.0)
    v = np.arange(6.0).reshape(1, 3, 1, 2)
    for sinks in ([1000.0, -1000.0], [2000.0, 1270.0], [0.0, 0.0]):
        out = spec.flash_attention(q, k, v, sinks=sinks, scale=1.0)           # logits 1800
        want, _ = brute_force_sinks(q, k, v, np.array(sinks), scale=1.0)
        assert np.isfinite(out).all()
        assert_close("output", out, want, atol=1e-13, rtol=1e-12, call=str(sinks))
    # a sink 1000 above every logit takes all the mass; 1000 below, none of it
    out = spec.flash_attention(q, k, v, sinks=[2800.0, 800.0], scale=1.0)
    assert (out[..., 0, :] == 0).all()
    assert_close("output", out[..., 1, :], spec.flash_attention(q, k, v, scale=1.0)[..., 1, :], atol=1e-15)


@pytest.mark.parametrize("options", [dict(), dict(causal=True, softcap=0.8), dict(alibi_slopes=[0.3, 0.8])])
def test_vjp_with_sinks_matches_central_differences(options):
    rng = np.random.default_rng(8)
    q, k, v = _qkv(rng, B=1, L=3, S=4, N=2, K=1, E=2, Ev=2, magnitude=1.5)
    sinks = [0.3, -0.6]
    upstream = rng.normal(size=(1, 3, 2, 2))
    grads = spec.flash_attention_vjp(q, k, v, upstream, sinks=sinks, **options)

    def loss(q, k, v):
        return float((spec.flash_attention(q, k, v, sinks=sinks, **options) * upstream).sum())

    def central(f, x, step=1e-6):
        grad = np.zeros_like(x)
        for index in np.ndindex(*x.shape):
            plus, minus = x.copy(), x.copy()
            plus[index] += step
            minus[index] -= step
            grad[index] = (f(plus) - f(minus)) / (2 * step)
        return grad

    expected = (central(lambda x: loss(x, k, v), q), central(lambda x: loss(q, x, v), k),
                central(lambda x: loss(q, k, x), v))
    for name, got, want in zip(("dquery", "dkey", "dvalue"), grads, expected, strict=True):
        assert_close(name, got, want, atol=1e-7, rtol=1e-6, call=str(options))


@pytest.mark.parametrize("sinks,rule", [([1.0], "shape (N,)"), ([[1.0, 2.0]], "shape (N,)"),
                                        ([np.inf, 0.0], "finite"), ([np.nan, 0.0], "finite")])
def test_invalid_sinks_raise_spec_error(sinks, rule):
    rng = np.random.default_rng(9)
    q, k, v = _qkv(rng)
    with pytest.raises(spec.SpecError, match="sinks") as info:
        spec.flash_attention(q, k, v, sinks=sinks)
    assert rule in str(info.value)


# --------------------------------------------------------------------------- at the SDPA level


def brute_force_sdpa_sinks(q, k, v, sinks, *, attend=None, additive=None, causal=None, scale=None):
    """SDPA with sinks by the definition, heads first: q (B, N, L, E), k/v (B, K, S, E|Ev);
    attend bool (L, S) True = may attend, additive float (L, S), causal upper_left/lower_right."""
    B, N, L, E = q.shape
    K, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    out = np.zeros((B, N, L, Ev))
    for b in range(B):
        for h in range(N):
            kv = h // (N // K)
            for i in range(L):
                scores = {}
                for j in range(S):
                    if attend is not None and not attend[i, j]:
                        continue
                    if causal == "upper_left" and j > i or causal == "lower_right" and j > i + S - L:
                        continue
                    s = scale * sum(q[b, h, i, e] * k[b, kv, j, e] for e in range(E))
                    if additive is not None:
                        if additive[i, j] == -math.inf:
                            continue
                        s += additive[i, j]
                    scores[j] = s
                top = max([sinks[h], *scores.values()])
                denominator = math.exp(sinks[h] - top) + sum(math.exp(s - top) for s in scores.values())
                for j, s in scores.items():
                    out[b, h, i] += math.exp(s - top) / denominator * v[b, kv, j]
    return out


SDPA_MASKS = [dict(), dict(causal="upper_left"), dict(causal="lower_right"), dict(attend="random"),
              dict(additive="random"), dict(attend="row0_blocked", causal="upper_left")]


@pytest.mark.parametrize("masks", SDPA_MASKS, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()) or "none")
@pytest.mark.parametrize("L,S", [(3, 4), (4, 2)])
def test_sdpa_sinks_equal_brute_force(masks, L, S):
    rng = np.random.default_rng(10)
    q, k, v = (x.transpose(0, 2, 1, 3) for x in _qkv(rng, L=L, S=S))     # heads first
    sinks = np.array([0.75, -2.0])
    attend = additive = None
    if masks.get("attend") == "random":
        attend = rng.random((L, S)) < 0.7
    elif masks.get("attend") == "row0_blocked":
        attend = np.ones((L, S), bool)
        attend[0] = False
    if masks.get("additive") == "random":
        additive = np.where(rng.random((L, S)) < 0.3, -np.inf, rng.normal(size=(L, S)))
    got = spec.sdpa(q, k, v, sinks=sinks, attend_mask=attend, additive_mask=additive, causal=masks.get("causal"))
    want = brute_force_sdpa_sinks(q, k, v, sinks, attend=attend, additive=additive, causal=masks.get("causal"))
    assert_close("output", got.output, want, atol=1e-13, rtol=1e-12, call=str(masks))
    # a row attending no key gives 0 whatever the policy: its weight is on the sink
    for policy in ("nan", "uniform"):
        np.testing.assert_array_equal(spec.sdpa(q, k, v, sinks=sinks, attend_mask=attend, additive_mask=additive,
                                                causal=masks.get("causal"), fully_masked=policy).output, got.output)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_sinks_are_the_flash_levels_bit_for_bit(causal):
    rng = np.random.default_rng(11)
    q, k, v = _qkv(rng, L=3, S=5)
    sinks = np.array([0.5, 1000.0])
    flash = spec.flash_attention(q, k, v, sinks=sinks, causal=causal)
    t = (0, 2, 1, 3)
    sdpa = spec.sdpa(q.transpose(t), k.transpose(t), v.transpose(t), sinks=sinks,
                     causal="lower_right" if causal else None).output
    np.testing.assert_array_equal(sdpa.transpose(t), flash)
    # the emulation in float64 is the oracle, and in bfloat16 it is close
    emulated = spec.emulate_sdpa(q.transpose(t), k.transpose(t), v.transpose(t), sinks=sinks, dtype="float64",
                                 causal="lower_right" if causal else None)
    np.testing.assert_array_equal(emulated, sdpa)


def test_sdpa_vjp_with_sinks_matches_central_differences():
    rng = np.random.default_rng(12)
    q, k, v = (x.transpose(0, 2, 1, 3) for x in _qkv(rng, B=1, L=3, S=4, N=2, K=1, E=2, Ev=2))
    sinks = [0.3, -0.6]
    additive = rng.normal(size=(3, 4))
    upstream = rng.normal(size=(1, 2, 3, 2))
    grads = spec.sdpa_vjp(q, k, v, upstream, sinks=sinks, additive_mask=additive, causal="upper_left")

    def loss(q, k, v):
        return float((spec.sdpa(q, k, v, sinks=sinks, additive_mask=additive, causal="upper_left").output
                      * upstream).sum())

    def central(f, x, step=1e-6):
        grad = np.zeros_like(x)
        for index in np.ndindex(*x.shape):
            plus, minus = x.copy(), x.copy()
            plus[index] += step
            minus[index] -= step
            grad[index] = (f(plus) - f(minus)) / (2 * step)
        return grad

    expected = (central(lambda x: loss(x, k, v), q), central(lambda x: loss(q, x, v), k),
                central(lambda x: loss(q, k, x), v))
    for name, got, want in zip(("dquery", "dkey", "dvalue"), grads[:3], expected, strict=True):
        assert_close(name, got, want, atol=1e-7, rtol=1e-6)
