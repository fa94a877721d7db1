"""Dropout at the flash level in the oracle (spec/README.md: dropout), against brute force.

With a given pattern (True = kept) the output is Σ_j keep_ij · w_ij · v_j / (1 - p), the
weights the softmax's (the sink's included in the denominator); the LSE is untouched; the
exact expectation over every pattern (enumerated) is the output without dropout; the VJP
with a pattern matches central differences; bad arguments raise.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import spec
from spec_test_cases import assert_close
from test_spec_flash import brute_force_flash

OPTIONS = [{}, {"causal": True}, {"window": (1, 0), "softcap": 0.8}, {"alibi_slopes": np.array([0.5, -0.25])},
           {"sinks": np.array([0.7, -1.5])}]


def _qkv(rng, B=1, L=3, S=4, N=2, K=1, E=3, Ev=2):
    return rng.standard_normal((B, L, N, E)), rng.standard_normal((B, S, K, E)), rng.standard_normal((B, S, K, Ev))


def brute_force_dropout(q, k, v, mask, p, **options):
    """Σ_j keep_ij w_ij v_j / (1 - p), one scalar at a time; w_ij is read off the
    dropout-free oracle with one-hot values (itself checked against the definition in
    test_spec_flash.py), so only the dropout step is written anew here."""
    B, L, N, _ = q.shape
    S, K, Ev = k.shape[1], k.shape[2], v.shape[3]
    out = np.zeros((B, L, N, Ev))
    for b, h, i in itertools.product(range(B), range(N), range(L)):
        for j in range(S):
            # the weight of key j alone: the output with v = e_j (one-hot over keys)
            onehot = np.zeros((B, S, K, 1))
            onehot[b, j, h // (N // K), 0] = 1.0
            w = spec.flash_attention(q, k, onehot, **options)[b, i, h, 0]
            if mask[b, h, i, j]:
                out[b, i, h] += w * v[b, j, h // (N // K)] / (1 - p)
    return out


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("L, S", [(3, 4), (4, 2)])
def test_dropout_with_a_pattern_equals_brute_force(options, L, S):
    rng = np.random.default_rng(L * 7 + S)
    q, k, v = _qkv(rng, L=L, S=S)
    mask = rng.random((1, 2, L, S)) < 0.6
    got = spec.flash_attention(q, k, v, dropout_p=0.3, dropout_mask=mask, return_lse=True, **options)
    assert_close("output", got.output, brute_force_dropout(q, k, v, mask, 0.3, **options), atol=1e-13, rtol=1e-12)
    plain = spec.flash_attention(q, k, v, return_lse=True, **options)
    np.testing.assert_array_equal(got.lse, plain.lse)                 # the LSE is the softmax's


def test_keeping_everything_rescales_and_dropping_everything_gives_zero():
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng)
    plain = spec.flash_attention(q, k, v)
    kept = spec.flash_attention(q, k, v, dropout_p=0.25, dropout_mask=np.ones((1, 2, 3, 4), bool))
    assert_close("output", kept, plain / 0.75, atol=1e-15, rtol=1e-15)
    dropped = spec.flash_attention(q, k, v, dropout_p=0.25, dropout_mask=np.zeros((1, 2, 3, 4), bool))
    np.testing.assert_array_equal(dropped, 0.0)
    # dropout_p = 0 with a pattern of all kept is no dropout at all
    np.testing.assert_array_equal(spec.flash_attention(q, k, v, dropout_mask=np.ones((1, 2, 3, 4), bool)), plain)


@pytest.mark.parametrize("options", OPTIONS[:3], ids=["plain", "causal", "window,softcap"])
def test_the_expectation_over_every_pattern_is_the_output_without_dropout(options):
    """All 2^(L·S) patterns of one head, each with probability (1-p)^kept · p^dropped."""
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, L=2, S=3, N=1)
    p = 0.4
    mean = np.zeros((1, 2, 1, 2))
    for bits in itertools.product([False, True], repeat=6):
        mask = np.array(bits).reshape(1, 1, 2, 3)
        weight = (1 - p) ** mask.sum() * p ** (~mask).sum()
        mean += weight * spec.flash_attention(q, k, v, dropout_p=p, dropout_mask=mask, **options)
    assert_close("expectation", mean, spec.flash_attention(q, k, v, **options), atol=1e-14, rtol=1e-13)


def _central(f, x, step=1e-6):
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[index] += step
        down[index] -= step
        grad[index] = (f(up) - f(down)) / (2 * step)
    return grad


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_vjp_with_a_pattern_matches_central_differences(options):
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, L=3, S=3, N=2, K=1)
    mask = rng.random((1, 2, 3, 3)) < 0.5
    grad = rng.standard_normal((1, 3, 2, 2))

    def loss(qq, kk, vv):
        return float((spec.flash_attention(qq, kk, vv, dropout_p=0.5, dropout_mask=mask, **options) * grad).sum())

    got = spec.flash_attention_vjp(q, k, v, grad, dropout_p=0.5, dropout_mask=mask, **options)
    expected = (_central(lambda x: loss(x, k, v), q), _central(lambda x: loss(q, x, v), k),
                _central(lambda x: loss(q, k, x), v))
    for name, a, b in zip(("dquery", "dkey", "dvalue"), got, expected, strict=True):
        assert_close(name, a, b, atol=1e-7, rtol=1e-6)


def test_brute_force_reference_agrees_without_dropout():
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, L=2, S=3)
    everything = np.ones((1, 2, 2, 3), bool)
    assert_close("output", brute_force_dropout(q, k, v, everything, 0.0), brute_force_flash(q, k, v)[0],
                 atol=1e-13, rtol=1e-12)


@pytest.mark.parametrize("p, mask, match", [
    (0.5, None, r"dropout_mask=None: is needed with dropout_p=0.5"),
    (1.0, np.ones((1, 2, 3, 4), bool), r"dropout_p=1.0: must be a number in \[0, 1\)"),
    (-0.1, None, r"dropout_p=-0.1: must be a number in \[0, 1\)"),
    (0.5, np.ones((1, 2, 3, 4)), r"dropout_mask=.*must be bool with shape \(B, N, L, S\) = \(1, 2, 3, 4\)"),
    (0.5, np.ones((1, 1, 3, 4), bool), r"dropout_mask=.*must be bool with shape"),
])
def test_bad_dropout_arguments_raise_naming_them(p, mask, match):
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng)
    with pytest.raises(spec.SpecError, match=match):
        spec.flash_attention(q, k, v, dropout_p=p, dropout_mask=mask)
