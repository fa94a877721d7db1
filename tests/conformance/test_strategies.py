"""Tests of conformance.strategies: every drawn case is valid, inside the
capabilities, exact in its dtype; forcing arguments force; impossible arguments
raise at once; examples shrink to tiny cases."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from conformance import strategies as cs
from conformance.core.cases import LAYOUTS, MHACase, SDPACase
from implementations.base import Capabilities, Implementation
from spec.emulate import round_to

FAST = settings(max_examples=25, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

CAPS = {
    "default": Capabilities(dtypes=("float64", "float32", "float16", "bfloat16")),
    "narrow": Capabilities(
        dtypes=("float16", "float32"), mask_kinds=frozenset({"none", "bool"}), causal="lower_right",
        gqa=False, different_v_dim=False, custom_scale=False, non_contiguous=False,
        min_head_dim=4, max_head_dim=8, max_seq_len=16,
        mha_features=frozenset({"batch_first", "need_weights", "key_padding_mask"}),
    ),
    "flash_like": Capabilities(
        dtypes=("bfloat16",), mask_kinds=frozenset({"none", "additive"}), causal=None,
        min_head_dim=16, max_head_dim=64, max_seq_len=33,
        mha_features=frozenset({"attn_mask", "is_causal", "bias_kv", "unbatched"}),
    ),
}


def _impl(caps: Capabilities) -> Implementation:
    return Implementation(name="probe", capabilities=caps, sdpa=lambda *a, **k: None,
                          mha=lambda *a, **k: None, load_weights=lambda m, p: None)


def assert_exact(name: str, array: np.ndarray, dtype: str) -> None:
    rounded = round_to(array, dtype)
    same = (rounded == array) | (np.isnan(rounded) & np.isnan(array))
    assert same.all(), f"{name} has values not exact in {dtype}: {array[~same][:5]}"


def assert_valid_sdpa_case(case: SDPACase, caps: Capabilities | None = None) -> None:
    assert isinstance(case, SDPACase)
    B, N, K, L, S, E, Ev = (case.sizes()[d] for d in ("B", "N", "K", "L", "S", "E", "Ev"))
    assert case.key.shape == (B, K, S, E) and case.value.shape == (B, K, S, Ev)
    assert min(B, N, K, L, S, E, Ev) >= 1 and N % K == 0
    assert case.layout in LAYOUTS and case.regime in cs.REGIMES
    assert case.causal in (None, "upper_left", "lower_right")
    assert case.attend_mask is None or case.additive_mask is None
    for name in ("query", "key", "value"):
        array = getattr(case, name)
        assert array.dtype == np.float64 and np.isfinite(array).all(), name
        assert_exact(name, array, case.dtype)
    if case.attend_mask is not None:
        assert case.attend_mask.dtype == np.bool_
        np.broadcast_to(case.attend_mask, (B, N, L, S))
        assert 2 <= case.attend_mask.ndim <= 4
    if case.additive_mask is not None:
        mask = case.additive_mask
        np.broadcast_to(mask, (B, N, L, S))
        assert 2 <= mask.ndim <= 4
        assert not np.isnan(mask).any() and not np.isposinf(mask).any()
        assert_exact("additive_mask", mask, case.dtype)
        if "additive=bias" in case.notes:
            assert (mask != 0).all(), "a bias mask must have no exact zeros"
    if case.dtype == "float16":
        assert_float16_dots_finite(case)
    if caps is not None:
        assert _impl(caps).not_supported_reasons(case.attrs()) == []


def assert_float16_dots_finite(case: SDPACase) -> None:
    group = case.N // case.K
    key = np.repeat(case.key, group, axis=1)
    products = case.query[:, :, :, None, :] * key[:, :, None, :, :]          # (B, N, L, S, E)
    partial = np.abs(np.cumsum(products, axis=-1)).max(initial=0.0)
    scale = abs(case.scale) if case.scale is not None else 1 / np.sqrt(case.E)
    assert partial < 30000 and partial * max(scale, 1.0) < 30000, partial


# -- capabilities respected ---------------------------------------------------

@pytest.mark.parametrize("caps_name", sorted(CAPS))
@FAST
@given(data=st.data())
def test_sdpa_cases_stay_inside_caps(caps_name: str, data: st.DataObject) -> None:
    caps = CAPS[caps_name]
    dtype = data.draw(cs.dtypes(caps=caps))
    layouts = LAYOUTS if caps.non_contiguous else ("contiguous",)
    case = data.draw(cs.sdpa_cases(dtype=dtype, caps=caps, layouts=layouts))
    assert_valid_sdpa_case(case, caps)
    if caps.max_seq_len is not None:
        assert max(case.L, case.S) <= caps.max_seq_len
    if caps.min_head_dim is not None:
        assert min(case.E, case.Ev) >= caps.min_head_dim


@pytest.mark.parametrize("caps_name", sorted(CAPS))
@FAST
@given(data=st.data())
def test_mha_cases_stay_inside_caps(caps_name: str, data: st.DataObject) -> None:
    caps = CAPS[caps_name]
    dtype = data.draw(cs.dtypes(caps=caps))
    case = data.draw(cs.mha_cases(dtype=dtype, caps=caps))
    assert isinstance(case, MHACase)
    assert case.mha_features() <= set(caps.mha_features)
    assert _impl(caps).not_supported_reasons(case.attrs()) == []
    assert_valid_mha_case(case)


def assert_valid_mha_case(case: MHACase) -> None:
    p = case.params
    assert case.D == case.N * (case.D // case.N)
    for name in ("query", "key", "value"):
        assert_exact(name, getattr(case, name), case.dtype)
    for name, value in vars(p).items():
        if isinstance(value, np.ndarray):
            assert_exact(f"params.{name}", value, case.dtype)
    kpm, mask = case.key_padding_mask, case.attn_mask
    if kpm is not None:
        assert kpm.shape == ((case.S,) if case.unbatched else (case.B, case.S))
        if kpm.dtype != np.bool_:
            assert set(np.unique(kpm)) <= {0.0, -np.inf}
    if mask is not None:
        heads = case.N if case.unbatched else case.B * case.N
        assert mask.shape in ((case.L, case.S), (heads, case.L, case.S))
        if kpm is not None:
            assert (mask.dtype == np.bool_) == (kpm.dtype == np.bool_)
    if case.is_causal:
        blocked = mask if mask.dtype == np.bool_ else np.isneginf(mask)
        assert np.array_equal(blocked, np.triu(np.ones((case.L, case.S), dtype=bool), 1))
    if "self_attention" in case.notes:
        assert case.key is case.query and case.value is case.query


# -- forcing arguments force --------------------------------------------------

SDPA_FORCING = [
    (dict(causal=("upper_left",)), lambda c: c.causal == "upper_left"),
    (dict(causal=("lower_right",)), lambda c: c.causal == "lower_right"),
    (dict(causal=(None,)), lambda c: c.causal is None),
    (dict(gqa=True), lambda c: c.K < c.N),
    (dict(gqa=False), lambda c: c.K == c.N),
    (dict(different_v_dim=True), lambda c: c.E != c.Ev),
    (dict(different_v_dim=False), lambda c: c.E == c.Ev),
    (dict(mask_kinds=("bool",)), lambda c: c.attend_mask is not None),
    (dict(mask_kinds=("additive",)), lambda c: c.additive_mask is not None),
    (dict(mask_kinds=("none",)), lambda c: c.mask_kind == "none"),
    (dict(mask_kinds=("bool",), mask_patterns=("padding",)),
     lambda c: "mask_pattern=padding" in c.notes and c.attend_mask.shape[-1] == c.S),
    (dict(fully_masked=True), lambda c: c.fully_masked_rows().any()),
    (dict(fully_masked=True, mask_kinds=("none",), causal=("lower_right",)),
     lambda c: c.L > c.S and c.fully_masked_rows().any()),
    (dict(fully_masked=False), lambda c: not c.fully_masked_rows().any()),
    (dict(fully_masked=False, causal=("lower_right",), mask_kinds=("bool", "additive")),
     lambda c: c.L <= c.S and not c.fully_masked_rows().any()),
    (dict(fully_masked=True, causal=("upper_left",), mask_kinds=("additive",)),
     lambda c: c.fully_masked_rows().any() and np.isneginf(c.additive_mask).any()),
    (dict(length_relations=("L=1<S",)), lambda c: c.L == 1 < c.S),
    (dict(length_relations=("L>S",), causal=("upper_left",)), lambda c: c.L > c.S),
    (dict(length_relations=("L=S",)), lambda c: c.L == c.S),
    (dict(length_relations=("1<L<S",), max_S=3), lambda c: c.L == 2 and c.S == 3),
    (dict(fully_masked=True, causal_dead_rows=True, causal=("lower_right",)),
     lambda c: c.fully_masked_rows().any() and (c.mask_kind != "none" or c.L > c.S)),
    (dict(regimes=("large_logits",)), lambda c: c.regime == "large_logits"),
    (dict(regimes=("tiny",)), lambda c: np.abs(c.query).max() < 0.1),
    (dict(layouts=("stride0",)), lambda c: c.layout == "stride0" and c.B >= 2
     and np.array_equal(c.key, np.broadcast_to(c.key[:1], c.key.shape))),
    (dict(layouts=("poisoned",)), lambda c: c.layout == "poisoned"),
    (dict(scale_kinds=("negative",)), lambda c: c.scale is not None and c.scale < 0),
    (dict(scale_kinds=("zero",)), lambda c: c.scale == 0.0),
    (dict(scale_kinds=("tiny",)), lambda c: abs(c.scale - 1e-6) < 1e-12),
    (dict(scale_kinds=False), lambda c: c.scale is None),
    (dict(min_L=5, max_L=7, min_S=30, max_S=33), lambda c: 5 <= c.L <= 7 and 30 <= c.S <= 33),
    (dict(min_batch=2, max_batch=2, min_heads=3, max_heads=3),
     lambda c: c.B == 2 and c.N == 3),
    (dict(min_head_dim=40, max_head_dim=48), lambda c: 40 <= min(c.E, c.Ev) <= max(c.E, c.Ev) <= 48),
]


@pytest.mark.parametrize("kwargs,check", SDPA_FORCING,
                         ids=[repr(k) for k, _ in SDPA_FORCING])
@settings(FAST, max_examples=15)
@given(data=st.data())
def test_sdpa_forcing_arguments_force(kwargs: dict, check, data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(["float32", "float16"]))
    case = data.draw(cs.sdpa_cases(dtype=dtype, **kwargs))
    assert_valid_sdpa_case(case)
    assert check(case), case.describe()


@FAST
@given(cs.sdpa_cases(dtype="float32", regimes=("large_logits",), scale_kinds=False))
def test_large_logits_are_large(case: SDPACase) -> None:
    logits = np.einsum("bnle,bnse->bnls", case.query,
                       np.repeat(case.key, case.N // case.K, axis=1)) / np.sqrt(case.E)
    assert np.abs(logits).max() > 1e3


@settings(FAST, max_examples=40)
@given(cs.sdpa_cases(dtype="float16", regimes=("large_logits", "wide_range")))
def test_float16_partial_dot_sums_stay_finite(case: SDPACase) -> None:
    assert_float16_dots_finite(case)


MHA_FORCING = [
    (dict(need_weights=True), lambda c: c.need_weights),
    (dict(need_weights=False), lambda c: not c.need_weights),
    (dict(average_attn_weights=False), lambda c: not c.average_attn_weights),
    (dict(is_causal=True), lambda c: c.is_causal and c.attn_mask is not None),
    (dict(is_causal=False), lambda c: not c.is_causal),
    (dict(fully_masked=True), lambda c: c.fully_masked_rows()),
    (dict(fully_masked=True, is_causal=True), lambda c: c.fully_masked_rows() and c.is_causal),
    (dict(fully_masked=False, required_features=("key_padding_mask", "attn_mask")),
     lambda c: not c.fully_masked_rows() and c.key_padding_mask is not None),
    (dict(required_features=("kdim_vdim", "bias_kv", "zero_attn", "no_bias")),
     lambda c: c.mha_features() >= {"kdim_vdim", "bias_kv", "zero_attn", "no_bias"}),
    (dict(required_features=("unbatched", "key_padding_mask")),
     lambda c: c.unbatched and c.query.ndim == 2 and c.key_padding_mask.shape == (c.S,)),
    (dict(required_features=("batch_first",)),
     lambda c: c.batch_first and (c.unbatched or c.query.shape[0] == c.B)),
    (dict(required_features=("attn_mask",), mask_kinds=("float",)),
     lambda c: c.attn_mask.dtype == np.float64),
    (dict(features=("need_weights",)), lambda c: c.mha_features() <= {"need_weights"}),
    (dict(features=set()), lambda c: c.mha_features() == set()),
    (dict(self_attention=True), lambda c: c.key is c.query and c.value is c.query),
    (dict(self_attention=False), lambda c: c.key is not c.query),
    (dict(required_features=("kv_cross_attention",)), lambda c: c.value is c.key and c.key is not c.query),
    (dict(features=("kv_cross_attention",), self_attention=False), lambda c: c.value is c.key),
    (dict(features=("cross_attention",), required_features=("cross_attention",)),
     lambda c: c.value is not c.key and c.key is not c.query),
]


@pytest.mark.parametrize("kwargs,check", MHA_FORCING, ids=[repr(k) for k, _ in MHA_FORCING])
@settings(FAST, max_examples=15)
@given(data=st.data())
def test_mha_forcing_arguments_force(kwargs: dict, check, data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(["float32", "float16"]))
    case = data.draw(cs.mha_cases(dtype=dtype, **kwargs))
    assert_valid_mha_case(case)
    assert check(case), case.describe()


# -- the parts ------------------------------------------------------------------

@settings(FAST, max_examples=40)
@given(data=st.data(), gqa=st.sampled_from([None, True, False]))
def test_head_configs(data: st.DataObject, gqa: bool | None) -> None:
    N, K = data.draw(cs.head_configs(min_heads=1, max_heads=8, gqa=gqa))
    assert 1 <= K <= N <= 8 and N % K == 0
    assert gqa is None or (K < N) == gqa


@settings(FAST, max_examples=40)
@given(cs.sdpa_shapes(caps=CAPS["narrow"]))
def test_sdpa_shapes_respect_caps(sizes: dict) -> None:
    assert set(sizes) == {"B", "N", "K", "L", "S", "E", "Ev"}
    assert sizes["N"] == sizes["K"] and sizes["E"] == sizes["Ev"]
    assert 4 <= sizes["E"] <= 8 and max(sizes["L"], sizes["S"]) <= 16


@settings(FAST, max_examples=20)
@given(cs.sdpa_cases(dtype="float16", caps=CAPS["narrow"], max_L=64, min_head_dim=1, max_head_dim=64))
def test_user_bounds_are_tightened_by_caps(case: SDPACase) -> None:
    assert case.L <= 16 and 4 <= case.E <= 8


def test_sdpa_shapes_reach_the_interesting_sizes() -> None:
    seen: list[dict] = []

    @settings(max_examples=300, deadline=None, database=None)
    @given(cs.sdpa_shapes())
    def collect(sizes: dict) -> None:
        seen.append(sizes)

    collect()
    lengths = {s["L"] for s in seen} | {s["S"] for s in seen}
    assert any(s["L"] > s["S"] for s in seen) and any(s["L"] < s["S"] for s in seen)
    assert lengths & set(cs.BLOCK_LENGTHS), "no length around a block size"
    assert {1, 2, 3, 5, 7} <= lengths
    assert any(s["K"] < s["N"] for s in seen) and any(s["E"] != s["Ev"] for s in seen)
    small = sum(max(s["L"], s["S"]) <= 12 for s in seen)
    assert small > 0.6 * len(seen), "typical sizes must stay tiny"


@settings(FAST, max_examples=40)
@given(data=st.data(), fully=st.sampled_from([None, True, False]),
       causal=st.sampled_from([None, "upper_left", "lower_right"]))
def test_masks(data: st.DataObject, fully: bool | None, causal: str | None) -> None:
    B, N, L, S = 2, 3, 4, 5
    drawn = data.draw(cs.masks(B=B, N=N, L=L, S=S, fully_masked=fully, causal=causal,
                               dtype="bfloat16"))
    if fully:
        assert drawn.kind != "none"
    for mask in (drawn.attend_mask, drawn.additive_mask):
        if mask is not None:
            np.broadcast_to(mask, (B, N, L, S))
    if drawn.kind == "none":
        return
    from spec import masks as spec_masks

    rows = spec_masks.fully_masked_rows((B, N, L, S), drawn.attend_mask, drawn.additive_mask, causal)
    if fully is not None:
        assert rows.any() == fully


def test_masks_reach_every_pattern_shape_and_expansion() -> None:
    seen_patterns, seen_shapes, expanded = set(), set(), []

    @settings(max_examples=250, deadline=None, database=None)
    @given(cs.masks(B=2, N=2, L=3, S=4, mask_kinds=("bool", "additive")))
    def collect(drawn: cs.MaskDraw) -> None:
        for note in drawn.notes:
            if note.startswith("mask_pattern="):
                seen_patterns.add(note.split("=", 1)[1])
            if note.startswith("mask_shape="):
                seen_shapes.add(note.split("=", 1)[1])
        expanded.append(cs.NOTE_MASK_EXPANDED in drawn.notes)

    collect()
    assert seen_patterns == set(cs.MASK_PATTERNS)
    assert len(seen_shapes) >= 5 and any(expanded)


@settings(FAST, max_examples=40)
@given(cs.scales(dtype="float16"))
def test_scales_are_float32_exact(scale: float | None) -> None:
    if scale is not None:
        assert scale == float(np.float32(scale))


def test_simple_strategies_respect_caps() -> None:
    narrow = CAPS["narrow"]
    assert find(cs.dtypes(caps=narrow), lambda d: True) == "float32"
    assert find(cs.layouts(caps=narrow), lambda x: True) == "contiguous"
    assert find(cs.scales(caps=narrow), lambda x: True) is None
    assert find(cs.value_regimes(), lambda r: True) == "normal"
    assert find(cs.layouts(), lambda x: x != "contiguous") == "transposed"



def test_strategy_reprs_read_as_calls() -> None:
    assert repr(cs.sdpa_cases(dtype="float16")) == "sdpa_cases(dtype='float16')"
    assert repr(cs.mha_cases(dtype="float32", need_weights=True)) == \
        "mha_cases(dtype='float32', need_weights=True)"
    assert repr(cs.masks(B=1, N=2, L=3, S=4, mask_kinds=("bool",))) == \
        "masks(B=1, N=2, L=3, S=4, mask_kinds=('bool',))"
    assert repr(cs.scales(scale_kinds=False)) == "scales(scale_kinds=False)"
    assert repr(cs.layouts()) == "layouts()"
    assert repr(cs.head_configs(gqa=True)) == "head_configs(gqa=True)"
    assert repr(cs.sdpa_shapes(max_L=4)) == "sdpa_shapes(max_L=4)"
    assert repr(cs.dtypes()) == "dtypes()" and repr(cs.value_regimes()) == "value_regimes()"


def test_mask_pattern_table_is_the_one_source() -> None:
    assert cs.MASK_PATTERNS == tuple(p.name for p in cs.MASK_PATTERN_TABLE)
    rng = np.random.default_rng(0)
    for pattern in cs.MASK_PATTERN_TABLE:
        shape = tuple(size if need else 1 for size, need in zip((2, 3, 4, 5), pattern.needs, strict=True))
        attend = pattern.build(rng, shape, 4, 5)
        assert attend.dtype == np.bool_ and attend.shape == shape, pattern.name
        assert pattern.weight > 0 and pattern.description

# -- invalid arguments raise at once ---------------------------------------------

INVALID = [
    (lambda: cs.sdpa_cases(dtype="float8"), "dtype='float8'"),
    (lambda: cs.sdpa_cases(dtype="float64", caps=CAPS["narrow"]), "dtype='float64'"),
    (lambda: cs.sdpa_cases(dtype="float32", device="cuda", caps=CAPS["narrow"]), "device='cuda'"),
    (lambda: cs.sdpa_cases(dtype="float32", caps=CAPS["narrow"], gqa=True), "gqa=True"),
    (lambda: cs.sdpa_cases(dtype="float32", caps=CAPS["narrow"], causal=("upper_left",)),
     "causal=('upper_left',)"),
    (lambda: cs.sdpa_cases(dtype="float32", causal="upper_left"), "causal='upper_left'"),
    (lambda: cs.sdpa_cases(dtype="float32", caps=CAPS["narrow"], mask_kinds=("additive",)),
     "mask_kinds=('additive',)"),
    (lambda: cs.sdpa_cases(dtype="float32", mask_kinds=("boolean",)), "mask_kinds=('boolean',)"),
    (lambda: cs.sdpa_cases(dtype="float32", caps=CAPS["narrow"], layouts=("stride0",)),
     "layouts=('stride0',)"),
    (lambda: cs.sdpa_cases(dtype="float32", caps=CAPS["narrow"], scale_kinds=("negative",)),
     "scale_kinds=('negative',)"),
    (lambda: cs.sdpa_cases(dtype="float32", caps=CAPS["narrow"], min_L=17), "min_L=17"),
    (lambda: cs.sdpa_cases(dtype="float32", caps=CAPS["narrow"], max_head_dim=2), "max_head_dim=2"),
    (lambda: cs.mha_cases(dtype="float32", features="need_weights"), "features='need_weights'"),
    (lambda: cs.sdpa_cases(dtype="float32", min_L=5, max_L=4), "max_L=4"),
    (lambda: cs.sdpa_cases(dtype="float32", min_S=0), "min_S=0"),
    (lambda: cs.sdpa_cases(dtype="float32", caps=CAPS["narrow"], different_v_dim=True),
     "different_v_dim=True"),
    (lambda: cs.sdpa_cases(dtype="float32", min_head_dim=8, max_head_dim=8, different_v_dim=True),
     "different_v_dim=True"),
    (lambda: cs.sdpa_cases(dtype="float32", fully_masked=True, mask_kinds=("none",),
                           causal=(None, "upper_left")), "fully_masked=True"),
    (lambda: cs.sdpa_cases(dtype="float32", fully_masked=False, causal=("lower_right",),
                           min_L=5, max_S=4), "fully_masked=False"),
    (lambda: cs.sdpa_cases(dtype="float32", layouts=("stride0",), max_batch=1), "max_batch=1"),
    (lambda: cs.sdpa_cases(dtype="float32", length_relations=("L>S",), max_L=1),
     "length_relations=('L>S',)"),
    (lambda: cs.sdpa_cases(dtype="float32", length_relations=("L=2S",)), "length_relations="),
    (lambda: cs.sdpa_cases(dtype="float32", length_relations=("L=S",), fully_masked=True),
     "length_relations="),
    (lambda: cs.sdpa_cases(dtype="float32", causal_dead_rows=True), "causal_dead_rows=True"),
    (lambda: cs.sdpa_cases(dtype="float32", regimes=("huge",)), "regimes=('huge',)"),
    (lambda: cs.sdpa_cases(dtype="float32", regimes=()), "regimes=()"),
    (lambda: cs.sdpa_cases(dtype="float32", gqa=True, max_heads=1), "max_heads=1"),
    (lambda: cs.head_configs(min_heads=3, max_heads=2), "max_heads=2"),
    (lambda: cs.masks(B=1, N=1, L=3, S=2, causal="lower_right", fully_masked=False),
     "fully_masked=False"),
    (lambda: cs.masks(B=1, N=1, L=3, S=2, mask_kinds=("none",), fully_masked=True),
     "mask_kinds=('none',)"),
    (lambda: cs.layouts(layouts=("diagonal",)), "layouts=('diagonal',)"),
    (lambda: cs.mha_cases(dtype="float32", caps=CAPS["narrow"], need_weights=None,
                          average_attn_weights=False), "average_attn_weights=False"),
    (lambda: cs.mha_cases(dtype="float32", caps=CAPS["narrow"], is_causal=True), "is_causal=True"),
    (lambda: cs.mha_cases(dtype="float32", caps=CAPS["narrow"], features=("dropout",)),
     "features=('dropout',)"),
    (lambda: cs.mha_cases(dtype="float32", required_features=("dropout",)), "required_features="),
    (lambda: cs.mha_cases(dtype="float32", required_features=("bias_kv",), fully_masked=True),
     "fully_masked=True"),
    (lambda: cs.mha_cases(dtype="float32", features=("need_weights",), fully_masked=True),
     "fully_masked=True"),
    (lambda: cs.mha_cases(dtype="float32", self_attention=True, required_features=("kdim_vdim",)),
     "self_attention=True"),
    (lambda: cs.mha_cases(dtype="float32", need_weights=False, required_features=("need_weights",)),
     "need_weights=False"),
    (lambda: cs.mha_cases(dtype="float32", mask_kinds=("int",)), "mask_kinds=('int',)"),
    (lambda: cs.mha_cases(dtype="float32", required_features=("bias",)), "'bias' is now 'no_bias'"),
    (lambda: cs.mha_cases(dtype="float32", features=("average_weights",)),
     "'average_weights' is now 'per_head_weights'"),
]


@pytest.mark.parametrize("make,fragment", INVALID, ids=[f for _, f in INVALID])
def test_impossible_arguments_raise_at_once(make, fragment: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        make()
    message = str(info.value)
    assert fragment in message and ";" in message, message


# -- shrinking --------------------------------------------------------------------

def test_l_ne_s_shrinks_to_a_tiny_case() -> None:
    case = find(cs.sdpa_cases(dtype="float32", mask_kinds=None, regimes=None,
                              layouts=LAYOUTS), lambda c: c.L != c.S,
                settings=settings(database=None, max_examples=200, derandomize=True))
    assert (case.B, case.N, case.K, case.E, case.Ev) == (1, 1, 1, 1, 1)
    assert sorted((case.L, case.S)) == [1, 2]
    assert case.mask_kind == "none" and case.causal is None and case.scale is None
    assert case.regime == "normal" and case.layout == "contiguous"


def test_fully_masked_shrinks_to_a_tiny_case() -> None:
    case = find(cs.sdpa_cases(dtype="float32"), lambda c: bool(c.fully_masked_rows().any()),
                settings=settings(database=None, max_examples=300, derandomize=True))
    # Either a 1x1 mask blocking the only key, or no mask and a lower-right causal
    # flag with L=2 > S=1: both are minimal.
    assert (case.B, case.N, case.K, case.E, case.Ev) == (1, 1, 1, 1, 1)
    assert case.L + case.S <= 3
    assert case.regime == "normal" and case.layout == "contiguous" and case.scale is None


def test_length_relations_reach_each_relation() -> None:
    """Every relation, a single query against several keys included, is drawn
    about a quarter of the time (what causal_flag_equivalence relies on)."""
    seen = collections.Counter()

    @settings(database=None, max_examples=200, derandomize=True)
    @given(cs.sdpa_cases(dtype="float32", mask_kinds=("none",), causal=("upper_left",),
                         length_relations=cs.LENGTH_RELATIONS))
    def draw(case: SDPACase) -> None:
        seen["L=1<S" if case.L == 1 < case.S else "L=S" if case.L == case.S
             else "1<L<S" if case.L < case.S else "L>S"] += 1

    draw()
    assert all(seen[r] >= 20 for r in cs.LENGTH_RELATIONS), seen


def _flag_only_dead_rows(causal_dead_rows: bool) -> int:
    """How many of 100 forced fully-masked cases have no mask (the flag empties the rows)."""
    drawn = []

    @settings(database=None, max_examples=100, derandomize=True)
    @given(cs.sdpa_cases(dtype="float32", fully_masked=True, causal_dead_rows=causal_dead_rows,
                         causal=("lower_right",)))
    def draw(case: SDPACase) -> None:
        assert case.fully_masked_rows().any()
        drawn.append(case.mask_kind == "none")

    draw()
    return sum(drawn)


def test_causal_dead_rows_reach_the_flag() -> None:
    """With masks allowed, fully_masked=True and causal_dead_rows=True still draw rows
    that only the lower-right flag empties (no mask, L > S); without the option they
    only come from masks."""
    assert _flag_only_dead_rows(True) >= 20
    assert _flag_only_dead_rows(False) == 0


def test_mha_shrinks_to_a_tiny_case() -> None:
    case = find(cs.mha_cases(dtype="float32"), lambda c: c.L != c.S,
                settings=settings(database=None, max_examples=200, derandomize=True))
    assert (case.B, case.N, case.D) == (1, 1, 1) and sorted((case.L, case.S)) == [1, 2]
    assert case.key_padding_mask is None and case.attn_mask is None and not case.is_causal
