"""A failure at a derived level, diagnosed through the derivation by the base level's variants.

The flash level derived from an SDPA callable (``implementations/flash_from_sdpa.py``) makes
each flash call one SDPA call: causal and the window an attend mask, ALiBi an additive
mask. A bug of the SDPA callable (it subtracts its float mask) then fails a flash property
(``alibi_equivalence``), where the flash level's variants can only name a flash bug
(``flash_alibi_upper_left``: a cause about ALiBi for a function that has none); on a
one-query case the two cannot be told apart. :func:`sdpa_case_of` rebuilds the SDPA call
the derivation makes on the flash case, and the diagnosis calls the SDPA callable on it
once (guarded, observed) and ranks the SDPA level's variants on its output
(``additive_mask_subtracted``). A cause named there is the verdict, with a note that says
how the flash call reached it.

The MHA level is derived the same way in the spec: each head's attention is one SDPA
call. A module that makes an SDPA-level arithmetic mistake in that step (OpenNMT-py's
``scores.float()`` before the softmax of a float64 module) is matched by the SDPA
variant lifted to the MHA problem (:func:`lifted_variant`): the MHA forward whose
attention step is the SDPA variant's, under the SDPA variant's own id.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from conformance.core.cases import SDPACase

__all__ = ["sdpa_case_of", "derived_from_sdpa", "through_derivation", "lifted_variants", "lifted_variant"]

#: SDPA-level variants tried at the MHA level through its per-head attention step.
MHA_LIFTED = ("softmax_float32",)


def derived_from_sdpa(target: Any) -> bool:
    """Whether ``target`` is a flash level derived from the implementation's SDPA callable."""
    from implementations.flash_from_sdpa import is_derived_flash

    return target.level == "flash" and is_derived_flash(target.impl)


def _attend(L: int, S: int, left: int, right: int) -> np.ndarray:
    position = np.arange(L)[:, None] + (S - L)
    keys = np.arange(S)[None, :]
    allowed = np.ones((L, S), dtype=bool)
    if left >= 0:
        allowed &= keys >= position - left
    if right >= 0:
        allowed &= keys <= position + right
    return allowed


def sdpa_case_of(target: Any, case: Any) -> SDPACase | None:
    """The SDPA case the derivation calls on flash ``case`` (None: one it would not make
    as a whole: softcap, sinks, FP8, dropout, rows it leaves out under a non-zero policy)."""
    if case.softcap or case.sinks is not None or getattr(case, "q_descale", None) is not None:
        return None
    q, k, v = (np.swapaxes(np.asarray(a), 1, 2) for a in (case.query, case.key, case.value))
    L, S = q.shape[2], k.shape[2]
    left, right = (int(side) for side in case.window)
    right = 0 if case.causal else right
    attend = _attend(L, S, left, right) if (left >= 0 or right >= 0) else None
    caps = target.impl.caps("sdpa").for_dtype(target.dtype)
    kind = "additive" if case.alibi_slopes is not None or "bool" not in caps.mask_kinds else "bool"
    if attend is not None and not attend.any(axis=-1).all() and caps.fully_masked_policy(kind) != "zero":
        return None                                        # the derivation leaves those rows out
    attend_mask = additive = None
    if case.alibi_slopes is not None:
        slopes = np.asarray(case.alibi_slopes, dtype=np.float64)
        distance = np.abs(np.arange(L)[:, None] + (S - L) - np.arange(S)[None, :]).astype(np.float64)
        bias = -slopes[..., None, None] * distance
        bias = bias[None] if bias.ndim == 3 else bias
        additive = np.where(attend, bias, -np.inf) if attend is not None else bias
    elif attend is not None:
        if "bool" in caps.mask_kinds:
            attend_mask = attend
        else:
            additive = np.where(attend, 0.0, -np.inf)
    return SDPACase(query=np.ascontiguousarray(q), key=np.ascontiguousarray(k), value=np.ascontiguousarray(v),
                    attend_mask=attend_mask, additive_mask=additive, scale=case.scale, dtype=case.dtype,
                    device=case.device, regime=case.regime, notes=("derived from a flash case",))


def through_derivation(target: Any, case: Any, call_once: Any) -> tuple[Any, Any, str] | None:
    """The SDPA level's target, the SDPA call the derivation makes on flash ``case`` (called
    once through ``call_once(target, case)``, the diagnosis' own) and the note that says how
    the flash call reached it; None when the derivation would not make it as a whole."""
    sdpa_case = sdpa_case_of(target, case)
    if sdpa_case is None:
        return None
    base = dataclasses.replace(target, level="sdpa")
    mask = "ALiBi as an additive mask" if case.alibi_slopes is not None else \
        f"causal and the window as a {sdpa_case.mask_kind} mask" if sdpa_case.mask_kind != "none" else "no mask"
    note = (f" [through the derivation: the flash call is one call of the SDPA callable with {mask}, "
            "and this SDPA-level variant explains it]")
    return base, call_once(base, sdpa_case), note


def _per_head(p: Any) -> tuple[Any, Any]:
    """The MHA problem's per-head attention as the spec computes it: ``(heads, SDPA problem)``."""
    from spec.variants import SDPAProblem
    from spec.variants.mha import _heads, _policy, _Steps

    heads = _heads(p, _Steps())
    return heads, SDPAProblem(heads.query, heads.key, heads.value, additive_mask=heads.additive, dtype=p.dtype,
                              fully_masked=_policy(p))


def _uniform_rows(p: Any, heads: Any) -> np.ndarray | None:
    """Bool (B, N, L, 1): rows with every key blocked, where the module fills them uniform
    (a finite fill such as -1e18: its softmax then runs on equal scores); None otherwise."""
    from spec.variants.mha import _policy

    if _policy(p) != "uniform" or heads.additive is None:
        return None
    shape = (*heads.query.shape[:3], heads.key.shape[2])
    return np.isneginf(np.broadcast_to(heads.additive, shape)).all(axis=-1, keepdims=True)


def _lift(variant: Any) -> Any:
    """``variant`` (SDPA level) as an MHA-level variant of the same id: the MHA forward with
    the attention of each head computed by it, projections and layout the spec's. A coarse
    precision also rounds the weights of rows the module fills uniform (1/S in float32:
    OpenNMT-py's -1e18 fill under its float32 softmax), which the SDPA variant leaves exact."""
    from spec.variants import Variant, VariantResult

    def coarse_uniform(p: Any, heads: Any) -> np.ndarray | None:
        rows = _uniform_rows(p, heads) if variant.precision and p.dtype == "float64" else None
        return rows if rows is not None and rows.any() else None

    def applies(p: Any) -> bool:
        heads, problem = _per_head(p)
        return variant.applies(problem) or coarse_uniform(p, heads) is not None

    def compute(p: Any) -> Any:
        heads, problem = _per_head(p)
        result = variant.compute(problem)
        rows = coarse_uniform(p, heads)
        if rows is not None and result.weights is not None:
            S = heads.key.shape[2]
            fill = float(np.array(1.0, dtype=variant.precision) / np.array(S, dtype=variant.precision))
            weights = np.where(rows, fill, result.weights)
            result = VariantResult(weights @ heads.value, weights)
        B, N, L, hd = result.output.shape
        output = result.output.transpose(0, 2, 1, 3).reshape(B, L, N * hd) @ p.params.out_proj_weight.T
        if p.params.out_proj_bias is not None:
            output = output + p.params.out_proj_bias
        if not heads.batched:
            output = output[0]
        elif not heads.batch_first:
            output = output.transpose(1, 0, 2)
        if not p.need_weights or result.weights is None:
            return VariantResult(output, None)
        weights = result.weights.mean(axis=1) if p.average_attn_weights else result.weights
        return VariantResult(output, weights if heads.batched else weights[0])

    return Variant(id=variant.id, level="mha", summary=variant.summary, models=variant.models,
                   applies=applies, compute=compute,
                   precision=variant.precision)


def lifted_variants(level: str) -> tuple[Any, ...] | None:
    """The variants the diagnosis ranks at ``level``: the MHA level's own and the lifted
    SDPA ones; None (the level's own, the default) elsewhere."""
    if level != "mha":
        return None
    from spec import variants as V

    return (*V.MHA_VARIANTS, *(_lift(V.VARIANTS[name]) for name in MHA_LIFTED))


def lifted_variant(level: str, variant_id: str) -> Any:
    """The variant object ``variant_id`` names at ``level`` (a lifted one at the MHA level),
    else the id itself (looked up in the table)."""
    for variant in lifted_variants(level) or ():
        if variant.id == variant_id:
            return variant
    return variant_id
