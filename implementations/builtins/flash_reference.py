"""``flash-ref``: FlashAttention's ``flash_attn_func`` written out in plain PyTorch.

A readable reference at the flash level, one step per line of ``spec.flash``: scaled
logits, soft-capping, the ALiBi bias, the sliding window (and causal, its right side 0),
a softmax from each row's max, the output and the log-sum-exp; learned ``sinks`` (N,)
(one logit per head in every row's denominator, no value) as in gpt-oss's reference. Layout is
FlashAttention's: q (B, L, N, E), k (B, S, K, E), v (B, S, K, Ev); causal and window
align bottom-right (query i lines up with key ``i + S - L``). Autograd does the backward.
16-bit inputs are computed in float32 and the output rounded back, as the kernels do.
"""

from __future__ import annotations

import math

import torch

from implementations.base import Capabilities, Implementation
from implementations.builtins._torch_common import torch_version

__all__ = ["flash_attn_func", "make_implementation"]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_size, softcap: float) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D: (B, L, N, E), (B, S, K, E), (B, S, K, Ev)")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"inconsistent shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"query heads N={q.shape[2]} must be a multiple of kv heads K={k.shape[2]}")
    if any(side < -1 for side in window_size):
        raise ValueError(f"window_size={tuple(window_size)}: each side must be >= 0, or -1 for unbounded")
    if not (softcap >= 0 and math.isfinite(softcap)):
        raise ValueError(f"softcap={softcap} must be a finite number >= 0 (0 = off)")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, sinks=None):
    """FlashAttention-2's forward: returns the output (B, L, N, Ev), or with
    ``return_attn_probs`` the tuple ``(output, lse (B, N, L), None)``. ``sinks`` (N,): a
    logit per query head joining each row's softmax, dropped after it (the LSE is the keys')."""
    if dropout_p:
        raise NotImplementedError("flash-ref has no dropout; dropout_p must be 0")
    _check(q, k, v, window_size, softcap)
    _, L, N, E = q.shape
    S, K = k.shape[1], k.shape[2]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(E) if softmax_scale is None else softmax_scale

    # (B, L, N, E) -> (B, N, L, E); each kv head serves N // K query heads.
    query = q.transpose(1, 2).to(compute)
    key = k.transpose(1, 2).repeat_interleave(N // K, dim=1).to(compute)
    value = v.transpose(1, 2).repeat_interleave(N // K, dim=1).to(compute)

    # 1. scaled logits (B, N, L, S)
    scores = scale * (query @ key.transpose(-1, -2))
    # 2. soft-capping squashes them into (-softcap, softcap), before bias and masks
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    # 3. the aligned position of each query and the distance to each key
    position = torch.arange(L, device=q.device)[:, None] + (S - L)          # (L, 1)
    keys = torch.arange(S, device=q.device)[None, :]                         # (1, S)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=q.device, dtype=compute).reshape(-1, N, 1, 1)
        scores = scores - slopes * (position - keys).abs().to(compute)
    # 4. the window: query i attends key j iff p_i - left <= j <= p_i + right
    left, right = window_size
    if causal:
        right = 0
    allowed = torch.ones(L, S, dtype=torch.bool, device=q.device)
    if left >= 0:
        allowed &= keys >= position - left
    if right >= 0:
        allowed &= keys <= position + right
    scores = scores.masked_fill(~allowed, float("-inf"))
    # 5. softmax from the row max; a row attending no key gets weight 0 everywhere
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    unnormalised = torch.exp(scores - row_max)
    total = unnormalised.sum(dim=-1, keepdim=True)
    empty = total == 0
    if sinks is None:
        weights = unnormalised / torch.where(empty, torch.ones_like(total), total)
    else:
        # the sink joins the max (never overflows) and the denominator, and carries no value
        if tuple(sinks.shape) != (N,):
            raise ValueError(f"sinks must have shape (N,) = ({N},), got {tuple(sinks.shape)}")
        sink = sinks.to(device=q.device, dtype=compute).reshape(1, N, 1, 1)
        shifted = torch.where(empty, sink, torch.maximum(row_max, sink)).detach()
        e = torch.exp(scores - shifted)
        weights = e / (e.sum(dim=-1, keepdim=True) + torch.exp(sink - shifted))
    # 6. output (B, N, L, Ev) -> (B, L, N, Ev); LSE (B, N, L), -inf where no key is attended
    output = (weights @ value).transpose(1, 2).to(q.dtype)
    if not return_attn_probs:
        return output
    lse = torch.where(empty, torch.full_like(total, float("-inf")),
                      row_max + torch.log(torch.where(empty, torch.ones_like(total), total)))
    return output, lse[..., 0], None


def make_implementation(name: str = "flash-ref") -> Implementation:
    caps = Capabilities(
        devices=("cpu", "cuda"),
        dtypes=("float64", "float32", "float16", "bfloat16"),
        mask_kinds=frozenset({"none"}),
        causal="lower_right",
        fully_masked="zero",
        dropout=False,
        mask_grad=False,
        flash_features=frozenset({"window", "softcap", "alibi", "lse", "sinks"}),
    )
    return Implementation(
        name=name,
        capabilities=caps,
        flash=flash_attn_func,
        version=torch_version(),
        description="flash_attn_func (window, softcap, ALiBi, LSE, GQA, learned sinks) in plain PyTorch, "
                    "autograd backward",
    )
