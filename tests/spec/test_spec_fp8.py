"""FP8 inputs with descale factors in the oracle (spec/README.md: FP8), against brute force.

The reference here dequantises one scalar at a time with Python's exact rational
arithmetic (``fractions.Fraction``) and runs the definition of attention loop by loop:
the oracle must give the same numbers, the formats must be the IEEE-style 8-bit formats
(every value ml_dtypes lists is one ``spec.fp8.quantize`` keeps), and bad descales raise.
"""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import spec
from spec_test_cases import assert_close
from test_spec_flash import brute_force_flash

FORMATS = ("float8_e4m3fn", "float8_e5m2")


def _all_values(fmt: str) -> np.ndarray:
    """Every finite value of ``fmt``, from its 256 bit patterns."""
    values = np.arange(256, dtype=np.uint8).view(getattr(ml_dtypes, fmt)).astype(np.float64)
    return values[np.isfinite(values)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_formats_are_the_ieee_style_8_bit_formats(fmt):
    f = spec.fp8.FORMATS[fmt]
    values = _all_values(fmt)
    assert values.max() == f.max == {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}[fmt]
    assert f.mantissa_bits == {"float8_e4m3fn": 3, "float8_e5m2": 2}[fmt]
    assert f.unit_roundoff == 2.0 ** -(f.mantissa_bits + 1)
    positive = np.unique(values[values > 0])
    assert positive[0] == f.smallest_subnormal and f.smallest_normal in positive
    # Every value keeps at most mantissa_bits + 1 significant bits.
    mantissa, _ = np.frexp(positive)
    assert np.all(mantissa * 2 ** (f.mantissa_bits + 1) == np.round(mantissa * 2 ** (f.mantissa_bits + 1)))
    assert spec.fp8.representable(values, fmt).all()
    np.testing.assert_array_equal(spec.fp8.quantize(values, fmt), values)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_rounds_to_the_nearest_value_ties_to_even(fmt):
    f = spec.fp8.FORMATS[fmt]
    grid = np.unique(_all_values(fmt))
    rng = np.random.default_rng(1)
    x = rng.uniform(-f.max, f.max, 2000)
    got = spec.fp8.quantize(x, fmt)
    nearest = grid[np.abs(x[:, None] - grid[None, :]).argmin(axis=1)]
    np.testing.assert_array_equal(np.abs(got - x), np.abs(nearest - x))
    # A midpoint goes to the neighbour with the even last significand bit.
    one, above = 1.0, 1.0 + 2.0 ** -f.mantissa_bits
    assert spec.fp8.quantize([(one + above) / 2], fmt)[0] == one
    # Relative error within the unit roundoff in the normal range.
    normal = np.abs(x) >= f.smallest_normal
    assert (np.abs(got - x)[normal] <= f.unit_roundoff * np.abs(x[normal])).all()


def test_quantize_refuses_values_beyond_the_range_unless_saturating():
    with pytest.raises(spec.SpecError, match=r"values=.*within ±448"):
        spec.fp8.quantize([500.0], "float8_e4m3fn")
    assert spec.fp8.quantize([500.0, -1e9], "float8_e4m3fn", saturate=True).tolist() == [448.0, -448.0]
    assert spec.fp8.representable([0.1, 448.0, 449.0, np.inf], "float8_e4m3fn").tolist() == [False, True, False, False]
    with pytest.raises(spec.SpecError, match="fp8='float8_e4m3'"):
        spec.fp8.quantize([1.0], "float8_e4m3")


def _exact_dequantise(x, descale, head_of):
    """Element by element, in exact rationals: x[..., h, :] * descale[b, head_of(h)]."""
    out = np.empty(x.shape)
    for index in np.ndindex(x.shape):
        b, _, h, _ = index
        out[index] = float(Fraction(x[index]) * Fraction(descale[b, head_of(h)]))
    return out


def _fp8_case(rng, fmt, B=2, L=3, S=4, N=4, K=2, E=3, Ev=2):
    f = spec.fp8.FORMATS[fmt]
    q, k, v = (spec.fp8.quantize(rng.normal(0, f.max / 8, shape), fmt, saturate=True)
               for shape in ((B, L, N, E), (B, S, K, E), (B, S, K, Ev)))
    descales = [np.float32(rng.uniform(2 ** -12, 2 ** -4, (B, K))).astype(np.float64) for _ in range(3)]
    return q, k, v, descales


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantisation_is_exact(fmt):
    rng = np.random.default_rng(2)
    q, k, v, (qd, kd, vd) = _fp8_case(rng, fmt)
    group = q.shape[2] // k.shape[2]
    got = spec.fp8.dequantize(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    want = (_exact_dequantise(q, qd, lambda h: h // group), _exact_dequantise(k, kd, lambda h: h),
            _exact_dequantise(v, vd, lambda h: h))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)   # bit for bit: no rounding anywhere


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(FORMATS), seed=st.integers(0, 2 ** 31), L=st.integers(1, 4), S=st.integers(1, 4),
       heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (2, 2)]), causal=st.booleans(),
       form=st.sampled_from(["per_head", "per_tensor", "none"]))
def test_fp8_attention_equals_brute_force_on_the_dequantised_values(fmt, seed, L, S, heads, causal, form):
    rng = np.random.default_rng(seed)
    N, K = heads
    q, k, v, descales = _fp8_case(rng, fmt, L=L, S=S, N=N, K=K)
    if form == "per_tensor":
        descales = [np.array([d[0, 0]]) for d in descales]
    elif form == "none":
        descales = [None, None, None]
    group = N // K
    exact = []
    for i, (x, d) in enumerate(zip((q, k, v), descales, strict=True)):
        if d is None:
            exact.append(x)
            continue
        full = np.full((2, K), d[0]) if d.shape == (1,) else d
        exact.append(_exact_dequantise(x, full, (lambda h: h // group) if i == 0 else (lambda h: h)))
    got = spec.flash_attention(q, k, v, causal=causal, return_lse=True, q_descale=descales[0],
                               k_descale=descales[1], v_descale=descales[2])
    want_out, want_lse = brute_force_flash(*exact, causal=causal)
    assert_close("output", got.output, want_out, atol=1e-12, rtol=1e-11)
    finite = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(got.lse), finite)
    assert_close("lse", got.lse[finite], want_lse[finite], atol=1e-12, rtol=1e-11)


def test_q_descale_is_read_per_kv_head_group():
    """Query head h uses q_descale[b, h // (N // K)]: doubling the factor of kv head 1
    changes exactly query heads 2 and 3 (N = 4, K = 2), as doubling those heads' q does."""
    rng = np.random.default_rng(3)
    q, k, v, (qd, kd, vd) = _fp8_case(rng, "float8_e4m3fn")
    base = spec.flash_attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    doubled = qd.copy()
    doubled[:, 1] *= 2
    changed = spec.flash_attention(q, k, v, q_descale=doubled, k_descale=kd, v_descale=vd)
    q2 = q.copy()
    q2[:, :, 2:] *= 2
    np.testing.assert_array_equal(changed, spec.flash_attention(q2, k, v, q_descale=qd, k_descale=kd, v_descale=vd))
    np.testing.assert_array_equal(changed[:, :, :2], base[:, :, :2])
    assert not np.allclose(changed[:, :, 2:], base[:, :, 2:])


def test_v_descale_scales_the_output_and_k_descale_the_logits():
    rng = np.random.default_rng(4)
    q, k, v, (qd, kd, vd) = _fp8_case(rng, "float8_e5m2", B=1, K=1, N=2)
    base = spec.flash_attention(q, k, v, q_descale=qd, k_descale=kd, return_lse=True)
    scaled = spec.flash_attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True)
    assert_close("output", scaled.output, base.output * vd[0, 0], atol=0, rtol=1e-15)
    np.testing.assert_array_equal(scaled.lse, base.lse)
    # k_descale is a temperature: the same as the scale multiplied by it.
    E = q.shape[-1]
    tempered = spec.flash_attention(q, k, v, q_descale=qd, scale=kd[0, 0] / math.sqrt(E))
    assert_close("output", spec.flash_attention(q, k, v, q_descale=qd, k_descale=kd), tempered,
                 atol=1e-13, rtol=1e-12)


@pytest.mark.parametrize("bad, match", [
    (np.ones((2, 4)), r"q_descale=.*must be a scalar, shape \(1,\) or \(B, K\) = \(2, 2\)"),
    (np.array([1.0, 2.0]), r"q_descale=.*must be a scalar"),
    (np.array([[1.0, 0.0], [1.0, 1.0]]), r"q_descale=.*must be finite and > 0"),
    (np.array([-0.5]), r"q_descale=.*must be finite and > 0"),
    (np.array([np.nan]), r"q_descale=.*must be finite and > 0"),
])
def test_bad_descales_raise_naming_the_argument(bad, match):
    rng = np.random.default_rng(5)
    q, k, v, _ = _fp8_case(rng, "float8_e4m3fn")
    with pytest.raises(spec.SpecError, match=match):
        spec.flash_attention(q, k, v, q_descale=bad)


def test_fp8_numpy_arrays_are_read_exactly():
    rng = np.random.default_rng(6)
    q, k, v, (qd, kd, vd) = _fp8_case(rng, "float8_e4m3fn")
    stored = [x.astype(ml_dtypes.float8_e4m3fn) for x in (q, k, v)]
    np.testing.assert_array_equal(spec.flash_attention(*stored, q_descale=qd, k_descale=kd, v_descale=vd),
                                  spec.flash_attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd))


def test_dequantize_varlen_is_dequantize_sequence_by_sequence():
    rng = np.random.default_rng(11)
    lengths = [(2, 3), (0, 1), (1, 0), (3, 2)]
    T_q, T_k = sum(L for L, _ in lengths), sum(S for _, S in lengths)
    q = spec.fp8.quantize(rng.standard_normal((T_q, 4, 2)), "float8_e4m3fn")
    k = spec.fp8.quantize(rng.standard_normal((T_k, 2, 2)), "float8_e4m3fn")
    v = spec.fp8.quantize(rng.standard_normal((T_k, 2, 3)), "float8_e4m3fn")
    cu_q, cu_k = np.cumsum([0] + [L for L, _ in lengths]), np.cumsum([0] + [S for _, S in lengths])
    qd, kd, vd = (2.0 ** rng.integers(-3, 4, (4, 2)).astype(float) for _ in range(3))
    got = spec.fp8.dequantize_varlen(q, k, v, cu_q, cu_k, q_descale=qd, k_descale=kd, v_descale=vd)
    for b in range(4):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        want = spec.fp8.dequantize(q[None, rows], k[None, keys], v[None, keys], q_descale=qd[b:b + 1],
                                   k_descale=kd[b:b + 1], v_descale=vd[b:b + 1])
        for g, w, part in zip(got, want, (rows, keys, keys), strict=True):
            np.testing.assert_array_equal(g[part], w[0])
    per_tensor = spec.fp8.dequantize_varlen(q, k, v, cu_q, cu_k, q_descale=np.array([0.5]))
    np.testing.assert_array_equal(per_tensor[0], q * 0.5)
    with pytest.raises(spec.SpecError, match="k_descale"):
        spec.fp8.dequantize_varlen(q, k, v, cu_q, cu_k, k_descale=np.ones((3, 2)))


@pytest.mark.parametrize("layout", ["contiguous", "cache_batch_idx", "paged"])
def test_kvcache_fp8_is_brute_force_on_each_sequences_dequantised_keys(layout):
    """spec.kvcache_attention with descales: sequence b's query and every key it attends
    (cached rows from its left pad, appended rows) multiplied by descale row b one scalar
    at a time (exact rationals), then attention by its definition; the caches returned hold
    the stored values (the same as the call without descales)."""
    rng = np.random.default_rng(12)
    fmt, B, L, N, K, E, Ev, S_cache, new = "float8_e4m3fn", 2, 2, 4, 2, 3, 2, 6, 2
    seqlens = np.array([3, 1])
    q = spec.fp8.quantize(rng.standard_normal((B, L, N, E)) * 4, fmt)
    k_new = spec.fp8.quantize(rng.standard_normal((B, new, K, E)) * 4, fmt)
    v_new = spec.fp8.quantize(rng.standard_normal((B, new, K, Ev)) * 4, fmt)
    qd, kd, vd = (np.float32(rng.uniform(2 ** -6, 2 ** 2, (B, K))).astype(np.float64) for _ in range(3))
    rows, options = [0, 1], {}
    if layout == "cache_batch_idx":
        rows = [2, 0]
        options = {"cache_batch_idx": np.array(rows), "cache_leftpad": np.array([1, 0])}
    cache_rows = 3 if layout == "cache_batch_idx" else B
    k_cache = spec.fp8.quantize(rng.standard_normal((cache_rows, S_cache, K, E)) * 4, fmt)
    v_cache = spec.fp8.quantize(rng.standard_normal((cache_rows, S_cache, K, Ev)) * 4, fmt)
    caches = (k_cache, v_cache)
    if layout == "paged":  # pages of 2, in reverse order, one spare page
        table = np.arange(B * S_cache // 2)[::-1].reshape(B, S_cache // 2)
        pages = [np.zeros((B * S_cache // 2 + 1, 2, K, X)) for X in (E, Ev)]
        for cache, paged in zip(caches, pages, strict=True):
            paged[table.reshape(-1)] = cache.reshape(-1, 2, K, cache.shape[-1])
        caches, options = tuple(pages), {"block_table": table}
    descales = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    got = spec.kvcache_attention(q, *caches, cache_seqlens=seqlens, k=k_new, v=v_new, causal=True, **options,
                                 **descales)
    plain = spec.kvcache_attention(q, *caches, cache_seqlens=seqlens, k=k_new, v=v_new, causal=True, **options)
    np.testing.assert_array_equal(got.k_cache, plain.k_cache)
    np.testing.assert_array_equal(got.v_cache, plain.v_cache)
    group = N // K
    pads = options.get("cache_leftpad", np.zeros(B, dtype=int))
    for b in range(B):
        keys = np.concatenate([k_cache[rows[b], :seqlens[b]], k_new[b]])[pads[b]:]
        values = np.concatenate([v_cache[rows[b], :seqlens[b]], v_new[b]])[pads[b]:]
        want, _ = brute_force_flash(_exact_dequantise(q[b:b + 1], qd[b:b + 1], lambda h: h // group),
                                    _exact_dequantise(keys[None], kd[b:b + 1], lambda h: h),
                                    _exact_dequantise(values[None], vd[b:b + 1], lambda h: h), causal=True)
        assert_close(f"output of sequence {b}", got.output[b:b + 1], want)
    assert not np.allclose(got.output, plain.output)       # the descales do change the answer


def test_kvcache_fp8_rejects_rotary_naming_it():
    rng = np.random.default_rng(13)
    q, k_cache, v_cache = (rng.standard_normal(s) for s in ((1, 1, 1, 2), (1, 3, 1, 2), (1, 3, 1, 2)))
    k_new, v_new = rng.standard_normal((1, 1, 1, 2)), rng.standard_normal((1, 1, 1, 2))
    angle = rng.uniform(0, 6, (4, 1))
    with pytest.raises(spec.SpecError, match="rotary_cos.*FP8"):
        spec.kvcache_attention(q, k_cache, v_cache, cache_seqlens=[1], k=k_new, v=v_new, rotary_cos=np.cos(angle),
                               rotary_sin=np.sin(angle), k_descale=np.array([0.5]))
    with pytest.raises(spec.SpecError, match="k_descale"):
        spec.kvcache_attention(q, k_cache, v_cache, cache_seqlens=[1], k_descale=np.ones((2, 1)))
