"""Cases derived from a failing call of the FlashAttention levels (flash, kvcache), on which
variants that explain it equally can differ (``ties._discriminating_calls`` picks the few
that tell the most apart, and confirms a match that agrees only where it predicts NaN).

* flash: one more query, one more key, both, the lengths made equal (top-left and
  bottom-right alignments coincide only when they are), and a bounded window side one
  wider (an off-by-one edge and a misplaced triangle empty the same rows on a window of 0);
* kvcache: one more query (rows of small new values beside rows whose logits overflow
  exp: a merge without its max is NaN in those only; and a diagonal moved by a pad is no
  longer the top-left one), and, for a case without new keys, the last cached keys
  appended as new ones (a window or causal rule aligned with the appended keys only
  attends none of a case without them).

New entries are seeded normal values rounded to the case's dtype; a derived case the spec
calls invalid (a rotary table too short for one more query) is left out, and
``ties`` keeps only the cases the target claims. The varlen level derives none yet.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from conformance.core.observe import _Call

__all__ = ["derived_cases", "run_like"]


def _grown(rng: np.random.Generator, x: np.ndarray, axis: int, n: int, dtype: str) -> np.ndarray:
    """``x`` with ``n`` more entries along ``axis``, seeded normal values in ``dtype``."""
    from spec.emulate import round_to

    if n <= 0:
        return x
    shape = list(x.shape)
    shape[axis] = n
    return np.concatenate([x, round_to(rng.standard_normal(shape), dtype).astype(x.dtype)], axis=axis)


def _flash_cases(case: Any, rng: np.random.Generator) -> list[tuple[str, Any]]:
    out = []
    L, S = case.L, case.S
    for more_q, more_k in ((1, 0), (0, 1), (1, 1), (max(S - L, 0), max(L - S, 0))):
        if not more_q and not more_k:
            continue
        grown = case.replace(query=_grown(rng, case.query, 1, more_q, case.dtype),
                             key=_grown(rng, case.key, 1, more_k, case.dtype),
                             value=_grown(rng, case.value, 1, more_k, case.dtype), notes=())
        out.append((f"L={L + more_q}, S={S + more_k}", grown))
    left, right = case.window
    if left >= 0:
        out.append((f"window=({left + 1}, {right})", case.replace(window=(left + 1, right), notes=())))
    if right >= 0 and not case.causal:
        out.append((f"window=({left}, {right + 1})", case.replace(window=(left, right + 1), notes=())))
    return out


def _kvcache_cases(case: Any, rng: np.random.Generator) -> list[tuple[str, Any]]:
    out = [(f"L={case.L + 1}", case.replace(query=_grown(rng, case.query, 1, 1, case.dtype)))]
    appended = _cached_keys_appended(case)
    if appended is not None:
        out.append(appended)
    return out


def _cached_keys_appended(case: Any) -> tuple[str, Any] | None:
    """A case without new keys whose last ``n`` valid cached keys of each sequence come as
    new keys instead (``cache_seqlens`` n lower): the same keys after the append, so the
    oracle is unchanged, while a variant that aligns with the appended keys only (a window
    or causal rule that ignores the cache) now attends some keys instead of none. Only for
    a plain cache: no rotary (it would rotate the moved keys), no cache_batch_idx, no FP8."""
    if (case.k_new is not None or case.rotary_cos is not None or case.cache_batch_idx is not None
            or case.fp8 is not None):
        return None
    pads = case.cache_leftpad or (0,) * case.B
    n = min(case.L, *(length - pad for length, pad in zip(case.cache_seqlens, pads, strict=True)))
    if n < 1:
        return None
    k_new = np.stack([case.k_cache[b, length - n:length] for b, length in enumerate(case.cache_seqlens)])
    v_new = np.stack([case.v_cache[b, length - n:length] for b, length in enumerate(case.cache_seqlens)])
    seqlens = tuple(length - n for length in case.cache_seqlens)
    return (f"the last {n} cached key(s) appended as new keys (S_new={n})",
            case.replace(k_new=k_new, v_new=v_new, cache_seqlens=seqlens))


def derived_cases(call: _Call) -> list[tuple[str, Any]]:
    """``(description, case)`` derived from ``call``'s case that the spec calls valid."""
    from conformance.core import levels

    derive = {"flash": _flash_cases, "kvcache": _kvcache_cases}.get(call.level)
    if derive is None:
        return []
    rng = np.random.default_rng(zlib.crc32(f"diagnosis/{call.level}/{call.case.dtype}".encode()))
    out = []
    for description, case in derive(call.case, rng):
        try:
            levels.module(call.level).validate(case)
        except ValueError:  # spec.SpecError included: not a case of this level
            continue
        out.append((description, case))
    return out


def run_like(target: Any, call: _Call, case: Any) -> None:
    """Call the implementation on ``case`` as ``call`` was made (with the LSE when it was
    asked for, the caches as pages when they were): the call is observed."""
    lse = call.extra.get("lse") is not None
    if call.level == "flash":
        from conformance.calls.flash import run_flash

        run_flash(target, case, lse=lse)
    elif call.level == "kvcache":
        from conformance.calls.kvcache import run_kvcache

        run_kvcache(target, case, paged=call.extra.get("paged"), lse=lse)
    else:
        raise ValueError(f"no cases are derived at the {call.level} level")
