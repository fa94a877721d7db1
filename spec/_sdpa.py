"""The float64 oracle for scaled dot-product attention and its closed-form VJP.

Dimension letters: B batch (any number of leading dims, written ``...``), N query heads,
K key/value heads, L query length, S key length, E q/k head dim, Ev value head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from . import _checks, masks
from ._flash_checks import sinks_array
from .errors import fail

__all__ = ["SDPAResult", "SDPAGrads", "sdpa", "sdpa_vjp"]


class SDPAResult(NamedTuple):
    """``output`` (..., N, L, Ev), ``weights`` (..., N, L, S), ``logits`` (..., N, L, S).

    ``logits`` is ``scale * q @ kᵀ`` with the kv heads repeated, before any mask.
    """

    output: np.ndarray
    weights: np.ndarray
    logits: np.ndarray


class SDPAGrads(NamedTuple):
    """Gradients of a scalar loss through SDPA, each with its input's shape.

    ``dquery`` (..., N, L, E), ``dkey`` (..., K, S, E), ``dvalue`` (..., K, S, Ev),
    ``dadditive_mask`` with the additive mask's own shape, or None without one.
    """

    dquery: np.ndarray
    dkey: np.ndarray
    dvalue: np.ndarray
    dadditive_mask: np.ndarray | None


@dataclass(frozen=True)
class Problem:
    """A validated SDPA call: float64 arrays, kv heads already repeated to N."""

    query: np.ndarray          # (..., N, L, E)
    key: np.ndarray            # (..., N, S, E)   kv heads repeated
    value: np.ndarray          # (..., N, S, Ev)  kv heads repeated
    allowed: np.ndarray        # (..., N, L, S)   True = may attend (bool, causal, -inf merged)
    additive: np.ndarray | None  # broadcastable to (..., N, L, S), float64, no NaN/+inf
    additive_shape: tuple[int, ...] | None
    scale: float
    group: int                 # N // K query heads per kv head
    sinks: np.ndarray | None = None  # (N, 1, 1) learned sink logits, None = no sink


def prepare(query: Any, key: Any, value: Any, *, attend_mask: Any = None,
            additive_mask: Any = None, causal: str | None = None,
            scale: float | None = None, sinks: Any = None) -> Problem:
    """Validate an SDPA call and bring it to float64 with the kv heads repeated."""
    q = _checks.as_float64("query", query)
    k = _checks.as_float64("key", key)
    v = _checks.as_float64("value", value)
    _checks.check_rank("query", q, 3, "(..., N, L, E)")
    _checks.check_rank("key", k, 3, "(..., K, S, E)")
    _checks.check_rank("value", v, 3, "(..., K, S, Ev)")
    *batch, N, L, E = q.shape
    *kbatch, K, S, Ek = k.shape
    if tuple(kbatch) != tuple(batch) or v.shape[:-1] != k.shape[:-1]:
        fail("key", k, f"leading dims and (K, S) must match query's leading dims {tuple(batch)} "
             f"and value's {v.shape[:-1]}", "give query, key and value the same batch dims, and key "
             "and value the same (K, S)")
    if Ek != E:
        fail("key", k, f"last dim E={Ek} must equal query's E={E}", "project q and k to the same head dim")
    for name, size in (("N", N), ("K", K), ("S", S), ("E", E)):
        if size < 1:
            fail(name, size, "must be >= 1", "pass non-empty heads, keys and head dims")
    if N % K != 0:
        fail("key", k, f"query heads N={N} must be a multiple of kv heads K={K} (GQA)",
             "use a K that divides N (K == N is plain multi-head attention)")
    _checks.check_causal(causal)
    scale = _checks.resolve_scale(scale, E)
    target, letters = (*batch, N, L, S), "(..., N, L, S)"
    if attend_mask is not None:
        attend_mask = _checks.attend_mask_array(attend_mask, target, letters)
    additive_shape = None
    if additive_mask is not None:
        additive_mask = _checks.additive_mask_array(additive_mask, target, letters)
        additive_shape = additive_mask.shape
    group = N // K
    return Problem(
        query=q,
        key=np.repeat(k, group, axis=-3),     # (..., K, S, E) -> (..., N, S, E), repeat_interleave
        value=np.repeat(v, group, axis=-3),   # (..., K, S, Ev) -> (..., N, S, Ev)
        allowed=masks.combined_attend_mask(target, attend_mask, additive_mask, causal),
        additive=additive_mask,
        additive_shape=additive_shape,
        scale=scale,
        group=group,
        sinks=None if sinks is None else sinks_array(sinks, N).reshape(N, 1, 1),
    )


def attention_weights(problem: Problem, fully_masked: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps 1-4 of the oracle: ``(weights, logits)``, both (..., N, L, S)."""
    p = problem
    # 1. logits = scale · q kᵀ                                   (..., N, L, S)
    logits = p.scale * (p.query @ np.swapaxes(p.key, -1, -2))
    # 2. scores = logits + additive mask; blocked keys -> -inf   (..., N, L, S)
    scores = logits if p.additive is None else logits + p.additive
    scores = np.where(p.allowed, scores, -np.inf)
    # 3. subtract each row's max over attended keys, so exp never overflows
    empty_row = ~p.allowed.any(axis=-1, keepdims=True)           # (..., N, L, 1)
    row_max = np.where(empty_row, 0.0, scores.max(axis=-1, keepdims=True))
    if p.sinks is not None:  # a sink joins the max (exp never overflows) and the denominator
        row_max = np.where(empty_row, p.sinks, np.maximum(row_max, p.sinks))
    with np.errstate(over="ignore", under="ignore"):
        unnormalised = np.exp(scores - row_max)                  # (..., N, L, S), blocked = 0
        sink_term = None if p.sinks is None else np.exp(p.sinks - row_max)   # <= 1
    # 4. normalise; rows with no attended key follow the policy (with a sink: 0, all the
    #    row's weight is on the sink, which carries no value and is dropped)
    total = unnormalised.sum(axis=-1, keepdims=True)             # (..., N, L, 1), >= 1 if any key
    if sink_term is not None:
        return unnormalised / (total + sink_term), logits
    weights = unnormalised / np.where(empty_row, 1.0, total)
    if fully_masked == "nan":
        weights = np.where(empty_row, np.nan, weights)
    elif fully_masked == "uniform":
        weights = np.where(empty_row, 1.0 / weights.shape[-1], weights)
    return weights, logits


def sdpa(query: Any, key: Any, value: Any, *, attend_mask: Any = None,
         additive_mask: Any = None, causal: str | None = None, scale: float | None = None,
         fully_masked: str = "zero", sinks: Any = None) -> SDPAResult:
    """Scaled dot-product attention, the float64 reference.

    Shapes: ``query`` (..., N, L, E), ``key`` (..., K, S, E), ``value`` (..., K, S, Ev);
    any number of leading batch dims ``...`` (the same for all three).

    * ``attend_mask``: bool, broadcastable to (..., N, L, S); **True = the query may attend
      the key**, False = blocked.
    * ``additive_mask``: float, broadcastable to (..., N, L, S), **added** to the scaled
      scores; -inf blocks, finite values bias. Both masks may be given together.
    * ``causal``: None, ``"upper_left"`` (query i sees keys j <= i; PyTorch ``is_causal``)
      or ``"lower_right"`` (j <= i + S - L; FlashAttention).
    * ``scale``: None means 1/sqrt(E) (E of q/k, never Ev); a number multiplies q·kᵀ as given
      (0 and negative allowed, NaN/inf raise).
    * GQA: K may divide N; query head h uses kv head ``h // (N // K)`` (repeat_interleave).
    * ``fully_masked``: what a query row that may attend no key gives:
      ``"zero"`` (output 0, weights 0; PyTorch SDPA since 2.5), ``"nan"``, or ``"uniform"``
      (weights 1/S on every key, output the mean of all values).
    * ``sinks`` (N,): learned sink logits, one per query head, as ``spec.flash_attention``'s:
      each joins its head's softmax denominator as a logit compared with the final scores
      (not scaled, after the masks), carries no value and is dropped, so a row's weights
      sum to less than 1 and a row attending no key gives 0 whatever ``fully_masked`` says.

    Returns :class:`SDPAResult` ``(output (..., N, L, Ev), weights (..., N, L, S),
    logits (..., N, L, S))``. Invalid input raises :class:`spec.SpecError`.
    """
    _checks.check_policy(fully_masked)
    problem = prepare(query, key, value, attend_mask=attend_mask, additive_mask=additive_mask,
                      causal=causal, scale=scale, sinks=sinks)
    weights, logits = attention_weights(problem, fully_masked)
    # 5. output = weights · v                                    (..., N, L, Ev)
    output = weights @ problem.value
    return SDPAResult(output, weights, logits)


def _sum_groups(grad: np.ndarray, group: int) -> np.ndarray:
    """(..., N, S, X) -> (..., K, S, X): add the gradients of the query heads sharing a kv head."""
    *batch, N, S, X = grad.shape
    return grad.reshape(*batch, N // group, group, S, X).sum(axis=-3)  # (..., K, G, S, X) -> (..., K, S, X)


def _reduce_to_shape(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum a broadcast result back to the shape it was broadcast from."""
    grad = grad.sum(axis=tuple(range(grad.ndim - len(shape))))     # drop leading broadcast dims
    shared = tuple(i for i, size in enumerate(shape) if size == 1 and grad.shape[i] != 1)
    return grad.sum(axis=shared, keepdims=True).reshape(shape)


def sdpa_vjp(query: Any, key: Any, value: Any, grad_output: Any, *, attend_mask: Any = None,
             additive_mask: Any = None, causal: str | None = None,
             scale: float | None = None, sinks: Any = None) -> SDPAGrads:
    """Vector-Jacobian product of :func:`sdpa` (policy ``"zero"``) in closed form, float64.

    ``grad_output`` (..., N, L, Ev) is the upstream gradient of the output. With
    P the weights, O the output and dO the upstream gradient:

        dV = Pᵀ dO,   dP = dO Vᵀ,   dZ = P ⊙ (dP − rowsum(dO ⊙ O)),
        dQ = scale · dZ K,   dK = scale · dZᵀ Q,   d(additive mask) = dZ,

    with dK, dV summed over each GQA group back to K heads and the mask gradient summed
    back to the additive mask's own shape. Fully-masked rows and blocked keys get zero.
    With ``sinks`` P holds the sink in its denominator and the formulas are unchanged (the
    sink has no value); the sinks' own gradient is not modelled.
    """
    problem = prepare(query, key, value, attend_mask=attend_mask, additive_mask=additive_mask,
                      causal=causal, scale=scale, sinks=sinks)
    p = problem
    grad_output = _checks.as_float64("grad_output", grad_output)
    expected = (*p.query.shape[:-1], p.value.shape[-1])
    if grad_output.shape != expected:
        fail("grad_output", grad_output, f"must have the output's shape (..., N, L, Ev) = {expected}",
             "pass the gradient of the loss with respect to the output")
    weights, _ = attention_weights(problem, "zero")              # (..., N, L, S)
    output = weights @ p.value                                   # (..., N, L, Ev)
    # 1. through output = P V
    dvalue = np.swapaxes(weights, -1, -2) @ grad_output          # (..., N, S, Ev)
    dweights = grad_output @ np.swapaxes(p.value, -1, -2)        # (..., N, L, S)
    # 2. through the softmax: dZ = P ⊙ (dP − Σ_j P_j dP_j), and Σ_j P_j dP_j = dO · O
    row_dot = (grad_output * output).sum(axis=-1, keepdims=True)  # (..., N, L, 1)
    dscores = weights * (dweights - row_dot)                     # (..., N, L, S)
    # 3. through scores = scale · q kᵀ + additive
    dquery = p.scale * (dscores @ p.key)                         # (..., N, L, E)
    dkey = p.scale * (np.swapaxes(dscores, -1, -2) @ p.query)    # (..., N, S, E)
    dadditive = None if p.additive_shape is None else _reduce_to_shape(dscores, p.additive_shape)
    return SDPAGrads(dquery, _sum_groups(dkey, p.group), _sum_groups(dvalue, p.group), dadditive)
