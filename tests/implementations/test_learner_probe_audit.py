"""The learner level's convention probes (``implementations/registry/learner``), audited as
the SDPA and MHA probes are (``test_probe_audit.py``): for each convention a probe decides,
hand-written modules that differ from one correct module in that convention alone. The
probe must find each one's own value, and every other probed convention as for the base
module: the calls it decides with are built where the alternatives differ (B = 3 != H = 2,
rows left different keys, a fused layout the oracle tells apart)."""

from __future__ import annotations

import textwrap

import pytest

from implementations import registry

BASE = {
    "proj": "self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)",
    "qkv": "q, k, v = self.q(x), self.k(x), self.v(x)",
    "split": "q, k, v = (t.view(B, L, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))",
    "mask": "scores = scores.masked_fill(mask == 0, float('-inf'))",
    "drop": "attn = self.drop(attn)",
}

#: convention -> (what the module changes, the plan/capability values the probe must find).
VARIANTS = {
    "keep": ({}, {}),
    "blocked": ({"mask": "scores = scores.masked_fill(mask, float('-inf'))"}, {"mask": "blocked"}),
    "blocked_long": ({"mask": "scores = scores.masked_fill(mask.bool(), float('-inf'))"},
                     {"mask": "blocked"}),  # a bool mask runs: bool is read first
    "additive": ({"mask": "scores = scores + mask"}, {"mask": "additive", "mask_dtype": "float"}),
    "finite_fill": ({"mask": "scores = scores.masked_fill(mask == 0, -1e9)"}, {"fully_masked": "uniform"}),
    "zero_rows": ({"mask": "scores = scores.masked_fill(mask == 0, float('-inf'))",
                   "drop": "attn = self.drop(torch.nan_to_num(attn))"}, {"fully_masked": "zero"}),
    "fused": ({"proj": "self.qkv = nn.Linear(d, 3 * d)", "qkv": "q, k, v = self.qkv(x).split(D, dim=-1)"},
              {"fused": "qkv"}),
    "fused_per_head": ({"proj": "self.qkv = nn.Linear(d, 3 * d)",
                        "qkv": "q, k, v = self.qkv(x).view(B, L, self.h, 3 * D // self.h).chunk(3, dim=-1)",
                        "split": "q, k, v = (t.transpose(1, 2) for t in (q, k, v))"},
                       {"fused": "qkv_per_head"}),
    "no_dropout": ({"drop": "attn = attn"}, {"dropout": False}),
    # a mask with a batch axis and no head axis, broadcast over the heads by the module itself
    "per_item_mask": ({"mask": "scores = scores.masked_fill(mask.unsqueeze(1) == 0, float('-inf'))"},
                      {"mask_shapes": {("B", "L", "S"), ("B", "1", "S")}}),
}

TEMPLATE = '''
import math

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, d, heads, dropout=0.0):
        super().__init__()
        self.h = heads
        {proj}
        self.o = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        B, L, D = x.shape
        {qkv}
        {split}
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.h)
        if mask is not None:
            {mask}
        attn = scores.softmax(dim=-1)
        {drop}
        return self.o((attn @ v).transpose(1, 2).reshape(B, L, D))
'''


def _probed(tmp_path, name: str) -> dict:
    changes, _ = VARIANTS[name]
    source = TEMPLATE.format(**{**BASE, **changes})
    if name == "no_dropout":
        source = source.replace("def __init__(self, d, heads, dropout=0.0)", "def __init__(self, d, heads)") \
                       .replace("self.drop = nn.Dropout(dropout)", "")
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    impl = registry.resolve(f"{path}:Attention")
    plan, caps = impl.mha.plan, impl.caps("mha")
    return {"mask": plan.mask, "mask_dtype": plan.mask_dtype, "fused": plan.fused if plan.role("qkv") else None,
            "fully_masked": caps.fully_masked_policy("bool"),
            "dropout": caps.dropout, "mask_shapes": set(plan.mask_shapes), "notes": " ".join(caps.probe_notes)}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return _probed(tmp_path_factory.mktemp("base"), "keep")


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "keep"])
def test_each_learner_convention_probe_finds_its_own_value_alone(name, base, tmp_path):
    _, expected = VARIANTS[name]
    found = _probed(tmp_path, name)
    for key, value in expected.items():
        assert found[key] == value, (name, key, found[key], found["notes"])
        assert base[key] != value, (key, base[key])
    same = [k for k in ("mask", "mask_dtype", "fully_masked", "dropout", "fused", "mask_shapes") if k not in expected]
    assert {k: found[k] for k in same} == {k: base[k] for k in same}, (name, found["notes"])


def test_the_base_module_is_read_as_written(base):
    """1 = keep in bool, -inf fill (NaN rows), dropout on the weights, separate projections;
    its mask broadcasts over heads, so (B, 1, 1, S) and (B, 1, L, S) masks run and (B, L, S)
    ones do not (B = 3 != H = 2 in the probe's call)."""
    assert (base["mask"], base["mask_dtype"], base["fully_masked"], base["dropout"], base["fused"]) == (
        "keep", "bool", "nan", True, None)
    assert {("B", "1", "L", "S"), ("B", "1", "1", "S")} <= base["mask_shapes"]
    assert ("B", "L", "S") not in base["mask_shapes"], base["mask_shapes"]
