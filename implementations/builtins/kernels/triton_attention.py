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

The module is split by job: importing Triton (``triton_runtime``), the kernels
(``triton_kernels``), planning a launch (``triton_launch``); here the launches, autograd
and the implementation. Their public names are importable from here.
"""

from __future__ import annotations

import math

import torch

from implementations.base import (
    ALL_MASK_KINDS,
    CAUSAL_ALIGNMENTS,
    Capabilities,
    Implementation,
)
from implementations.builtins.kernels.triton_launch import (
    MAX_HEAD_DIM,
    PLANTED_BUGS,
    KernelConfig,
    Launch,
    LaunchPlan,
    _validate,
    backward_config,
    kernel_config,
    plan_backward,
    plan_launch,
)
from implementations.builtins.kernels.triton_runtime import (
    _IMPORT_ERROR,
    _interpreter_mismatch,
    _interpreting,
    _launching,
    triton,
)

if triton is not None:  # the backward kernels by name (_BACKWARD_KERNELS); tests read all three off here
    from implementations.builtins.kernels.triton_kernels import (  # noqa: F401
        _attn_bwd_dkdv_kernel,
        _attn_bwd_dq_kernel,
        _attn_fwd_kernel,
    )

__all__ = ["MAX_HEAD_DIM", "PLANTED_BUGS", "KernelConfig", "Launch", "LaunchPlan", "backward_config",
           "kernel_config", "make_implementation", "plan_backward", "plan_launch"]


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
