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
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from conformance.core.cases import SDPACase

__all__ = ["sdpa_case_of", "derived_from_sdpa", "through_derivation"]


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
