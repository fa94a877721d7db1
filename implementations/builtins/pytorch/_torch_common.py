"""Helpers shared by the torch-based built-ins (and the bug zoo): weight loading,
strides, batching. (The suite's dtype names are torch's attribute names,
``getattr(torch, name)`` for each of ``implementations.base.ALL_DTYPES``.)"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from implementations.base import ImplementationError

__all__ = ["contiguous_strides", "flatten_batch", "load_mha_weights", "torch_version"]


def torch_version() -> str:
    return f"torch {torch.__version__}"


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides (in elements) a contiguous tensor of ``shape`` would have."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _module_param(module: Any, name: str) -> torch.Tensor | None:
    """``module.<name>``, with ``out_proj_weight`` meaning ``module.out_proj.weight``."""
    if name.startswith("out_proj_"):
        out_proj = getattr(module, "out_proj", None)
        return None if out_proj is None else getattr(out_proj, name.removeprefix("out_proj_"), None)
    return getattr(module, name, None)


def load_mha_weights(module: Any, params: Any) -> None:
    """Copy a ``spec.MHAParams`` (NumPy float64) into a module that uses
    ``nn.MultiheadAttention``'s parameter names, casting to each parameter's dtype/device.

    ``in_proj_weight`` and ``q/k/v_proj_weight`` are converted into each other when
    the module holds the other form (possible only when kdim == vdim == embed_dim).
    """
    values: dict[str, np.ndarray | None] = {
        name: getattr(params, name, None)
        for name in (
            "in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
            "in_proj_bias", "out_proj_weight", "out_proj_bias", "bias_k", "bias_v",
        )
    }
    has_packed = _module_param(module, "in_proj_weight") is not None
    if values["in_proj_weight"] is None and has_packed:
        parts = [values[f"{x}_proj_weight"] for x in "qkv"]
        if any(p is None for p in parts):
            raise ImplementationError("params have neither in_proj_weight nor q/k/v_proj_weight")
        values["in_proj_weight"] = np.concatenate(parts, axis=0)
    if values["in_proj_weight"] is not None and not has_packed:
        for x, part in zip("qkv", np.split(values["in_proj_weight"], 3, axis=0), strict=True):
            values[f"{x}_proj_weight"] = part
        values["in_proj_weight"] = None
    with torch.no_grad():
        for name, value in values.items():
            target = _module_param(module, name)
            if value is None:
                if target is not None and name in ("in_proj_bias", "out_proj_bias"):
                    raise ImplementationError(
                        f"params have {name}=None (bias=False) but {type(module).__name__} "
                        f"has a {name} parameter; build the module with bias=False"
                    )
                continue
            if target is None:
                raise ImplementationError(
                    f"{type(module).__name__} has no parameter {name!r} to load "
                    f"(shape {tuple(np.shape(value))}); a drop-in for nn.MultiheadAttention "
                    "must use its parameter names"
                )
            if tuple(target.shape) != tuple(np.shape(value)):
                raise ImplementationError(
                    f"{type(module).__name__}.{name} has shape {tuple(target.shape)} but the "
                    f"weights to load have shape {tuple(np.shape(value))}"
                )
            target.copy_(torch.as_tensor(np.asarray(value), dtype=torch.float64))


def flatten_batch(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap a 4-D-only SDPA kernel so it takes any number of leading batch dims and
    masks of any broadcastable rank (both are views; the kernel sees the same values)."""

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.dim() < 3 or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                f"query/key/value must have the same rank >= 3; got {query.dim()}, "
                f"{key.dim()}, {value.dim()}"
            )
        lead = query.shape[:-3]
        q4 = query.reshape(-1, *query.shape[-3:])
        k4 = key.reshape(-1, *key.shape[-3:])
        v4 = value.reshape(-1, *value.shape[-3:])
        if attn_mask is not None:
            full = (*lead, query.shape[-3], query.shape[-2], key.shape[-2])
            attn_mask = attn_mask.expand(full).reshape(-1, *full[-3:])
        out = fn(q4, k4, v4, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                 scale=scale, enable_gqa=enable_gqa)
        return out.reshape(*lead, *out.shape[-3:])

    return sdpa
