"""The SDPA-level correct bases of the bug zoo, and the pieces the MHA base shares.

:class:`NaiveSDPA` (straight-line math), :class:`LowerRightSDPA` (its lower-right
causal variant), :class:`ManualBackwardSDPA` (a hand-written backward) and
:class:`TiledSDPA` (a FlashAttention-style online softmax over key blocks of
:data:`BLOCK` keys); each step is a method a mutant overrides. Conventions, and the
MHA base, are in :mod:`implementations.mutants._base`, which re-exports these names.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from implementations.base import ALL_DTYPES, Capabilities, Implementation
from implementations.builtins.pytorch._torch_common import contiguous_strides

__all__ = [
    "BLOCK",
    "AttentionInputError",
    "LowerRightSDPA",
    "ManualBackwardSDPA",
    "NaiveSDPA",
    "TiledSDPA",
    "read_as_contiguous",
    "safe_softmax",
    "sdpa_implementation",
    "LOWER_RIGHT_CAPABILITIES",
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
