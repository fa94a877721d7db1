"""Flash kernels with the limits of real tiled kernels, as plain torch functions with
``flash_attn_func``'s signature that raise outside their limits (no adapter): each
certifies only with the declarations that state its limits (``--impl-option``).

* :func:`tiled_16bit`: float16/bfloat16 only, E >= 16, L and S multiples of 16;
* :func:`head_dims_64`: float16/bfloat16 only, E in {64, 96, 128}, L and S multiples of 16;
* :func:`causal_only`: causal=True only (any dtype and size).

Each computes attention correctly (float32 accumulation, FlashAttention's lower-right
causal rule, rows attending no key 0 with LSE -inf, GQA); window, softcap and ALiBi raise.
"""

from __future__ import annotations

import math

import torch


def _attention(q, k, v, softmax_scale, causal, return_attn_probs):
    B, L, N, E = q.shape
    S, K = k.shape[1], k.shape[2]
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = (x.to(wide).transpose(1, 2) for x in (q, k, v))  # (B, heads, len, dim)
    if K != N:
        kf, vf = kf.repeat_interleave(N // K, dim=1), vf.repeat_interleave(N // K, dim=1)
    scale = 1 / math.sqrt(E) if softmax_scale is None else softmax_scale
    scores = scale * (qf @ kf.transpose(-1, -2))
    if causal:  # lower-right: query i attends keys j <= i + S - L
        allowed = torch.ones(L, S, dtype=torch.bool).tril(S - L)
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                          # (B, N, L), -inf where empty
    weights = torch.exp(scores - lse[..., None].clamp_min(-1e30))
    weights = torch.where(torch.isfinite(lse)[..., None], weights, torch.zeros_like(weights))
    out = (weights @ vf).transpose(1, 2).to(q.dtype)
    return (out, lse, None) if return_attn_probs else out


def _no_extras(window_size, softcap, alibi_slopes, dropout_p):
    if tuple(window_size) != (-1, -1) or softcap or alibi_slopes is not None or dropout_p:
        raise NotImplementedError("this kernel has no window, softcap, ALiBi or dropout")


def _tiles(q, k, v, head_dims):
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"only float16 and bfloat16 are supported, got {q.dtype}")
    E, Ev = q.shape[-1], v.shape[-1]
    if not head_dims(E) or not head_dims(Ev):
        raise ValueError(f"head dim {E} (value {Ev}) is not supported by this kernel")
    if q.shape[1] % 16 or k.shape[1] % 16:
        raise ValueError(f"lengths must be multiples of 16, got L={q.shape[1]}, S={k.shape[1]}")


def tiled_16bit(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    _no_extras(window_size, softcap, alibi_slopes, dropout_p)
    _tiles(q, k, v, lambda e: e >= 16)
    return _attention(q, k, v, softmax_scale, causal, return_attn_probs)


def head_dims_64(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                 softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    _no_extras(window_size, softcap, alibi_slopes, dropout_p)
    _tiles(q, k, v, lambda e: e in (64, 96, 128))
    return _attention(q, k, v, softmax_scale, causal, return_attn_probs)


def causal_only(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    _no_extras(window_size, softcap, alibi_slopes, dropout_p)
    if not causal:
        raise NotImplementedError("this kernel runs only causal=True")
    return _attention(q, k, v, softmax_scale, causal, return_attn_probs)
