"""The MHA-level correct base of the bug zoo: :class:`HandwrittenMHA`.

A drop-in for ``torch.nn.MultiheadAttention`` (same constructor, parameter names
and forward; its bool masks are **True = blocked**), written the way tutorials
write it: batch-first internally, explicit head split/merge; each step is a method
a mutant overrides. :mod:`implementations.mutants._base` re-exports these names.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from implementations.base import Capabilities, Implementation
from implementations.builtins.pytorch._torch_common import load_mha_weights
from implementations.mutants.sdpa._sdpa_bases import (
    AttentionInputError,
    read_as_contiguous,
    safe_softmax,
)

__all__ = ["HandwrittenMHA", "MHA_CAPABILITIES", "mha_implementation"]

#: HandwrittenMHA computes in its parameters' dtype; 16-bit MHA is not claimed.
MHA_CAPABILITIES = Capabilities(
    devices=("cpu",),
    dtypes=("float64", "float32"),
    causal="upper_left",
    fully_masked="zero",
    dropout=True,
    gqa=False,
    different_v_dim=False,
)



class HandwrittenMHA(nn.Module):
    """A drop-in for ``torch.nn.MultiheadAttention`` written like a tutorial.

    Same constructor, parameter names and ``forward``; masks in MHA's convention
    (bool **True = blocked**, float added); ``is_causal`` is a hint as in torch
    (an ``attn_mask`` is required, and applied). Fully-masked query rows give a zero
    attention output (so ``out_proj.bias`` after the projection) and zero weights.

    Deliberately independent of the built-in
    :class:`implementations.builtins.references.handwritten.MultiheadAttention` (written apart, no
    shared code), so that a bug in one cannot hide in the other: keep them separate.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        if embed_dim % num_heads != 0:
            raise AttentionInputError(
                f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}"
            )
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.dropout, self.batch_first, self.add_zero_attn = dropout, batch_first, add_zero_attn
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
        else:
            self.bias_k = self.bias_v = None
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        for p in (self.in_proj_weight, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
            if p is not None:
                nn.init.xavier_uniform_(p)
        for p in (self.bias_k, self.bias_v):
            if p is not None:
                nn.init.xavier_normal_(p)

    # -- forward ---------------------------------------------------------
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ):
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        B, L, D = query.shape                                                  # (B, L, D)
        S = key.shape[1]
        N, E = self.num_heads, self.head_dim
        dtype = query.dtype
        padding = self.padding_to_additive(key_padding_mask, dtype)            # (B, S) or None
        attn_mask, causal_flag = self.resolve_causal(attn_mask, is_causal, padding, need_weights)
        mask = self.attn_mask_to_additive(attn_mask, dtype)                    # (L, S)/(B*N, L, S)
        self.check_mask_shapes(mask, padding, B, L, S)

        q, k, v = self.project_inputs(query, key, value)                       # (B, T, D)
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(B, 1, D)], dim=1)
            v = torch.cat([v, self.bias_v.expand(B, 1, D)], dim=1)
            mask, padding = _pad_last(mask), _pad_last(padding)
        q, k, v = self.split_heads(q), self.split_heads(k), self.split_heads(v)  # (B, N, T, E)
        if self.add_zero_attn:
            zeros = torch.zeros(B, N, 1, E, dtype=k.dtype, device=k.device)
            k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
            mask, padding = _pad_last(mask), _pad_last(padding)
        S_total = k.shape[2]
        bias = torch.zeros(B, N, L, S_total, dtype=dtype, device=q.device)   # (B, N, L, S')
        if mask is not None:
            bias = bias + mask.reshape(-1, N, L, S_total) if mask.dim() == 3 else bias + mask
        if padding is not None:
            bias = bias + padding.reshape(B, 1, 1, S_total)
        if causal_flag:
            causal = torch.ones(L, S_total, dtype=torch.bool, device=q.device).tril()
            bias = bias.masked_fill(~causal, float("-inf"))

        attended, weights = self.attention(q, k, v, bias, self.effective_dropout())
        out = self.project_output(self.merge_heads(attended))                 # (B, L, D)

        if unbatched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        if average_attn_weights:
            weights = self.average_heads(weights)                              # (B, L, S')
        if unbatched:
            weights = weights.squeeze(0)
        return out, weights

    # -- steps (mutant hooks) ---------------------------------------------
    def padding_to_additive(self, key_padding_mask, dtype):
        if key_padding_mask is None:
            return None
        if key_padding_mask.dtype == torch.bool:
            zeros = torch.zeros(key_padding_mask.shape, dtype=dtype, device=key_padding_mask.device)
            return zeros.masked_fill(key_padding_mask, float("-inf"))
        return key_padding_mask.to(dtype)

    def resolve_causal(self, attn_mask, is_causal, padding, need_weights):
        """is_causal is a hint that needs the causal attn_mask, and the mask is what
        is applied. Returns (attn_mask, apply a causal triangle as well).

        torch 2.13 swaps the mask for SDPA's is_causal on the need_weights=False,
        no-padding path, which also blocks the keys add_zero_attn/add_bias_kv append
        (so its output then depends on need_weights); the spec, and this base, apply
        the (padded) mask on every path.
        """
        if is_causal and attn_mask is None:
            raise AttentionInputError(
                "is_causal=True needs attn_mask (the causal mask); the flag is only a hint"
            )
        return attn_mask, False

    def attn_mask_to_additive(self, attn_mask, dtype):
        if attn_mask is None:
            return None
        if attn_mask.dtype == torch.bool:
            zeros = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device)
            return zeros.masked_fill(attn_mask, float("-inf"))                 # True = blocked
        return attn_mask.to(dtype)

    def check_mask_shapes(self, mask, padding, B: int, L: int, S: int) -> None:
        if mask is not None:
            allowed = [(L, S), (B * self.num_heads, L, S)]
            if tuple(mask.shape) not in allowed:
                raise AttentionInputError(
                    f"attn_mask.shape={tuple(mask.shape)} must be one of {allowed}"
                )
        if padding is not None and tuple(padding.shape) != (B, S):
            raise AttentionInputError(
                f"key_padding_mask.shape={tuple(padding.shape)} must be (B, S)={(B, S)}"
            )

    def project_inputs(self, query, key, value):
        D = self.embed_dim
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight[:D], self.in_proj_weight[D:2 * D], self.in_proj_weight[2 * D:]
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias[:D], self.in_proj_bias[D:2 * D], self.in_proj_bias[2 * D:]
        return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

    def split_heads(self, x):
        B, T, _ = x.shape
        return x.reshape(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, N, T, E)

    def merge_heads(self, x):
        B, N, L, E = x.shape
        return x.transpose(1, 2).reshape(B, L, N * E)                          # (B, L, D)

    def effective_dropout(self) -> float:
        return self.dropout if self.training else 0.0

    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def kernel_input(self, x):
        """The attention kernel reads raw memory, so it is handed dense tensors."""
        return x.contiguous()

    def attention(self, q, k, v, bias, dropout_p):
        q, k, v = (read_as_contiguous(self.kernel_input(x)) for x in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * self.scale() + bias               # (B, N, L, S)
        weights = self.dropout_weights(self.softmax(scores), dropout_p)
        return weights @ v, weights

    def softmax(self, scores):
        return safe_softmax(scores)

    def dropout_weights(self, weights, dropout_p: float):
        return F.dropout(weights, p=dropout_p, training=True) if dropout_p > 0 else weights

    def project_output(self, x):
        return self.out_proj(x)

    def average_heads(self, weights):
        return weights.mean(dim=1)


def _pad_last(mask):
    return None if mask is None else F.pad(mask, (0, 1))


def mha_implementation(name: str, module_class: type, capabilities: Capabilities, description: str) -> Implementation:
    def factory(embed_dim: int, num_heads: int, **options: Any) -> nn.Module:
        return module_class(embed_dim, num_heads, **options)

    return Implementation(
        name=name,
        capabilities=capabilities,
        mha=factory,
        load_weights=load_mha_weights,
        description=description,
        listed=False,
    )
