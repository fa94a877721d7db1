"""FlashAttention's attention features on the float64 oracle: window, soft-capping, ALiBi, LSE.

Layout (FlashAttention's): query (B, L, N, E), key (B, S, K, E), value (B, S, K, Ev);
output (B, L, N, Ev); LSE (B, N, L). GQA when K divides N: query head h reads kv head
``h // (N // K)``. B batch, L query length, S key length, N query heads, K kv heads.

Every position-dependent feature reads the query's **aligned position** ``p_i``, the key
index query i lines up with: ``p_i = i + S - L`` (``alignment="lower_right"``,
FlashAttention's, the default) or ``p_i = i`` (``"upper_left"``, PyTorch ``is_causal``).

* window ``(left, right)``: query i attends key j iff ``p_i - left <= j <= p_i + right``;
  -1 leaves that side unbounded. ``causal=True`` sets ``right = 0`` (the intersection of
  the window with the causal rule, since right >= 0 or unbounded).
* soft-capping ``c > 0``: the scaled logits s become ``c * tanh(s / c)``, before bias and masks.
* ALiBi slopes (N,) or (B, N): the bias ``-slope_h * |p_i - j|`` is added to the (capped)
  scaled logits.
* LSE: ``log sum_j exp(score_ij)`` over the attended keys, scores = capped logits + bias;
  -inf for a row that attends no key.
* learned sinks (N,): one logit per query head that joins every row's softmax
  denominator and carries no value: ``w_ij = exp(score_ij) / (exp(sink_h) + sum_j
  exp(score_ij))``; the sink's own weight is dropped, so a row's weights sum to less than
  1 and a row attending no key gives 0. The sink is compared with the final scores as
  given (not scaled, capped or biased). The LSE stays the keys' (the sink left out).
* FP8 inputs: q, k, v holding 8-bit float values with ``q_descale``, ``k_descale``,
  ``v_descale`` (None, per tensor, or (B, K)) stand for ``value · descale``
  (:mod:`spec.fp8`, exact in float64); everything above runs on those values.
* dropout ``dropout_p`` with a given pattern ``dropout_mask`` (B, N, L, S), True = kept:
  the weights (after the softmax, the sink's dropped weight aside) are multiplied by the
  pattern and by ``1 / (1 - dropout_p)``; the LSE is not (it is the softmax's
  normaliser). The expectation over patterns of independent keeps with probability
  ``1 - dropout_p`` is the output without dropout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from . import _checks
from . import _flash_checks as checks
from . import fp8
from ._sdpa import _sum_groups
from .errors import fail

__all__ = ["FlashResult", "FlashGrads", "window_mask", "alibi_bias", "flash_attention",
           "flash_attention_vjp", "merge_partials"]

LAYOUT = ("(B, L, N, E)", "(B, S, K, E)", "(B, S, K, Ev)")


class FlashResult(NamedTuple):
    """``output`` (B, L, N, Ev) and ``lse`` (B, N, L), float64 (varlen: (T, N, Ev) and (N, T))."""

    output: np.ndarray
    lse: np.ndarray


class FlashGrads(NamedTuple):
    """Gradients in FlashAttention's layout: dquery (B, L, N, E), dkey (B, S, K, E), dvalue (B, S, K, Ev)."""

    dquery: np.ndarray
    dkey: np.ndarray
    dvalue: np.ndarray


def _aligned_positions(L: int, S: int, alignment: str) -> np.ndarray:
    """p_i for each query as a column (L, 1): i + S - L (lower_right) or i (upper_left)."""
    offset = S - L if alignment == "lower_right" else 0
    return np.arange(L)[:, None] + offset                                # (L, 1)


def window_mask(L: int, S: int, window: tuple[int, int] = (-1, -1), *, causal: bool = False,
                alignment: str = "lower_right") -> np.ndarray:
    """Sliding-window attend mask, bool (L, S), **True = may attend** (FlashAttention's ``window_size``).

    Query i attends key j iff ``p_i - left <= j <= p_i + right`` with ``p_i = i + S - L``
    (lower_right) or ``i`` (upper_left); a side of -1 is unbounded; ``causal=True`` sets
    ``right = 0``. ``window=(-1, -1)`` without causal attends everything.
    """
    L, S = checks.size("L", L), checks.size("S", S)
    left, right = checks.window_pair(window)
    if checks.causal_flag(causal):
        right = 0
    position = _aligned_positions(L, S, checks.alignment(alignment))    # (L, 1)
    keys = np.arange(S)[None, :]                                         # (1, S)
    allowed = np.ones((L, S), dtype=bool)
    if left >= 0:
        allowed &= keys >= position - left
    if right >= 0:
        allowed &= keys <= position + right
    return allowed


def alibi_bias(L: int, S: int, slopes: Any, *, alignment: str = "lower_right") -> np.ndarray:
    """ALiBi additive bias ``-slope_h * |p_i - j|``: slopes (N,) -> (N, L, S), (B, N) -> (B, N, L, S).

    Add it to the scaled scores (``spec.sdpa(additive_mask=...)`` in (B, N, L, S) layout).
    """
    L, S = checks.size("L", L), checks.size("S", S)
    slopes = _checks.as_float64("alibi_slopes", slopes)
    if slopes.ndim not in (1, 2) or not np.isfinite(slopes).all():
        fail("alibi_slopes", slopes, "must be finite with shape (N,) or (B, N)",
             "pass one finite slope per query head, optionally one row per batch element")
    position = _aligned_positions(L, S, checks.alignment(alignment))    # (L, 1)
    distance = np.abs(position - np.arange(S)[None, :])                  # (L, S)
    return -slopes[..., None, None] * distance                           # (..., N, 1, 1) * (L, S)


@dataclass(frozen=True)
class Problem:
    """A validated call, heads first: float64 arrays, kv heads repeated to N."""

    query: np.ndarray          # (B, N, L, E)
    key: np.ndarray            # (B, N, S, E)   kv heads repeated
    value: np.ndarray          # (B, N, S, Ev)  kv heads repeated
    allowed: np.ndarray        # (L, S)         window and causal, True = may attend
    bias: np.ndarray | None    # (1 or B, N, L, S) ALiBi
    scale: float
    softcap: float             # 0 = off
    group: int                 # N // K query heads per kv head
    sinks: np.ndarray | None = None  # (N,) learned sink logits, None = no sink


def prepare(query: Any, key: Any, value: Any, *, causal: Any = False, window: Any = (-1, -1),
            softcap: Any = 0.0, alibi_slopes: Any = None, scale: Any = None,
            alignment: Any = "lower_right", sinks: Any = None, q_descale: Any = None,
            k_descale: Any = None, v_descale: Any = None) -> Problem:
    """Validate a FlashAttention-layout call and bring it to float64, heads first (FP8
    values multiplied by their descale factors first, :func:`spec.fp8.dequantize`)."""
    q = _checks.as_float64("query", query)
    k = _checks.as_float64("key", key)
    v = _checks.as_float64("value", value)
    checks.head_layout(q, k, v, 2, LAYOUT)
    if q_descale is not None or k_descale is not None or v_descale is not None:
        q, k, v = fp8.dequantize(q, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    B, L, N, E = q.shape
    S, K = k.shape[1], k.shape[2]
    slopes = checks.slopes_array(alibi_slopes, B, N)                     # (1 or B, N)
    group = N // K
    return Problem(
        query=q.transpose(0, 2, 1, 3),                                   # (B, L, N, E) -> (B, N, L, E)
        key=np.repeat(k.transpose(0, 2, 1, 3), group, axis=1),          # (B, S, K, E) -> (B, N, S, E)
        value=np.repeat(v.transpose(0, 2, 1, 3), group, axis=1),        # (B, S, K, Ev) -> (B, N, S, Ev)
        allowed=window_mask(L, S, window, causal=causal, alignment=alignment),
        bias=None if slopes is None else alibi_bias(L, S, slopes, alignment=alignment),
        scale=_checks.resolve_scale(scale, E),
        softcap=checks.softcap_value(softcap),
        group=group,
        sinks=checks.sinks_array(sinks, N),
    )


class Forward(NamedTuple):
    logits: np.ndarray         # (B, N, L, S) scale · q kᵀ, before the cap
    weights: np.ndarray        # (B, N, L, S) 0 at blocked keys and in empty rows
    lse: np.ndarray            # (B, N, L)    -inf in empty rows (the keys' only, sinks left out)
    empty_row: np.ndarray      # (L, 1)       True where no key is attended
    sink_weight: np.ndarray | None = None  # (B, N, L, 1) the dropped weight of the sink


def attend(p: Problem) -> Forward:
    """Steps 1-5 of the oracle: logits, cap, bias and window, softmax, LSE."""
    # 1. logits = scale · q kᵀ                                        (B, N, L, S)
    logits = p.scale * (p.query @ np.swapaxes(p.key, -1, -2))
    # 2. soft-capping squashes the logits into (-c, c), before any bias or mask
    capped = logits if p.softcap == 0 else p.softcap * np.tanh(logits / p.softcap)
    # 3. scores = capped logits + ALiBi bias; keys outside the window -> -inf
    scores = capped if p.bias is None else capped + p.bias
    scores = np.where(p.allowed, scores, -np.inf)
    # 4. softmax from each row's max over attended keys, so exp never overflows
    empty_row = ~p.allowed.any(axis=-1, keepdims=True)                  # (L, 1)
    key_max = np.where(empty_row, 0.0, scores.max(axis=-1, keepdims=True, initial=-np.inf))
    row_max = key_max
    sink = None
    if p.sinks is not None:
        # the sink joins the max (so exp(sink - max) <= 1 never overflows) and the denominator
        sink = p.sinks[None, :, None, None]                              # (1, N, 1, 1)
        row_max = np.where(empty_row, sink, np.maximum(key_max, sink))   # (B, N, L, 1)
    with np.errstate(over="ignore", under="ignore"):
        unnormalised = np.exp(scores - row_max)                          # (B, N, L, S), blocked = 0
        sink_term = None if sink is None else np.exp(sink - row_max)     # (B, N, L, 1), <= 1
    keys_total = unnormalised.sum(axis=-1, keepdims=True)               # (B, N, L, 1)
    total = keys_total if sink_term is None else keys_total + sink_term
    if sink_term is None:
        weights = unnormalised / np.where(empty_row, 1.0, total)
        sink_weight = None
    else:                                                                # total >= 1: the max term is 1
        weights, sink_weight = unnormalised / total, sink_term / total
    # 5. LSE = log Σ exp(scores) over attended keys = key max + log(Σ exp(s - key max)); -inf
    #    if none (with a sink, recomputed from the keys' max: the sink's may underflow them)
    if sink_term is not None:
        with np.errstate(under="ignore"):
            keys_total = np.exp(scores - key_max).sum(axis=-1, keepdims=True)
    lse = np.where(empty_row, -np.inf, key_max + np.log(np.where(empty_row, 1.0, keys_total)))
    return Forward(logits, weights, lse[..., 0], empty_row, sink_weight)


def flash_attention(query: Any, key: Any, value: Any, *, causal: bool = False,
                    window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Any = None, scale: float | None = None,
                    return_lse: bool = False, fully_masked: str = "zero",
                    alignment: str = "lower_right", sinks: Any = None, q_descale: Any = None,
                    k_descale: Any = None, v_descale: Any = None, dropout_p: float = 0.0,
                    dropout_mask: Any = None) -> np.ndarray | FlashResult:
    """FlashAttention's forward (``flash_attn_func``) as the float64 reference.

    Shapes: query (B, L, N, E), key (B, S, K, E), value (B, S, K, Ev), K dividing N.
    Scores are ``c·tanh(s/c) + bias`` with ``s = scale · q·k`` (``scale=None`` ->
    1/sqrt(E); ``softcap=0`` leaves s as is); keys outside the window (``causal`` =
    right side 0) are blocked; ``alibi_slopes`` (N,) or (B, N) give the bias
    ``-slope_h · |p_i - j|``. See the module docstring for ``p_i`` and ``alignment``.

    Rows attending no key (causal or window with L > S, S = 0) follow ``fully_masked``:
    ``"zero"`` (FlashAttention), ``"nan"``, or ``"uniform"`` (the mean of all S values).
    Returns the output (B, L, N, Ev), or ``FlashResult(output, lse)`` with ``return_lse``;
    lse (B, N, L) is -inf in rows that attend no key. With ``softcap=0`` this equals
    ``spec.sdpa(q, k, v, attend_mask=window_mask(...), additive_mask=alibi_bias(...))``
    on the heads-first transposes.

    ``sinks`` (N,): learned sink logits that join each row's softmax denominator and are
    dropped after it (no value); a row attending no key then puts all its weight on the
    sink and gives 0 whatever ``fully_masked`` says. The LSE stays the keys' own.

    ``q_descale``, ``k_descale``, ``v_descale`` (None, a scalar, (1,) or (B, K)): the
    inputs hold FP8 values standing for ``value · descale`` (:mod:`spec.fp8`); the result
    is that of the dequantised inputs.

    ``dropout_p`` in [0, 1) with ``dropout_mask`` bool (B, N, L, S), True = kept (the
    pattern a call drew): the weights are multiplied by the pattern and ``1 / (1 -
    dropout_p)`` before the values; the LSE is the softmax's, untouched. ``dropout_p > 0``
    needs the pattern (the spec draws nothing; the expectation over patterns is the
    output with ``dropout_p = 0``).
    """
    _checks.check_policy(fully_masked)
    p = prepare(query, key, value, causal=causal, window=window, softcap=softcap,
                alibi_slopes=alibi_slopes, scale=scale, alignment=alignment, sinks=sinks,
                q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    keep = checks.dropout_pattern(dropout_p, dropout_mask, p.query.shape[:3] + p.key.shape[2:3])
    if p.sinks is not None:
        fully_masked = "zero"                                            # the sink holds the row's mass
    if fully_masked == "uniform" and p.key.shape[-2] == 0:
        fail("fully_masked", fully_masked, "needs S >= 1 keys to average (S=0 here)",
             "pass fully_masked='zero' or 'nan' when a sequence may have no keys")
    forward = attend(p)
    # 6. output = weights · v (dropped and rescaled by a dropout pattern); rows attending
    #    no key follow the policy                                        (B, N, L, Ev)
    weights = forward.weights if keep is None else forward.weights * keep
    output = weights @ p.value
    if fully_masked == "nan":
        output = np.where(forward.empty_row, np.nan, output)
    elif fully_masked == "uniform":
        output = np.where(forward.empty_row, p.value.mean(axis=-2, keepdims=True), output)
    output = output.transpose(0, 2, 1, 3)                                # (B, N, L, Ev) -> (B, L, N, Ev)
    return FlashResult(output, forward.lse) if return_lse else output


def flash_attention_vjp(query: Any, key: Any, value: Any, grad_output: Any, *,
                        causal: bool = False, window: tuple[int, int] = (-1, -1),
                        softcap: float = 0.0, alibi_slopes: Any = None,
                        scale: float | None = None, alignment: str = "lower_right",
                        sinks: Any = None, dropout_p: float = 0.0,
                        dropout_mask: Any = None) -> FlashGrads:
    """Vector-Jacobian product of :func:`flash_attention` (policy ``"zero"``) in closed form.

    ``grad_output`` (B, L, N, Ev). With P the weights, O the output, dO the upstream
    gradient, s the scaled logits and t = tanh(s / c):

        dV = Pᵀ dO,   dZ = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O)),   dS = dZ ⊙ (1 − t²)  (dZ if c = 0),
        dQ = scale · dS K,   dK = scale · dSᵀ Q,

    dK and dV summed over each GQA group. The ALiBi bias and the window are constants;
    blocked keys and rows attending no key get zero gradient. With ``sinks`` P holds the
    weights with the sink in the denominator and the formulas are unchanged (the sink has
    no value, so rowsum(dO ⊙ O) is still Σ_j P_j dP_j); the sinks' own gradient is not modelled.
    With a dropout pattern, D = mask / (1 - dropout_p): O = (P ⊙ D) V, so dV = (P ⊙ D)ᵀ dO and
    dP = D ⊙ (dO Vᵀ), and Σ_j P_j dP_j = dO · O still: dZ = P ⊙ (dP − rowsum(dO ⊙ O)).
    """
    p = prepare(query, key, value, causal=causal, window=window, softcap=softcap,
                alibi_slopes=alibi_slopes, scale=scale, alignment=alignment, sinks=sinks)
    keep = checks.dropout_pattern(dropout_p, dropout_mask, p.query.shape[:3] + p.key.shape[2:3])
    grad_output = _checks.as_float64("grad_output", grad_output)
    B, N, L, Ev = p.query.shape[:3] + p.value.shape[-1:]
    if grad_output.shape != (B, L, N, Ev):
        fail("grad_output", grad_output, f"must have the output's shape (B, L, N, Ev) = {(B, L, N, Ev)}",
             "pass the gradient of the loss with respect to the output")
    grad = grad_output.transpose(0, 2, 1, 3)                             # (B, L, N, Ev) -> (B, N, L, Ev)
    forward = attend(p)
    weights = forward.weights                                            # (B, N, L, S)
    dropped = weights if keep is None else weights * keep               # P ⊙ D
    output = dropped @ p.value                                           # (B, N, L, Ev)
    # 1. through output = (P ⊙ D) V
    dvalue = np.swapaxes(dropped, -1, -2) @ grad                        # (B, N, S, Ev)
    dweights = grad @ np.swapaxes(p.value, -1, -2)                      # (B, N, L, S)
    if keep is not None:
        dweights = dweights * keep
    # 2. through the softmax: dZ = P ⊙ (dP − Σ_j P_j dP_j), and Σ_j P_j dP_j = dO · O
    row_dot = (grad * output).sum(axis=-1, keepdims=True)               # (B, N, L, 1)
    dscores = weights * (dweights - row_dot)                             # (B, N, L, S)
    # 3. through the cap: d/ds c·tanh(s/c) = 1 − tanh²(s/c); the bias is a constant
    dlogits = dscores
    if p.softcap > 0:
        dlogits = dscores * (1.0 - np.tanh(forward.logits / p.softcap) ** 2)
    # 4. through s = scale · q kᵀ
    dquery = p.scale * (dlogits @ p.key)                                 # (B, N, L, E)
    dkey = p.scale * (np.swapaxes(dlogits, -1, -2) @ p.query)           # (B, N, S, E)
    return FlashGrads(
        dquery.transpose(0, 2, 1, 3),                                    # (B, N, L, E) -> (B, L, N, E)
        _sum_groups(dkey, p.group).transpose(0, 2, 1, 3),               # (B, K, S, E) -> (B, S, K, E)
        _sum_groups(dvalue, p.group).transpose(0, 2, 1, 3),             # (B, K, S, Ev) -> (B, S, K, Ev)
    )


def _partial(index: int, output: Any, lse: Any) -> tuple[np.ndarray, np.ndarray]:
    output = _checks.as_float64(f"out{index}", output)
    lse = _checks.as_float64(f"lse{index}", lse)
    if output.ndim < 3:
        fail(f"out{index}", output, "must have rank >= 3: (B, L, N, Ev) or, packed, (T, N, Ev)",
             "pass an output of flash_attention, varlen_attention or kvcache_attention")
    expected = (*output.shape[:-3], output.shape[-2], output.shape[-3])
    if lse.shape != expected:
        fail(f"lse{index}", lse, f"must have shape {expected}: out{index}'s leading dims with the "
             "last two swapped ((B, N, L) for (B, L, N, Ev), (N, T) for (T, N, Ev))",
             "pass the LSE returned with that output")
    if np.isnan(lse).any() or np.isposinf(lse).any():
        fail(f"lse{index}", lse, "must be finite or -inf (-inf = the partial attended no key)",
             "FlashAttention-2 writes +inf for a row with no key; map it to -inf first")
    return output, np.swapaxes(lse, -1, -2)[..., None]                  # (..., N, L) -> (..., L, N, 1)


def merge_partials(out1: Any, lse1: Any, out2: Any, lse2: Any) -> FlashResult:
    """Attention over the union of two disjoint key sets, from each set's output and LSE.

    ``lse = log(e^lse1 + e^lse2)`` and ``out = e^(lse1 − lse) · out1 + e^(lse2 − lse) · out2``.
    A partial with LSE -inf (it attended no key) contributes nothing, whatever its output
    holds (0 or NaN); rows where both are -inf give output 0 and LSE -inf. Layouts as
    returned: out (B, L, N, Ev) with lse (B, N, L), or packed out (T, N, Ev) with lse (N, T).
    """
    out1, a = _partial(1, out1, lse1)
    out2, b = _partial(2, out2, lse2)
    if out1.shape != out2.shape:
        fail("out2", out2, f"must have out1's shape {out1.shape}",
             "merge partial results of the same queries (only the key sets differ)")
    # 1. the union's LSE, from the larger of the two so exp never overflows
    top = np.maximum(a, b)
    both_empty = np.isneginf(top)                                        # (..., L, N, 1)
    shift = np.where(both_empty, 0.0, top)
    lse = shift + np.log(np.where(both_empty, 1.0, np.exp(a - shift) + np.exp(b - shift)))
    # 2. each output weighted by its share of the union's softmax mass
    first = np.where(np.isneginf(a), 0.0, np.exp(a - lse) * out1)       # (..., L, N, Ev)
    second = np.where(np.isneginf(b), 0.0, np.exp(b - lse) * out2)
    lse = np.where(both_empty, -np.inf, lse)
    return FlashResult(first + second, np.swapaxes(lse[..., 0], -1, -2))  # (..., L, N) -> (..., N, L)
