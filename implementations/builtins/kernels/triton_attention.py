"""Triton fused attention (flash-attention style), forward and backward, registered as ``triton``.

``make_implementation()`` returns an :class:`~implementations.base.Implementation`
with torch SDPA's calling convention (``sdpa``) and FlashAttention-2's
``flash_attn_func`` (``flash``: sliding window, softcap, ALiBi, LSE output; forward
and backward).
It supports bool and additive masks (any broadcastable rank), the causal flag in
either alignment, GQA, Ev != E, any strides, head dims up to 256, float64 / float32
(never TF32) / float16 / bfloat16, and gradients w.r.t. q, k, v; not dropout, nor a
gradient w.r.t. the mask. Fully-masked rows give 0. Without a GPU it runs under the
Triton interpreter, which this module switches on *before* importing triton: import
it before triton.

Details (the kernels, the interpreter and how the kernel avoids its traps, timings,
the planted bugs of the bug zoo) are in ``docs/TRITON.md``.

Dimension letters: B batch, N query heads, K key/value heads, L query length,
S key length, E q/k head dim, Ev value head dim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from implementations.base import ALL_MASK_KINDS, CAUSAL_ALIGNMENTS, Capabilities, Implementation
from implementations.builtins.pytorch._torch_common import contiguous_strides

__all__ = ["PLANTED_BUGS", "Launch", "LaunchPlan", "make_implementation", "plan_backward", "plan_launch"]

#: planted_bug name -> the ``BUG`` constexpr the kernel sees (0: none).
PLANTED_BUGS = {"drop_ragged_block": 1, "no_rescale": 2, "ignore_strides": 3, "window_left_off_by_one": 4}
#: Largest head dim (E and Ev) the kernel accepts: BLOCK_E up to 256.
MAX_HEAD_DIM = 256
#: ``MASK_KIND`` constexpr values.
MASK_NONE, MASK_BOOL, MASK_ADDITIVE = 0, 1, 2

_TRITON_IMPORTED_EARLIER = "triton" in sys.modules
if not torch.cuda.is_available():
    # Must happen before triton is first imported (docs/TRITON.md, the interpreter).
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError as exc:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None
    libdevice = None
    _IMPORT_ERROR: str | None = f"triton is not importable ({exc})"
else:
    _IMPORT_ERROR = None


def _interpreting() -> bool:
    return triton is not None and bool(triton.knobs.runtime.interpret)


@contextlib.contextmanager
def _launching():
    """Around a launch: under the interpreter, no int32 overflow check of each integer
    add and multiply (a cast to int64, two compares and a device assert per op, about a
    third of a call's time here). Compiled kernels assert nothing without ``debug``; the
    index arithmetic is bounded by the tensors' sizes, as on a GPU. Put back afterwards,
    so another Triton kernel in the process keeps the interpreter's default."""
    if not _interpreting():
        yield
        return
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    saved = builder.options
    builder.options = dataclasses.replace(saved, sanitize_overflow=False)
    try:
        yield
    finally:
        builder.options = saved


def _interpreter_mismatch() -> str | None:
    """Why the interpreter cannot run here, when triton was imported in the other mode.

    triton.language's own helpers (``tl.max``, ``tl.sum``, ``tl.zeros`` ...) are
    decorated once, when triton is first imported: compiled ``JITFunction`` s
    cannot be called by interpreted code, and interpreted ones cannot be compiled.
    """
    if not _interpreting():
        return None
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.zeros, InterpretedFunction):
        return ("triton was imported before TRITON_INTERPRET=1 was set, so its language "
                "helpers cannot run under the interpreter; import "
                "implementations.builtins.kernels.triton_attention before triton, or export TRITON_INTERPRET=1")
    return None


if triton is not None:

    @triton.jit
    def _tanh(x, LIBDEVICE: tl.constexpr):
        """tanh to a few ulps: libdevice's on a GPU; the interpreter cannot call libdevice,
        so there tanh|x| = -m / (2 + m) with m = expm1(-2|x|), and expm1 by Kahan's
        exact-ratio trick (u - 1) * y / log(u), u = exp(y): no cancellation near 0, where
        a cap far above the logits puts every argument."""
        if LIBDEVICE:
            return libdevice.tanh(x)
        y = -2.0 * tl.abs(x)
        u = tl.exp(y)
        saturated = (u - 1.0) == -1.0  # u below half an ulp of 1 (maybe subnormal): m = -1
        log_u = tl.log(tl.where((u == 1.0) | saturated, 0.5, u))
        m = tl.where(u == 1.0, y, tl.where(saturated, -1.0, (u - 1.0) * y / log_u))
        t = -m / (2.0 + m)
        return tl.where(x < 0, -t, t)

    def _attn_fwd_kernel_fn(
        Q, K, V, Mask, Out, LSE, Alibi,
        stride_qb, stride_qh, stride_ql, stride_qe,
        stride_kb, stride_kh, stride_ks, stride_ke,
        stride_vb, stride_vh, stride_vs, stride_ve,
        stride_mb, stride_mh, stride_ml, stride_ms,
        stride_ob, stride_oh, stride_ol, stride_oe,
        stride_ab, stride_ah,
        N, L, S, E, EV, GROUP,
        scale: tl.float64, causal_offset, window_offset, alibi_offset, softcap: tl.float64,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
        CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
        ACC_F64: tl.constexpr, NATIVE_DOT: tl.constexpr,
        BUG: tl.constexpr,
        WINDOW_LEFT: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
        ALIBI: tl.constexpr = False, LIBDEVICE_TANH: tl.constexpr = False,
    ):
        """One program: BLOCK_M queries of one (batch, query head); all keys it may see.

        Key j is visible to query i iff j <= i + causal_offset (CAUSAL: the causal
        diagonal or a window's right edge) and j >= i + window_offset (WINDOW_LEFT).
        SOFTCAP: s = softcap * tanh(s / softcap) after the scale; ALIBI: the bias
        -slope_h * |i + alibi_offset - j| after that.
        """
        # axis 0 (up to 2**31 - 1 programs) takes B*N, which can exceed 65535.
        pid_bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        b = (pid_bh // N).to(tl.int64)
        h = (pid_bh % N).to(tl.int64)
        kv_h = h // GROUP  # GQA as repeat_interleave
        # scale is declared fp64 so float64 inputs keep a float64 scale on the GPU;
        # it is left uncast there (the interpreter passes a Python float, and its
        # tl.cast of a Python float goes through float32).
        if ACC_F64:
            acc_dtype = tl.float64
        else:
            acc_dtype = tl.float32
            scale = tl.cast(scale, tl.float32)
            if SOFTCAP:
                softcap = tl.cast(softcap, tl.float32)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_e = tl.arange(0, BLOCK_E)
        offs_ev = tl.arange(0, BLOCK_EV)
        row_ok = offs_m < L

        q_ptrs = (Q + b * stride_qb + h * stride_qh
                  + offs_m[:, None] * stride_ql + offs_e[None, :] * stride_qe)
        q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_e[None, :] < E), other=0.0)
        if not NATIVE_DOT:
            q = q.to(acc_dtype)
        k_base = K + b * stride_kb + kv_h * stride_kh
        v_base = V + b * stride_vb + kv_h * stride_vh
        m_base = Mask + b * stride_mb + h * stride_mh
        if ALIBI:
            slope = tl.load(Alibi + b * stride_ab + h * stride_ah).to(acc_dtype)
        window_lo = window_offset
        if BUG == 4:  # planted: window_left_off_by_one keeps j > i + window_offset only
            window_lo = window_offset + 1

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=acc_dtype)
        l_i = tl.zeros([BLOCK_M], dtype=acc_dtype)
        acc = tl.zeros([BLOCK_M, BLOCK_EV], dtype=acc_dtype)

        hi = S
        if CAUSAL:
            # keys past the last query's diagonal are never visible to this tile
            hi = tl.maximum(tl.minimum(S, pid_m * BLOCK_M + BLOCK_M + causal_offset), 0)
        if BUG == 1:  # planted: drop_ragged_block
            hi = tl.minimum(hi, (S // BLOCK_N) * BLOCK_N)
        lo = 0
        if WINDOW_LEFT:
            # key blocks wholly left of the first query's window are never visible
            lo = tl.maximum(pid_m * BLOCK_M + window_offset, 0)
            lo = (lo // BLOCK_N) * BLOCK_N

        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + offs_n0
            col_ok = offs_n < S
            k = tl.load(k_base + offs_n[None, :] * stride_ks + offs_e[:, None] * stride_ke,
                        mask=col_ok[None, :] & (offs_e[:, None] < E), other=0.0)
            if not NATIVE_DOT:
                k = k.to(acc_dtype)
            s = tl.dot(q, k, input_precision="ieee", out_dtype=acc_dtype) * scale
            if SOFTCAP:
                s = softcap * _tanh(s / softcap, LIBDEVICE_TANH)
            if ALIBI:
                distance = tl.abs(offs_m[:, None] + alibi_offset - offs_n[None, :])
                s = s - slope * distance.to(acc_dtype)

            visible = row_ok[:, None] & col_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
            if WINDOW_LEFT:
                visible = visible & (offs_n[None, :] >= offs_m[:, None] + window_lo)
            if MASK_KIND == 1:
                attend = tl.load(m_base + offs_m[:, None] * stride_ml + offs_n[None, :] * stride_ms,
                                 mask=visible, other=0)
                visible = visible & (attend != 0)
            if MASK_KIND == 2:
                bias = tl.load(m_base + offs_m[:, None] * stride_ml + offs_n[None, :] * stride_ms,
                               mask=visible, other=0.0)
                s = s + bias.to(acc_dtype)
            s = tl.where(visible, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row with nothing visible yet keeps m = -inf; subtract 0 there, not -inf
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            if BUG != 2:  # planted no_rescale skips this
                acc = acc * alpha[:, None]

            v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_ev[None, :] * stride_ve,
                        mask=col_ok[:, None] & (offs_ev[None, :] < EV), other=0.0)
            if NATIVE_DOT:
                acc = tl.dot(p.to(v.dtype), v, acc)
            else:
                acc = tl.dot(p, v.to(acc_dtype), acc, input_precision="ieee", out_dtype=acc_dtype)
            m_i = m_new

        # fully-masked rows: l = 0 and acc = 0 -> output 0 (never 0/0)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        o_ptrs = (Out + b * stride_ob + h * stride_oh
                  + offs_m[:, None] * stride_ol + offs_ev[None, :] * stride_oe)
        tl.store(o_ptrs, out, mask=row_ok[:, None] & (offs_ev[None, :] < EV))
        # log-sum-exp per row for the backward; +inf on fully-masked rows makes every
        # recomputed probability exp(s - lse) exactly 0 there
        lse = tl.where(l_i == 0.0, float("inf"), tl.where(m_i == float("-inf"), 0.0, m_i) + tl.log(l_safe))
        tl.store(LSE + pid_bh.to(tl.int64) * L + offs_m, lse, mask=row_ok)

    # Sizes vary from call to call; specialising on them (== 1, divisible by 16) would
    # multiply the compiled variants for little gain. Strides stay specialised (a unit
    # last-dim stride gives vectorised loads).
    _SIZE_ARGS = ["N", "L", "S", "E", "EV", "GROUP", "causal_offset"]
    _attn_fwd_kernel = triton.jit(_attn_fwd_kernel_fn,
                                  do_not_specialize=_SIZE_ARGS + ["window_offset", "alibi_offset"])

    def _attn_bwd_dkdv_kernel_fn(
        Q, K, V, Mask, DO, LSE, Delta, DK, DV,
        stride_qb, stride_qh, stride_ql, stride_qe,
        stride_kb, stride_kh, stride_ks, stride_ke,
        stride_vb, stride_vh, stride_vs, stride_ve,
        stride_mb, stride_mh, stride_ml, stride_ms,
        stride_dob, stride_doh, stride_dol, stride_doe,
        stride_dkb, stride_dkh, stride_dks, stride_dke,
        stride_dvb, stride_dvh, stride_dvs, stride_dve,
        Alibi, stride_ab, stride_ah,
        N, KH, L, S, E, EV, GROUP,
        scale: tl.float64, causal_offset, window_offset, alibi_offset, softcap: tl.float64,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
        CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
        ACC_F64: tl.constexpr, NATIVE_DOT: tl.constexpr,
        WINDOW_LEFT: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
        ALIBI: tl.constexpr = False, LIBDEVICE_TANH: tl.constexpr = False,
    ):
        """One program: BLOCK_N keys of one (batch, kv head); dK, dV summed over its GQA group.

        Works transposed (keys along rows): sT = (q @ kT)ᵀ, pT = exp(sT - lse),
        dV += pT @ dO, dpT = v @ dOT, dsT = pT * (dpT - delta), dK += scale * dsT @ q.
        """
        pid_bk = tl.program_id(0)
        pid_n = tl.program_id(1)
        b = (pid_bk // KH).to(tl.int64)
        kv_h = (pid_bk % KH).to(tl.int64)
        if ACC_F64:
            acc_dtype = tl.float64
        else:
            acc_dtype = tl.float32
            scale = tl.cast(scale, tl.float32)
            if SOFTCAP:
                softcap = tl.cast(softcap, tl.float32)

        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m0 = tl.arange(0, BLOCK_M)
        offs_e = tl.arange(0, BLOCK_E)
        offs_ev = tl.arange(0, BLOCK_EV)
        col_ok = offs_n < S
        # keys as the forward loads them, (E, keys): the scores are recomputed by the very
        # dot the forward ran (q @ kT), bit for bit. Transposed (k @ qT) they round
        # differently, and with |scores| near 1e9 (an ulp of 64 in float32) exp(s - lse)
        # then overflows to 1e27 or NaN.
        kT = tl.load(K + b * stride_kb + kv_h * stride_kh + offs_n[None, :] * stride_ks
                     + offs_e[:, None] * stride_ke, mask=col_ok[None, :] & (offs_e[:, None] < E), other=0.0)
        v = tl.load(V + b * stride_vb + kv_h * stride_vh + offs_n[:, None] * stride_vs
                    + offs_ev[None, :] * stride_ve, mask=col_ok[:, None] & (offs_ev[None, :] < EV), other=0.0)
        if not NATIVE_DOT:
            kT = kT.to(acc_dtype)
            v = v.to(acc_dtype)
        dk = tl.zeros([BLOCK_N, BLOCK_E], dtype=acc_dtype)
        dv = tl.zeros([BLOCK_N, BLOCK_EV], dtype=acc_dtype)

        lo = 0
        if CAUSAL:
            # query i sees key j iff j <= i + causal_offset: skip query blocks before the first
            lo = tl.maximum(pid_n * BLOCK_N - causal_offset, 0)
            lo = (lo // BLOCK_M) * BLOCK_M
        hi = L
        if WINDOW_LEFT:
            # query i sees key j only if j >= i + window_offset: stop past the last such query
            hi = tl.maximum(tl.minimum(L, pid_n * BLOCK_N + BLOCK_N - window_offset), 0)
        for g in range(0, GROUP):
            h = kv_h * GROUP + g
            bh = b * N + h
            q_base = Q + b * stride_qb + h * stride_qh
            do_base = DO + b * stride_dob + h * stride_doh
            m_base = Mask + b * stride_mb + h * stride_mh
            if ALIBI:
                slope = tl.load(Alibi + b * stride_ab + h * stride_ah).to(acc_dtype)
            for start_m in range(lo, hi, BLOCK_M):
                offs_m = start_m + offs_m0
                row_ok = offs_m < L
                q = tl.load(q_base + offs_m[:, None] * stride_ql + offs_e[None, :] * stride_qe,
                            mask=row_ok[:, None] & (offs_e[None, :] < E), other=0.0)
                do = tl.load(do_base + offs_m[:, None] * stride_dol + offs_ev[None, :] * stride_doe,
                             mask=row_ok[:, None] & (offs_ev[None, :] < EV), other=0.0)
                if not NATIVE_DOT:
                    q = q.to(acc_dtype)
                    do = do.to(acc_dtype)
                lse = tl.load(LSE + bh * L + offs_m, mask=row_ok, other=float("inf"))
                delta = tl.load(Delta + bh * L + offs_m, mask=row_ok, other=0.0)
                sT = tl.trans(tl.dot(q, kT, input_precision="ieee", out_dtype=acc_dtype) * scale)
                if SOFTCAP:
                    tanhT = _tanh(sT / softcap, LIBDEVICE_TANH)
                    sT = softcap * tanhT
                if ALIBI:
                    sT = sT - slope * tl.abs(offs_m[None, :] + alibi_offset - offs_n[:, None]).to(acc_dtype)
                visible = col_ok[:, None] & row_ok[None, :]
                if CAUSAL:
                    visible = visible & (offs_n[:, None] <= offs_m[None, :] + causal_offset)
                if WINDOW_LEFT:
                    visible = visible & (offs_n[:, None] >= offs_m[None, :] + window_offset)
                if MASK_KIND == 1:
                    attend = tl.load(m_base + offs_m[None, :] * stride_ml + offs_n[:, None] * stride_ms,
                                     mask=visible, other=0)
                    visible = visible & (attend != 0)
                if MASK_KIND == 2:
                    bias = tl.load(m_base + offs_m[None, :] * stride_ml + offs_n[:, None] * stride_ms,
                                   mask=visible, other=0.0)
                    sT = sT + bias.to(acc_dtype)
                # blocked scores -> -inf first, so exp never overflows on a blocked entry
                pT = tl.exp(tl.where(visible, sT, float("-inf")) - lse[None, :])
                if NATIVE_DOT:
                    dv = tl.dot(pT.to(do.dtype), do, dv)
                else:
                    dv = tl.dot(pT, do, dv, input_precision="ieee", out_dtype=acc_dtype)
                dpT = tl.dot(v, tl.trans(do), input_precision="ieee", out_dtype=acc_dtype)
                dsT = pT * (dpT - delta[None, :])
                if SOFTCAP:  # d(c tanh(s / c)) / ds = 1 - tanh^2
                    dsT = dsT * (1.0 - tanhT * tanhT)
                if NATIVE_DOT:
                    dk = tl.dot(dsT.to(q.dtype), q, dk)
                else:
                    dk = tl.dot(dsT, q, dk, input_precision="ieee", out_dtype=acc_dtype)
        dk = dk * scale
        tl.store(DK + b * stride_dkb + kv_h * stride_dkh + offs_n[:, None] * stride_dks
                 + offs_e[None, :] * stride_dke, dk, mask=col_ok[:, None] & (offs_e[None, :] < E))
        tl.store(DV + b * stride_dvb + kv_h * stride_dvh + offs_n[:, None] * stride_dvs
                 + offs_ev[None, :] * stride_dve, dv, mask=col_ok[:, None] & (offs_ev[None, :] < EV))

    def _attn_bwd_dq_kernel_fn(
        Q, K, V, Mask, DO, LSE, Delta, DQ,
        stride_qb, stride_qh, stride_ql, stride_qe,
        stride_kb, stride_kh, stride_ks, stride_ke,
        stride_vb, stride_vh, stride_vs, stride_ve,
        stride_mb, stride_mh, stride_ml, stride_ms,
        stride_dob, stride_doh, stride_dol, stride_doe,
        stride_dqb, stride_dqh, stride_dql, stride_dqe,
        Alibi, stride_ab, stride_ah,
        N, L, S, E, EV, GROUP,
        scale: tl.float64, causal_offset, window_offset, alibi_offset, softcap: tl.float64,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
        CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
        ACC_F64: tl.constexpr, NATIVE_DOT: tl.constexpr,
        WINDOW_LEFT: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
        ALIBI: tl.constexpr = False, LIBDEVICE_TANH: tl.constexpr = False,
    ):
        """One program: BLOCK_M queries of one (batch, head); dQ = scale * sum_j dS_ij k_j."""
        pid_bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        b = (pid_bh // N).to(tl.int64)
        h = (pid_bh % N).to(tl.int64)
        kv_h = h // GROUP
        if ACC_F64:
            acc_dtype = tl.float64
        else:
            acc_dtype = tl.float32
            scale = tl.cast(scale, tl.float32)
            if SOFTCAP:
                softcap = tl.cast(softcap, tl.float32)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_e = tl.arange(0, BLOCK_E)
        offs_ev = tl.arange(0, BLOCK_EV)
        row_ok = offs_m < L
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_ql
                    + offs_e[None, :] * stride_qe, mask=row_ok[:, None] & (offs_e[None, :] < E), other=0.0)
        do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dol
                     + offs_ev[None, :] * stride_doe, mask=row_ok[:, None] & (offs_ev[None, :] < EV), other=0.0)
        if not NATIVE_DOT:
            q = q.to(acc_dtype)
            do = do.to(acc_dtype)
        bh = pid_bh.to(tl.int64)
        lse = tl.load(LSE + bh * L + offs_m, mask=row_ok, other=float("inf"))
        delta = tl.load(Delta + bh * L + offs_m, mask=row_ok, other=0.0)
        k_base = K + b * stride_kb + kv_h * stride_kh
        v_base = V + b * stride_vb + kv_h * stride_vh
        m_base = Mask + b * stride_mb + h * stride_mh
        dq = tl.zeros([BLOCK_M, BLOCK_E], dtype=acc_dtype)
        if ALIBI:
            slope = tl.load(Alibi + b * stride_ab + h * stride_ah).to(acc_dtype)

        hi = S
        if CAUSAL:
            hi = tl.maximum(tl.minimum(S, pid_m * BLOCK_M + BLOCK_M + causal_offset), 0)
        lo = 0
        if WINDOW_LEFT:
            lo = tl.maximum(pid_m * BLOCK_M + window_offset, 0)
            lo = (lo // BLOCK_N) * BLOCK_N
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + offs_n0
            col_ok = offs_n < S
            kT = tl.load(k_base + offs_n[None, :] * stride_ks + offs_e[:, None] * stride_ke,
                         mask=col_ok[None, :] & (offs_e[:, None] < E), other=0.0)
            vT = tl.load(v_base + offs_n[None, :] * stride_vs + offs_ev[:, None] * stride_ve,
                         mask=col_ok[None, :] & (offs_ev[:, None] < EV), other=0.0)
            if not NATIVE_DOT:
                kT = kT.to(acc_dtype)
                vT = vT.to(acc_dtype)
            s = tl.dot(q, kT, input_precision="ieee", out_dtype=acc_dtype) * scale
            if SOFTCAP:
                tanh_s = _tanh(s / softcap, LIBDEVICE_TANH)
                s = softcap * tanh_s
            if ALIBI:
                s = s - slope * tl.abs(offs_m[:, None] + alibi_offset - offs_n[None, :]).to(acc_dtype)
            visible = row_ok[:, None] & col_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
            if WINDOW_LEFT:
                visible = visible & (offs_n[None, :] >= offs_m[:, None] + window_offset)
            if MASK_KIND == 1:
                attend = tl.load(m_base + offs_m[:, None] * stride_ml + offs_n[None, :] * stride_ms,
                                 mask=visible, other=0)
                visible = visible & (attend != 0)
            if MASK_KIND == 2:
                bias = tl.load(m_base + offs_m[:, None] * stride_ml + offs_n[None, :] * stride_ms,
                               mask=visible, other=0.0)
                s = s + bias.to(acc_dtype)
            p = tl.exp(tl.where(visible, s, float("-inf")) - lse[:, None])
            dp = tl.dot(do, vT, input_precision="ieee", out_dtype=acc_dtype)
            ds = p * (dp - delta[:, None])
            if SOFTCAP:
                ds = ds * (1.0 - tanh_s * tanh_s)
            if NATIVE_DOT:
                dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq)
            else:
                dq = tl.dot(ds, tl.trans(kT), dq, input_precision="ieee", out_dtype=acc_dtype)
        dq = dq * scale
        tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dql
                 + offs_e[None, :] * stride_dqe, dq, mask=row_ok[:, None] & (offs_e[None, :] < E))

    _attn_bwd_dkdv_kernel = triton.jit(_attn_bwd_dkdv_kernel_fn,
                                       do_not_specialize=_SIZE_ARGS + ["KH", "window_offset", "alibi_offset"])
    _attn_bwd_dq_kernel = triton.jit(_attn_bwd_dq_kernel_fn,
                                     do_not_specialize=_SIZE_ARGS + ["window_offset", "alibi_offset"])


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class KernelConfig:
    """Block sizes and launch options for one (device kind, dtype, head dims)."""

    block_m: int
    block_n: int
    block_e: int
    block_ev: int
    num_warps: int = 4
    num_stages: int = 1
    native_dot: bool = False


def kernel_config(dtype: torch.dtype, E: int, Ev: int, *, gpu: bool) -> KernelConfig:
    """Block sizes the launcher uses; the compile test enumerates these.

    Every dot dim is >= 16 (NVIDIA rejects smaller 16-bit dots); head dims are
    padded to a power of 2. CPU (interpreter): 16 x 16 tiles, 16-bit operands
    upcast before dots. GPU: tiles sized to fit shared memory on sm_80 and sm_90.
    """
    block_e = max(16, _next_pow2(E))
    block_ev = max(16, _next_pow2(Ev))
    if not gpu:
        # interpreter cost is per executed op: 64 queries per program is ~2-3x
        # faster than 16 on tiny cases; 16-key blocks keep S <= 70 multi-block.
        return KernelConfig(64, 16, block_e, block_ev)
    widest = max(block_e, block_ev)
    if dtype in (torch.float16, torch.bfloat16):
        # Tensor-core dots with head-dim blocks below 64 or unequal (E = 20, Ev = 12: 32 and
        # 16) gave outputs off by 1.5 and, for E = 61, Ev = 12, an illegal memory access
        # on an H200 (triton 3.6, benchmarks/results/gpu-2026-12-04/triton_gpu_probe.md);
        # 64/64 and 128/128 were right. One block of max(64, E, Ev) for both, padded.
        block_e = block_ev = widest = max(64, widest)
        if widest <= 64:
            return KernelConfig(128, 64, block_e, block_ev, num_warps=4, num_stages=3, native_dot=True)
        if widest <= 128:
            return KernelConfig(128, 64, block_e, block_ev, num_warps=8, num_stages=2, native_dot=True)
        return KernelConfig(64, 32, block_e, block_ev, num_warps=8, num_stages=2, native_dot=True)
    if dtype == torch.float32:  # ieee fp32 dots run on FMA units: smaller tiles
        if widest <= 64:
            return KernelConfig(64, 32, block_e, block_ev, num_warps=4, num_stages=2)
        return KernelConfig(32, 32, block_e, block_ev, num_warps=4, num_stages=1)
    # float64
    if widest <= 64:
        return KernelConfig(32, 32, block_e, block_ev, num_warps=4, num_stages=1)
    return KernelConfig(16, 16, block_e, block_ev, num_warps=4, num_stages=1)


_SUPPORTED_DTYPES = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}


@dataclass
class LaunchPlan:
    """Everything one kernel launch needs: grid, positional args, constexprs."""

    grid: tuple[int, int, int]
    args: list[Any]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    out: torch.Tensor          # float32/float64 buffer the kernel writes, (B, N, L, Ev)
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype
    lse: torch.Tensor | None = None   # (B, N, L) row log-sum-exp, +inf on fully-masked rows
    context: dict[str, Any] | None = None  # what plan_backward reuses


@dataclass
class Launch:
    """One backward kernel launch (the compile test builds each of these too)."""

    kernel: str                # "dkdv" or "dq"
    grid: tuple[int, int, int]
    args: list[Any]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int


def _as_4d(t: torch.Tensor, what: str) -> torch.Tensor:
    """(..., X, Y, Z) -> (B, X, Y, Z) without a copy where strides allow."""
    if t.dim() < 4:
        return t[(None,) * (4 - t.dim())]
    if t.dim() == 4:
        return t
    try:
        return t.view(-1, *t.shape[-3:])
    except RuntimeError:  # declared: non-mergeable leading batch dims are copied
        return t.reshape(-1, *t.shape[-3:])


def _strides(t: torch.Tensor, ignore_strides: bool) -> tuple[int, ...]:
    if not ignore_strides:
        return tuple(t.stride())
    available = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    if available < t.numel() * t.element_size():
        return tuple(t.stride())  # the mutant must not read past memory (docs/TRITON.md)
    return contiguous_strides(tuple(t.shape))


def _validate(query, key, value, attn_mask, dropout_p, enable_gqa) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"{name}.dim()={t.dim()}; need (..., L, E) with at least 2 dims")
    if dropout_p:
        raise ValueError(f"dropout_p={dropout_p}: the triton implementation has no dropout; "
                         "use dropout_p=0.0")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"query.dtype={query.dtype}, key.dtype={key.dtype}, value.dtype={value.dtype}; "
                         "they must be equal")
    if query.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"query.dtype={query.dtype} is not supported; use one of "
                         f"{sorted(_SUPPORTED_DTYPES.values())}")
    if not (query.device == key.device == value.device):
        raise ValueError(f"query, key, value are on {query.device}, {key.device}, {value.device}; "
                         "put them on one device")
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError(f"query.dim()={query.dim()}, key.dim()={key.dim()}, value.dim()={value.dim()}; "
                         "they must be equal")
    if query.shape[:-3] != key.shape[:-3] or key.shape[:-3] != value.shape[:-3]:
        raise ValueError(f"batch dims differ: query {tuple(query.shape)}, key {tuple(key.shape)}, "
                         f"value {tuple(value.shape)}; broadcast them first")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query E={query.shape[-1]} != key E={key.shape[-1]}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key S={key.shape[-2]} != value S={value.shape[-2]}")
    if query.dim() >= 3:
        N, Kh, Kv = query.shape[-3], key.shape[-3], value.shape[-3]
        if Kh != Kv:
            raise ValueError(f"key has K={Kh} heads but value has {Kv}; they must be equal")
        if N != Kh:
            if not enable_gqa:
                raise ValueError(f"query has N={N} heads, key/value K={Kh}; pass enable_gqa=True "
                                 "for grouped-query attention or repeat the kv heads")
            if Kh == 0 or N % Kh != 0:
                raise ValueError(f"GQA needs N % K == 0, got N={N}, K={Kh}; use a K that divides N")
    for name, dim in (("E", query.shape[-1]), ("Ev", value.shape[-1])):
        if dim > MAX_HEAD_DIM:
            raise ValueError(f"{name}={dim} > {MAX_HEAD_DIM}, the largest head dim the triton "
                             "kernel supports")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise ValueError(f"attn_mask.dtype={attn_mask.dtype}; use bool (True = may attend) "
                             "or a floating dtype (added to the scores)")
        if attn_mask.device != query.device:
            raise ValueError(f"attn_mask is on {attn_mask.device}, query on {query.device}")
        target = (*query.shape[:-1], key.shape[-2])
        try:
            broadcast = torch.broadcast_shapes(tuple(attn_mask.shape), target)
        except RuntimeError:
            broadcast = None
        if broadcast != torch.Size(target):
            raise ValueError(f"attn_mask.shape={tuple(attn_mask.shape)} does not broadcast to "
                             f"(..., N, L, S)={target}; build the mask for these q/k lengths")


def plan_launch(query, key, value, attn_mask=None, is_causal=False, scale=None, *,
                causal_alignment: str = "upper_left", planted_bug: str | None = None,
                gpu: bool | None = None, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                alibi_slopes: torch.Tensor | None = None) -> LaunchPlan:
    """Validate nothing; turn SDPA arguments into one kernel launch.

    ``gpu`` picks the block configuration (default: the tensors' device). The
    compile test calls this with CPU tensors and ``gpu=True`` to get exactly the
    arguments and constexprs a GPU launch would use.

    The flash level's extras (heads-first tensors here): ``window`` (left, right),
    aligned like ``is_causal`` (query i sits at key i + offset, offset = S - L for
    lower_right, else 0), -1 unbounded, ``is_causal`` sets right = 0; ``softcap`` > 0
    caps the scaled logits; ``alibi_slopes`` (N,) or (B, N) adds -slope * |i + offset - j|.
    """
    if gpu is None:
        gpu = query.device.type == "cuda"
    bug = PLANTED_BUGS.get(planted_bug, 0) if planted_bug else 0
    out_shape = (*query.shape[:-1], value.shape[-1])
    q4, k4, v4 = _as_4d(query, "query"), _as_4d(key, "key"), _as_4d(value, "value")
    B, N, L, E = q4.shape
    _, Kh, S, _ = k4.shape
    Ev = v4.shape[-1]
    acc_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    out = torch.empty((B, N, L, Ev), dtype=acc_dtype, device=query.device)
    lse = torch.empty((B, N, L), dtype=acc_dtype, device=query.device)

    if attn_mask is None:
        mask_kind, mask, m_strides = MASK_NONE, q4, (0, 0, 0, 0)
    else:
        m4 = _as_4d(attn_mask.expand(*query.shape[:-1], S), "attn_mask")
        if attn_mask.dtype == torch.bool:
            mask_kind, mask = MASK_BOOL, m4.view(torch.uint8)  # same itemsize: no copy
        else:
            mask_kind, mask = MASK_ADDITIVE, m4
        m_strides = tuple(m4.stride())

    if scale is None:
        scale = 1.0 / math.sqrt(E) if E > 0 else 1.0
    offset = S - L if causal_alignment == "lower_right" else 0
    # a side of L + S or more reaches every key: clamping keeps the offsets int32
    left, right = (side if side < 0 else min(side, L + S) for side in window)
    if is_causal:
        right = 0
    causal_offset = offset + right if right >= 0 else 0
    window_offset = offset - left if left >= 0 else 0
    if alibi_slopes is None:
        alibi, a_strides = q4, (0, 0)
    else:
        alibi = alibi_slopes.reshape(-1, N)  # (1|B, N)
        a_strides = (alibi.stride(0) if alibi.shape[0] > 1 else 0, alibi.stride(1))

    ignore = bug == PLANTED_BUGS["ignore_strides"]
    cfg = kernel_config(query.dtype, E, Ev, gpu=gpu)
    args = [
        q4, k4, v4, mask, out, lse, alibi,
        *_strides(q4, ignore), *_strides(k4, ignore), *_strides(v4, ignore),
        *m_strides, *out.stride(), *a_strides,
        N, L, S, E, Ev, N // Kh,
        float(scale), causal_offset, window_offset, offset, float(softcap),
    ]
    constexprs = dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_E=cfg.block_e, BLOCK_EV=cfg.block_ev,
        CAUSAL=right >= 0, MASK_KIND=mask_kind,
        ACC_F64=acc_dtype == torch.float64,
        NATIVE_DOT=cfg.native_dot and query.dtype in (torch.float16, torch.bfloat16),
        BUG=bug if bug in (1, 2, 4) else 0,
        WINDOW_LEFT=left >= 0, SOFTCAP=softcap > 0, ALIBI=alibi_slopes is not None,
        LIBDEVICE_TANH=softcap > 0 and gpu,
    )
    grid = (B * N, -(-L // cfg.block_m), 1)
    context = dict(q4=q4, k4=k4, v4=v4, mask=mask, m_strides=m_strides, mask_kind=mask_kind,
                   sizes=(B, N, Kh, L, S, E, Ev), scale=float(scale), causal_offset=causal_offset,
                   causal=right >= 0, acc_dtype=acc_dtype, gpu=gpu,
                   alibi=(alibi, *a_strides), flash_tail=[window_offset, offset, float(softcap)],
                   flash_constexprs={key: constexprs[key] for key in
                                     ("WINDOW_LEFT", "SOFTCAP", "ALIBI", "LIBDEVICE_TANH")})
    return LaunchPlan(grid, args, constexprs, cfg.num_warps, cfg.num_stages, out,
                      tuple(out_shape), query.dtype, lse, context)


def backward_config(dtype: torch.dtype, E: int, Ev: int, *, gpu: bool) -> KernelConfig:
    """Block sizes of both backward kernels (dK/dV: BLOCK_N keys per program, BLOCK_M
    queries per step; dQ: BLOCK_M queries per program, BLOCK_N keys per step)."""
    block_e = max(16, _next_pow2(E))
    block_ev = max(16, _next_pow2(Ev))
    if not gpu:
        return KernelConfig(64, 16, block_e, block_ev)
    widest = max(block_e, block_ev)
    if dtype in (torch.float16, torch.bfloat16):
        block_e = block_ev = widest = max(64, widest)  # as kernel_config (measured there)
        if widest <= 64:
            return KernelConfig(64, 64, block_e, block_ev, num_warps=4, num_stages=1, native_dot=True)
        if widest <= 128:
            return KernelConfig(64, 64, block_e, block_ev, num_warps=8, num_stages=1, native_dot=True)
        return KernelConfig(32, 32, block_e, block_ev, num_warps=8, num_stages=1, native_dot=True)
    if dtype == torch.float32:
        if widest <= 64:
            return KernelConfig(32, 32, block_e, block_ev, num_warps=4, num_stages=1)
        return KernelConfig(16, 16, block_e, block_ev, num_warps=4, num_stages=1)
    return KernelConfig(16, 16, block_e, block_ev, num_warps=4, num_stages=1)


def plan_backward(plan: LaunchPlan, grad_out: torch.Tensor, out: torch.Tensor):
    """The two backward launches for a forward ``plan``; returns (launches, dq, dk, dv).

    ``grad_out`` and ``out`` have the forward output's shape (..., N, L, Ev); the
    gradient buffers are float32 (float64 for float64), shaped (B, N|K, L|S, E|Ev).
    delta_i = sum_e dO_ie * O_ie is computed on the host (one torch reduction).
    """
    ctx = plan.context
    B, N, Kh, L, S, E, Ev = ctx["sizes"]
    acc_dtype, device = ctx["acc_dtype"], grad_out.device
    do4 = _as_4d(grad_out, "grad_out")
    delta = (do4.to(acc_dtype) * _as_4d(out, "out").to(acc_dtype)).sum(-1).contiguous()  # (B, N, L)
    dq = torch.empty((B, N, L, E), dtype=acc_dtype, device=device)
    dk = torch.empty((B, Kh, S, E), dtype=acc_dtype, device=device)
    dv = torch.empty((B, Kh, S, Ev), dtype=acc_dtype, device=device)
    cfg = backward_config(plan.out_dtype, E, Ev, gpu=ctx["gpu"])
    constexprs = dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_E=cfg.block_e, BLOCK_EV=cfg.block_ev,
        CAUSAL=ctx["causal"], MASK_KIND=ctx["mask_kind"], ACC_F64=acc_dtype == torch.float64,
        NATIVE_DOT=cfg.native_dot and plan.out_dtype in (torch.float16, torch.bfloat16),
        **ctx["flash_constexprs"],
    )
    q4, k4, v4, mask = ctx["q4"], ctx["k4"], ctx["v4"], ctx["mask"]
    inputs = [*q4.stride(), *k4.stride(), *v4.stride(), *ctx["m_strides"], *do4.stride()]
    tail = [ctx["scale"], ctx["causal_offset"], *ctx["flash_tail"]]
    dkdv = Launch("dkdv", (B * Kh, -(-S // cfg.block_n), 1),
                  [q4, k4, v4, mask, do4, plan.lse, delta, dk, dv, *inputs,
                   *dk.stride(), *dv.stride(), *ctx["alibi"], N, Kh, L, S, E, Ev, N // Kh, *tail],
                  constexprs, cfg.num_warps, cfg.num_stages)
    dq_launch = Launch("dq", (B * N, -(-L // cfg.block_m), 1),
                       [q4, k4, v4, mask, do4, plan.lse, delta, dq, *inputs,
                        *dq.stride(), *ctx["alibi"], N, L, S, E, Ev, N // Kh, *tail],
                       constexprs, cfg.num_warps, cfg.num_stages)
    return [dkdv, dq_launch], dq, dk, dv


def _run_forward(plan: LaunchPlan) -> torch.Tensor:
    if plan.out.numel() and plan.grid[1] > 0:
        with _launching():
            _attn_fwd_kernel[plan.grid](*plan.args, **plan.constexprs,
                                        num_warps=plan.num_warps, num_stages=plan.num_stages)
    elif plan.lse is not None:
        plan.lse.fill_(float("inf"))
    out = plan.out.view(plan.out_shape)
    return out if out.dtype == plan.out_dtype else out.to(plan.out_dtype)


_BACKWARD_KERNELS = {"dkdv": "_attn_bwd_dkdv_kernel", "dq": "_attn_bwd_dq_kernel"}


class _TritonAttentionFunction(torch.autograd.Function):
    """Forward and backward both in Triton kernels; gradients for q, k, v only."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, is_causal, scale, causal_alignment, planted_bug,
                flash_options):
        plan = plan_launch(query, key, value, attn_mask, is_causal, scale,
                           causal_alignment=causal_alignment, planted_bug=planted_bug, **flash_options)
        out = _run_forward(plan)
        ctx.plan = plan
        ctx.shapes = (query.shape, key.shape, value.shape)
        ctx.dtype = query.dtype
        ctx.save_for_backward(out)
        ctx.mark_non_differentiable(plan.lse)
        return out, plan.lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        (out,) = ctx.saved_tensors
        q_shape, k_shape, v_shape = ctx.shapes
        launches, dq, dk, dv = plan_backward(ctx.plan, grad_out, out)
        if dq.numel() or dk.numel():
            for launch in launches:
                if launch.grid[0] and launch.grid[1]:
                    kernel = globals()[_BACKWARD_KERNELS[launch.kernel]]
                    with _launching():
                        kernel[launch.grid](*launch.args, **launch.constexprs,
                                            num_warps=launch.num_warps, num_stages=launch.num_stages)
                elif launch.kernel == "dkdv":
                    dk.zero_(); dv.zero_()
                else:
                    dq.zero_()
        grads = (dq.view(q_shape), dk.view(k_shape), dv.view(v_shape))
        grads = tuple(g if g.dtype == ctx.dtype else g.to(ctx.dtype) for g in grads)
        return (*grads, None, None, None, None, None, None)


def _make_sdpa(causal_alignment: str, planted_bug: str | None):
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        _validate(query, key, value, attn_mask, dropout_p, enable_gqa)
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and attn_mask is not None and attn_mask.requires_grad:
            raise NotImplementedError(
                "the triton implementation has no gradient w.r.t. attn_mask "
                "(capabilities.mask_grad=False); pass attn_mask.detach()")
        if grad_enabled and any(t.requires_grad for t in (query, key, value)):
            return _TritonAttentionFunction.apply(query, key, value, attn_mask, is_causal, scale,
                                                  causal_alignment, planted_bug, {})[0]
        return _run_forward(plan_launch(query, key, value, attn_mask, is_causal, scale,
                                        causal_alignment=causal_alignment,
                                        planted_bug=planted_bug))

    sdpa.__name__ = "triton_sdpa"
    return sdpa


def _validate_flash(q, k, v, dropout_p, window_size, softcap, alibi_slopes) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor: q (B, L, N, E), k (B, S, K, E), "
                             f"v (B, S, K, Ev); got {getattr(t, 'shape', type(t).__name__)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q has batch B={q.shape[0]}, k B={k.shape[0]}; they must be equal")
    if len(tuple(window_size)) != 2 or any(int(side) != side or side < -1 for side in window_size):
        raise ValueError(f"window_size={tuple(window_size)}: use (left, right), each an int >= 0, "
                         "or -1 for unbounded")
    if not (softcap >= 0 and math.isfinite(softcap)):
        raise ValueError(f"softcap={softcap} must be a finite number >= 0 (0 = off)")
    _validate(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, dropout_p, True)
    if alibi_slopes is not None:
        B, N = q.shape[0], q.shape[2]
        if not isinstance(alibi_slopes, torch.Tensor) or tuple(alibi_slopes.shape) not in ((N,), (B, N)):
            raise ValueError(f"alibi_slopes shape={tuple(getattr(alibi_slopes, 'shape', ()))}; "
                             f"use (N,)=({N},) or (B, N)=({B}, {N})")
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes is on {alibi_slopes.device}, q on {q.device}")


def _make_flash(planted_bug: str | None):
    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
        """FlashAttention-2's ``flash_attn_func``, forward and backward (q, k, v): q (B, L, N, E), k (B, S, K, E),
        v (B, S, K, Ev) -> output (B, L, N, Ev); with ``return_attn_probs`` the tuple
        (output, softmax_lse (B, N, L) float32 (float64 for float64), None), +inf in rows
        attending no key, as FlashAttention-2. Causal and window align bottom-right."""
        _validate_flash(q, k, v, dropout_p, window_size, softcap, alibi_slopes)
        if alibi_slopes is not None and alibi_slopes.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError("the triton implementation has no gradient w.r.t. alibi_slopes; "
                                      "pass alibi_slopes.detach()")
        options = dict(window=tuple(int(side) for side in window_size), softcap=float(softcap),
                       alibi_slopes=alibi_slopes)
        # (B, L, N, E) -> (B, N, L, E): strided views, the kernel takes any strides
        heads_first = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            out, lse = _TritonAttentionFunction.apply(*heads_first, None, bool(causal), softmax_scale,
                                                      "lower_right", planted_bug, options)
        else:
            plan = plan_launch(*heads_first, None, bool(causal), softmax_scale,
                               causal_alignment="lower_right", planted_bug=planted_bug, **options)
            out, lse = _run_forward(plan), plan.lse
        out = out.transpose(1, 2).contiguous()  # (B, L, N, Ev)
        if not return_attn_probs:
            return out
        return out, lse, None

    flash_attn_func.__name__ = "triton_flash_attn_func"
    return flash_attn_func


def make_implementation(*, causal_alignment: str = "upper_left",
                        planted_bug: str | None = None) -> Implementation:
    """The Triton flash-attention forward as an SDPA-level Implementation.

    ``causal_alignment``: what ``is_causal=True`` means ("upper_left" = PyTorch,
    "lower_right" = FlashAttention). ``planted_bug``: None or one of
    ``PLANTED_BUGS`` (each described in docs/TRITON.md), for the bug zoo.
    """
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment={causal_alignment!r}; use one of {CAUSAL_ALIGNMENTS}")
    if planted_bug is not None and planted_bug not in PLANTED_BUGS:
        raise ValueError(f"planted_bug={planted_bug!r}; use None or one of {sorted(PLANTED_BUGS)}")
    name = "triton" if planted_bug is None else f"triton-{planted_bug.replace('_', '-')}"
    if triton is None:
        return Implementation(name=name, unavailable_reason=_IMPORT_ERROR, listed=planted_bug is None)
    interpreting = _interpreting()
    mismatch = _interpreter_mismatch()
    if mismatch is not None:
        return Implementation(name=name, listed=planted_bug is None, unavailable_reason=mismatch)
    if not interpreting and not torch.cuda.is_available():
        return Implementation(
            name=name, listed=planted_bug is None,
            unavailable_reason="TRITON_INTERPRET=0 and no CUDA device: the kernel cannot run")
    capabilities = Capabilities(
        devices=("cpu",) if interpreting else ("cuda",),
        dtypes=("float64", "float32", "float16", "bfloat16"),
        mask_kinds=ALL_MASK_KINDS,
        causal=causal_alignment,
        fully_masked="zero",
        different_v_dim=True,
        gqa=True,
        dropout=False,
        custom_scale=True,
        autograd=True,
        mask_grad=False,  # no d(additive mask): an attn_mask requiring grad raises
        non_contiguous=True,
        max_head_dim=MAX_HEAD_DIM,
        tf32=False,
    )
    flash_capabilities = capabilities.replace(
        mask_kinds=frozenset({"none"}),
        causal="lower_right",
        flash_features=frozenset({"window", "softcap", "alibi", "lse"}),
    )
    mode = "interpreter (CPU)" if interpreting else "compiled (CUDA)"
    description = (f"Triton flash-attention forward + backward, {mode}, causal={causal_alignment}; "
                   "flash level (window, softcap, ALiBi, LSE)"
                   + (f", planted bug {planted_bug!r}" if planted_bug else ""))
    return Implementation(
        name=name,
        capabilities=capabilities,
        sdpa=_make_sdpa(causal_alignment, planted_bug),
        flash=_make_flash(planted_bug),
        flash_capabilities=flash_capabilities,
        version=f"0.1+triton{triton.__version__}",
        description=description,
        listed=planted_bug is None,
    )
