"""Cases derived from a failing MHA-level case, for telling apart the variants that
explain it equally (``ties._discriminating_calls``): one or two more keys, one more
query, both, one more batch item. The new keys, queries and batch items are seeded
normal values rounded to the dtype; the new mask entries attend (key padding False or
0.0, ``attn_mask`` False or 0.0), so a row whose keys were all blocked gains one it may
attend, and a mask read the wrong way round is seen on a row that is not fully masked.
A self-attention case (key and value are the query) stays one.

A causal case keeps its sizes (its ``attn_mask`` is the causal mask of L and S: grown
with attending entries it would not be); a per-head ``attn_mask`` (B*N, L, S) keeps B.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

__all__ = ["mha_derived_cases"]


def mha_derived_cases(case: Any) -> list[tuple[str, Any]]:
    """``(description, case)`` for each derived case of the MHA case ``case``."""
    from spec.emulate import round_to

    rng = np.random.default_rng(zlib.crc32(f"diagnosis/mha/{case.dtype}".encode()))
    seq_axis = 0 if case.unbatched or not case.batch_first else 1
    batch_axis = None if case.unbatched else (0 if case.batch_first else 1)
    self_attention = case.self_attention

    def grown(x: np.ndarray, axis: int, more: int) -> np.ndarray:
        if more <= 0:
            return x
        shape = list(x.shape)
        shape[axis] = more
        extra = round_to(rng.standard_normal(shape), case.dtype).astype(x.dtype)
        return np.concatenate([x, extra], axis=axis)

    def attending(mask: np.ndarray | None, axis: int, more: int) -> np.ndarray | None:
        if mask is None or more <= 0:
            return mask
        shape = list(mask.shape)
        shape[axis] = more
        fill = np.zeros(shape, dtype=mask.dtype)                      # False, or 0.0 added
        return np.concatenate([mask, fill], axis=axis)

    def sized(more_l: int, more_s: int, more_b: int) -> tuple[str, Any] | None:
        if (more_l or more_s) and case.is_causal:
            return None
        if more_b and (batch_axis is None or (case.attn_mask is not None and case.attn_mask.ndim == 3)):
            return None
        if self_attention and more_l != more_s:
            return None
        query = grown(case.query, seq_axis, more_l)
        shared = case.value is case.key
        key = query if self_attention else grown(case.key, seq_axis, more_s)
        value = query if self_attention else key if shared else grown(case.value, seq_axis, more_s)
        if more_b:
            query = grown(query, batch_axis, more_b)
            key = query if self_attention else grown(key, batch_axis, more_b)
            value = query if self_attention else key if shared else grown(value, batch_axis, more_b)
        padding = attending(case.key_padding_mask, -1, more_s)
        if padding is not None and more_b and padding.ndim == 2:
            padding = attending(padding, 0, more_b)
        attn_mask = attending(attending(case.attn_mask, -2, more_l), -1, more_s)
        L, S, B = case.L + more_l, case.S + more_s, case.B + more_b
        return (f"B={B}, L={L}, S={S}", case.replace(query=query, key=key, value=value,
                                                      key_padding_mask=padding, attn_mask=attn_mask, notes=()))

    wanted = [(0, 1, 0), (0, 2, 0), (1, 0, 0), (1, 1, 0), (2, 2, 0), (0, 0, 1)]
    return [derived for derived in (sized(*more) for more in wanted) if derived is not None]
