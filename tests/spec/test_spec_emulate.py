"""spec.emulate_sdpa: the naive same-precision yardstick (spec section: tolerance)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import spec
from spec.emulate import round_to
from spec_test_cases import assert_close, describe_case, sdpa_cases

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
