"""spec.emulate_sdpa and spec.emulate_mha: the naive same-precision yardsticks (spec
section: tolerance)."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import spec
from spec import masks
from spec.emulate import round_arrays_to, round_to
from spec_test_cases import POLICIES, assert_close, describe_case, sdpa_cases

LOW = ("float32", "float16", "bfloat16")
EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


@settings(deadline=None, max_examples=100)
@given(sdpa_cases())
def test_float64_emulation_is_the_oracle(case):
    got = spec.emulate_sdpa(dtype="float64", **case)
    assert_close("output", got, spec.sdpa(**case).output, atol=1e-15, rtol=1e-15, call=describe_case(case))


@settings(deadline=None, max_examples=100)
@given(sdpa_cases(), st.sampled_from(LOW))
def test_low_precision_output_is_representable_and_close(case, dtype):
    got = spec.emulate_sdpa(dtype=dtype, **case)
    assert got.dtype == np.float64
    finite = np.isfinite(got)
    np.testing.assert_array_equal(round_to(got[finite], dtype), got[finite])   # values of dtype
    expected = spec.sdpa(**case).output
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    # a loose bound: the naive error is a few eps per op, amplified by the logits' size
    logit_size = 1.0 + np.abs(spec.sdpa(**case).logits).max()
    if case["additive_mask"] is not None:
        logit_size += np.abs(case["additive_mask"][np.isfinite(case["additive_mask"])]).max(initial=0)
    bound = 16 * EPS[dtype] * logit_size * (1 + np.abs(case["value"]).max())
    assert np.nanmax(np.abs(got - expected), initial=0) <= bound, describe_case(case)


@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_error_is_nonzero_but_small(dtype):
    rng = np.random.default_rng(0)
    q, k, v = (round_to(rng.normal(size=(2, 4, 16, 32)), dtype) for _ in range(3))
    error = np.abs(spec.emulate_sdpa(q, k, v, dtype=dtype) - spec.sdpa(q, k, v).output).max()
    assert 0 < error < 8 * EPS[dtype]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sixteen_bit_emulation_matches_a_naive_torch_computation(dtype):
    """A plain torch fp16/bf16 q@kᵀ·scale -> softmax -> @v on CPU rounds like the emulation."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    q, k, v = (round_to(rng.normal(size=(4, 4, 16, 32)), dtype) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(x).to(getattr(torch, dtype)) for x in (q, k, v))
    scores = (tq @ tk.transpose(-1, -2)) * (1 / np.sqrt(32))
    naive = (torch.softmax(scores, dim=-1) @ tv).double().numpy()
    emulated = spec.emulate_sdpa(q, k, v, dtype=dtype)
    oracle = spec.sdpa(q, k, v).output
    assert (emulated == naive).mean() > 0.99
    assert np.abs(emulated - oracle).max() == pytest.approx(np.abs(naive - oracle).max(), rel=0.5)


def test_stored_low_precision_inputs_are_used_exactly():
    rng = np.random.default_rng(2)
    q, k, v = rng.normal(size=(3, 1, 3, 4))
    stored = [x.astype(ml_dtypes.bfloat16) for x in (q, k, v)]
    upcast = [x.astype(np.float64) for x in stored]
    np.testing.assert_array_equal(spec.emulate_sdpa(*stored, dtype="bfloat16"),
                                  spec.emulate_sdpa(*upcast, dtype="bfloat16"))
    np.testing.assert_array_equal(spec.sdpa(*stored).output, spec.sdpa(*upcast).output)
    halves = [x.astype(np.float16) for x in (q, k, v)]
    np.testing.assert_array_equal(spec.sdpa(*halves).output, spec.sdpa(*[h.astype(np.float64) for h in halves]).output)


def test_float16_overflow_is_naive():
    """Scores beyond 65504 overflow in a naive float16 computation; the emulation does too."""
    q = np.full((1, 1, 2), 200.0)
    k = np.full((1, 2, 2), 200.0)                   # q·k = 80000 > 65504
    v = np.ones((1, 2, 1))
    assert np.isnan(spec.emulate_sdpa(q, k, v, dtype="float16", scale=1.0)).all()
    assert np.isfinite(spec.emulate_sdpa(q, k, v, dtype="bfloat16", scale=1.0)).all()
    np.testing.assert_array_equal(spec.emulate_sdpa(q, k, v, dtype="float32", scale=1.0), [[[1.0]]])


def test_policies_in_low_precision():
    q, k, v = np.zeros((1, 1, 2)), np.zeros((1, 3, 2)), np.arange(3.0).reshape(1, 3, 1)
    blocked = np.zeros((1, 3), bool)
    assert (spec.emulate_sdpa(q, k, v, dtype="float16", attend_mask=blocked) == 0).all()
    assert np.isnan(spec.emulate_sdpa(q, k, v, dtype="float16", attend_mask=blocked, fully_masked="nan")).all()
    np.testing.assert_array_equal(
        spec.emulate_sdpa(q, k, v, dtype="bfloat16", attend_mask=blocked, fully_masked="uniform"),
        round_to(round_to(1 / 3, "bfloat16") * 3, "bfloat16").reshape(1, 1, 1))


# --------------------------------------------------------------------------- MHA


def _mha_mask(rng, kind: str, shape: tuple[int, ...], *, dtype: str):
    """An MHA-convention mask (bool True = blocked, float added; values of ``dtype``)."""
    if kind == "bool":
        return rng.random(shape) < 0.4
    return round_to(np.where(rng.random(shape) < 0.4, -np.inf, rng.normal(0, 1, shape)), dtype)


@st.composite
def mha_calls(draw, *, dtype: str = "float64"):
    """nn.MultiheadAttention calls over every option (kdim/vdim, bias, bias_kv, zero-attn,
    unbatched, batch_first, both masks bool or float, (L, S) or (B*N, L, S), is_causal with
    its mask, fully-masked rows), parameters and inputs exact in ``dtype``.
    Shrinks towards one head, no options, no masks."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    N, head_dim = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    D = N * head_dim
    self_attention = draw(st.booleans())
    kdim = D if self_attention else draw(st.sampled_from([D, 1, 5]))
    vdim = D if self_attention else draw(st.sampled_from([D, 2, 4]))
    params = spec.MHAParams.random(rng, D, N, kdim=kdim, vdim=vdim, bias=draw(st.booleans()),
                                   add_bias_kv=draw(st.booleans()), add_zero_attn=draw(st.booleans()))
    params = round_arrays_to(params, dtype)
    B, L = draw(st.integers(1, 2)), draw(st.integers(1, 5))
    S = L if self_attention else draw(st.integers(1, 5))
    unbatched, batch_first = draw(st.booleans()), draw(st.booleans())
    lead = (L,) if unbatched else ((B, L) if batch_first else (L, B))
    key_lead = (S,) if unbatched else ((B, S) if batch_first else (S, B))
    query = round_to(rng.normal(size=(*lead, D)), dtype)
    key = query if self_attention else round_to(rng.normal(size=(*key_lead, kdim)), dtype)
    value = query if self_attention else round_to(rng.normal(size=(*key_lead, vdim)), dtype)
    kind = draw(st.sampled_from(["bool", "float"]))
    kpm = _mha_mask(rng, kind, (S,) if unbatched else (B, S), dtype=dtype) if draw(st.booleans()) else None
    attn_mask, is_causal = None, False
    mask_choice = draw(st.sampled_from([None, "random", "causal"]))
    if mask_choice == "random":
        shape = draw(st.sampled_from([(L, S), ((1 if unbatched else B) * N, L, S)]))
        attn_mask = _mha_mask(rng, kind, shape, dtype=dtype)
    elif mask_choice == "causal":
        blocked = masks.to_mha_bool(masks.causal_mask(L, S, "upper_left"))
        attn_mask = blocked if kind == "bool" else np.where(blocked, -np.inf, 0.0)
        is_causal = draw(st.booleans())
    return dict(params=params, query=query, key=key, value=value, key_padding_mask=kpm,
                attn_mask=attn_mask, need_weights=draw(st.booleans()),
                average_attn_weights=draw(st.booleans()), is_causal=is_causal,
                batch_first=batch_first, fully_masked=draw(st.sampled_from(POLICIES)))


def _describe_mha(call) -> str:
    p = call["params"]
    shown = {n: (v.shape if isinstance(v, np.ndarray) else v) for n, v in call.items() if n != "params"}
    return (f"[D={p.embed_dim}, N={p.num_heads}, kdim={p.kdim}, vdim={p.vdim}, "
            f"bias={p.in_proj_bias is not None}, bias_kv={p.bias_k is not None}, "
            f"zero_attn={p.add_zero_attn}, {shown}]")


def _mha_size(call) -> float:
    """A loose size of any module output error: (1 + the largest |logit| from absolute
    values + |mask|) × (Σ|W_o| × the largest |projected value| + |b_o|)."""
    p = call["params"]
    abs_params = dataclasses.replace(p, **{f.name: np.abs(getattr(p, f.name)) for f in dataclasses.fields(p)
                                           if isinstance(getattr(p, f.name), np.ndarray)})
    steps = spec.emulate_mha_steps(abs_params, np.abs(call["query"]), np.abs(call["key"]),
                                   np.abs(call["value"]), dtype="float64", batch_first=call["batch_first"])
    logits = steps.scale * (steps.query @ np.swapaxes(steps.key, -1, -2))
    for m in (call["key_padding_mask"], call["attn_mask"]):
        if m is not None and m.dtype != np.bool_:
            logits = logits + np.abs(m[np.isfinite(m)]).max(initial=0.0)
    out_bias = 0.0 if p.out_proj_bias is None else np.abs(p.out_proj_bias).max()
    return (1 + logits.max()) * (np.abs(p.out_proj_weight).sum(axis=1).max() * steps.value.max() + out_bias)


@settings(deadline=None, max_examples=150)
@given(mha_calls())
def test_float64_mha_emulation_is_the_oracle(call):
    got_output, got_weights = spec.emulate_mha(dtype="float64", **call)
    output, weights = spec.mha_forward(**call)
    assert_close("output", got_output, output, atol=1e-15, rtol=1e-15, call=_describe_mha(call))
    assert (got_weights is None) == (weights is None)
    if weights is not None:
        assert_close("weights", got_weights, weights, atol=1e-15, rtol=1e-15, call=_describe_mha(call))


@settings(deadline=None, max_examples=150)
@given(st.sampled_from(LOW).flatmap(lambda dtype: st.tuples(st.just(dtype), mha_calls(dtype=dtype))))
def test_low_precision_mha_error_is_of_the_order_of_eps(dtype_and_call):
    dtype, call = dtype_and_call
    got_output, got_weights = spec.emulate_mha(dtype=dtype, **call)
    output, weights = spec.mha_forward(**call)
    for got, expected in ((got_output, output), (got_weights, weights)):
        if got is None:
            continue
        finite = np.isfinite(got)
        np.testing.assert_array_equal(round_to(got[finite], dtype), got[finite])   # values of dtype
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    error = np.nanmax(np.abs(got_output - output), initial=0.0)
    assert error <= 16 * EPS[dtype] * _mha_size(call), _describe_mha(call)


def _mha_fixture(dtype: str, *, seed: int, kdim: int | None = None):
    rng = np.random.default_rng(seed)
    params = spec.MHAParams.random(rng, 32, 4, kdim=kdim, vdim=kdim)
    params = round_arrays_to(params, dtype)
    query = round_to(rng.normal(size=(16, 2, 32)), dtype)
    key = round_to(rng.normal(size=(12, 2, kdim or 32)), dtype)
    value = round_to(rng.normal(size=(12, 2, kdim or 32)), dtype)
    return params, query, key, value


@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_mha_error_is_nonzero_but_small(dtype):
    params, query, key, value = _mha_fixture(dtype, seed=3)
    got, _ = spec.emulate_mha(params, query, key, value, dtype=dtype)
    expected, _ = spec.mha_forward(params, query, key, value)
    error = np.abs(got - expected).max()
    assert 0 < error < 16 * EPS[dtype] * np.abs(expected).max()


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("kdim", [None, 24])
@pytest.mark.parametrize("need_weights", [True, False])
def test_mha_emulation_errs_like_torch_module(dtype, kdim, need_weights):
    """nn.MultiheadAttention run in ``dtype`` on the CPU is off from the oracle by about as
    much as the emulation (not bit for bit: torch scales q before q·kᵀ, fuses the mask add,
    and with need_weights=False runs a fused SDPA)."""
    torch = pytest.importorskip("torch")
    params, query, key, value = _mha_fixture(dtype, seed=4, kdim=kdim)
    rng = np.random.default_rng(5)
    kpm = rng.random((2, 12)) < 0.3
    kpm[:, 0] = False
    module = torch.nn.MultiheadAttention(32, 4, kdim=kdim, vdim=kdim, dtype=getattr(torch, dtype)).eval()
    state = {"in_proj_weight": params.in_proj_weight, "q_proj_weight": params.q_proj_weight,
             "k_proj_weight": params.k_proj_weight, "v_proj_weight": params.v_proj_weight,
             "in_proj_bias": params.in_proj_bias, "out_proj.weight": params.out_proj_weight,
             "out_proj.bias": params.out_proj_bias}
    module.load_state_dict({n: torch.from_numpy(v).to(getattr(torch, dtype)) for n, v in state.items()
                            if v is not None})
    tensors = [torch.from_numpy(x).to(getattr(torch, dtype)) for x in (query, key, value)]
    with torch.no_grad():
        out, weights = module(*tensors, key_padding_mask=torch.from_numpy(kpm), need_weights=need_weights)
    torch_output = out.double().numpy()
    emulated, emulated_weights = spec.emulate_mha(params, query, key, value, dtype=dtype,
                                                  key_padding_mask=kpm, need_weights=need_weights)
    expected, expected_weights = spec.mha_forward(params, query, key, value, key_padding_mask=kpm,
                                                  need_weights=need_weights)
    torch_error = np.abs(torch_output - expected).max()
    emulated_error = np.abs(emulated - expected).max()
    assert torch_error / 4 <= emulated_error <= 4 * torch_error
    assert np.abs(emulated - torch_output).max() <= 4 * emulated_error
    if need_weights:
        torch_weights_error = np.abs(weights.double().numpy() - expected_weights).max()
        emulated_weights_error = np.abs(emulated_weights - expected_weights).max()
        assert torch_weights_error / 4 <= emulated_weights_error <= 4 * torch_weights_error


def test_mha_emulation_checks_its_arguments():
    params, query, key, value = _mha_fixture("float64", seed=6)
    with pytest.raises(spec.SpecError, match="dtype"):
        spec.emulate_mha(params, query, key, value, dtype="int8")
    with pytest.raises(spec.SpecError, match="is_causal"):
        spec.emulate_mha(params, query, key, value, dtype="float16", is_causal=True)
    with pytest.raises(spec.SpecError, match="key_padding_mask"):
        spec.emulate_mha(params, query, key, value, dtype="float16", key_padding_mask=np.zeros((3, 3), bool))


def test_mha_steps_hold_the_intermediates():
    params, query, key, value = _mha_fixture("float64", seed=7)
    steps = spec.emulate_mha_steps(params, query, key, value, dtype="bfloat16")
    assert steps.query.shape == (2, 4, 16, 8) and steps.key.shape == steps.value.shape == (2, 4, 12, 8)
    assert steps.weights.shape == (2, 4, 16, 12) and steps.attended.shape == (2, 4, 16, 8)
    assert steps.output.shape == (2, 16, 32) and steps.layout(steps.output).shape == (16, 2, 32)
    np.testing.assert_array_equal(steps.layout(steps.output),
                                  spec.emulate_mha(params, query, key, value, dtype="bfloat16")[0])
    assert steps.scale == pytest.approx(1 / np.sqrt(8))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_round_arrays_to_rounds_every_array_field_and_nothing_else(dtype):
    params = spec.MHAParams.random(np.random.default_rng(3), 8, 2, bias=False, add_zero_attn=True)
    rounded = round_arrays_to(params, dtype)
    for f in dataclasses.fields(params):
        before, after = getattr(params, f.name), getattr(rounded, f.name)
        if isinstance(before, np.ndarray):
            np.testing.assert_array_equal(after, round_to(before, dtype))
            assert not np.array_equal(after, before), f"{f.name} was not rounded to {dtype}"
        else:
            assert after == before, f"{f.name}={after!r}, but should be left as {before!r}"


def _bfloat16_edge_values() -> np.ndarray:
    """Random magnitudes over bfloat16's whole range and past it, every float32 bit
    pattern class, float64 values just off a bfloat16 halfway point (where rounding
    through float32 first would round twice), subnormals, overflow, NaN and signed zeros."""
    with np.errstate(all="ignore"):   # NaN bit patterns among the float32 ones
        return _edge_values(np.random.default_rng(0))


def _edge_values(rng: np.random.Generator) -> np.ndarray:
    halves = ((rng.integers(0, 2**16, 20000).astype(np.uint32) << 16) | 0x8000).view(np.float32).astype(np.float64)
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, (2 - 2.0**-7) * 2.0**127, 3.39e38,
                        -3.39e38, (2 - 2.0**-8) * 2.0**127, (2 - 2.0**-8) * 2.0**127 * (1 - 2.0**-50),
                        2.0**-134, 1.5 * 2.0**-133, 2.5 * 2.0**-133, -2.0**-134 * 1.0000001, 1e-300,
                        -1e-300, 1e300, -1e300])
    return np.concatenate([
        rng.standard_normal(20000) * 10.0 ** rng.integers(-45, 40, 20000),
        rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32).astype(np.float64),
        rng.integers(0, 2**64 - 1, 20000, dtype=np.uint64).view(np.float64),
        halves, halves * (1 + 2.0**-40), halves * (1 - 2.0**-40), special,
    ])


def test_bfloat16_rounding_is_ml_dtypes_bit_for_bit():
    # round_to rounds to bfloat16 in NumPy bit operations (no ml_dtypes import on the
    # runner's start-up path); it must be the very rounding ml_dtypes' cast does.
    x = _bfloat16_edge_values()
    if tuple(int(p) for p in ml_dtypes.__version__.split(".")[:2]) < (0, 7):
        # ml_dtypes before 0.7 casts float64 to bfloat16 through float32, rounding twice
        # (9.75168699e23, just above a tie, goes down): compared where float32 is exact
        x = x[x.astype(np.float32).astype(np.float64) == x]
    with np.errstate(all="ignore"):
        expected = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    got = round_to(x, "bfloat16")
    same = ((got == expected) & (np.signbit(got) == np.signbit(expected))) | (np.isnan(got) & np.isnan(expected))
    assert same.all(), f"{(~same).sum()} values differ, e.g. {x[~same][:3]} -> {got[~same][:3]}, not {expected[~same][:3]}"
