"""Shared pieces of the SDPA variants: the oracle with changed arguments, masks, a plain softmax.

Dimension letters: B batch, N query heads, K kv heads, L query length, S key length,
E q/k head dim, Ev value head dim.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import masks
from .._sdpa import prepare, sdpa
from ._core import SDPAProblem, VariantResult

__all__ = ["declared_policy", "oracle_with", "reference", "allowed_keys", "blocks_differ", "scores_of",
           "apply_policy", "softmax", "sdpa_of", "finish", "magnitude", "compute_dtype", "valid_rows"]


def declared_policy(p: SDPAProblem) -> str:
    """The policy fully-masked rows get ("unspecified" leaves them free: zero is as good as any)."""
    return "zero" if p.fully_masked == "unspecified" else p.fully_masked


def oracle_with(p: SDPAProblem, *, key: Any = None, value: Any = None, **changes: Any) -> VariantResult:
    """The oracle on ``p`` with some of its arguments changed."""
    args = dict(attend_mask=p.attend_mask, additive_mask=p.additive_mask, causal=p.causal,
                scale=p.scale, fully_masked=declared_policy(p))
    args.update(changes)
    result = sdpa(p.query, p.key if key is None else key, p.value if value is None else value, **args)
    return VariantResult(result.output, result.weights)


def sdpa_of(p: SDPAProblem, *, query: Any, key: Any, value: Any, **changes: Any) -> VariantResult:
    """The oracle on other q, k, v (same masks, scale and policy unless changed)."""
    args = dict(attend_mask=p.attend_mask, additive_mask=p.additive_mask, causal=p.causal,
                scale=p.scale, fully_masked=declared_policy(p))
    args.update(changes)
    result = sdpa(query, key, value, **args)
    return VariantResult(result.output, result.weights)


def reference(p: SDPAProblem) -> VariantResult:
    """The correct convention: :func:`spec.sdpa` under the declared policy, no dropout."""
    return oracle_with(p)


def allowed_keys(p: SDPAProblem, **changes: Any) -> np.ndarray:
    """Bool (B, N, L, S), True = may attend, with some mask arguments changed."""
    args = dict(attend_mask=p.attend_mask, additive_mask=p.additive_mask, causal=p.causal)
    args.update(changes)
    B, N, L, _ = p.query.shape
    return masks.combined_attend_mask((B, N, L, p.key.shape[2]), **args)


def blocks_differ(p: SDPAProblem, **changes: Any) -> bool:
    """Whether changing the mask arguments changes which keys some query may attend."""
    return bool((allowed_keys(p, **changes) != allowed_keys(p)).any())


def scores_of(p: SDPAProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(logits, scores, allowed, value)``: (B, N, L, S) ×3 and (B, N, S, Ev), kv heads repeated."""
    prepared = prepare(p.query, p.key, p.value, attend_mask=p.attend_mask,
                       additive_mask=p.additive_mask, causal=p.causal, scale=p.scale)
    logits = prepared.scale * (prepared.query @ np.swapaxes(prepared.key, -1, -2))
    scores = logits if prepared.additive is None else logits + prepared.additive
    return logits, scores, prepared.allowed, prepared.value


def apply_policy(weights: np.ndarray, empty: np.ndarray, policy: str) -> np.ndarray:
    """Rows with no attendable key (``empty`` (..., 1)) get the policy's weights."""
    fill = {"zero": 0.0, "nan": np.nan, "uniform": 1.0 / weights.shape[-1]}[policy]
    return np.where(empty, fill, weights)


def softmax(scores: np.ndarray, allowed: np.ndarray, policy: str, dtype: Any = np.float64) -> np.ndarray:
    """Plain softmax over the allowed keys in ``dtype``, as float64 weights (..., L, S).

    NaN and +inf scores propagate as in any implementation (the row becomes NaN).
    """
    empty = ~allowed.any(axis=-1, keepdims=True)                         # (..., L, 1)
    with np.errstate(all="ignore"):
        masked = np.where(allowed, scores, -np.inf).astype(dtype)
        row_max = np.where(empty, 0, masked.max(axis=-1, keepdims=True)).astype(dtype)
        unnormalised = np.exp(masked - row_max)
        total = unnormalised.sum(axis=-1, keepdims=True)
        weights = (unnormalised / np.where(empty, 1, total).astype(dtype)).astype(np.float64)
    return apply_policy(weights, empty, policy)


def finish(weights: np.ndarray, value: np.ndarray, slack: Any = 0.0) -> VariantResult:
    with np.errstate(all="ignore"):
        return VariantResult(weights @ value, weights, slack)


def magnitude(weights: np.ndarray, value: np.ndarray) -> np.ndarray:
    """``weights @ |V|``: the size of what each output element sums (0 where unknown)."""
    with np.errstate(all="ignore"):
        return np.nan_to_num(np.abs(weights) @ np.abs(value), nan=0.0, posinf=0.0)


def compute_dtype(p: SDPAProblem) -> Any:
    """What the softmax runs in: float64 for float64, float32 for everything else."""
    return np.float64 if p.dtype == "float64" else np.float32


def valid_rows(p: SDPAProblem) -> np.ndarray:
    """Bool (B, N, L, 1): rows with at least one attendable key."""
    return allowed_keys(p).any(axis=-1, keepdims=True)                       # (B, N, L, 1)
