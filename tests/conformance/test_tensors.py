"""Tests of conformance.core.tensors: cases become tensors with the right dtype,
device and memory layout, and come back unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conformance import strategies as cs
from conformance.core.cases import LAYOUTS, SDPACase
from conformance.core.tensors import (
    POISON_PAD,
    dtype_of,
    mha_inputs,
    sdpa_inputs,
    to_numpy,
)

FAST = settings(max_examples=20, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPES = ("float64", "float32", "float16", "bfloat16")


def assert_round_trip(case: SDPACase, inputs: dict) -> None:
    for name in ("query", "key", "value"):
        tensor = inputs[name]
        assert tensor.dtype == dtype_of(case.dtype), name
        assert tuple(tensor.shape) == getattr(case, name).shape, name
        assert np.array_equal(to_numpy(tensor), getattr(case, name)), name
    mask = inputs["attn_mask"]
    if case.mask_kind == "none":
        assert mask is None
        return
    expected = case.attend_mask if case.attend_mask is not None else case.additive_mask
    got = to_numpy(mask)
    if cs.NOTE_MASK_EXPANDED in case.notes:
        assert tuple(mask.shape) == (case.B, case.N, case.L, case.S)
        expected = np.broadcast_to(expected, got.shape)
    assert np.array_equal(got, expected)
    assert mask.dtype == (torch.bool if case.attend_mask is not None else dtype_of(case.dtype))


def assert_strides(tensor: torch.Tensor, expected: tuple) -> None:
    """Strides of the dims longer than 1 (a size-1 dim's stride means nothing)."""
    for dim, (size, stride, want) in enumerate(zip(tensor.shape, tensor.stride(), expected, strict=True)):
        if size > 1 and want is not None:
            assert stride == want, f"stride({dim})={stride}, but should be {want} {tensor.stride()}"


def assert_layout(case: SDPACase, inputs: dict) -> None:
    q, k, v = inputs["query"], inputs["key"], inputs["value"]
    if case.layout == "contiguous":
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    elif case.layout == "transposed":
        # stored (B, L, N, E): the head stride is E, the length stride N * E
        assert_strides(q, (None, case.E, case.N * case.E, 1))
        assert_strides(k, (None, case.E, case.K * case.E, 1))
        assert_strides(v, (None, case.Ev, case.K * case.Ev, 1))
        if case.N > 1 and case.L > 1:
            assert not q.is_contiguous()
    elif case.layout == "stride0":
        assert k.stride(0) == 0 and v.stride(0) == 0
        if cs.NOTE_STRIDE0_HEADS in case.notes:
            assert k.stride(1) == 0 and v.stride(1) == 0
    else:
        for t in (q, k, v):
            assert t.storage_offset() == POISON_PAD
            assert t.stride(-2) == t.shape[-1] + POISON_PAD
            # What a kernel ignoring the offset, or the row stride, would read:
            before = t.as_strided((1,), (1,), 0)
            after_row = t.as_strided((1,), (1,), t.storage_offset() + t.shape[-1])
            assert torch.isnan(before).all() and torch.isnan(after_row).all()


@pytest.mark.parametrize("layout", LAYOUTS)
@FAST
@given(data=st.data())
def test_sdpa_inputs_round_trip_in_every_layout(layout: str, data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(DTYPES))
    case = data.draw(cs.sdpa_cases(dtype=dtype, layouts=(layout,)))
    inputs = sdpa_inputs(case)
    assert_round_trip(case, inputs)
    assert_layout(case, inputs)


@FAST
@given(cs.sdpa_cases(dtype="float32", mask_kinds=("bool", "additive"), layouts=LAYOUTS))
def test_masks_round_trip(case: SDPACase) -> None:
    assert_round_trip(case, sdpa_inputs(case))


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(FAST, max_examples=10)
@given(data=st.data())
def test_requires_grad_keeps_layout_and_fills_grad(layout: str, data: st.DataObject) -> None:
    case = data.draw(cs.sdpa_cases(dtype="float64", layouts=(layout,), mask_kinds=("none", "additive"),
                                   fully_masked=False, gqa=False))
    inputs = sdpa_inputs(case, requires_grad=True)
    plain = sdpa_inputs(case)
    for name in ("query", "key", "value"):
        assert inputs[name].stride() == plain[name].stride()
    out = torch.nn.functional.scaled_dot_product_attention(
        inputs["query"], inputs["key"], inputs["value"], attn_mask=inputs["attn_mask"],
        scale=case.scale)
    out.sum().backward()
    for name in ("query", "key", "value"):
        grad = inputs[name].grad
        assert grad is not None and grad.shape == inputs[name].shape
        assert torch.isfinite(grad).all()
    if inputs["attn_mask"] is not None:
        assert inputs["attn_mask"].grad is not None


def test_additive_float16_mask_keeps_minus_inf() -> None:
    case = SDPACase(query=np.zeros((1, 1, 2, 1)), key=np.zeros((1, 1, 2, 1)), value=np.zeros((1, 1, 2, 1)),
                    additive_mask=np.array([[0.5, -np.inf], [-np.inf, -1.25]]), dtype="float16")
    mask = sdpa_inputs(case)["attn_mask"]
    assert mask.dtype == torch.float16
    assert np.array_equal(to_numpy(mask), case.additive_mask)


def test_to_numpy_and_dtype_of() -> None:
    t = torch.tensor([1.0 + 2**-7, -3.0], dtype=torch.bfloat16)
    array = to_numpy(t)
    assert array.dtype == np.float64 and array.tolist() == [1.0 + 2**-7, -3.0]
    assert to_numpy(torch.tensor([True, False])).dtype == np.bool_
    assert [dtype_of(d) for d in DTYPES] == [torch.float64, torch.float32, torch.float16, torch.bfloat16]
    with pytest.raises(ValueError, match="dtype='half'"):
        dtype_of("half")


def test_stride0_without_notes_expands_where_key_and_value_are_constant() -> None:
    rng = np.random.default_rng(0)
    key = np.broadcast_to(rng.standard_normal((1, 2, 3, 4)), (2, 2, 3, 4)).copy()
    value = np.broadcast_to(rng.standard_normal((1, 2, 3, 5)), (2, 2, 3, 5)).copy()
    case = SDPACase(query=rng.standard_normal((2, 2, 1, 4)), key=key, value=value, layout="stride0")
    inputs = sdpa_inputs(case)
    assert inputs["key"].stride(0) == 0 and inputs["value"].stride(0) == 0
    assert inputs["key"].stride(1) != 0
    assert np.array_equal(to_numpy(inputs["key"]), key)


def test_inputs_are_copies_of_the_case() -> None:
    case = SDPACase(query=np.ones((1, 1, 1, 1)), key=np.ones((1, 1, 1, 1)), value=np.ones((1, 1, 1, 1)))
    sdpa_inputs(case)["query"].mul_(0)
    assert case.query[0, 0, 0, 0] == 1.0


@FAST
@given(data=st.data())
def test_mha_inputs(data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(DTYPES))
    case = data.draw(cs.mha_cases(dtype=dtype))
    inputs = mha_inputs(case)
    assert set(inputs) == {"query", "key", "value", "key_padding_mask", "attn_mask", "need_weights",
                           "average_attn_weights", "is_causal"}
    for name in ("query", "key", "value"):
        assert inputs[name].dtype == dtype_of(dtype)
        assert np.array_equal(to_numpy(inputs[name]), getattr(case, name))
    if "self_attention" in case.notes:
        assert inputs["query"] is inputs["key"] is inputs["value"]
    for name in ("key_padding_mask", "attn_mask"):
        array = getattr(case, name)
        if array is None:
            assert inputs[name] is None
        else:
            assert inputs[name].dtype == (torch.bool if array.dtype == np.bool_ else dtype_of(dtype))
            assert np.array_equal(to_numpy(inputs[name]), array)
    assert inputs["is_causal"] == case.is_causal and inputs["need_weights"] == case.need_weights
