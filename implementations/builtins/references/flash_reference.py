"""``flash-ref``: FlashAttention's ``flash_attn_func`` written out in plain PyTorch.

A readable reference at the flash level, one step per line of ``spec.flash``: scaled
logits, soft-capping, the ALiBi bias, the sliding window (and causal, its right side 0),
a softmax from each row's max, the output and the log-sum-exp; learned ``sinks`` (N,)
(one logit per head in every row's denominator, no value) as in gpt-oss's reference. Layout is
FlashAttention's: q (B, L, N, E), k (B, S, K, E), v (B, S, K, Ev); causal and window
align bottom-right (query i lines up with key ``i + S - L``). Autograd does the backward.
16-bit inputs are computed in float32 and the output rounded back, as the kernels do.

Dropout (``dropout_p > 0``) drops each weight after the softmax with probability p (torch's
generator) and rescales the kept ones by 1/(1 - p); ``return_attn_probs=True`` then returns
FlashAttention-2's ``(out, lse, S_dmask)`` with S_dmask the weights, negated where dropped.
FP8 q, k, v (``float8_e4m3fn``, ``float8_e5m2``) with FlashAttention-3's ``q_descale``,
``k_descale``, ``v_descale`` (float32, per tensor or (B, K)) are dequantised to float32 and
computed there; the output is bfloat16 (FlashAttention-3's).
"""

from __future__ import annotations

import math

import torch

from implementations.base import Capabilities, Implementation
from implementations.builtins.pytorch._torch_common import torch_version

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


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _descale(name: str, descale, B: int, K: int, device) -> torch.Tensor:
    """A descale factor as float32 (B, K, 1, 1): None -> 1; shape () or (1,) -> every (b, g)."""
    if descale is None:
        return torch.ones(B, K, 1, 1, device=device)
    d = descale.to(device=device, dtype=torch.float32)
    if d.numel() == 1:
        return d.reshape(1, 1, 1, 1).expand(B, K, 1, 1)
    if tuple(d.shape) != (B, K):
        raise ValueError(f"{name} must have shape (1,) or (B, K) = ({B}, {K}), got {tuple(d.shape)}")
    return d.reshape(B, K, 1, 1)


def _inputs(q, k, v, q_descale, k_descale, v_descale, compute):
    """q, k, v heads first in ``compute``, kv heads repeated to the query heads; FP8 inputs
    multiplied by their descales first (query head h by its kv head h // (N // K)'s)."""
    B, _, N, _ = q.shape
    K = k.shape[2]
    group = N // K
    query, key, value = (x.transpose(1, 2).to(compute) for x in (q, k, v))   # (B, H, T, X)
    if q.dtype in _FP8:
        query = query * _descale("q_descale", q_descale, B, K, q.device).repeat_interleave(group, dim=1)
        key = key * _descale("k_descale", k_descale, B, K, q.device)
        value = value * _descale("v_descale", v_descale, B, K, q.device)
    elif any(d is not None for d in (q_descale, k_descale, v_descale)):
        raise ValueError("q_descale, k_descale and v_descale are for FP8 q, k, v (float8_e4m3fn, float8_e5m2)")
    return query, key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, sinks=None,
                    q_descale=None, k_descale=None, v_descale=None):
    """FlashAttention-2's forward: returns the output (B, L, N, Ev), or with
    ``return_attn_probs`` the tuple ``(output, lse (B, N, L), S_dmask)`` (S_dmask (B, N, L, S)
    the weights, negative where dropout dropped them; None without dropout). ``sinks`` (N,):
    a logit per query head joining each row's softmax, dropped after it (the LSE is the
    keys'). FP8 q, k, v take FlashAttention-3's descales and give a bfloat16 output."""
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p={dropout_p} must be in [0, 1)")
    _check(q, k, v, window_size, softcap)
    if q.dtype in _FP8 and not (k.dtype == v.dtype == q.dtype):
        raise ValueError(f"FP8 q, k, v must share one format, got {q.dtype}, {k.dtype}, {v.dtype}")
    _, L, N, E = q.shape
    S = k.shape[1]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    out_dtype = torch.bfloat16 if q.dtype in _FP8 else q.dtype
    scale = 1.0 / math.sqrt(E) if softmax_scale is None else softmax_scale

    # (B, L, N, E) -> (B, N, L, E); each kv head serves N // K query heads.
    query, key, value = _inputs(q, k, v, q_descale, k_descale, v_descale, compute)

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
    # 6. dropout after the softmax: each weight kept with probability 1 - p, rescaled by 1/(1 - p)
    keep = None
    if dropout_p:
        keep = torch.rand(weights.shape, device=q.device) >= dropout_p
        dropped = weights * keep / (1.0 - dropout_p)
    else:
        dropped = weights
    # 7. output (B, N, L, Ev) -> (B, L, N, Ev); LSE (B, N, L), -inf where no key is attended
    output = (dropped @ value).transpose(1, 2).to(out_dtype)
    if not return_attn_probs:
        return output
    lse = torch.where(empty, torch.full_like(total, float("-inf")),
                      row_max + torch.log(torch.where(empty, torch.ones_like(total), total)))
    probs = None if keep is None else torch.where(keep, weights, -weights).detach().to(out_dtype)
    return output, lse[..., 0], probs


def make_implementation(name: str = "flash-ref") -> Implementation:
    caps = Capabilities(
        devices=("cpu", "cuda"),
        dtypes=("float64", "float32", "float16", "bfloat16"),
        mask_kinds=frozenset({"none"}),
        causal="lower_right",
        fully_masked="zero",
        dropout=True,
        mask_grad=False,
        flash_features=frozenset({"window", "softcap", "alibi", "lse", "sinks", "dropout_pattern"}),
        fp8_dtypes=("float8_e4m3fn", "float8_e5m2"),
    )
    return Implementation(
        name=name,
        capabilities=caps,
        flash=flash_attn_func,
        version=torch_version(),
        description="flash_attn_func (window, softcap, ALiBi, LSE, GQA, learned sinks, dropout with its "
                    "pattern, FP8 q/k/v with descales) in plain PyTorch, autograd backward",
    )
