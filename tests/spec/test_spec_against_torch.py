"""spec.sdpa and spec.mha_forward against PyTorch float64 (spec sections: SDPA, MHA).

Agreement is to 1e-12. Every place PyTorch 2.13 (CPU) differs from the spec is pinned by
its own test in the "PyTorch differences" part at the end (also listed in spec/README.md).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import spec
from spec import masks
from spec_test_cases import assert_close, describe_case, sdpa_cases, torch_sdpa

torch = pytest.importorskip("torch")
F = torch.nn.functional

TOL = 1e-12


def _t(array):
    return torch.from_numpy(np.ascontiguousarray(array))


# --------------------------------------------------------------------------- SDPA


@settings(deadline=None, max_examples=150)
@given(sdpa_cases(policies=("zero",)))
def test_sdpa_matches_torch_float64(case):
    expected = torch_sdpa(case).numpy()
    assert_close("output", spec.sdpa(**case).output, expected, atol=TOL, rtol=TOL,
                 call=describe_case(case))


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")  # it does not (2.13)
@pytest.mark.parametrize("L,S", [(1, 4), (4, 1), (2, 5), (5, 2), (3, 3)])
def test_lower_right_matches_torch_causal_lower_right(L, S):
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    rng = np.random.default_rng(L * 10 + S)
    q, k, v = rng.normal(size=(2, 3, L, 4)), rng.normal(size=(2, 3, S, 4)), rng.normal(size=(2, 3, S, 5))
    for alignment, bias in (("lower_right", causal_lower_right), ("upper_left", causal_upper_left)):
        expected = F.scaled_dot_product_attention(_t(q), _t(k), _t(v), attn_mask=bias(L, S)).numpy()
        assert_close("output", spec.sdpa(q, k, v, causal=alignment).output, expected,
                     atol=TOL, rtol=TOL, call=f"[causal={alignment!r}, L={L}, S={S}]")


def test_sdpa_fully_masked_rows_are_zero_in_torch_too():
    """Spec policy 'zero' is SDPA's own behaviour since 2.5, for bool and -inf float masks."""
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(1, 2, 3, 4)), rng.normal(size=(1, 2, 5, 4)), rng.normal(size=(1, 2, 5, 3))
    attend = np.ones((3, 5), bool)
    attend[1] = False
    for mask in (_t(attend), _t(masks.to_additive(attend))):
        got = F.scaled_dot_product_attention(_t(q), _t(k), _t(v), attn_mask=mask).numpy()
        assert_close("output", got, spec.sdpa(q, k, v, attend_mask=attend).output)
        assert (got[..., 1, :] == 0).all()


def test_sdpa_large_finite_logits_match_torch():
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(1, 2, 3, 4)) * 1e150, rng.normal(size=(1, 2, 5, 4)) * 1e150, rng.normal(size=(1, 2, 5, 3))
    got = F.scaled_dot_product_attention(_t(q), _t(k), _t(v)).numpy()
    assert_close("output", spec.sdpa(q, k, v).output, got)


# --------------------------------------------------------------------------- MHA


def make_torch_mha(params: spec.MHAParams, *, bias: bool, batch_first: bool):
    module = torch.nn.MultiheadAttention(
        params.embed_dim, params.num_heads, bias=bias, add_bias_kv=params.bias_k is not None,
        add_zero_attn=params.add_zero_attn, kdim=params.kdim, vdim=params.vdim,
        batch_first=batch_first, dtype=torch.float64).eval()
    state = {
        "in_proj_weight": params.in_proj_weight, "q_proj_weight": params.q_proj_weight,
        "k_proj_weight": params.k_proj_weight, "v_proj_weight": params.v_proj_weight,
        "in_proj_bias": params.in_proj_bias, "out_proj.weight": params.out_proj_weight,
        "out_proj.bias": params.out_proj_bias, "bias_k": params.bias_k, "bias_v": params.bias_v,
    }
    module.load_state_dict({name: _t(value) for name, value in state.items() if value is not None})
    return module


def _mha_mask(rng, kind: str, shape: tuple[int, ...]):
    """An MHA-convention mask (bool True = blocked, float added) whose key 0 is never blocked."""
    if kind == "bool":
        mask = rng.random(shape) < 0.4
        mask[..., 0] = False
    else:
        mask = np.where(rng.random(shape) < 0.4, -np.inf, rng.normal(0, 1, shape))
        mask[..., 0] = 0.0
    return mask


@st.composite
def mha_cases(draw, *, fast_path: bool = False):
    """nn.MultiheadAttention calls over all constructor options and forward arguments.

    ``fast_path=True`` draws only calls that take torch's fused fast path (batch_first
    self-attention, even heads, packed weights with bias, no bias_kv/zero-attn, bool masks,
    no grad). No fully-masked rows (key 0 is always attended): those are pinned separately.
    Shrinks towards one head, no options, no masks.
    """
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    N, head_dim = (2 if fast_path else draw(st.integers(1, 3))), draw(st.integers(1, 3))
    D = N * head_dim
    self_attention = fast_path or draw(st.booleans())
    kdim = D if self_attention else draw(st.sampled_from([D, D, 1, 5]))
    vdim = D if self_attention else draw(st.sampled_from([D, D, 2, 4]))
    options = dict(bias=fast_path or draw(st.booleans()), add_bias_kv=not fast_path and draw(st.booleans()),
                   add_zero_attn=not fast_path and draw(st.booleans()))
    params = spec.MHAParams.random(rng, D, N, kdim=kdim, vdim=vdim, **options)
    B, L = draw(st.integers(1, 2)), draw(st.integers(1, 4))
    S = L if self_attention else draw(st.integers(1, 4))
    unbatched = not fast_path and draw(st.booleans())
    batch_first = fast_path or draw(st.booleans())
    lead = (L,) if unbatched else ((B, L) if batch_first else (L, B))
    key_lead = (S,) if unbatched else ((B, S) if batch_first else (S, B))
    query = rng.normal(size=(*lead, D))
    key = query if self_attention else rng.normal(size=(*key_lead, kdim))
    value = query if self_attention else rng.normal(size=(*key_lead, vdim))
    B_ = 1 if unbatched else B
    kpm_kind = draw(st.sampled_from([None, "bool"] if fast_path else [None, "bool", "float"]))
    kpm = None if kpm_kind is None else _mha_mask(rng, kpm_kind, (S,) if unbatched else (B, S))
    attn_kind = draw(st.sampled_from([None, "bool", "causal-bool"] if fast_path
                                     else [None, "bool", "float", "causal-bool", "causal-float"]))
    attn_mask, is_causal = None, False
    if attn_kind in ("bool", "float"):
        shape = draw(st.sampled_from([(L, S), (B_ * N, L, S)]))
        attn_mask = _mha_mask(rng, attn_kind, shape)
    elif attn_kind is not None:
        blocked = masks.to_mha_bool(masks.causal_mask(L, S, "upper_left"))
        attn_mask = blocked if attn_kind == "causal-bool" else np.where(blocked, -np.inf, 0.0)
        is_causal = draw(st.booleans())
    forward = dict(key_padding_mask=kpm, attn_mask=attn_mask, need_weights=draw(st.booleans()),
                   average_attn_weights=draw(st.booleans()), is_causal=is_causal,
                   batch_first=batch_first)
    # PyTorch difference D3 (pinned below): is_causal drops attn_mask on its SDPA path,
    # and the causal rule then also blocks the bias_k / zero-attention keys.
    assume(not (is_causal and (options["add_bias_kv"] or options["add_zero_attn"])
                and kpm is None and not forward["need_weights"]))
    return dict(params=params, bias=options["bias"], query=query, key=key, value=value,
                grad_enabled=not fast_path and draw(st.booleans()), forward=forward)


def run_torch_mha(case):
    module = make_torch_mha(case["params"], bias=case["bias"], batch_first=case["forward"]["batch_first"])
    forward = {name: (None if value is None else (_t(value) if isinstance(value, np.ndarray) else value))
               for name, value in case["forward"].items() if name != "batch_first"}
    query = _t(case["query"])
    key = query if case["key"] is case["query"] else _t(case["key"])
    value = query if case["value"] is case["query"] else _t(case["value"])
    if case["grad_enabled"]:
        query.requires_grad_(True)                                # forces the slow path
    fused = torch._native_multi_head_attention
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    torch._native_multi_head_attention = counting
    try:
        with torch.set_grad_enabled(case["grad_enabled"]), warnings.catch_warnings():
            warnings.simplefilter("ignore")                       # mixed bool/float mask deprecation
            output, weights = module(query, key, value, **forward)
    finally:
        torch._native_multi_head_attention = fused
    case["took_fast_path"] = bool(calls)
    return output.detach().numpy(), None if weights is None else weights.detach().numpy()


def _describe_mha(case) -> str:
    p, f = case["params"], case["forward"]
    kinds = {n: (None if f[n] is None else f"{f[n].dtype}{f[n].shape}") for n in ("key_padding_mask", "attn_mask")}
    return (f"[D={p.embed_dim}, N={p.num_heads}, kdim={p.kdim}, vdim={p.vdim}, bias={case['bias']}, "
            f"add_bias_kv={p.bias_k is not None}, add_zero_attn={p.add_zero_attn}, query={case['query'].shape}, "
            f"key={case['key'].shape}, self_attention={case['key'] is case['query']}, {kinds}, "
            f"need_weights={f['need_weights']}, average={f['average_attn_weights']}, "
            f"is_causal={f['is_causal']}, batch_first={f['batch_first']}, grad={case['grad_enabled']}]")


@settings(deadline=None, max_examples=200)
@given(mha_cases())
def test_mha_matches_torch_module(case):
    check_mha_case(case)


@settings(deadline=None, max_examples=60)
@given(mha_cases(fast_path=True))
def test_mha_matches_torch_module_fast_path(case):
    check_mha_case(case)
    assert case["took_fast_path"], "torch did not take its fast path " + _describe_mha(case)


def check_mha_case(case):
    expected_output, expected_weights = run_torch_mha(case)
    output, weights = spec.mha_forward(case["params"], case["query"], case["key"], case["value"],
                                       **case["forward"])
    call = _describe_mha(case)
    assert_close("output", output, expected_output, atol=TOL, rtol=TOL, call=call)
    assert (weights is None) == (expected_weights is None), call
    if weights is not None:
        assert_close("weights", weights, expected_weights, atol=TOL, rtol=TOL, call=call)


def test_mha_is_causal_without_attn_mask_raises_like_torch():
    params = spec.MHAParams.random(np.random.default_rng(0), 4, 2)
    x = np.random.default_rng(1).normal(size=(3, 1, 4))
    module = make_torch_mha(params, bias=True, batch_first=False)
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        module(_t(x), _t(x), _t(x), is_causal=True)
    with pytest.raises(spec.SpecError, match="is_causal=True"):
        spec.mha_forward(params, x, x, x, is_causal=True)


# --------------------------------------------------------------------------- PyTorch differences
# Each test below pins one documented place where torch 2.13 CPU differs from the spec
# (spec/README.md, "Where PyTorch differs"). If one starts failing, PyTorch changed:
# update the README and the runner's expected-failures files.


def _fully_masked_mha_case(batch_first: bool):
    rng = np.random.default_rng(5)
    params = spec.MHAParams.random(rng, 8, 2)
    x = rng.normal(size=(2, 3, 8))                                # (B, L, D) batch_first
    if not batch_first:
        x = np.ascontiguousarray(x.transpose(1, 0, 2))            # (L, B, D)
    kpm = np.zeros((2, 3), bool)
    kpm[1] = True                                                 # batch 1: every key padded
    return params, x, kpm


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("path", ["slow", "fast"])
def test_difference_D1_mha_fully_masked_rows(path, need_weights):
    """D1: spec (policy zero) gives output = out_proj_bias for a fully-masked row; torch gives NaN
    on the slow path with need_weights=True and on the fast path always (#41508, #190486)."""
    params, x, kpm = _fully_masked_mha_case(batch_first=True)
    module = make_torch_mha(params, bias=True, batch_first=True)
    query = _t(x)
    if path == "slow":
        query.requires_grad_(True)                                # grad enabled: no fast path
    with torch.set_grad_enabled(path == "slow"):
        output, weights = module(query, query, query, key_padding_mask=_t(kpm), need_weights=need_weights)
    output = output.detach().numpy()
    expected, expected_weights = spec.mha_forward(params, x, x, x, key_padding_mask=kpm,
                                                  need_weights=need_weights, batch_first=True)
    np.testing.assert_allclose(expected[1], np.broadcast_to(params.out_proj_bias, (3, 8)), atol=1e-15)
    assert_close("batch 0 output", output[0], expected[0])        # other rows untouched
    if path == "slow" and not need_weights:
        assert_close("batch 1 output", output[1], expected[1])   # torch agrees with the spec here
    else:
        assert np.isnan(output[1]).all()                          # torch: NaN
    if need_weights:
        assert np.isnan(weights.detach().numpy()[1]).all()
        assert (expected_weights[1] == 0).all()
        # NaN policy of the spec reproduces torch's weights there
        _, nan_weights = spec.mha_forward(params, x, x, x, key_padding_mask=kpm, batch_first=True,
                                          fully_masked="nan")
        assert np.isnan(nan_weights[1]).all()


def test_difference_D1_seq_first_slow_path_need_weights_false_is_bias():
    params, x, kpm = _fully_masked_mha_case(batch_first=False)
    module = make_torch_mha(params, bias=True, batch_first=False)
    with torch.no_grad():
        output, _ = module(_t(x), _t(x), _t(x), key_padding_mask=_t(kpm), need_weights=False)
    expected, _ = spec.mha_forward(params, x, x, x, key_padding_mask=kpm, need_weights=False)
    assert_close("output", output.numpy(), expected)


@pytest.mark.parametrize("option", ["add_bias_kv", "add_zero_attn"])
def test_difference_D2_is_causal_with_extra_keys(option):
    """D2: with is_causal=True, no key_padding_mask and need_weights=False, torch drops attn_mask
    and runs SDPA's upper-left causal rule on the key sequence *including* the bias_k / zero key,
    so those keys are blocked for queries i < S; with need_weights=True it uses the padded
    attn_mask and attends them. The spec always uses attn_mask (padded: extra keys attended)."""
    rng = np.random.default_rng(2)
    params = spec.MHAParams.random(rng, 8, 2, **{option: True})
    x = rng.normal(size=(3, 2, 8))
    causal = masks.to_mha_bool(masks.causal_mask(3, 3, "upper_left"))
    module = make_torch_mha(params, bias=True, batch_first=False)
    expected, _ = spec.mha_forward(params, x, x, x, attn_mask=causal, is_causal=True)
    with torch.no_grad():
        with_weights, _ = module(_t(x), _t(x), _t(x), attn_mask=_t(causal), is_causal=True, need_weights=True)
        without, _ = module(_t(x), _t(x), _t(x), attn_mask=_t(causal), is_causal=True, need_weights=False)
    assert_close("output (need_weights=True)", with_weights.numpy(), expected)
    assert np.abs(without.numpy() - expected).max() > 1e-3


def test_difference_D3_is_causal_with_a_non_causal_attn_mask():
    """D3: is_causal is a hint; with a non-causal attn_mask torch's SDPA path (need_weights=False,
    no key_padding_mask) uses the causal rule and ignores attn_mask, its other paths use attn_mask.
    The spec always computes from attn_mask."""
    rng = np.random.default_rng(3)
    params = spec.MHAParams.random(rng, 8, 2)
    x = rng.normal(size=(4, 2, 8))
    not_causal = np.zeros((4, 4), bool)
    not_causal[:, 1] = True                                      # block key 1 only
    module = make_torch_mha(params, bias=True, batch_first=False)
    with torch.no_grad():
        sdpa_path, _ = module(_t(x), _t(x), _t(x), attn_mask=_t(not_causal), is_causal=True, need_weights=False)
        weights_path, _ = module(_t(x), _t(x), _t(x), attn_mask=_t(not_causal), is_causal=True, need_weights=True)
    from_mask, _ = spec.mha_forward(params, x, x, x, attn_mask=not_causal, is_causal=True)
    from_causal, _ = spec.mha_forward(params, x, x, x, attn_mask=masks.to_mha_bool(masks.causal_mask(4, 4)))
    assert_close("need_weights=True path", weights_path.numpy(), from_mask)
    assert_close("SDPA path", sdpa_path.numpy(), from_causal)


def _small_sdpa_inputs():
    rng = np.random.default_rng(4)
    return rng.normal(size=(1, 2, 3, 4)), rng.normal(size=(1, 2, 5, 4)), rng.normal(size=(1, 2, 5, 3))


def _outcome(output) -> str:
    """'all NaN', 'all 0', or 'other' for a torch output."""
    values = output.double()
    if torch.isnan(values).all():
        return "all NaN"
    return "all 0" if (values == 0).all() else "other"


#: What the CPU flash kernel returns for scale=NaN on ``_small_sdpa_inputs`` with E == Ev.
#: Undefined upstream: the kernel's running row max over NaN scores depends on which
#: vectorised max the ATen CPU capability selects. Measured (torch 2.13, AMD EPYC):
#: float64 all NaN under ATEN_CPU_CAPABILITY=default and avx2, all 0 under avx512;
#: float32 all 0 under all three (and on another CPU's avx2). Larger cases (L=17, S=33)
#: give all NaN everywhere. Never a finite, plausible-looking output.
FLASH_NAN_SCALE_OUTCOMES = {"all NaN", "all 0"}


def test_difference_D4_nan_and_inf_scale():
    """D4: torch computes silently with scale=NaN: all-NaN output on the math backend (taken
    on CPU when E != Ev); on the CPU flash backend (E == Ev) all 0 (every row counted as
    fully masked) or all NaN, depending on dtype, sizes and CPU capability; scale=inf gives
    NaN. The spec raises SpecError for both."""
    q, k, v = _small_sdpa_inputs()                                  # E=4, Ev=3: math backend
    v_same = np.random.default_rng(8).normal(size=(1, 2, 5, 4))    # E = Ev = 4: CPU flash backend
    nan = float("nan")
    assert np.isnan(F.scaled_dot_product_attention(_t(q), _t(k), _t(v), scale=nan).numpy()).all()
    for dtype in (torch.float64, torch.float32):
        flash = F.scaled_dot_product_attention(*(_t(x).to(dtype) for x in (q, k, v_same)), scale=nan)
        assert _outcome(flash) in FLASH_NAN_SCALE_OUTCOMES, f"{dtype}: {flash}"
    got_inf = F.scaled_dot_product_attention(_t(q), _t(k), _t(v), scale=float("inf")).numpy()
    assert np.isnan(got_inf).any()
    for bad in (nan, float("inf")):
        with pytest.raises(spec.SpecError, match="scale="):
            spec.sdpa(q, k, v, scale=bad)


def test_difference_D5_positive_infinity_or_nan_in_additive_mask():
    """D5: torch propagates NaN from a +inf/NaN float mask entry; the spec raises SpecError."""
    q, k, v = _small_sdpa_inputs()
    for bad in (np.inf, np.nan):
        mask = np.zeros((3, 5))
        mask[0, 0] = bad
        got = F.scaled_dot_product_attention(_t(q), _t(k), _t(v), attn_mask=_t(mask)).numpy()
        assert np.isnan(got[..., 0, :]).all()
        with pytest.raises(spec.SpecError, match="additive_mask="):
            spec.sdpa(q, k, v, additive_mask=mask)


def test_difference_D6_rank_two_inputs():
    """D6: torch SDPA accepts (L, E) inputs with no head dim; the spec requires (..., N, L, E)."""
    q, k, v = _small_sdpa_inputs()
    got = F.scaled_dot_product_attention(_t(q[0, 0]), _t(k[0, 0]), _t(v[0, 0])).numpy()
    assert_close("output", got, spec.sdpa(q[0, :1], k[0, :1], v[0, :1]).output[0])
    with pytest.raises(spec.SpecError, match="rank >= 3"):
        spec.sdpa(q[0, 0], k[0, 0], v[0, 0])


def test_difference_D7_gqa_needs_enable_gqa_in_torch():
    """D7 (API, not values): torch needs enable_gqa=True for K < N and raises otherwise; the spec
    applies GQA whenever K divides N. Both reject N % K != 0."""
    rng = np.random.default_rng(6)
    q, k, v = rng.normal(size=(1, 4, 3, 2)), rng.normal(size=(1, 2, 3, 2)), rng.normal(size=(1, 2, 3, 2))
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(_t(q), _t(k), _t(v))
    got = F.scaled_dot_product_attention(_t(q), _t(k), _t(v), enable_gqa=True).numpy()
    assert_close("output", spec.sdpa(q, k, v).output, got)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(_t(q[:, :3]), _t(k), _t(v), enable_gqa=True)
    with pytest.raises(spec.SpecError, match="multiple of kv heads"):
        spec.sdpa(q[:, :3], k, v)


@pytest.mark.parametrize("scale", [0.0, -1.0])
def test_difference_D8_upper_left_causal_with_non_positive_scale(scale):
    """D8 (a PyTorch bug): with is_causal=True (or causal_upper_left) and scale <= 0, torch 2.13's
    CPU flash kernel (taken when E == Ev) returns NaN for every query row that has a blocked key
    (-inf · 0 = NaN, -inf · -1 = +inf), in float64 and float32. The math kernel (E != Ev), an
    explicit bool mask and causal_lower_right are right and agree with the spec."""
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    rng = np.random.default_rng(9)
    q, k, v = rng.normal(size=(1, 1, 3, 2)), rng.normal(size=(1, 1, 4, 2)), rng.normal(size=(1, 1, 4, 2))
    for mask in (None, causal_upper_left(3, 4)):
        got = F.scaled_dot_product_attention(_t(q), _t(k), _t(v), attn_mask=mask, is_causal=mask is None,
                                             scale=scale).numpy()
        assert np.isnan(got).all()                                 # every row has a blocked key here
    expected = spec.sdpa(q, k, v, causal="upper_left", scale=scale).output
    assert np.isfinite(expected).all()
    explicit = _t(masks.causal_mask(3, 4, "upper_left"))
    assert_close("explicit mask", F.scaled_dot_product_attention(_t(q), _t(k), _t(v), attn_mask=explicit,
                                                                 scale=scale).numpy(), expected)
    v_other = rng.normal(size=(1, 1, 4, 3))                        # E != Ev: math kernel
    assert_close("math kernel", F.scaled_dot_product_attention(_t(q), _t(k), _t(v_other), is_causal=True,
                                                               scale=scale).numpy(),
                 spec.sdpa(q, k, v_other, causal="upper_left", scale=scale).output)
    assert_close("lower_right", F.scaled_dot_product_attention(_t(q), _t(k), _t(v), attn_mask=causal_lower_right(3, 4),
                                                               scale=scale).numpy(),
                 spec.sdpa(q, k, v, causal="lower_right", scale=scale).output)
