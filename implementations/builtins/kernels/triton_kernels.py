"""The Triton kernels of the triton built-in: the forward (output and LSE) and the two
backward kernels (dk and dv by key block, dq by query block), written flash-attention
style, with the masks, the causal flag in either alignment, a sliding window,
soft-capping and ALiBi as constexpr switches, and the bug zoo's planted bugs (``BUG``).

Launched by ``implementations.builtins.kernels.triton_attention`` from the plans of
``triton_launch``; docs/TRITON.md describes them and the interpreter's traps they avoid.
When triton is not installed this module defines no kernel.
"""

from __future__ import annotations

from implementations.builtins.kernels.triton_runtime import libdevice, tl, triton

__all__: list[str] = []

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
