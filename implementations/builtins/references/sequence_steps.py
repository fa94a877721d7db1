"""The steps one sequence's attention takes in the varlen and kvcache references: its
logits (scale, soft-capping, ALiBi), the keys it may attend (causal bottom-right, window),
the softmax with its LSE, and the checks and conversions of FlashAttention's options
(descale rows, ALiBi slopes row, the default scale).

``implementations.builtins.references.varlen_reference`` (packed sequences) and
``kvcache_reference`` (decoding against a cache) run each sequence through :func:`attend`;
the bug zoo's varlen mutants replace one step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["attend", "logits", "softmax_rows", "window_allowed"]


def _refuse(**given: Any) -> None:
    """Options of FlashAttention this reference does not implement must keep their default."""
    for name, (value, default) in given.items():
        if value != default:
            raise NotImplementedError(f"{name}={value!r} is not supported (only {default!r})")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def window_allowed(L: int, S: int, window: tuple[int, int], causal: bool, offset: int,
                   device: Any) -> torch.Tensor:
    """(L, S) bool: query i attends key j iff p_i - left <= j <= p_i + right, p_i = i + offset
    (``offset`` = S - L: bottom-right); causal sets right = 0; a side of -1 is unbounded."""
    left, right = (int(x) for x in window)
    if causal:
        right = 0
    position = torch.arange(L, device=device)[:, None] + offset          # (L, 1)
    keys = torch.arange(S, device=device)[None, :]                       # (1, S)
    allowed = torch.ones(L, S, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= keys >= position - left
    if right >= 0:
        allowed &= keys <= position + right
    return allowed


def logits(q: torch.Tensor, k: torch.Tensor, *, scale: float, softcap: float, slopes: Any,
           offset: int) -> torch.Tensor:
    """Heads first q (N, L, E), k (N, S, E) -> scores (N, L, S): scale·q·k, soft-capped, plus
    the ALiBi bias -slope_h·|p_i - j| (p_i = i + offset)."""
    scores = scale * (q @ k.transpose(-1, -2))
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if slopes is not None:
        L, S = q.shape[1], k.shape[1]
        position = torch.arange(L, device=q.device)[:, None] + offset
        distance = (position - torch.arange(S, device=q.device)[None, :]).abs().to(scores.dtype)
        scores = scores - slopes.to(device=q.device, dtype=scores.dtype).reshape(-1, 1, 1) * distance
    return scores


def softmax_rows(scores: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (N, L, S), lse (N, L)) from the row max over the allowed keys; a row with no
    allowed key has weight 0 everywhere and LSE -inf."""
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)                                # exp(-inf) = 0 on blocked keys
    total = weights.sum(dim=-1, keepdim=True)
    lse = torch.where(total > 0, row_max + torch.log(torch.where(total > 0, total, torch.ones_like(total))),
                      torch.full_like(total, float("-inf")))
    return weights / torch.where(total > 0, total, torch.ones_like(total)), lse[..., 0]  # empty rows stay 0


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
           window: tuple[int, int] = (-1, -1), softcap: float = 0.0, slopes: Any = None,
           offset: int | None = None, lse: bool = False, dropout: Any = None) -> Any:
    """One sequence: q (L, N, E), k (S, K, E), v (S, K, Ev) -> (L, N, Ev), in q's dtype (with
    ``lse``: also the LSE (N, L) in the compute dtype). ``offset``: the aligned position's
    shift p_i - i (None: S - L, FlashAttention's bottom-right). ``dropout``: applied to the
    weights (N, L, S) after the softmax (the LSE stays the dropout-free one)."""
    L, N, _ = q.shape
    S, K, Ev = v.shape
    if N % K:
        raise ValueError(f"query heads N={N} must be a multiple of kv heads K={K}")
    out_dtype, work = q.dtype, _compute_dtype(q.dtype)
    if L == 0 or S == 0:
        out = torch.zeros(L, N, Ev, dtype=out_dtype, device=q.device)
        return (out, torch.full((N, L), float("-inf"), dtype=work, device=q.device)) if lse else out
    offset = S - L if offset is None else offset
    group = N // K
    q = q.to(work).transpose(0, 1)                                      # (N, L, E)
    k = k.to(work).repeat_interleave(group, dim=1).transpose(0, 1)      # (N, S, E)
    v = v.to(work).repeat_interleave(group, dim=1).transpose(0, 1)      # (N, S, Ev)
    scores = logits(q, k, scale=scale, softcap=softcap, slopes=slopes, offset=offset)
    weights, row_lse = softmax_rows(scores, window_allowed(L, S, window, causal, offset, q.device))
    if dropout is not None:
        weights = dropout(weights)
    out = (weights @ v).transpose(0, 1).to(out_dtype)                    # (L, N, Ev)
    return (out, row_lse) if lse else out


#: The 8-bit float types q, k, v may come in (FlashAttention-3, with descales).
_FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _descale_rows(descale: Any, name: str, B: int, K: int) -> torch.Tensor:
    """A descale as float32 (B, K): None -> ones, (1,) -> filled, (B, K) as given."""
    if descale is None:
        return torch.ones(B, K)
    d = descale.detach().to("cpu", torch.float32)
    if tuple(d.shape) in ((), (1,)):
        return d.reshape(1, 1).expand(B, K)
    if tuple(d.shape) != (B, K):
        raise ValueError(f"{name} has shape {tuple(d.shape)}, but should be (1,) or (num_sequences, K) = ({B}, {K})")
    return d


def _check_options(window_size: Any, softcap: float) -> None:
    if any(int(side) < -1 for side in window_size):
        raise ValueError(f"window_size={tuple(window_size)}: each side must be >= 0, or -1 for unbounded")
    if not (softcap >= 0 and math.isfinite(softcap)):
        raise ValueError(f"softcap={softcap} must be a finite number >= 0 (0 = off)")


def _slopes_of(alibi_slopes: Any, b: int, N: int) -> Any:
    """Sequence b's slopes (N,) from (N,) or (B, N); None stays None."""
    if alibi_slopes is None:
        return None
    return alibi_slopes.reshape(-1, N)[b % alibi_slopes.reshape(-1, N).shape[0]]


def _scale(softmax_scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
