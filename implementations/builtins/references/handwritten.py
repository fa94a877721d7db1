"""Attention written out by hand in PyTorch, step by step, from the spec.

This is the implementation to read next to ``spec/``: every step of the math is
one line or two, with the shape after it in a comment. It is deliberately plain
(no fused kernels, no fast paths) and supports every feature the suite checks.

Dimension letters: B batch, N query heads, K key/value heads, L query length,
S key length, E q/k head dim, Ev value head dim, D model (embed) dim.

Mask polarity, stated once:

* :func:`scaled_dot_product_attention` (the SDPA level) takes a bool mask with
  **True = may attend**, or a float mask that is **added** to the scaled scores.
* :class:`MultiheadAttention` (the MHA level) takes nn.MultiheadAttention's
  masks: bool **True = blocked**, float **added**.

A query row whose every key is blocked has no distribution to average over; its
output (and its weights) are defined as 0, as the spec's ``fully_masked="zero"``
policy and SDPA since PyTorch 2.5 do. Gradients through such rows are 0, not NaN.

The bug zoo's correct bases (``NaiveSDPA`` in ``implementations/mutants/sdpa/_sdpa_bases.py``,
``HandwrittenMHA`` in ``implementations/mutants/mha/_mha_base.py``) are a second
hand-written implementation, deliberately independent of this one (written apart, no
shared code) so that a bug in one cannot hide in the other: keep them separate.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = ["MultiheadAttention", "attention_with_weights", "scaled_dot_product_attention"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    sinks: Tensor | None = None,
) -> Tensor:
    """Same signature and meaning as ``torch.nn.functional.scaled_dot_product_attention``.

    query (..., N, L, E), key (..., K, S, E), value (..., K, S, Ev) -> (..., N, L, Ev).
    ``is_causal`` is upper-left aligned (query i sees keys 0..i), as in PyTorch.
    ``sinks`` (N,): learned sink logits (gpt-oss), one per query head, that join the
    softmax and are dropped after it (``spec.sdpa(sinks=)``).
    """
    output, _ = attention_with_weights(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        sinks=sinks,
    )
    return output


def attention_with_weights(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """SDPA returning ``(output (..., N, L, Ev), weights (..., N, L, S))``."""
    _check_inputs(query, key, value, attn_mask, enable_gqa)
    out_dtype = query.dtype
    # 16-bit inputs are computed in float32 and rounded once at the end, as fused
    # kernels do; float32/float64 are computed in their own precision.
    work_dtype = torch.float32 if out_dtype in _LOW_PRECISION else out_dtype
    q, k, v = query.to(work_dtype), key.to(work_dtype), value.to(work_dtype)
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    N, K = q.shape[-3], k.shape[-3]

    # 1. Grouped-query attention: query head h reads kv head h // (N // K).
    if N != K:
        k = k.repeat_interleave(N // K, dim=-3)  # (..., N, S, E)
        v = v.repeat_interleave(N // K, dim=-3)  # (..., N, S, Ev)

    # 2. Scaled scores. The default scale uses E, the q/k head dim (never Ev or D).
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (..., N, L, S)

    # 3. Masks: a float mask is added, a bool mask and the causal flag block keys.
    may_attend = torch.ones(L, S, dtype=torch.bool, device=q.device)  # (L, S)
    if is_causal:
        may_attend = torch.tril(may_attend)  # upper-left: query i sees keys 0..i
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        may_attend = may_attend & attn_mask  # broadcasts to (..., N, L, S)
    elif attn_mask is not None:
        scores = scores + attn_mask.to(work_dtype)
    scores = scores.masked_fill(~may_attend, float("-inf"))  # (..., N, L, S)

    # 4. Softmax over keys. A row that is -inf everywhere has no distribution:
    #    softmax it as zeros (finite, so no NaN reaches the gradient) and then
    #    define its weights as 0.
    if sinks is not None:
        # Learned sinks: one more column, the head's sink logit, in the softmax; it is
        # dropped after it (no value), so a row with every key blocked gives 0.
        if tuple(sinks.shape) != (N,):
            raise ValueError(f"sinks must have shape (N,) = ({N},), got {tuple(sinks.shape)}")
        sink = sinks.to(device=q.device, dtype=work_dtype).reshape(N, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # (..., N, L, S)
    else:
        fully_masked = torch.isneginf(scores).all(dim=-1, keepdim=True)  # (..., N, L, 1)
        weights = torch.softmax(scores.masked_fill(fully_masked, 0.0), dim=-1)
        weights = weights.masked_fill(fully_masked, 0.0)  # (..., N, L, S)

    # 5. Dropout on the weights (functional SDPA always applies dropout_p).
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)

    # 6. Weighted sum of the values.
    output = weights @ v  # (..., N, L, Ev)
    return output.to(out_dtype), weights.to(out_dtype)


def _check_inputs(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, enable_gqa: bool
) -> None:
    """Raise a ValueError naming the argument for every input the spec calls invalid."""
    if query.dim() < 3 or key.dim() < 3 or value.dim() < 3:
        raise ValueError(
            f"query/key/value need at least 3 dims (..., heads, length, head_dim); got "
            f"query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}, "
            f"value.shape={tuple(value.shape)}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query E={query.shape[-1]} but key E={key.shape[-1]}; q and k must share the head dim"
        )
    if key.shape[-2] != value.shape[-2] or key.shape[-3] != value.shape[-3]:
        raise ValueError(
            f"key.shape={tuple(key.shape)} and value.shape={tuple(value.shape)} must share "
            "(heads K, length S)"
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(
            f"query/key/value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}"
        )
    N, K = query.shape[-3], key.shape[-3]
    if N != K:
        if not enable_gqa:
            raise ValueError(
                f"query has N={N} heads but key/value have K={K}; pass enable_gqa=True for "
                "grouped-query attention"
            )
        if N % K != 0:
            raise ValueError(f"N={N} query heads is not a multiple of K={K} kv heads")
    try:
        batch = torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
    except RuntimeError as exc:
        raise ValueError(
            f"batch dims of query {tuple(query.shape[:-3])}, key {tuple(key.shape[:-3])} "
            f"and value {tuple(value.shape[:-3])} do not broadcast"
        ) from exc
    if attn_mask is not None:
        target = (*batch, N, query.shape[-2], key.shape[-2])
        try:
            ok = torch.broadcast_shapes(attn_mask.shape, target) == torch.Size(target)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"attn_mask.shape={tuple(attn_mask.shape)} does not broadcast to "
                f"(..., N, L, S)={target}"
            )
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise ValueError(
                f"attn_mask.dtype={attn_mask.dtype}: use bool (True = may attend) or a float "
                "mask that is added to the scores"
            )


class MultiheadAttention(nn.Module):
    """A drop-in for ``torch.nn.MultiheadAttention``: same constructor, parameter names
    and ``forward``; bool masks are **True = blocked**, float masks are added.

    Parameters, as in PyTorch: ``in_proj_weight (3D, D)`` when kdim == vdim == D,
    otherwise ``q_proj_weight (D, D)``, ``k_proj_weight (D, kdim)``,
    ``v_proj_weight (D, vdim)``; ``in_proj_bias (3D,)``; ``out_proj`` (Linear D -> D);
    ``bias_k``/``bias_v (1, 1, D)`` with ``add_bias_kv``.
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
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.dropout, self.add_zero_attn, self.batch_first = dropout, add_zero_attn, batch_first
        D = embed_dim
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * D, D, **factory))
            self.q_proj_weight = self.k_proj_weight = self.v_proj_weight = None
        else:
            self.in_proj_weight = None
            self.q_proj_weight = nn.Parameter(torch.empty(D, D, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(D, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(D, self.vdim, **factory))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * D, **factory)) if bias else None
        self.out_proj = nn.Linear(D, D, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, D, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, D, **factory))
        else:
            self.bias_k = self.bias_v = None
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        for weight in (self.in_proj_weight, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
            if weight is not None:
                nn.init.xavier_uniform_(weight)
        for extra in (self.bias_k, self.bias_v):
            if extra is not None:
                nn.init.xavier_normal_(extra)

    def _projection_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        if self.in_proj_weight is not None:
            return self.in_proj_weight.chunk(3, dim=0)  # three (D, D)
        return self.q_proj_weight, self.k_proj_weight, self.v_proj_weight

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        # 0. is_causal is only a hint that attn_mask is the causal mask (PyTorch's rule):
        #    the mask itself is what gets applied, so it must be there.
        if is_causal and attn_mask is None:
            raise ValueError(
                "is_causal=True needs attn_mask: nn.MultiheadAttention treats is_causal as a "
                "hint that attn_mask is causal; pass the causal mask (True = blocked above the diagonal)"
            )

        # 1. Bring every input to batch-first (B, length, features).
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)  # (1, S)
        elif not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        B, L, D = query.shape
        N, E = self.num_heads, self.head_dim

        # 2. Project: q (B, L, D), k (B, S, D), v (B, S, D).
        w_q, w_k, w_v = self._projection_weights()
        b_q, b_k, b_v = (None, None, None) if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
        q, k, v = F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

        # 3. One additive mask (B, N, L, S): 0 where a key may be attended, -inf where
        #    blocked, or the given float. MHA's bool masks are True = blocked.
        S = k.shape[1]
        bias = torch.zeros(B, N, L, S, dtype=q.dtype, device=q.device)
        if attn_mask is not None:
            mask = attn_mask.view(B, N, L, S) if attn_mask.dim() == 3 else attn_mask  # (B, N, L, S) or (L, S)
            bias = bias + _as_additive(mask, q.dtype)
        if key_padding_mask is not None:
            bias = bias + _as_additive(key_padding_mask, q.dtype).view(B, 1, 1, S)

        # 4. Extra keys that no mask blocks: the learned bias_k/bias_v, then a zero key.
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(B, 1, D)], dim=1)  # (B, S+1, D)
            v = torch.cat([v, self.bias_v.expand(B, 1, D)], dim=1)
            bias = F.pad(bias, (0, 1))  # (B, N, L, S+1), new column 0 = may attend
        if self.add_zero_attn:
            k = F.pad(k, (0, 0, 0, 1))  # (B, S+1, D), a zero key
            v = F.pad(v, (0, 0, 0, 1))
            bias = F.pad(bias, (0, 1))

        # 5. Split heads: (B, len, D) -> (B, len, N, E) -> (B, N, len, E).
        #    view(B, N, len, E) directly would mix positions into heads.
        q = q.view(B, L, N, E).transpose(1, 2)  # (B, N, L, E)
        k = k.view(B, -1, N, E).transpose(1, 2)  # (B, N, S', E)
        v = v.view(B, -1, N, E).transpose(1, 2)  # (B, N, S', E)

        # 6. Attention per head, with dropout only while training.
        dropout_p = self.dropout if self.training else 0.0
        heads, weights = attention_with_weights(q, k, v, attn_mask=bias, dropout_p=dropout_p)
        # heads (B, N, L, E), weights (B, N, L, S')

        # 7. Merge heads back: (B, N, L, E) -> (B, L, N, E) -> (B, L, D), then project.
        merged = heads.transpose(1, 2).contiguous().view(B, L, D)
        output = self.out_proj(merged)  # (B, L, D)

        # 8. Back to the caller's layout.
        if unbatched:
            output, weights = output.squeeze(0), weights.squeeze(0)  # (L, D), (N, L, S')
        elif not self.batch_first:
            output = output.transpose(0, 1)  # (L, B, D)
        if not need_weights:
            return output, None
        if average_attn_weights:
            weights = weights.mean(dim=-3)  # average over the N heads
        return output, weights


def _as_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """MHA convention -> additive: bool True (blocked) -> -inf, False -> 0; floats as given."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.to(dtype)
