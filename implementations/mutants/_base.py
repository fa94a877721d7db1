"""Correct bases the mutants are built from; each step is a method a mutant overrides.

Three SDPA-level bases, all with torch SDPA's calling convention
``f(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
enable_gqa=False)`` (bool mask **True = may attend**, float mask **added**):

* :class:`NaiveSDPA` — straight-line math: scores, mask, safe softmax, dropout, weights @ V.
* :class:`ManualBackwardSDPA` — the same forward in an ``autograd.Function`` with a
  hand-written backward, output stored in FlashAttention's (B, L, N, Ev) layout.
* :class:`TiledSDPA` — a pure-torch FlashAttention-style kernel: online softmax over
  key blocks of :data:`BLOCK` keys, running max, rescaled accumulator.
* :class:`LowerRightSDPA` — :class:`NaiveSDPA` whose ``is_causal`` means
  FlashAttention's lower-right triangle (declared in :data:`LOWER_RIGHT_CAPABILITIES`).

One MHA-level base, :class:`HandwrittenMHA`, a drop-in for ``nn.MultiheadAttention``
(same constructor, parameter names and forward; its bool masks are **True = blocked**),
written the way tutorials write it: batch-first internally, explicit head split/merge.

Every base is correct (``tests/mutants/test_mutant_records.py`` checks them against
torch in float64); a mutant is a subclass overriding exactly one method.

Dimension letters: B batch, N query heads, K kv heads, L query length, S key length,
E q/k head dim, Ev value head dim, D model dim.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from implementations.base import ALL_DTYPES, Capabilities, Implementation
from implementations.builtins._torch_common import contiguous_strides, load_mha_weights

__all__ = [
    "BLOCK",
    "AttentionInputError",
    "HandwrittenMHA",
    "LowerRightSDPA",
    "ManualBackwardSDPA",
    "NaiveSDPA",
    "TiledSDPA",
    "contiguous_strides",
    "load_mha_weights",
    "mha_implementation",
    "read_as_contiguous",
    "safe_softmax",
    "sdpa_implementation",
    "LOWER_RIGHT_CAPABILITIES",
    "MHA_CAPABILITIES",
    "SDPA_CAPABILITIES",
]

#: Key block size of the tiled kernel (lengths ≡ 1 mod 16 hit its ragged tail).
BLOCK = 16

#: What the SDPA-level bases honestly support (mutants keep these claims).
SDPA_CAPABILITIES = Capabilities(
    devices=("cpu",),
    dtypes=ALL_DTYPES,
    causal="upper_left",
    fully_masked="zero",
    dropout=True,
)
#: LowerRightSDPA: the same claims, with is_causal meaning the lower-right triangle.
LOWER_RIGHT_CAPABILITIES = SDPA_CAPABILITIES.replace(causal="lower_right")
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


class AttentionInputError(ValueError, RuntimeError):
    """Invalid attention inputs (a ValueError, and a RuntimeError like torch's own)."""


def read_as_contiguous(x: torch.Tensor) -> torch.Tensor:
    """What a kernel that takes a data pointer and assumes a dense layout reads.

    Identity for contiguous tensors; for any other layout it reinterprets the raw
    storage (wrong values, or an out-of-bounds error for stride-0 expansions).
    """
    return torch.as_strided(x, x.shape, contiguous_strides(tuple(x.shape)), x.storage_offset())


def safe_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim; rows with every score -inf give all-zero weights."""
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    # A fully-masked row has max -inf; shifting by 0 keeps exp(-inf) = 0 instead of NaN.
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exps = torch.exp(scores - row_max)
    denom = exps.sum(dim=-1, keepdim=True)
    return exps / torch.where(denom == 0, torch.ones_like(denom), denom)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # 16-bit inputs are upcast: float32 math, result rounded once to the input dtype.
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------- SDPA


class NaiveSDPA:
    """Correct SDPA in straight-line torch; see the module docstring for conventions.

    Steps (each a method): check inputs -> upcast -> expand kv heads (GQA,
    repeat_interleave) -> check/upcast mask -> resolve scale -> attend
    (scores, mask, softmax, dropout, weights @ V) -> cast back.
    """

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        self.check_inputs(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        in_dtype = query.dtype
        compute = _compute_dtype(in_dtype)
        q, k, v = query.to(compute), key.to(compute), value.to(compute)
        k, v = self.expand_kv_heads(k, v, num_heads=q.shape[-3])
        mask = self.prepare_mask(attn_mask, q, k, compute)
        scale = self.resolve_scale(scale, E=q.shape[-1], Ev=v.shape[-1])
        out = self.attend(q, k, v, mask, is_causal, scale, dropout_p, in_dtype)
        return out.to(in_dtype)

    # -- validation ------------------------------------------------------
    def check_inputs(self, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> None:
        if not (query.dim() == key.dim() == value.dim() and query.dim() >= 3):
            raise AttentionInputError(
                f"query.dim()={query.dim()}, key.dim()={key.dim()}, value.dim()={value.dim()}: "
                "all three must have the same number (>= 3) of dims (..., heads, length, dim)"
            )
        if not (query.dtype == key.dtype == value.dtype):
            raise AttentionInputError(
                f"query.dtype={query.dtype}, key.dtype={key.dtype}, value.dtype={value.dtype} "
                "must match; cast them to one dtype"
            )
        if query.shape[:-3] != key.shape[:-3] or key.shape[:-3] != value.shape[:-3]:
            raise AttentionInputError(
                f"batch dims query={tuple(query.shape[:-3])}, key={tuple(key.shape[:-3])}, "
                f"value={tuple(value.shape[:-3])} must be equal"
            )
        if query.shape[-1] != key.shape[-1]:
            raise AttentionInputError(
                f"query E={query.shape[-1]} != key E={key.shape[-1]}; q and k need one head dim"
            )
        if key.shape[-2] != value.shape[-2] or key.shape[-3] != value.shape[-3]:
            raise AttentionInputError(
                f"key (K, S)={tuple(key.shape[-3:-1])} != value (K, S)={tuple(value.shape[-3:-1])}"
            )
        self.check_heads(query.shape[-3], key.shape[-3], enable_gqa)
        if is_causal and attn_mask is not None:
            raise AttentionInputError(
                "is_causal=True with an attn_mask: give one of them (merge the causal mask in)"
            )
        if not 0.0 <= dropout_p < 1.0:
            raise AttentionInputError(f"dropout_p={dropout_p} must be in [0, 1)")

    def check_heads(self, N: int, K: int, enable_gqa: bool) -> None:
        if N == K:
            return
        if not enable_gqa:
            raise AttentionInputError(
                f"query heads N={N} != kv heads K={K}; pass enable_gqa=True for GQA"
            )
        if N % K != 0:
            raise AttentionInputError(
                f"query heads N={N} not a multiple of kv heads K={K}; GQA needs N % K == 0"
            )

    def expand_kv_heads(self, k, v, num_heads: int):
        """GQA: query head h uses kv head h // (N // K) (repeat_interleave)."""
        K = k.shape[-3]
        if K == num_heads:
            return k, v
        group = num_heads // K
        return k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)

    def prepare_mask(self, attn_mask, q, k, compute):
        """Check the mask broadcasts to (..., N, L, S); float masks go to the compute dtype."""
        if attn_mask is None:
            return None
        target = (*q.shape[:-1], k.shape[-2])
        try:
            broadcast = torch.broadcast_shapes(tuple(attn_mask.shape), target)
        except RuntimeError:
            broadcast = None
        if broadcast != target:
            raise AttentionInputError(
                f"attn_mask.shape={tuple(attn_mask.shape)} does not broadcast to "
                f"(..., N, L, S)={target}; build the mask for these query/key lengths"
            )
        if attn_mask.dtype == torch.bool:
            return attn_mask
        if not attn_mask.is_floating_point():
            raise AttentionInputError(
                f"attn_mask.dtype={attn_mask.dtype}: use bool (True = may attend) or float (added)"
            )
        return attn_mask.to(compute)

    def resolve_scale(self, scale, E: int, Ev: int) -> float:
        return 1.0 / math.sqrt(E) if scale is None else scale

    # -- the math --------------------------------------------------------
    def attend(self, q, k, v, mask, is_causal, scale, dropout_p, in_dtype):
        scores = self.scores(q, k, scale, in_dtype)
        weights = self.attention_weights(scores, mask, is_causal, dropout_p)
        return weights @ v

    def scores(self, q, k, scale, in_dtype):
        return (q @ k.transpose(-2, -1)) * scale

    def blocked_positions(self, mask, is_causal, L: int, S: int, device):
        """Bool, True = blocked, broadcastable to scores; None when nothing is blocked."""
        if is_causal:
            return ~self.causal_attend(L, S, device)
        if mask is not None and mask.dtype == torch.bool:
            return self.bool_blocked(mask)
        return None

    def bool_blocked(self, mask):
        return ~mask  # canonical polarity: True = may attend

    def causal_attend(self, L: int, S: int, device):
        return torch.ones(L, S, dtype=torch.bool, device=device).tril()  # upper-left

    def attention_weights(self, scores, mask, is_causal, dropout_p):
        if mask is not None and mask.dtype != torch.bool:
            scores = scores + mask
        blocked = self.blocked_positions(mask, is_causal, scores.shape[-2], scores.shape[-1], scores.device)
        if blocked is not None:
            scores = scores.masked_fill(blocked, float("-inf"))
        weights = self.softmax(scores)
        return self.dropout(weights, dropout_p)

    def softmax(self, scores):
        return safe_softmax(scores)

    def dropout(self, weights, dropout_p: float):
        if dropout_p == 0.0:
            return weights
        return F.dropout(weights, p=dropout_p, training=True)


class LowerRightSDPA(NaiveSDPA):
    """Correct SDPA whose ``is_causal`` is FlashAttention's lower-right triangle:
    query i sees keys j <= i + S - L, so for L > S the first L - S rows see no key
    (output 0, the declared fully-masked policy)."""

    def causal_attend(self, L: int, S: int, device):
        return torch.ones(L, S, dtype=torch.bool, device=device).tril(diagonal=S - L)


class _ManualAttention(torch.autograd.Function):
    """Forward of NaiveSDPA with a closed-form backward (no dropout).

    The output is returned as a (..., N, L, Ev) view of a (..., L, N, Ev) buffer,
    the layout fused kernels write. ``grad_layout`` is the owner's hook turning the
    incoming gradient into the tensor the backward math reads.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, scale, owner):
        scores = (q @ k.transpose(-2, -1)) * scale
        if bias is not None:
            scores = scores + bias
        weights = safe_softmax(scores)
        out = weights @ v                                                      # (..., N, L, Ev)
        buffer = out.transpose(-3, -2).contiguous()                            # (..., L, N, Ev)
        out = buffer.transpose(-3, -2)                                         # (..., N, L, Ev) view
        ctx.save_for_backward(q, k, v, weights)
        ctx.scale, ctx.owner = scale, owner
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.out_shape, ctx.out_stride = tuple(out.shape), tuple(out.stride())
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, weights = ctx.saved_tensors
        grad_out = ctx.owner.grad_layout(grad_out, ctx.out_shape, ctx.out_stride)
        dv = weights.transpose(-2, -1) @ grad_out                              # (..., N, S, Ev)
        dweights = grad_out @ v.transpose(-2, -1)                              # (..., N, L, S)
        dscores = weights * (dweights - (dweights * weights).sum(-1, keepdim=True))
        dq = (dscores @ k) * ctx.scale
        dk = (dscores.transpose(-2, -1) @ q) * ctx.scale
        dbias = None
        if ctx.bias_shape is not None and ctx.needs_input_grad[3]:
            dbias = dscores.sum_to_size(ctx.bias_shape)
        return dq, dk, dv, dbias, None, None


class ManualBackwardSDPA(NaiveSDPA):
    """NaiveSDPA's forward with a hand-written backward (dropout not supported)."""

    def attend(self, q, k, v, mask, is_causal, scale, dropout_p, in_dtype):
        if dropout_p:
            raise NotImplementedError("ManualBackwardSDPA does not implement dropout")
        L, S = q.shape[-2], k.shape[-2]
        bias = None
        if mask is not None and mask.dtype != torch.bool:
            bias = mask
        blocked = self.blocked_positions(mask, is_causal, L, S, q.device)
        if blocked is not None:
            block_bias = torch.zeros(blocked.shape, dtype=q.dtype, device=q.device)
            block_bias = block_bias.masked_fill(blocked, float("-inf"))
            bias = block_bias if bias is None else bias + block_bias
        return _ManualAttention.apply(q, k, v, bias, scale, self)

    def grad_layout(self, grad_out, out_shape, out_stride):
        """The upstream gradient as given: its own strides are respected."""
        return grad_out


class TiledSDPA(NaiveSDPA):
    """FlashAttention-style online softmax over key blocks of BLOCK keys (no dropout).

    Per block: s = q kᵀ·scale + bias; m_new = max(m, rowmax(s)); p = exp(s - m_new);
    l = l·e^(m - m_new) + rowsum(p); acc = acc·e^(m - m_new) + p v. Output acc / l,
    0 where l = 0 (fully-masked rows).
    """

    def attend(self, q, k, v, mask, is_causal, scale, dropout_p, in_dtype):
        if dropout_p:
            raise NotImplementedError("TiledSDPA does not implement dropout")
        q, k, v = self.load_inputs(q, k, v)
        batch = q.shape[:-3]
        N, L, E = q.shape[-3:]
        S, Ev = k.shape[-2], v.shape[-1]
        q = q.reshape(-1, N, L, E)                                             # (B, N, L, E)
        k = self.kv_batch_view(k.reshape(-1, N, S, E))                         # (B, N, S, E)
        v = self.kv_batch_view(v.reshape(-1, N, S, Ev))                        # (B, N, S, Ev)
        bias = self.full_bias(mask, is_causal, (*batch, N, L, S), q)           # (B, N, L, S)
        acc_dtype = self.accumulator_dtype(q.dtype)
        row_max = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=q.dtype, device=q.device)
        row_sum = torch.zeros((*q.shape[:-1], 1), dtype=acc_dtype, device=q.device)
        acc = torch.zeros((*q.shape[:-1], Ev), dtype=acc_dtype, device=q.device)
        for start, stop in self.key_blocks(S):
            k_block = self.load_block(k, start, stop)                          # (B, N, b, E)
            v_block = self.load_block(v, start, stop)                          # (B, N, b, Ev)
            s = (q @ k_block.transpose(-2, -1)) * scale + bias[..., start:stop]
            new_max = torch.maximum(row_max, self.block_max(s))
            # Rows that have seen only -inf keep a finite shift so exp gives 0, not NaN.
            shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            p = torch.exp(s - shift)
            alpha = torch.exp(row_max - shift)
            row_sum = (row_sum * alpha + p.sum(-1, keepdim=True)).to(acc_dtype)
            acc = (self.rescale(acc, alpha) + p @ v_block).to(acc_dtype)
            row_max = new_max
        row_sum = row_sum.to(q.dtype)
        out = acc.to(q.dtype) / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
        return out.reshape(*batch, N, L, Ev)

    def full_bias(self, mask, is_causal, shape, q):
        """Additive bias (B, N, L, S): float mask + -inf where bool/causal blocks."""
        bias = torch.zeros(shape, dtype=q.dtype, device=q.device)
        if mask is not None and mask.dtype != torch.bool:
            bias = bias + mask
        blocked = self.blocked_positions(mask, is_causal, shape[-2], shape[-1], q.device)
        if blocked is not None:
            bias = bias.masked_fill(blocked, float("-inf"))
        return bias.reshape(-1, *shape[-3:])

    def load_inputs(self, q, k, v):
        """Inputs as the kernel sees them: strided access, any layout."""
        return q, k, v

    def kv_batch_view(self, x):
        """K/V for every batch item (the kernel's batch offset into K/V)."""
        return x

    def key_blocks(self, S: int) -> list[tuple[int, int]]:
        return [(start, min(start + BLOCK, S)) for start in range(0, S, BLOCK)]

    def load_block(self, x, start: int, stop: int):
        return x[..., start:stop, :]

    def block_max(self, s):
        return s.detach().amax(dim=-1, keepdim=True)  # the shift needs no gradient

    def accumulator_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        return compute_dtype

    def rescale(self, acc, alpha):
        return acc * alpha


def sdpa_implementation(name: str, attention: Callable, capabilities: Capabilities, description: str) -> Implementation:
    return Implementation(
        name=name,
        capabilities=capabilities,
        sdpa=attention,
        description=description,
        listed=False,
    )


# --------------------------------------------------------------------------- MHA


class HandwrittenMHA(nn.Module):
    """A drop-in for ``torch.nn.MultiheadAttention`` written like a tutorial.

    Same constructor, parameter names and ``forward``; masks in MHA's convention
    (bool **True = blocked**, float added); ``is_causal`` is a hint as in torch
    (an ``attn_mask`` is required, and applied). Fully-masked query rows give a zero
    attention output (so ``out_proj.bias`` after the projection) and zero weights.

    Deliberately independent of the built-in
    :class:`implementations.builtins.handwritten.MultiheadAttention` (written apart, no
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
