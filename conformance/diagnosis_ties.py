"""Telling apart variants that match a failing case equally: cases derived from it on
which the tied variants' outputs differ (:func:`_derived_cases`), the implementation
called on the few that separate the most pairs (:func:`_discriminating_calls`).
``conformance.diagnosis._separate`` ranks the tied causes by the cases they fit.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np

from conformance.diagnosis_observe import _EXAMPLE, _Call, start_example
from spec import variants as V

__all__ = ["MAX_DISCRIMINATING", "sdpa_mask_kind"]

#: Cases derived from a failing case that the implementation is called on, at most,
#: to tell apart variants that match the failing case equally (``diagnosis._separate``).
MAX_DISCRIMINATING = 2


def sdpa_mask_kind(case: Any) -> str:
    """The fully-masked-row kind of an SDPA case as the implementation received it
    (``Capabilities.fully_masked_policy``): the causal flag alone, else the mask's kind."""
    return "causal" if case.causal is not None and case.mask_kind == "none" else \
        "additive" if case.additive_mask is not None else "bool"


def _discriminating_calls(target: Any, call: _Call, tied: list[str]) -> list[tuple[str, _Call]]:
    """The implementation called on up to :data:`MAX_DISCRIMINATING` cases derived from
    ``call``'s case on which the ``tied`` variants' outputs differ (most pairs told
    apart first; the variants are computed, not the implementation, to choose them),
    as ``(description, observed call)``. Only a deterministic SDPA call, and only cases
    the target claims (``directed.admitted``); a call that raises is left out."""
    from conformance.calls import run_sdpa
    from conformance.directed import admitted

    if call.level != "sdpa" or call.dropout_p > 0:
        return []
    apart: set[frozenset[str]] = set()
    chosen: list[tuple[str, Any]] = []
    candidates = [(d, c) for d, c in _derived_cases(call.case) if admitted(target, c)]
    while len(chosen) < MAX_DISCRIMINATING and candidates:
        scored = []
        for index, (description, case) in enumerate(candidates):
            policy = target.caps.fully_masked_policy(sdpa_mask_kind(case))      # the kind's own policy
            groups = V.partition(V.SDPAProblem.from_case(case, fully_masked=policy), tied)
            pairs = {frozenset((a, b)) for g in groups for h in groups if g is not h for a in g for b in h}
            scored.append((len(pairs - apart), -index, description, case, pairs))
        gained, _, description, case, pairs = max(scored, key=lambda item: item[:2])
        if not gained:
            break
        apart |= pairs
        chosen.append((description, case))
        candidates = [(d, c) for d, c in candidates if d != description]
    if _EXAMPLE.get() is None:
        start_example(call.case)
    out = []
    for description, case in chosen:
        start = len(_EXAMPLE.get().calls)
        try:
            run_sdpa(target, case)
        except Exception:  # noqa: BLE001, S112 - no output on this case: it tells nothing
            continue
        out.append((f"a discriminating case ({description})", _EXAMPLE.get().calls[start]))
    return out


def _derived_cases(case: Any) -> list[tuple[str, Any]]:
    """Small changes of ``case`` that separate the usual ties: one or two more queries
    or keys (causal alignments, a one-query shortcut), a key block more (a ragged last
    block), another explicit scale (a falsy or ignored scale), one more batch item, and
    for a masked case without the causal flag a fully blocked key block in front (a
    kernel's NaN first block against NaN fully masked rows).
    The new entries are seeded normal values rounded to the dtype; new mask entries
    attend. Keys that equal the values (shared kv) stay equal. Contiguous, so any target
    that claims the sizes takes them; ``_discriminating_calls`` keeps only the cases the
    target claims (``directed.admitted``: sizes, max_seq_len, self-attention lengths,
    head dims, mask kinds, scales)."""
    from spec.emulate import round_to

    B, L, S = case.B, case.L, case.S
    sizes = [(B, L + 1, S + 1), (B, L + 1, S + 2), (B, L + 2, S + 1), (B, L + 1, S), (B, L, S + 1),
             (B, L, S + V.KERNEL_BLOCK), (B, L, S + V.KERNEL_BLOCK + 1), (B + 1, L, S)]
    rng = np.random.default_rng(zlib.crc32(f"diagnosis/{case.dtype}".encode()))

    def grown(x: np.ndarray | None, new: tuple[int, ...], fill: Any = None) -> np.ndarray | None:
        """``x`` grown to ``new`` at the end of each axis: new values drawn, or ``fill``
        for a mask (whose axes of size 1 broadcast and stay)."""
        if x is None:
            return None
        for axis, n in zip(range(-len(new), 0), new, strict=True):
            if -axis > x.ndim or x.shape[axis] == n or fill is not None and x.shape[axis] == 1:
                continue
            shape = list(x.shape)
            shape[axis] = n - x.shape[axis]
            extra = round_to(rng.standard_normal(shape), case.dtype) if fill is None else np.full(shape, fill)
            x = np.concatenate([x, extra.astype(x.dtype)], axis=axis)
        return x

    # keys that are the values (a shared-kv implementation's cases) stay the values
    shared = case.key.shape == case.value.shape and bool(np.array_equal(case.key, case.value))
    out = []
    for b, l, s in sizes:
        q = grown(case.query, (b, case.N, l, case.E))
        k = grown(case.key, (b, case.K, s, case.E))
        v = k if shared else grown(case.value, (b, case.K, s, case.Ev))
        mask_shape = (b, case.N, l, s)
        out.append((f"B={b}, L={l}, S={s}", case.replace(
            query=q, key=k, value=v, attend_mask=grown(case.attend_mask, mask_shape, True),
            additive_mask=grown(case.additive_mask, mask_shape, 0.0), layout="contiguous", notes=())))
    if case.causal is None and (case.attend_mask is not None or case.additive_mask is not None):
        # a fully blocked key block in front: the correct output is unchanged, a kernel
        # that makes NaN of a fully blocked first block (or skips blocks) is not
        def front(x: np.ndarray | None, fill: Any) -> np.ndarray | None:
            if x is None:
                return None
            extra = np.full((*x.shape[:-1], V.KERNEL_BLOCK), fill, dtype=x.dtype)
            return np.concatenate([extra, x], axis=-1)

        def keys_front(x: np.ndarray) -> np.ndarray:
            shape = (*x.shape[:-2], V.KERNEL_BLOCK, x.shape[-1])
            return np.concatenate([round_to(rng.standard_normal(shape), case.dtype).astype(x.dtype), x], axis=-2)

        key = keys_front(case.key)
        out.append((f"{V.KERNEL_BLOCK} blocked keys first", case.replace(
            key=key, value=key if shared else keys_front(case.value),
            attend_mask=front(case.attend_mask, False), additive_mask=front(case.additive_mask, -np.inf),
            layout="contiguous", notes=())))
    default = 1.0 / math.sqrt(case.E)
    for scale in (None, 1.5 * default):
        if scale != case.scale:
            out.append((f"scale={scale!r}", case.replace(scale=scale, layout="contiguous", notes=())))
    return out
