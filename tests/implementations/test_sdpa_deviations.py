"""The deviations in implementations/xfail/sdpa.toml and sdpa-flash.toml are still real
on the installed torch (a test here fails when torch fixes one: its entry is stale),
and the range syntax of their match filters works."""

from __future__ import annotations

import textwrap

import pytest
import torch

from implementations import registry
from implementations.base import ImplementationError
from implementations.flash_from_sdpa import _alibi_mask


def listed(impl, property_id, case, device="cpu"):
    """The expected failure of ``impl`` covering ``case`` on ``device`` (these deviations
    are measured here, on the CPU), or None (as the runner looks it up)."""
    case = {"device": device, **case}
    return next((entry for entry in impl.expected_failures if entry.applies(property_id, case)), None)


@pytest.mark.parametrize("name", ["sdpa", "sdpa-flash"])
@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_causal_with_non_positive_scale_gives_nan(name, scale):
    impl = registry.resolve(name)
    sign = "zero" if scale == 0 else "negative"
    entry = listed(impl, "forward_agreement", {"causal": "upper_left", "scale": scale, "scale_sign": sign,
                                               "mask_kind": "none", "different_v_dim": False})
    assert entry is not None
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=g) for _ in range(3))
    out = impl.sdpa(q, k, v, is_causal=True, scale=scale)  # (1, 2, 3, 4), L == S
    assert torch.isnan(out[..., :2, :]).all()  # rows 0 and 1 have causally blocked keys
    assert torch.isfinite(out[..., 2, :]).all()  # the last row sees every key
    math = registry.resolve("sdpa-math").sdpa(q, k, v, is_causal=True, scale=scale)
    assert torch.isfinite(math).all()
    # the same scale with an explicit causal mask, or a positive scale with the flag, is fine
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    assert torch.isfinite(impl.sdpa(q, k, v, attn_mask=causal, scale=scale)).all()
    assert torch.isfinite(impl.sdpa(q, k, v, is_causal=True, scale=0.5)).all()


def _grads(impl, query, key, value, grad_out, attn_mask=None):
    """(dq, dv) of ``impl.sdpa`` (default scale) for upstream gradient ``grad_out``."""
    query, key, value = (x.clone().requires_grad_() for x in (query, key, value))
    impl.sdpa(query, key, value, attn_mask=attn_mask).backward(grad_out)
    return query.grad.double(), value.grad.double()


def _wrong_heads(impl, inputs, attn_mask=None):
    """Heads whose dq is not finite or whose dv is off by more than 10% of the MATH backend's."""
    dq, dv = _grads(impl, *inputs, attn_mask=attn_mask)
    ref_dq, ref_dv = _grads(registry.resolve("sdpa-math"), *inputs, attn_mask=attn_mask)
    assert torch.isfinite(ref_dq).all() and torch.isfinite(ref_dv).all()
    scale = ref_dv.abs().amax(dim=(2, 3)) + 1.0                          # (1, H)
    wrong = ~torch.isfinite(dq).all(dim=(2, 3)) | ~((dv - ref_dv).abs().amax(dim=(2, 3)) <= 0.1 * scale)
    return int(wrong.sum())


#: A spread of sizes: which of them go wrong depends on the machine's CPU kernels (one
#: AVX512 Xeon: float32 at (3, 12), (4, 12), (64, 64), bfloat16 also at (1, 1), (1, 2);
#: another: float32 from (4, 12) on, bfloat16 at (1, 1) and (31, 29)), never on a rule.
SPREAD = [(1, 1), (1, 2), (3, 12), (4, 12), (31, 29), (64, 64)]
GRADIENT_PROPERTIES = {"gradient_agreement": {}, "fully_masked_rows": {},
                       "flash_gradients": {"level": "flash"}, "alibi_equivalence": {"level": "flash"},
                       "window_equivalence": {"level": "flash"}}


@pytest.mark.parametrize("name", ["sdpa", "sdpa-flash"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_wide_range_backward_entries_cover_every_size_and_are_intermittent(name, dtype):
    impl = registry.resolve(name)
    for prop, level in GRADIENT_PROPERTIES.items():
        for L, S in SPREAD + [(2, 2), (200, 3)]:
            attrs = {"regime": "wide_range", "dtype": dtype, "different_v_dim": False, "L": L, "S": S, **level}
            entry = listed(impl, prop, attrs)
            assert entry is not None and entry.intermittent, (prop, L, S)
            # Ev != E runs another kernel, which is right; so do other regimes and dtypes
            assert listed(impl, prop, dict(attrs, different_v_dim=True)) is None, prop
            assert listed(impl, prop, dict(attrs, regime="normal")) is None, prop
            assert listed(impl, prop, dict(attrs, dtype="float16")) is None, prop


@pytest.mark.parametrize("name", ["sdpa", "sdpa-flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", [None, "additive", "bool"])
def test_backward_with_logits_near_1e9_is_wrong_at_some_size(name, dtype, mask, large_logit_heads):
    """The entries are intermittent (no size is wrong everywhere), so this is their pin: when
    no size of the spread goes wrong any more, torch has fixed the backward. With a mask:
    the derived flash level passes ALiBi as an additive mask and the window as a bool one."""
    impl = registry.resolve(name)
    wrong = 0
    for L, S in SPREAD:
        attn_mask = {None: None, "additive": torch.zeros(L, S, dtype=dtype),
                     "bool": torch.ones(L, S, dtype=torch.bool)}[mask]
        wrong += sum(_wrong_heads(impl, large_logit_heads(dtype, L, S, seed=seed), attn_mask) for seed in range(2))
    assert wrong > 0, (
        f"{name} backward at {dtype} (mask: {mask}) now agrees with MATH at every size of {SPREAD}: the "
        "wide_range entries of implementations/xfail are stale")


def _alibi_like(L: int, S: int, heads: int = 16, seed: int = 0) -> torch.Tensor:
    """(1, heads, L, S) float32: the mask the derived flash level passes for ALiBi, with
    slopes in [0, 0.5)."""
    slopes = torch.rand(heads, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.5
    return _alibi_mask(L, S, slopes, None, torch.float32)


@pytest.mark.parametrize("name", ["sdpa", "sdpa-flash"])
def test_float32_backward_with_logits_near_1e9_is_wrong_at_small_sizes_with_a_varying_additive_mask(
        name, large_logit_heads):
    """Found by a dev seed (alibi_equivalence, L = 6, S = 3): with a float additive mask
    whose values vary, the deviation shows at small sizes too."""
    impl = registry.resolve(name)
    wrong = sum(_wrong_heads(impl, large_logit_heads(torch.float32, 6, 3, seed=seed), _alibi_like(6, 3, seed=seed))
                for seed in range(4))
    assert wrong > 0, (f"{name} backward with an ALiBi-like mask at L=6, S=3 now agrees with MATH: the "
                       "alibi wide_range entries of implementations/xfail may be stale")


def test_entries_do_not_cover_positive_or_default_scales():
    impl = registry.resolve("sdpa-flash")
    for attrs in ({"causal": "upper_left", "scale": 0.5, "scale_sign": "positive"},
                  {"causal": "upper_left", "scale": None, "scale_sign": "default"},
                  {"causal": None, "scale": -1.0, "scale_sign": "negative"}):
        assert listed(impl, "forward_agreement", attrs) is None


def test_range_match_syntax(tmp_path):
    (tmp_path / "ranges.toml").write_text(textwrap.dedent(
        """
        [[xfail]]
        property = "forward_agreement"
        match = { S = { ge = 64, lt = 128 }, dtype = { in = ["float16", "bfloat16"] } }
        reason = "r"
        """
    ))
    (entry,) = registry.load_expected_failures("ranges", directory=tmp_path)
    assert entry.applies("forward_agreement", {"S": 64, "dtype": "float16"})
    assert not entry.applies("forward_agreement", {"S": 128, "dtype": "float16"})
    assert not entry.applies("forward_agreement", {"S": 70, "dtype": "float32"})
    assert not entry.applies("forward_agreement", {"dtype": "float16"})  # S missing
    (tmp_path / "bad.toml").write_text(
        '[[xfail]]\nproperty = "p"\nreason = "r"\nmatch = { S = { between = 3 } }\n'
    )
    with pytest.raises(ImplementationError, match="lt"):
        registry.load_expected_failures("bad", directory=tmp_path)


def test_deviations_are_listed_for_the_device_they_were_measured_on():
    """The CPU kernels' deviations do not excuse a CUDA failure, and the CUDA ones
    (measured on an H200, torch 2.11: benchmarks/results/gpu-2026-12-04) not a CPU one."""
    impl = registry.resolve("sdpa")
    cpu_only = {"causal": "upper_left", "scale": 0.0, "scale_sign": "zero", "mask_kind": "none",
                "different_v_dim": False, "dtype": "float32"}
    assert listed(impl, "forward_agreement", cpu_only) is not None
    assert listed(impl, "forward_agreement", cpu_only, device="cuda") is None
    flash_nan = {"causal": None, "scale": 0.0, "scale_sign": "zero", "mask_kind": "none", "dtype": "float16"}
    assert "NaN" in listed(impl, "forward_agreement", flash_nan, device="cuda").reason
    assert listed(impl, "forward_agreement", flash_nan) is None
    assert listed(impl, "forward_agreement", {**flash_nan, "dtype": "float32"}, device="cuda") is None


def test_cuda_backends_deviations_are_never_named_for_a_cpu_failure():
    """sdpa-cudnn refuses S = 1 on CUDA: a CPU failure with S = 1 (torch-mha's dropout
    spread, seed 704) was told it was that deviation before the entries named their device."""
    from implementations.registry.expected_failures import builtin_deviations

    cpu = {"level": "mha", "device": "cpu", "dtype": "float64", "S": 1, "scale_sign": "zero",
           "fully_masked_rows": True}
    named = {name for name, _, _ in builtin_deviations("mha_dropout_expectation", [cpu])}
    assert not named & {"sdpa-cudnn", "sdpa-flash-cuda"}
    cuda = {**cpu, "device": "cuda", "level": "sdpa"}
    assert "sdpa-cudnn" in {name for name, _, _ in builtin_deviations("forward_agreement", [cuda])}
