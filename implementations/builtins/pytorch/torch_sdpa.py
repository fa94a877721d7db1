"""``torch.nn.functional.scaled_dot_product_attention`` under each backend.

Capabilities of the CPU backends were measured on torch 2.13 CPU by calling each
feature under ``sdpa_kernel(backend)`` and recording which calls raise "No available
kernel" (tests/implementations/test_capabilities.py re-checks every claim):

* default dispatch and MATH: everything (masks of both kinds and any rank, GQA,
  Ev != E, dropout, float64..bfloat16, gradients incl. the additive mask's).
* CPU FLASH_ATTENTION: masks (bool and additive), causal, GQA, custom scale, all four
  dtypes, backward; refuses Ev != E, dropout_p > 0, a mask that requires grad, inputs
  whose last dim is not unit-stride, and masks/inputs that are not 2-D/4-D resp. 4-D
  (the adapter reshapes ranks, which are views, so only the first four remain refusals).

The CUDA-only backends cannot be measured on this machine; their capabilities are
declared conservatively from PyTorch's documented constraints (sdp_utils) and say so.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from implementations.base import Capabilities, Implementation
from implementations.builtins.pytorch._torch_common import flatten_batch, torch_version

__all__ = ["make_default", "make_backend"]

_ALL = ("float64", "float32", "float16", "bfloat16")


def _devices() -> tuple[str, ...]:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def _with_backend(backend: SDPBackend):
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
            )

    sdpa.__name__ = f"sdpa_{backend.name.lower()}"
    return sdpa


def make_default() -> Implementation:
    """``F.scaled_dot_product_attention`` with PyTorch's own backend choice."""
    return Implementation(
        name="sdpa",
        capabilities=Capabilities(devices=_devices(), dtypes=_ALL, dropout=True),
        sdpa=F.scaled_dot_product_attention,
        version=torch_version(),
        description="torch.nn.functional.scaled_dot_product_attention, default dispatch",
    )


# name -> (backend, capabilities, description)
#: Head dims a multiple of 8 (up to 512): the memory-efficient and cuDNN kernels refuse
#: the others in 16-bit (H200, torch 2.11: 1, 2, 4, 6, 12, 20 refused; 8, 24, 256 ran).
_MULTIPLES_OF_8 = tuple(range(8, 513, 8))

_BACKENDS: dict[str, tuple[str, Capabilities, str]] = {
    "sdpa-math": (
        "MATH",
        Capabilities(devices=_devices(), dtypes=_ALL, dropout=True),
        "SDPA forced to the MATH backend (the reference composite)",
    ),
    "sdpa-flash": (
        "FLASH_ATTENTION",
        Capabilities(
            devices=("cpu",), dtypes=_ALL, different_v_dim=False, dropout=False,
            mask_grad=False, non_contiguous=False,
        ),
        "SDPA forced to the CPU FLASH_ATTENTION kernel (measured on torch 2.13 CPU); "
        "4-D only, so the adapter reshapes leading batch dims and mask rank (views)",
    ),
    "sdpa-flash-cuda": (
        "FLASH_ATTENTION",
        Capabilities(
            devices=("cuda",), dtypes=("float16", "bfloat16"), mask_kinds=frozenset({"none"}),
            causal=None, different_v_dim=False, dropout=True, mask_grad=False,
            non_contiguous=False, max_head_dim=256,
        ),
        "SDPA forced to CUDA FlashAttention-2; measured call by call on an H200 with torch "
        "2.11 (benchmarks/sdpa_backend_caps.py): no attn_mask, 16-bit only, E = Ev <= 256, "
        "GQA, is_causal refused when L != S (so the causal flag is not claimed)",
    ),
    "sdpa-efficient": (
        "EFFICIENT_ATTENTION",
        Capabilities(
            devices=("cuda",), dtypes=("float32", "float16", "bfloat16"), gqa=False,
            dropout=True, mask_grad=False, non_contiguous=False, head_dims=_MULTIPLES_OF_8,
        ),
        "SDPA forced to CUDA memory-efficient attention; measured call by call on an H200 "
        "with torch 2.11 (benchmarks/sdpa_backend_caps.py): head dims a multiple of 8 in "
        "16-bit (of 4 in float32; declared as 8 for all), no GQA, no mask gradient",
    ),
    "sdpa-cudnn": (
        "CUDNN_ATTENTION",
        Capabilities(
            devices=("cuda",), dtypes=("float16", "bfloat16"), causal="upper_left",
            different_v_dim=True, gqa=True, dropout=False, mask_grad=False,
            non_contiguous=False, head_dims=tuple(d for d in _MULTIPLES_OF_8 if d <= 256),
        ),
        "SDPA forced to cuDNN attention; measured call by call on an H200 with torch 2.11 "
        "(benchmarks/sdpa_backend_caps.py): bool and additive masks, is_causal top-left for "
        "any L and S, GQA, Ev != E, head dims a multiple of 8 up to 256, S >= 2 (its "
        "expected failures: S = 1 refused, scale <= 0 NaN, fully-masked rows not zero)",
    ),
}


def make_backend(name: str) -> Implementation:
    """SDPA forced to the backend registered as ``name`` (see ``_BACKENDS``)."""
    backend_name, caps, description = _BACKENDS[name]
    backend = getattr(SDPBackend, backend_name)
    sdpa = _with_backend(backend)
    if name == "sdpa-flash":
        sdpa = flatten_batch(sdpa)
    reason = None
    if caps.devices == ("cuda",) and not torch.cuda.is_available():
        reason = "needs a CUDA device (torch.cuda.is_available() is False)"
    return Implementation(
        name=name,
        capabilities=caps,
        sdpa=sdpa,
        version=torch_version(),
        description=description,
        unavailable_reason=reason,
    )
