"""Registers :mod:`implementations.builtins.references.handwritten` at both levels."""

from __future__ import annotations

import torch

from implementations.base import ALL_MHA_FEATURES, Capabilities, Implementation
from implementations.builtins.pytorch._torch_common import load_mha_weights, torch_version
from implementations.builtins.references.handwritten import MultiheadAttention, scaled_dot_product_attention

__all__ = ["make_implementation"]


def make_implementation() -> Implementation:
    devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    caps = Capabilities(
        devices=devices,
        dtypes=("float64", "float32", "float16", "bfloat16"),
        causal="upper_left",
        fully_masked="zero",
        dropout=True,
        sdpa_sinks=True,
    )
    return Implementation(
        name="handwritten",
        capabilities=caps,
        mha_capabilities=caps.replace(mha_features=ALL_MHA_FEATURES),
        sdpa=scaled_dot_product_attention,
        mha=MultiheadAttention,
        load_weights=load_mha_weights,
        version=torch_version(),
        description="plain PyTorch written step by step from the spec "
        "(implementations/builtins/references/handwritten.py)",
    )
