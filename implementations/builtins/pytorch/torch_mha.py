"""``torch.nn.MultiheadAttention`` itself, certified at the MHA level.

The module already speaks the MHA convention the suite hands it (bool masks True =
blocked, float masks added), so the adapter only builds the module and copies
weights in by parameter name. Its known deviations on torch 2.13 CPU are listed in
``implementations/xfail/torch-mha.toml``.
"""

from __future__ import annotations

import torch
from torch import nn

from implementations.base import ALL_MHA_FEATURES, Capabilities, Implementation
from implementations.builtins.pytorch._torch_common import load_mha_weights, torch_version

__all__ = ["make_implementation"]


def make_implementation() -> Implementation:
    devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    caps = Capabilities(
        devices=devices,
        dtypes=("float64", "float32", "float16", "bfloat16"),
        causal="upper_left",
        fully_masked="zero",
        dropout=True,
        mha_features=ALL_MHA_FEATURES,
    )
    return Implementation(
        name="torch-mha",
        capabilities=caps,
        mha=nn.MultiheadAttention,
        load_weights=load_mha_weights,
        version=torch_version(),
        description="torch.nn.MultiheadAttention (slow path, and its fast path in eval "
        "with grad disabled), weights copied in by parameter name",
    )
