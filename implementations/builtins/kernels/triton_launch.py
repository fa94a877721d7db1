"""Planning a launch of the triton built-in's kernels: the inputs checked, viewed as 4-D
with their strides, the block sizes of each dtype and head dim (:func:`kernel_config`,
:func:`backward_config`), and every argument and constexpr of the forward launch
(:func:`plan_launch`) and of the two backward launches (:func:`plan_backward`).

Planning needs no kernel and no GPU: the tests read the plans as data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from implementations.builtins.pytorch._torch_common import contiguous_strides

__all__ = ["MAX_HEAD_DIM", "PLANTED_BUGS", "KernelConfig", "Launch", "LaunchPlan", "backward_config",
           "kernel_config", "plan_backward", "plan_launch"]

#: planted_bug name -> the ``BUG`` constexpr the kernel sees (0: none).
PLANTED_BUGS = {"drop_ragged_block": 1, "no_rescale": 2, "ignore_strides": 3, "window_left_off_by_one": 4}
#: Largest head dim (E and Ev) the kernel accepts: BLOCK_E up to 256.
MAX_HEAD_DIM = 256
#: ``MASK_KIND`` constexpr values.
MASK_NONE, MASK_BOOL, MASK_ADDITIVE = 0, 1, 2


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
