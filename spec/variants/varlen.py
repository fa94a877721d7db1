"""The varlen-level variants: ``flash_attn_varlen_func`` with one step done the way real
code gets it wrong (a sequence's key slice running into its neighbour's, the default
scale 1/E, soft-capping after the mask, the LSE over every packed key), each computed in
float64 on the call's own inputs, sequence by sequence (``spec.variants._kernel``).

Layouts are FlashAttention's packed ones: query (T_q, N, E), output (T_q, N, Ev), LSE (N, T_q).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ._core import Variant, VariantResult
from ._family import VarlenProblem
from ._kernel import Steps, attend, plain_lse

__all__ = ["VARLEN_VARIANTS", "reference", "compute", "live_rows"]


def _slopes(p: VarlenProblem, b: int) -> np.ndarray | None:
    if p.alibi_slopes is None:
        return None
    rows = np.asarray(p.alibi_slopes).reshape(-1, p.query.shape[1])
    return rows[b % rows.shape[0]]


def compute(p: VarlenProblem, steps: Steps | None = None, *, neighbour_key: bool = False,
            scale_over_e: bool = False) -> VariantResult:
    """What ``flash_attn_varlen_func`` returns on ``p`` under ``steps``; ``neighbour_key``:
    each sequence's key slice runs one row into the next sequence's; ``scale_over_e``: the
    default scale is 1/E."""
    steps = steps or Steps()
    T, N, E = p.query.shape
    Ev, T_k = p.value.shape[-1], p.key.shape[0]
    scale = 1.0 / E if (scale_over_e and p.scale is None) else p.resolved_scale
    policy = "zero" if p.fully_masked == "unspecified" else p.fully_masked
    output, magnitude = np.zeros((T, N, Ev)), np.zeros((T, N, Ev))
    lse, size = np.zeros((N, T)), np.zeros((N, T))
    for b, (rows, keys) in enumerate(p.sequences()):
        if neighbour_key:
            keys = slice(keys.start, min(keys.stop + 1, T_k))
        part = attend(p.query[rows], p.key[keys], p.value[keys], scale=scale, causal=bool(p.causal),
                      window=p.window, softcap=float(p.softcap), slopes=_slopes(p, b), policy=policy, dtype=p.dtype,
                      steps=steps)
        output[rows], magnitude[rows], lse[:, rows], size[:, rows] = (part.output, part.magnitude, part.lse,
                                                                       part.score_size)
    return VariantResult(output, lse=lse, magnitude=magnitude, score_size=size)


def reference(p: VarlenProblem) -> VariantResult:
    """The correct convention: :func:`spec.varlen_attention` (with its LSE)."""
    return compute(p)


def live_rows(p: VarlenProblem) -> np.ndarray:
    """Bool (T_q, 1, 1): rows that attend a key under the correct convention."""
    live = np.zeros(p.query.shape[0], dtype=bool)
    for b, (rows, keys) in enumerate(p.sequences()):
        part = attend(p.query[rows], p.key[keys], p.value[keys], scale=p.resolved_scale, causal=bool(p.causal),
                      window=p.window, slopes=_slopes(p, b))
        live[rows] = part.live
    return live[:, None, None]


def _lse_packed(p: VarlenProblem) -> VariantResult:
    # each query's LSE over the whole packed key tensor (plain scaled logits); the output is right
    result = reference(p)
    if p.key.shape[0] == 0:
        return result
    lse, size = result.lse.copy(), result.score_size.copy()
    for rows, _ in p.sequences():
        lse[:, rows], packed = plain_lse(p.query[rows], p.key, p.resolved_scale)
        size[:, rows] = np.maximum(size[:, rows], packed)
    return result._replace(lse=lse, score_size=size)


def _neighbour_reaches(p: VarlenProblem) -> bool:
    """Some sequence with queries has a key row after its own."""
    return any(rows.stop > rows.start and keys.stop < p.key.shape[0] for rows, keys in p.sequences())


VARLEN_VARIANTS = (
    Variant(
        id="varlen_neighbour_key",
        level="varlen",
        summary="runs each packed sequence's key slice one row into the next sequence: it also attends that "
                "sequence's first key (and its aligned positions count it)",
        models="a key-block loop bounded by the next sequence's start read inclusively "
               "(cu_seqlens_k[b + 1] + 1; bug zoo: varlen_neighbour_key)",
        applies=_neighbour_reaches,
        compute=lambda p: compute(p, neighbour_key=True),
    ),
    Variant(
        id="varlen_scale_over_e",
        level="varlen",
        summary="reads softmax_scale=None as 1/E instead of 1/sqrt(E)",
        models="the default scale written as 1 / head_dim in a packed kernel (bug zoo: varlen_scale_over_e)",
        applies=lambda p: p.scale is None and p.query.shape[-1] > 1,
        compute=lambda p: compute(p, scale_over_e=True),
    ),
    Variant(
        id="varlen_softcap_after_mask",
        level="varlen",
        summary="soft-caps the scores after the window/causal mask (and the ALiBi bias): a blocked key's -inf "
                "becomes -softcap, so blocked keys get weight",
        models="c·tanh(s/c) applied to the masked scores; FlashAttention caps before bias and masks "
               "(bug zoo: varlen_softcap_after_mask)",
        applies=lambda p: bool(p.softcap) and (bool(p.causal) or tuple(p.window) != (-1, -1)
                                               or p.alibi_slopes is not None),
        compute=lambda p: compute(p, replace(Steps(), softcap_after_mask=True)),
    ),
    Variant(
        id="varlen_lse_packed",
        level="varlen",
        summary="returns each query's LSE over the whole packed key tensor (every sequence's keys, no mask, cap "
                "or bias) instead of over its own sequence's attended keys; the output is right",
        models="the LSE taken over the packed keys, cu_seqlens ignored for the LSE only (bug zoo: varlen_lse_packed)",
        applies=lambda p: p.key.shape[0] > 0,
        compute=_lse_packed,
    ),
)
