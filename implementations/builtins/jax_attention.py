"""``jax.nn.dot_product_attention`` on the CPU, registered as ``jax``.

A NumPy bridge gives it torch SDPA's calling convention: torch tensors go to NumPy
(bfloat16 through ``ml_dtypes``), then to JAX; the output comes back the same way,
with the query's dtype and device. The transposes to JAX's layout (B, L, N, E) happen
inside the JAX function, so the bridge copies nothing but the arrays themselves.

How SDPA's arguments map (read from ``jax/_src/nn/functions.py``, jax 0.10):

* a bool ``attn_mask`` (True = may attend) is JAX's ``mask`` (the same polarity);
  a float one is JAX's ``bias`` (added to the scaled logits);
* ``is_causal`` is JAX's ``is_causal``: ``tril(ones(L, S))``, PyTorch's upper-left
  alignment;
* ``scale`` is passed through (None: JAX's own 1/sqrt(E));
* GQA: JAX takes K < N directly (query head h reads kv head h // (N/K));
  ``enable_gqa`` is accepted and not needed;
* value must have key's shape, so Ev != E is not supported;
* gradients: a ``torch.autograd.Function`` whose backward is ``jax.vjp`` of the same
  function (q, k, v and the additive mask).

Fully-masked rows, declared per kind (``Capabilities.fully_masked``): keys blocked by
the bool mask (or the causal flag) get a large finite negative logit rather than -inf,
so a row whose keys are all blocked comes out uniform, while a row whose additive mask
is -inf everywhere comes out NaN. The measured deviation (``implementations/xfail/jax.toml``,
re-measured by ``tests/implementations/test_jax_deviations.py``): JAX computes the
softmax in float32 whatever the input dtype.

Enabling float64 needs ``jax_enable_x64``, a process-wide JAX setting: building this
implementation switches it on (before JAX's first use in a certification run).

float32 and float64 run as one jitted function: every new (shape, dtype, mask kind,
causal) combination costs one XLA compilation (0.1-0.5 s on a CPU). float16 and
bfloat16 run op by op, because ``jax.jit`` of this function fails on the CPU for them
(see ``_functions_for``), which costs more per new shape. ``capabilities.jit`` says
so, and a shape budget in the strategies keeps the count of distinct shapes small.

Dimension letters: B batch, N query heads, K key/value heads, L query length,
S key length, E head dim.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from implementations.base import Capabilities, Implementation
from implementations.builtins._torch_common import flatten_batch

__all__ = ["CAPABILITIES", "make_implementation"]

CAPABILITIES = Capabilities(
    devices=("cpu",),
    dtypes=("float64", "float32", "float16", "bfloat16"),
    causal="upper_left",
    # Blocked keys get a finite large negative logit from a bool mask or the causal flag
    # (a row with every key blocked is uniform), while a -inf bias is added as given (NaN).
    fully_masked={"bool": "uniform", "additive": "nan", "causal": "uniform"},
    different_v_dim=False,
    gqa=True,
    dropout=False,
    custom_scale=True,
    autograd=True,
    mask_grad=True,
    non_contiguous=True,
    jit=True,
)


def make_implementation() -> Implementation:
    """The ``jax`` built-in, or an unavailable one saying why (jax not installed)."""
    try:
        import jax
    except ImportError as exc:
        return Implementation(
            name="jax",
            capabilities=CAPABILITIES,
            unavailable_reason=f"jax is not importable ({exc}); pip install 'attention-conformance[jax]'",
        )
    jax.config.update("jax_enable_x64", True)  # float64 arrays stay float64
    return Implementation(
        name="jax",
        capabilities=CAPABILITIES,
        sdpa=flatten_batch(jax_sdpa),
        version=f"jax {jax.__version__}",
        description="jax.nn.dot_product_attention (XLA, CPU) through a NumPy bridge; "
        "jitted for float32/float64 (one compilation per new shape), op by op for float16/bfloat16",
    )


# --------------------------------------------------------------------------- torch <-> NumPy


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy array with the tensor's values and dtype (bfloat16 as ml_dtypes')."""
    t = tensor.detach().cpu().resolve_conj().resolve_neg()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _to_torch(array: Any, like: torch.Tensor) -> torch.Tensor:
    """A torch tensor with ``array``'s values, on ``like``'s device."""
    host = np.array(array)  # a writable copy: JAX's buffers are read-only
    if like.dtype == torch.bfloat16:
        return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16).to(like.device)
    return torch.from_numpy(host).to(like.device)


# --------------------------------------------------------------------------- the jitted core


@functools.cache
def _functions(jitted: bool) -> tuple[Any, Any]:
    """(forward, vjp), jitted or not; built on first use so that importing needs no jax."""
    import jax
    import jax.numpy as jnp

    def forward(query, key, value, bias, mask, scale, is_causal):
        # (B, N, L, E) -> JAX's (B, L, N, E) and back
        out = jax.nn.dot_product_attention(
            jnp.swapaxes(query, 1, 2), jnp.swapaxes(key, 1, 2), jnp.swapaxes(value, 1, 2),
            bias=bias, mask=mask, scale=scale, is_causal=is_causal,
        )
        return jnp.swapaxes(out, 1, 2)

    def vjp(query, key, value, bias, mask, scale, is_causal, grad_output):
        def differentiable(q, k, v, b):
            return forward(q, k, v, b, mask, scale, is_causal)

        _, pullback = jax.vjp(differentiable, query, key, value, bias)
        return pullback(grad_output)

    if not jitted:
        return forward, vjp
    return (jax.jit(forward, static_argnames=("is_causal",)),
            jax.jit(vjp, static_argnames=("is_causal",)))


def _functions_for(dtype: torch.dtype) -> tuple[Any, Any]:
    """float16 and bfloat16 run op by op (measured on jax 0.10.2, CPU): under
    ``jax.jit``, dot_product_attention's 16-bit matmuls (precision F16_F16_F32 /
    BF16_BF16_F32) raise "not supported by dot_general on CPU" for every float16
    shape and "Algorithm not supported by the ElementalIrEmitter" for some bfloat16
    shapes with B = N = 1 (L = S = 1; L or S = 1 with E = 1). Called eagerly, JAX
    catches the error and retries at the default precision."""
    return _functions(jitted=dtype not in (torch.float16, torch.bfloat16))


class _JaxAttention(torch.autograd.Function):
    """JAX's forward, and ``jax.vjp`` as the backward (q, k, v, additive mask)."""

    @staticmethod
    def forward(ctx, query, key, value, bias, mask, scale, is_causal):
        arrays = [None if t is None else _to_numpy(t) for t in (query, key, value, bias, mask)]
        forward, _ = _functions_for(query.dtype)
        ctx.arrays, ctx.scale, ctx.is_causal = arrays, scale, is_causal
        ctx.like = (query, key, value, bias)
        return _to_torch(forward(*arrays, scale, is_causal=is_causal), query)

    @staticmethod
    def backward(ctx, grad_output):
        _, vjp = _functions_for(ctx.like[0].dtype)
        q, k, v, b, m = ctx.arrays
        grad = _to_numpy(grad_output.to(ctx.like[0].dtype))
        grads = vjp(q, k, v, b, m, ctx.scale, ctx.is_causal, grad)
        out = [None if g is None or like is None else _to_torch(g, like)
               for g, like in zip(grads, ctx.like, strict=False)]
        return (*out, None, None, None)


def jax_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
    """torch SDPA's signature on 4-D tensors, computed by ``jax.nn.dot_product_attention``."""
    if dropout_p:
        raise NotImplementedError("jax.nn.dot_product_attention has no dropout; dropout_p must be 0")
    bias = mask = None
    if attn_mask is not None:
        full = (*query.shape[:-1], key.shape[-2])  # (B, N, L, S): JAX wants N = 1 or N
        if attn_mask.dtype == torch.bool:
            mask = attn_mask.expand(full)
        else:
            bias = attn_mask.expand(full)
    jax_scale = None if scale is None else np.float64(scale)
    return _JaxAttention.apply(query, key, value, bias, mask, jax_scale, bool(is_causal))
