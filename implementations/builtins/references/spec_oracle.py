"""The NumPy oracle (``spec/``) behind the torch calling convention.

Every call converts the torch tensors to float64 NumPy exactly (16-bit values
upcast, never regenerated), runs ``spec.sdpa`` / ``spec.mha_forward`` and converts
the result back to the input's dtype and device. Gradients come from the spec's
closed-form ``spec.sdpa_vjp`` through a ``torch.autograd.Function``. Certifying
``spec`` against itself is the suite's own sanity check: it must pass everything.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from implementations.base import ALL_DTYPES, ALL_MHA_FEATURES, Capabilities, Implementation
from implementations.builtins.pytorch._torch_common import load_mha_weights

__all__ = ["SpecMultiheadAttention", "make_implementation", "spec_sdpa"]


def _np(t: torch.Tensor | None) -> np.ndarray | None:
    if t is None:
        return None
    t = t.detach().cpu()
    if t.is_floating_point():
        t = t.to(torch.float64)
    return t.numpy()


def _back(a: np.ndarray | None, like: torch.Tensor) -> torch.Tensor | None:
    if a is None:
        return None
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype=like.dtype, device=like.device)


def _mask_args(attn_mask: torch.Tensor | None) -> dict[str, Any]:
    if attn_mask is None:
        return {}
    if attn_mask.dtype == torch.bool:
        return {"attend_mask": _np(attn_mask)}
    return {"additive_mask": _np(attn_mask)}


class _SpecSDPA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, attn_mask, is_causal, scale):
        import spec

        kwargs = dict(_mask_args(attn_mask), causal="upper_left" if is_causal else None, scale=scale)
        ctx.save_for_backward(query, key, value, attn_mask)
        ctx.kwargs = kwargs
        result = spec.sdpa(_np(query), _np(key), _np(value), **kwargs)
        return _back(result.output, query)

    @staticmethod
    def backward(ctx, grad_output):
        import spec

        query, key, value, attn_mask = ctx.saved_tensors
        kwargs = dict(_mask_args(attn_mask), causal=ctx.kwargs["causal"], scale=ctx.kwargs["scale"])
        grads = spec.sdpa_vjp(_np(query), _np(key), _np(value), _np(grad_output), **kwargs)
        dmask = None
        if attn_mask is not None and attn_mask.is_floating_point():
            dmask = _back(grads.dadditive_mask, attn_mask)
        return _back(grads.dquery, query), _back(grads.dkey, key), _back(grads.dvalue, value), dmask, None, None


def spec_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA through the oracle; same signature as torch's, upper-left ``is_causal``."""
    if dropout_p:
        raise NotImplementedError("the spec oracle is deterministic: dropout_p must be 0")
    if query.dim() >= 3 and key.dim() >= 3 and query.shape[-3] != key.shape[-3] and not enable_gqa:
        raise ValueError(
            f"query has N={query.shape[-3]} heads but key has K={key.shape[-3]}; "
            "pass enable_gqa=True for grouped-query attention"
        )
    return _SpecSDPA.apply(query, key, value, attn_mask, bool(is_causal), scale)


class SpecMultiheadAttention(nn.Module):
    """An ``nn.MultiheadAttention`` look-alike whose forward is ``spec.mha_forward``.

    It holds real parameters under nn.MultiheadAttention's names (so weights load by
    name), runs in eval semantics only (no dropout) and has no autograd.
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
                 add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None, dtype=None):
        super().__init__()
        if dropout:
            raise NotImplementedError("the spec oracle has no dropout; use dropout=0.0")
        from implementations.builtins.references.handwritten import MultiheadAttention

        # Borrow the handwritten module's parameter layout; only forward differs.
        self.inner = MultiheadAttention(embed_dim, num_heads, bias=bias, add_bias_kv=add_bias_kv,
                                        add_zero_attn=add_zero_attn, kdim=kdim, vdim=vdim,
                                        batch_first=batch_first, device=device, dtype=dtype)
        self.batch_first = batch_first

    def params(self):
        import spec

        m = self.inner
        get = lambda t: _np(t)  # noqa: E731
        return spec.MHAParams(
            embed_dim=m.embed_dim, num_heads=m.num_heads,
            out_proj_weight=get(m.out_proj.weight), out_proj_bias=get(m.out_proj.bias),
            in_proj_weight=get(m.in_proj_weight), q_proj_weight=get(m.q_proj_weight),
            k_proj_weight=get(m.k_proj_weight), v_proj_weight=get(m.v_proj_weight),
            in_proj_bias=get(m.in_proj_bias), bias_k=get(m.bias_k), bias_v=get(m.bias_v),
            kdim=m.kdim, vdim=m.vdim, add_zero_attn=m.add_zero_attn,
        )

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        import spec

        output, weights = spec.mha_forward(
            self.params(), _np(query), _np(key), _np(value),
            key_padding_mask=_np(key_padding_mask), attn_mask=_np(attn_mask),
            need_weights=need_weights, average_attn_weights=average_attn_weights,
            is_causal=is_causal, batch_first=self.batch_first,
        )
        return _back(output, query), _back(weights, query)


def _load_spec_weights(module: SpecMultiheadAttention, params: Any) -> None:
    load_mha_weights(module.inner, params)


def make_implementation() -> Implementation:
    try:
        import spec  # noqa: F401
    except ImportError as exc:
        return Implementation(name="spec", unavailable_reason=f"the spec package does not import: {exc}")
    mha_features = ALL_MHA_FEATURES - {"dropout"}
    return Implementation(
        name="spec",
        capabilities=Capabilities(devices=("cpu",), dtypes=ALL_DTYPES, dropout=False, non_contiguous=True),
        mha_capabilities=Capabilities(
            devices=("cpu",), dtypes=ALL_DTYPES, dropout=False, autograd=False,
            mask_grad=False, mha_features=mha_features,
        ),
        sdpa=spec_sdpa,
        mha=SpecMultiheadAttention,
        load_weights=_load_spec_weights,
        version="spec",
        description="the float64 NumPy oracle (spec.sdpa / spec.mha_forward, grads from "
        "spec.sdpa_vjp); inputs upcast exactly, output cast back to the input dtype",
    )
