"""The deviations in implementations/xfail/sdpa.toml and sdpa-flash.toml are still real
on the installed torch, and the range syntax of their match filters works."""

from __future__ import annotations

import textwrap

import pytest
import torch

from implementations import registry
from implementations.base import ImplementationError


def listed(impl, property_id, case):
    """The expected failure of ``impl`` covering ``case``, or None (as the runner looks it up)."""
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
