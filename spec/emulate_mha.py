"""A naive ``nn.MultiheadAttention`` call computed in low-precision arithmetic.

The module-level counterpart of :func:`spec.emulate_sdpa`: the error yardstick for the
tolerance of a whole module call. It mirrors :func:`spec.mha_forward` step by step (same
arguments, checks and mask conventions: bool **True = blocked**, float added) with every
operation's result rounded to ``dtype``:

1. each input projection is a matmul accumulated in float32 for the 16-bit dtypes (in
   ``dtype`` itself for float32/float64), rounded, then its bias added and rounded;
2-4. bias_k/bias_v and add_zero_attn append their keys as in the oracle (exact values);
5-6. the attention of each head is :func:`spec.emulate_sdpa`'s naive computation;
7. heads merged, out_proj computed like an input projection; averaged weights are the
   head mean, accumulated and rounded once.

Parameters and inputs are rounded to ``dtype`` first (values already stored in it are
unchanged). With "float64" the result equals the oracle to the last bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _checks, masks
from ._sdpa import prepare
from .emulate import EMULATED_DTYPES, _rounder, attend
from .errors import fail
from .mha import MHAParams, _check_masks, _inputs, _pad_key

__all__ = ["MHASteps", "emulate_mha", "emulate_mha_steps"]


@dataclass(frozen=True)
class MHASteps:
    """The intermediate values of one module call, float64, batch-first inside.

    ``query`` (B, N, L, hd), ``key`` and ``value`` (B, N, S', hd) after the projections
    and the appended bias_kv / zero-attn keys; ``additive`` the merged additive mask
    broadcastable to (B, N, L, S') or None; ``scale`` 1/sqrt(hd); ``weights``
    (B, N, L, S'); ``attended`` (B, N, L, hd) the per-head attention output; ``output``
    (B, L, D) the module output. :meth:`layout` turns a (B, L, D) array into the caller's
    layout, :meth:`weights_layout` a (B, N, L, S') one into the returned weights' form.
    """

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    additive: np.ndarray | None
    scale: float
    weights: np.ndarray
    attended: np.ndarray
    output: np.ndarray
    batched: bool
    batch_first: bool

    def layout(self, x: np.ndarray) -> np.ndarray:
        """(B, L, ...) -> (L, B, ...) / (B, L, ...) with batch_first / (L, ...) unbatched."""
        if not self.batched:
            return x[0]
        return x if self.batch_first else np.swapaxes(x, 0, 1)

    def weights_layout(self, x: np.ndarray, *, average: bool, dtype: str = "float64") -> np.ndarray:
        """(B, N, L, S') -> (B, L, S') averaged over heads (accumulated, rounded once to
        ``dtype``) or kept per head; no B unbatched."""
        if average:
            store, accumulate = _rounder(dtype)
            x = store(np.asarray(x, dtype=accumulate).mean(axis=1)).astype(np.float64)
        return x if self.batched else x[0]


def _project(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, dtype: str) -> np.ndarray:
    """``x @ weightᵀ + bias`` the naive way: accumulated matmul rounded, bias add rounded."""
    store, accumulate = _rounder(dtype)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        y = store(store(x).astype(accumulate) @ store(weight).astype(accumulate).T)
        if bias is not None:
            y = store(y + store(bias))
    return y.astype(np.float64)


def emulate_mha_steps(params: MHAParams, query: Any, key: Any, value: Any, *, dtype: str,
                      key_padding_mask: Any = None, attn_mask: Any = None, is_causal: bool = False,
                      batch_first: bool = False, fully_masked: str = "zero") -> MHASteps:
    """Every intermediate of a naive ``dtype`` module call (see :class:`MHASteps`).

    Same arguments as :func:`emulate_mha`, without the weights options."""
    _checks.check_choice("dtype", dtype, tuple(EMULATED_DTYPES))
    _checks.check_policy(fully_masked)
    if not isinstance(params, MHAParams):
        fail("params", params, "must be a spec.MHAParams", "build one with spec.MHAParams(...)")
    q_in, k_in, v_in, batched = _inputs(params, query, key, value, batch_first)
    B, L, D = q_in.shape
    S, N, hd = k_in.shape[1], params.num_heads, params.head_dim
    key_padding_mask, attn_mask = _check_masks(key_padding_mask, attn_mask, batched, B, N, L, S)
    if is_causal and attn_mask is None:
        fail("is_causal", is_causal, "nn.MultiheadAttention treats is_causal as a hint and needs attn_mask",
             "also pass attn_mask=spec.masks.to_mha_bool(spec.masks.causal_mask(L, S, 'upper_left'))")
    # 1. input projections, rounded as a naive linear layer      (B, L, D), (B, S, D), (B, S, D)
    (w_q, w_k, w_v), (b_q, b_k, b_v) = params.projection_weights(), params.projection_biases()
    has_bias = params.in_proj_bias is not None
    q = _project(q_in, w_q, b_q if has_bias else None, dtype)
    k = _project(k_in, w_k, b_k if has_bias else None, dtype)
    v = _project(v_in, w_v, b_v if has_bias else None, dtype)
    # 2. bias_k / bias_v: one more key and value; masks get an attended column
    if params.bias_k is not None:
        store, _ = _rounder(dtype)
        bias_k, bias_v = (store(b[0]).astype(np.float64) for b in (params.bias_k, params.bias_v))
        k = np.concatenate([k, np.broadcast_to(bias_k, (B, 1, D))], axis=1)  # (B, S+1, D)
        v = np.concatenate([v, np.broadcast_to(bias_v, (B, 1, D))], axis=1)  # (B, S+1, D)
        attn_mask, key_padding_mask = _pad_key(attn_mask), _pad_key(key_padding_mask)
    # 3. split heads                                             (B, L, D) -> (B, N, L, hd)
    q = q.reshape(B, L, N, hd).transpose(0, 2, 1, 3)
    k = k.reshape(B, -1, N, hd).transpose(0, 2, 1, 3)             # (B, N, S', hd)
    v = v.reshape(B, -1, N, hd).transpose(0, 2, 1, 3)             # (B, N, S', hd)
    # 4. add_zero_attn: a zero key and value after everything else (in head space)
    if params.add_zero_attn:
        k = np.concatenate([k, np.zeros((B, N, 1, hd))], axis=2)  # (B, N, S'+1, hd)
        v = np.concatenate([v, np.zeros((B, N, 1, hd))], axis=2)
        attn_mask, key_padding_mask = _pad_key(attn_mask), _pad_key(key_padding_mask)
    # 5. one additive mask, broadcastable to (B, N, L, S')
    additive = masks.merge_key_padding(key_padding_mask, attn_mask, num_heads=N)
    # 6. the naive attention of each head, scale 1/sqrt(hd)     (B, N, L, hd)
    problem = prepare(q, k, v, additive_mask=additive)
    attended, weights = attend(problem, dtype, fully_masked)
    attended, weights = attended.astype(np.float64), weights.astype(np.float64)
    # 7. merge heads and project out                            (B, N, L, hd) -> (B, L, D)
    merged = attended.transpose(0, 2, 1, 3).reshape(B, L, D)
    output = _project(merged, params.out_proj_weight, params.out_proj_bias, dtype)
    return MHASteps(query=q, key=k, value=v, additive=additive, scale=problem.scale,
                    weights=weights, attended=attended, output=output, batched=batched,
                    batch_first=batch_first)


def emulate_mha(params: MHAParams, query: Any, key: Any, value: Any, *, dtype: str,
                key_padding_mask: Any = None, attn_mask: Any = None, need_weights: bool = True,
                average_attn_weights: bool = True, is_causal: bool = False,
                batch_first: bool = False,
                fully_masked: str = "zero") -> tuple[np.ndarray, np.ndarray | None]:
    """``(output, weights)`` of a naive ``nn.MultiheadAttention`` call in ``dtype``, as
    float64 values of ``dtype``.

    Arguments, shapes and mask conventions as :func:`spec.mha_forward` (bool True =
    blocked, float added; ``is_causal`` a hint that needs ``attn_mask``). ``dtype`` is one
    of "float64", "float32", "float16", "bfloat16".
    """
    steps = emulate_mha_steps(params, query, key, value, dtype=dtype,
                              key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                              is_causal=is_causal, batch_first=batch_first,
                              fully_masked=fully_masked)
    output = steps.layout(steps.output)
    if not need_weights:
        return output, None
    return output, steps.weights_layout(steps.weights, average=average_attn_weights, dtype=dtype)
