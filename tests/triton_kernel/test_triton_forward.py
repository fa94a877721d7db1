"""The triton forward kernel against a float64 reference, on a table of cases.

Runs wherever the implementation runs (the Triton interpreter on CPU, the compiled
kernel on CUDA). The reference is a straight float64 torch computation of the spec's
SDPA (docs/CONTRACTS.md): GQA by repeat_interleave, bool True = may attend, float masks
added to the scaled scores, causal upper-left or lower-right, fully-masked rows -> 0.
Inputs of every dtype are drawn in float64, rounded to the dtype once, and the reference
sees exactly the stored values. Lengths ≡ 1 mod 16 leave a ragged 1-key/1-query block.
"""

from __future__ import annotations

import math

import pytest

# Imported before anything imports triton: on a machine without CUDA the module must
# set TRITON_INTERPRET=1 before triton's first import (see its docstring).
import implementations.builtins.kernels.triton_attention as ta  # (before triton: see its docstring)

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]')")

import torch  # noqa: E402

IMPL = ta.make_implementation()
if not IMPL.available:  # e.g. TRITON_INTERPRET=0 on a machine with no GPU
    pytest.skip(f"triton implementation unavailable: {IMPL.unavailable_reason}",
                allow_module_level=True)
DEVICE = IMPL.capabilities.devices[0]

#: max |got - reference| allowed, relative to max(1, max|reference|)
TOLERANCE = {
    torch.float64: 1e-12,
    torch.float32: 2e-5,
    torch.float16: 4e-3,
    torch.bfloat16: 3e-2,
}


def reference(q, k, v, mask=None, causal=None, scale=None):
    """float64 SDPA, written like the math. causal: None / "upper_left" / "lower_right"."""
    q, k, v = q.double(), k.double(), v.double()
    N, K = q.shape[-3] if q.dim() >= 3 else 1, k.shape[-3] if k.dim() >= 3 else 1
    if N != K:
        k = k.repeat_interleave(N // K, dim=-3)  # query head h uses kv head h // (N // K)
        v = v.repeat_interleave(N // K, dim=-3)
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    scores = scale * (q @ k.transpose(-2, -1))                       # (..., N, L, S)
    visible = torch.ones(L, S, dtype=torch.bool, device=q.device)
    if causal is not None:
        visible = torch.ones(L, S, device=q.device).tril(0 if causal == "upper_left" else S - L).bool()
    if mask is not None and mask.dtype == torch.bool:
        visible = visible & mask
    elif mask is not None:
        scores = scores + mask.double()
    visible = visible.expand_as(scores)
    scores = scores.masked_fill(~visible, float("-inf"))
    fully_masked = (scores == float("-inf")).all(-1, keepdim=True)  # (..., N, L, 1)
    weights = torch.softmax(scores.masked_fill(fully_masked, 0.0), dim=-1)
    weights = weights.masked_fill(fully_masked, 0.0)                 # policy "zero"
    return weights @ v                                               # (..., N, L, Ev)


def _randn(*shape, dtype=torch.float32, gen):
    return torch.randn(*shape, dtype=torch.float64, generator=gen).to(dtype).to(DEVICE)


def assert_matches_reference(got, want, dtype, what=""):
    assert got.shape == want.shape, f"shape={tuple(got.shape)}, but should be {tuple(want.shape)} [{what}]"
    assert got.dtype == dtype, f"dtype={got.dtype}, but should be {dtype} [{what}]"
    assert not torch.isnan(got).any(), f"NaN in output [{what}]"
    err = (got.double().cpu() - want.cpu()).abs()
    allowed = TOLERANCE[dtype] * max(1.0, want.abs().max().item() if want.numel() else 1.0)
    worst = err.max().item() if err.numel() else 0.0
    assert worst <= allowed, (
        f"max abs error={worst:.3g} at {tuple(torch.nonzero(err == worst)[0].tolist())}, "
        f"but should be <= {allowed:.3g} ({(err > allowed).sum().item()}/{err.numel()} "
        f"elements over) [{what}]")


# ---- the case table -------------------------------------------------------------------
# Each case builds (q, k, v, mask, is_causal, scale, enable_gqa) from a generator.

def _case_plain(B=2, N=3, K=None, L=33, S=49, E=20, Ev=12, dtype=torch.float32):
    K = N if K is None else K

    def build(gen):
        return dict(q=_randn(B, N, L, E, dtype=dtype, gen=gen),
                    k=_randn(B, K, S, E, dtype=dtype, gen=gen),
                    v=_randn(B, K, S, Ev, dtype=dtype, gen=gen),
                    enable_gqa=K != N)
    return build


def _with(base, **extra):
    def build(gen):
        case = base(gen)
        for key, make in extra.items():
            case[key] = make(case, gen) if callable(make) else make
        return case
    return build


def _bool_mask(shape_of):
    def make(case, gen):
        L, S = case["q"].shape[-2], case["k"].shape[-2]
        shape = shape_of(case["q"].shape[:-2], L, S)
        mask = torch.rand(*shape, generator=gen) > 0.4
        return mask.to(DEVICE)
    return make


def _additive_mask(shape_of, dtype=None, neg_inf_fraction=0.0):
    def make(case, gen):
        L, S = case["q"].shape[-2], case["k"].shape[-2]
        shape = shape_of(case["q"].shape[:-2], L, S)
        mask = torch.randn(*shape, dtype=torch.float64, generator=gen)
        if neg_inf_fraction:
            mask = mask.masked_fill(torch.rand(*shape, generator=gen) < neg_inf_fraction, float("-inf"))
        return mask.to(dtype or case["q"].dtype).to(DEVICE)
    return make


def _fully_masked_rows_bool(case, gen):
    L, S = case["q"].shape[-2], case["k"].shape[-2]
    mask = torch.rand(L, S, generator=gen) > 0.3
    mask[::3] = False  # every third query row sees nothing
    return mask.to(DEVICE)


def _fully_masked_rows_additive(case, gen):
    L, S = case["q"].shape[-2], case["k"].shape[-2]
    mask = torch.randn(1, 1, L, S, dtype=torch.float64, generator=gen)
    mask[..., 1::4, :] = float("-inf")
    return mask.to(case["q"].dtype).to(DEVICE)


def _layout(transform):
    """Re-lay q, k, v out in memory (same values), e.g. transposed or sliced."""
    def build_from(base):
        def build(gen):
            case = base(gen)
            for name in ("q", "k", "v"):
                case[name] = transform(case[name], gen)
            return case
        return build
    return build_from


def _transposed(t, gen):  # stored (B, L, N, E), viewed (B, N, L, E)
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _sliced_from_larger(t, gen):  # a window of a bigger, poisoned buffer
    big = torch.full((t.shape[0] + 1, t.shape[1] + 2, t.shape[2] + 3, 2 * t.shape[3] + 5),
                     float("nan"), dtype=t.dtype, device=t.device)
    window = big[1:, 2:, 3:, 5::2]
    window.copy_(t)
    return window


def _expanded_kv(B=2, N=4, L=17, S=33, E=24, Ev=40, dtype=torch.float32):
    """K/V with stride 0 over batch and heads (one (S, E) block expanded)."""
    def build(gen):
        return dict(q=_randn(B, N, L, E, dtype=dtype, gen=gen),
                    k=_randn(1, 1, S, E, dtype=dtype, gen=gen).expand(B, N, S, E),
                    v=_randn(1, 1, S, Ev, dtype=dtype, gen=gen).expand(B, N, S, Ev))
    return build


UL, LR = "upper_left", "lower_right"
full = lambda lead, L, S: (*lead, L, S)  # noqa: E731

CASES = {
    "basic": (_case_plain(), None),
    "E_ne_Ev": (_case_plain(E=7, Ev=29), None),
    "L_gt_S": (_case_plain(L=65, S=17), None),
    "L1": (_case_plain(L=1, S=33), None),
    "S1": (_case_plain(L=17, S=1), None),
    "one_of_everything": (_case_plain(B=1, N=1, L=1, S=1, E=1, Ev=1), None),
    "ragged_65": (_case_plain(B=1, N=2, L=65, S=65, E=33, Ev=17), None),
    "causal_UL_L_lt_S": (_case_plain(L=17, S=49), UL),
    "causal_UL_L_gt_S": (_case_plain(L=49, S=17), UL),
    "causal_LR_L_lt_S": (_case_plain(L=17, S=49), LR),
    "causal_LR_L_gt_S": (_case_plain(L=49, S=17), LR),  # first L - S rows fully masked
    "bool_LS": (_with(_case_plain(), mask=_bool_mask(lambda lead, L, S: (L, S))), None),
    "bool_full": (_with(_case_plain(), mask=_bool_mask(full)), None),
    "bool_padding_B11S": (_with(_case_plain(), mask=_bool_mask(lambda lead, L, S: (lead[0], 1, 1, S))), None),
    "bool_fully_masked_rows": (_with(_case_plain(L=33, S=17), mask=_fully_masked_rows_bool), None),
    "bool_and_causal_LR": (_with(_case_plain(L=33, S=49), mask=_bool_mask(full)), LR),
    "additive_NLS": (_with(_case_plain(), mask=_additive_mask(lambda lead, L, S: (lead[-1], L, S))), None),
    "additive_full_neg_inf": (_with(_case_plain(), mask=_additive_mask(full, neg_inf_fraction=0.3)), None),
    "additive_fully_masked_rows": (_with(_case_plain(), mask=_fully_masked_rows_additive), None),
    "additive_fp32_mask_causal": (_with(_case_plain(dtype=torch.float16),
                                        mask=_additive_mask(full, dtype=torch.float32)), UL),
    "scale_zero": (_with(_case_plain(), scale=0.0), None),
    "scale_negative": (_with(_case_plain(), scale=-0.7), None),
    "scale_tiny": (_with(_case_plain(), scale=1e-4), None),
    "scale_large": (_with(_case_plain(E=4), scale=3.0), None),
    "gqa_4_2": (_case_plain(N=4, K=2), None),
    "gqa_6_3_causal": (_case_plain(N=6, K=3, L=17, S=33), LR),
    "gqa_4_1_mask": (_with(_case_plain(N=4, K=1), mask=_bool_mask(full)), None),
    "transposed": (_layout(_transposed)(_case_plain(L=33, S=17)), None),
    "sliced_from_larger": (_layout(_sliced_from_larger)(_case_plain(L=17, S=33, E=16, Ev=8)), UL),
    "expanded_kv_S33": (_expanded_kv(S=33), None),
    "expanded_kv_S17_causal": (_expanded_kv(L=49, S=17), UL),
    "expanded_kv_S65_mask": (_with(_expanded_kv(S=65), mask=_additive_mask(lambda lead, L, S: (L, S))), None),
    "expanded_gqa": (_with(_expanded_kv(N=4), k=lambda c, g: c["k"][:, :2], v=lambda c, g: c["v"][:, :2],
                           enable_gqa=True), None),
}
DTYPE_CASES = {
    name: _case_plain(dtype=dtype)
    for name, dtype in (("float64", torch.float64), ("float32", torch.float32),
                        ("float16", torch.float16), ("bfloat16", torch.bfloat16))
}


def _run(build, causal, seed=0, impl=IMPL):
    gen = torch.Generator().manual_seed(seed)
    case = build(gen)
    got = impl.sdpa(case["q"], case["k"], case["v"], attn_mask=case.get("mask"),
                    is_causal=causal is not None, scale=case.get("scale"),
                    enable_gqa=case.get("enable_gqa", False))
    want = reference(case["q"], case["k"], case["v"], case.get("mask"), causal, case.get("scale"))
    return case, got, want


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_matches_reference(name):
    build, causal = CASES[name]
    impl = IMPL if causal != LR else ta.make_implementation(causal_alignment=LR)
    case, got, want = _run(build, causal, impl=impl)
    assert_matches_reference(got, want, case["q"].dtype, name)


@pytest.mark.parametrize("dtype_name", sorted(DTYPE_CASES))
@pytest.mark.parametrize("causal", [None, UL], ids=["full", "causal"])
def test_forward_every_dtype(dtype_name, causal):
    case, got, want = _run(DTYPE_CASES[dtype_name], causal)
    assert_matches_reference(got, want, case["q"].dtype, dtype_name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_16bit_additive_mask_in_dtype(dtype):
    build = _with(_case_plain(dtype=dtype, L=17, S=33), mask=_additive_mask(full, neg_inf_fraction=0.2))
    case, got, want = _run(build, UL)
    assert_matches_reference(got, want, dtype, f"{dtype} additive + causal")


def test_leading_batch_dims_3d_and_5d():
    gen = torch.Generator().manual_seed(1)
    q3, k3, v3 = _randn(2, 17, 8, gen=gen), _randn(2, 33, 8, gen=gen), _randn(2, 33, 5, gen=gen)
    assert_matches_reference(IMPL.sdpa(q3, k3, v3), reference(q3, k3, v3), torch.float32, "3-D")
    q5, k5, v5 = (_randn(2, 3, 2, 17, 8, gen=gen), _randn(2, 3, 2, 33, 8, gen=gen),
                  _randn(2, 3, 2, 33, 5, gen=gen))
    mask = (torch.rand(3, 1, 17, 33, generator=gen) > 0.5).to(DEVICE)
    assert_matches_reference(IMPL.sdpa(q5, k5, v5, attn_mask=mask), reference(q5, k5, v5, mask),
                             torch.float32, "5-D + broadcast mask")
    # 5-D whose leading dims cannot be merged by a view (declared copy path)
    q5t = q5.transpose(0, 1).contiguous().transpose(0, 1)
    assert_matches_reference(IMPL.sdpa(q5t, k5, v5), reference(q5, k5, v5), torch.float32,
                             "5-D non-mergeable batch strides")


def test_fully_masked_rows_are_zero_and_others_untouched():
    gen = torch.Generator().manual_seed(2)
    q, k, v = _randn(1, 2, 20, 8, gen=gen), _randn(1, 2, 33, 8, gen=gen), _randn(1, 2, 33, 8, gen=gen)
    mask = (torch.rand(20, 33, generator=gen) > 0.5).to(DEVICE)
    mask[3] = False
    out = IMPL.sdpa(q, k, v, attn_mask=mask)
    assert torch.equal(out[..., 3, :], torch.zeros_like(out[..., 3, :]))
    other = IMPL.sdpa(q, k, v, attn_mask=mask.index_fill(0, torch.tensor([3], device=DEVICE), True))
    keep = [i for i in range(20) if i != 3]
    assert torch.equal(out[..., keep, :], other[..., keep, :])


# ---- invalid inputs -------------------------------------------------------------------

def _qkv(N=4, K=4, L=5, S=6, E=8, Ev=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    return (_randn(1, N, L, E, dtype=dtype, gen=gen), _randn(1, K, S, E, dtype=dtype, gen=gen),
            _randn(1, K, S, Ev, dtype=dtype, gen=gen))


def test_gqa_heads_must_divide():
    q, k, v = _qkv(N=4, K=3)
    with pytest.raises(ValueError, match="N % K"):
        IMPL.sdpa(q, k, v, enable_gqa=True)


def test_gqa_needs_enable_gqa():
    q, k, v = _qkv(N=4, K=2)
    with pytest.raises(ValueError, match="enable_gqa"):
        IMPL.sdpa(q, k, v)


def test_dropout_raises():
    with pytest.raises(ValueError, match="dropout"):
        IMPL.sdpa(*_qkv(), dropout_p=0.1)


def test_mask_shape_mismatch_raises():
    q, k, v = _qkv(S=6)
    with pytest.raises(ValueError, match="attn_mask"):
        IMPL.sdpa(q, k, v, attn_mask=torch.ones(5, 20, dtype=torch.bool, device=DEVICE))


def test_mask_integer_dtype_raises():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="attn_mask.dtype"):
        IMPL.sdpa(q, k, v, attn_mask=torch.ones(5, 6, dtype=torch.int64, device=DEVICE))


def test_dtype_mismatch_raises():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="dtype"):
        IMPL.sdpa(q, k.half(), v)


def test_head_dim_too_large_raises():
    q, k, v = _qkv(E=ta.MAX_HEAD_DIM + 1)
    with pytest.raises(ValueError, match="head dim"):
        IMPL.sdpa(q, k, v)


def test_mask_requiring_grad_raises_since_no_mask_gradient():
    q, k, v = _qkv()
    mask = torch.zeros(5, 6, device=DEVICE, requires_grad=True)
    assert not IMPL.capabilities.mask_grad
    with pytest.raises(NotImplementedError, match="attn_mask"):
        IMPL.sdpa(q, k, v, attn_mask=mask)
    with torch.no_grad():
        IMPL.sdpa(q, k, v, attn_mask=mask)


def test_capabilities_are_declared():
    caps = IMPL.capabilities
    assert caps.causal == UL and ta.make_implementation(causal_alignment=LR).capabilities.causal == LR
    assert set(caps.dtypes) == {"float64", "float32", "float16", "bfloat16"}
    assert caps.fully_masked == "zero" and not caps.dropout and not caps.tf32
    assert caps.autograd and not caps.mask_grad
    assert caps.gqa and caps.different_v_dim and caps.non_contiguous and caps.custom_scale
    assert IMPL.name == "triton"


# ---- planted bugs ---------------------------------------------------------------------

def _max_growing_keys(B=1, N=2, L=17, S=150, E=16, Ev=8):
    """Keys whose logits grow along S, so the running row max changes every block."""
    def build(gen):
        q = torch.rand(B, N, L, E, dtype=torch.float64, generator=gen) + 0.5
        ramp = torch.linspace(0.1, 3.0, S, dtype=torch.float64)[:, None]
        k = ramp * (torch.rand(B, N, S, E, dtype=torch.float64, generator=gen) + 0.5)
        v = torch.randn(B, N, S, Ev, dtype=torch.float64, generator=gen)
        return dict(q=q.float().to(DEVICE), k=k.float().to(DEVICE), v=v.float().to(DEVICE))
    return build


PLANTED = {
    # bug -> (case that exposes it, causal)
    "drop_ragged_block": (_case_plain(L=17, S=33), None),
    "no_rescale": (_max_growing_keys(), None),
    "ignore_strides": (_layout(_transposed)(_case_plain(L=33, S=17)), None),
}


#: planted bugs of the flash level (window, softcap): tests/triton_kernel/test_triton_flash.py
FLASH_PLANTED = ("window_left_off_by_one",)


def test_every_planted_bug_is_tested():
    assert set(ta.PLANTED_BUGS) == set(PLANTED) | set(FLASH_PLANTED)


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_planted_bug_gives_wrong_answer_where_clean_is_right(bug):
    build, causal = PLANTED[bug]
    case, got, want = _run(build, causal)
    assert_matches_reference(got, want, case["q"].dtype, f"clean kernel on the {bug} case")
    mutant = ta.make_implementation(planted_bug=bug)
    assert mutant.name != "triton" and not mutant.listed
    _, bad, _ = _run(build, causal, impl=mutant)
    with pytest.raises(AssertionError):
        assert_matches_reference(bad, want, case["q"].dtype, f"planted {bug}")


def test_planted_bugs_are_silent_where_they_should_be():
    """Each bug needs its trigger: no partial block / one key block / contiguous input."""
    exact = _case_plain(L=17, S=64)   # S % BLOCK_N == 0 for every config (16..64)
    one_block = _case_plain(L=17, S=9)
    for bug, build in (("drop_ragged_block", exact), ("no_rescale", one_block),
                       ("ignore_strides", _case_plain())):
        case, got, want = _run(build, None, impl=ta.make_implementation(planted_bug=bug))
        assert_matches_reference(got, want, case["q"].dtype, f"{bug} without its trigger")


def test_unknown_planted_bug_raises():
    with pytest.raises(ValueError, match="planted_bug"):
        ta.make_implementation(planted_bug="nope")
