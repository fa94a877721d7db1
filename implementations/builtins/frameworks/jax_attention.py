"""``jax.nn.dot_product_attention`` on the CPU, registered as ``jax``.

An instance of the framework bridge (:mod:`implementations.bridge`), with its
capabilities declared rather than probed: torch tensors go to NumPy (bfloat16 through
``ml_dtypes``), then to JAX; the output comes back the same way, with the query's dtype
and device; query, key and value are transposed to JAX's layout (B, L, N, E) and the
output back (``layout="BLNE"``).

How SDPA's arguments map (read from ``jax/_src/nn/functions.py``, jax 0.10):

* a bool ``attn_mask`` (True = may attend) is JAX's ``mask`` (the same polarity);
  a float one is JAX's ``bias`` (added to the scaled logits);
* ``is_causal`` is JAX's ``is_causal``: ``tril(ones(L, S))``, PyTorch's upper-left
  alignment;
* ``scale`` is passed through (None: JAX's own 1/sqrt(E));
* GQA: JAX takes K < N directly (query head h reads kv head h // (N/K));
  ``enable_gqa`` is accepted and not needed;
* value must have key's shape, so Ev != E is not supported;
* gradients: the bridge's ``torch.autograd.Function``, whose backward is ``jax.vjp`` of
  the same call (q, k, v and the additive mask).

Fully-masked rows, declared per kind (``Capabilities.fully_masked``): keys blocked by
the bool mask (or the causal flag) get a large finite negative logit rather than -inf,
so a row whose keys are all blocked comes out uniform, while a row whose additive mask
is -inf everywhere comes out NaN. The measured deviation (``implementations/xfail/jax.toml``,
re-measured by ``tests/implementations/test_jax_deviations.py``): JAX computes the
softmax in float32 whatever the input dtype.

float64 needs JAX's ``jax_enable_x64``: the bridge's JAX framework switches it on around
each float64 call only (``jax.enable_x64``, thread-local), so the other dtypes run as JAX
runs by default.

Each dtype runs as one jitted function: every new (shape, dtype, mask kind, causal)
combination costs one XLA compilation (0.1-0.5 s on a CPU). float16 is compiled with its
matmul at the default precision, the retry JAX's own eager call makes on a CPU (see
``_jit_for``); a shape whose compilation still fails (some bfloat16 shapes) runs op by op.
``capabilities.jit`` says so, and the compile budget in the strategies keeps the count of
distinct configurations small.

Dimension letters: B batch, N query heads, K key/value heads, L query length,
S key length, E head dim.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from implementations.base import Capabilities, Implementation

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
    return Implementation(
        name="jax",
        capabilities=CAPABILITIES,
        sdpa=jax_sdpa(jax),
        version=f"jax {jax.__version__}",
        description="jax.nn.dot_product_attention (XLA, CPU) through a NumPy bridge; "
        "jitted (one compilation per new configuration; float16's matmul at the default precision, "
        "as JAX's eager call retries it on a CPU; a shape XLA refuses runs op by op)",
    )


def _jit_for(dtype: torch.dtype) -> bool | str:
    """Measured on jax 0.10.2, CPU: under ``jax.jit``, dot_product_attention's 16-bit
    matmuls (precision F16_F16_F32 / BF16_BF16_F32) raise "not supported by dot_general
    on CPU" for every float16 shape and "Algorithm not supported by the
    ElementalIrEmitter" for some bfloat16 shapes with B = N = 1 (L = S = 1; L or S = 1
    with E = 1). Called eagerly, the function catches the error (its own ``try``) and
    calls the same einsum at the default precision. So float16 is compiled with that
    retry made ahead (``"default-precision"``: the refused precision rewritten to the
    default in the traced program, what the eager call computes), and bfloat16 is jitted
    with an eager fallback for the shapes the compiler refuses (``"fallback"``: the
    jitted call computes with the explicit precision, as the eager call does wherever
    that precision compiles); both fall back to the eager call for a shape that still
    does not compile."""
    if dtype == torch.float16:
        return "default-precision"
    return "fallback" if dtype == torch.bfloat16 else True


def jax_sdpa(jax: Any) -> Callable[..., torch.Tensor]:
    """``jax.nn.dot_product_attention`` behind torch SDPA's signature: the framework
    bridge (layout BLNE, jitted per :func:`_jit_for`)."""
    from implementations.bridge import make_bridge

    return make_bridge(jax.nn.dot_product_attention, "jax", layout="BLNE", jit=_jit_for,
                       origin="jax.nn.dot_product_attention")
