"""Telling apart variants that match a failing case equally: cases derived from it on
which the tied variants' outputs differ (:func:`_derived_cases`), the implementation
called on the few that separate the most pairs (:func:`_discriminating_calls`).
``conformance.diagnosis.diagnose._separate`` ranks the tied causes by the cases they fit.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np

from conformance.core.observe import _EXAMPLE, _Call, start_example
from conformance.diagnosis.problems import _MHA_OVERRIDES, _sdpa_problem, problem_of, sdpa_mask_kind
from spec import variants as V

__all__ = ["MAX_DISCRIMINATING", "sdpa_mask_kind"]

#: Cases derived from a failing case that the implementation is called on, at most,
#: to tell apart variants that match the failing case equally (``diagnose._separate``).
MAX_DISCRIMINATING = 2


def _discriminating_calls(target: Any, call: _Call, tied: list[Any],
                          confirm: list[str] = ()) -> list[tuple[str, _Call]]:
    """The implementation called on up to :data:`MAX_DISCRIMINATING` cases derived from
    ``call``'s case on which the ``tied`` variants' outputs differ (most pairs told
    apart first; the variants are computed, not the implementation, to choose them),
    as ``(description, observed call)``. ``confirm``: variants whose match is NaN-only;
    among cases that tell as many pairs apart, one where such a variant predicts a
    wrong but partly finite output comes first (only such a case can confirm it), and
    one is chosen for it even when every pair is already apart. Only a deterministic
    SDPA call, a flash or kvcache call (``family_cases``: made as the failing call was,
    compared on what it returns) or an MHA call in eval mode (``mha_cases``), and only cases the target claims
    (``directed.examples.admitted``, ``calls.declarations.outside_declarations``); a call
    that raises is left out."""
    from conformance.calls.declarations import outside_declarations
    from conformance.calls.sdpa import run_sdpa
    from conformance.diagnosis.family_cases import derived_cases, run_like
    from conformance.directed.examples import admitted

    if call.level in V.FLASH_FAMILY:
        candidates = [(d, c) for d, c in derived_cases(call) if not outside_declarations(target, c)]
        parts = ("output", "lse", "k_cache", "v_cache") if call.extra.get("lse") is not None else \
            ("output", "k_cache", "v_cache")

        def make(case: Any) -> None:
            run_like(target, call, case)
    elif call.level == "sharded":
        from conformance.sharded.cases import run_sharded

        candidates = _sharded_derived_cases(call.case)
        parts = ("output",)

        def make(case: Any) -> None:
            run_sharded(target, case)
    elif call.level == "mha" and not getattr(call.module, "training", False) \
            and not set(call.overrides) - _MHA_OVERRIDES:
        from conformance.calls.mha import run_mha
        from conformance.diagnosis.mha_cases import mha_derived_cases

        made = call.case.replace(**call.overrides) if call.overrides else call.case
        candidates = [(d, c) for d, c in mha_derived_cases(made) if admitted(target, c)]
        parts = ("output", "weights") if made.need_weights else ("output",)

        def make(case: Any) -> None:
            run_mha(target, case)
    elif call.level == "sdpa" and call.dropout_p == 0:
        candidates = [(d, c) for d, c in _derived_cases(call.case) if admitted(target, c)]
        parts = ("output",)

        def make(case: Any) -> None:
            run_sdpa(target, case)
    else:
        return []
    apart: set[frozenset[str]] = set()
    unconfirmed = set(confirm)
    chosen: list[tuple[str, Any]] = []
    while len(chosen) < MAX_DISCRIMINATING and candidates:
        scored = []
        for index, (description, case) in enumerate(candidates):
            problem, allowed = _expected_problem(target, case, call)
            if problem is None:
                continue
            groups = V.partition(problem, tied, allowed, parts=parts)
            pairs = {frozenset((a, b)) for g in groups for h in groups if g is not h for a in g for b in h}
            confirms = {v for v in unconfirmed if _could_confirm(problem, v, allowed)}
            scored.append((len(pairs - apart), len(confirms), -index, description, case, pairs, confirms))
        if not scored:
            break
        gained, confirming, _, description, case, pairs, confirms = max(scored, key=lambda item: item[:3])
        if not gained and not confirming:
            break
        apart |= pairs
        unconfirmed -= confirms
        chosen.append((description, case))
        candidates = [(d, c) for d, c in candidates if d != description]
    if _EXAMPLE.get() is None:
        start_example(call.case)
    out = []
    for description, case in chosen:
        start = len(_EXAMPLE.get().calls)
        try:
            make(case)
        except Exception:  # noqa: BLE001, S112 - no output on this case: it tells nothing
            continue
        out.append((f"a discriminating case ({description})", _EXAMPLE.get().calls[start]))
    return out


def _first_block_blocked(case: Any, rng: np.random.Generator, shared: bool) -> tuple[str, Any] | None:
    """``case`` with KERNEL_BLOCK more queries and keys, where the new queries may attend
    only the keys from KERNEL_BLOCK on: their first key block is fully blocked, their
    row is not (a kernel's NaN first block against NaN fully masked rows). The original
    rows attend the new keys; under either causal alignment a new query sees keys up to
    its own, so some new row has attendable keys past the first block. Needs a mask to
    say it (a case without one is left alone)."""
    from spec.emulate import round_to

    mask = case.attend_mask if case.attend_mask is not None else case.additive_mask
    if mask is None:
        return None
    n = V.KERNEL_BLOCK
    L, S = case.L, case.S
    full = np.broadcast_to(mask, (*mask.shape[:-2], L, S)) if mask.ndim >= 2 else np.broadcast_to(mask, (L, S))
    attend, block = (True, False) if case.attend_mask is not None else (0.0, -np.inf)
    grown = np.full((*full.shape[:-2], L + n, S + n), attend, dtype=full.dtype)
    grown[..., :L, :S] = full
    grown[..., L:, :n] = block                                  # new queries: first block blocked

    def more(x: np.ndarray, axis: int) -> np.ndarray:
        shape = list(x.shape)
        shape[axis] = n
        return np.concatenate([x, round_to(rng.standard_normal(shape), case.dtype).astype(x.dtype)], axis=axis)

    key = more(case.key, -2)
    changes = dict(query=more(case.query, -2), key=key, value=key if shared else more(case.value, -2),
                   layout="contiguous", notes=())
    changes["attend_mask" if case.attend_mask is not None else "additive_mask"] = grown
    return (f"{n} more queries whose first key block is blocked (L={L + n}, S={S + n})", case.replace(**changes))


def _expected_problem(target: Any, case: Any, like: _Call | None = None) -> tuple[Any, Any]:
    """The problem of a call of ``case`` (made as ``like`` was, at the FlashAttention
    levels) and the runner's allowed error for it (the tolerance rule the observation
    will be judged by, so that variants told apart here are told apart by the call too)."""
    if like is not None and like.level == "sharded":
        problem, _, allowed = problem_of(target, _Call("sharded", case, None))
        return problem, allowed
    if like is not None and like.level == "mha":
        prepared = problem_of(target, _Call("mha", case, None))
        return (None, None) if prepared is None else (prepared[0], prepared[2])
    if like is not None and like.level in V.FLASH_FAMILY:
        problem, _, allowed = problem_of(target, _Call(like.level, case, None, extra={"paged": like.extra.get("paged")}))
        return problem, allowed
    problem, _, allowed = _sdpa_problem(target, _Call("sdpa", case, None))
    return problem, allowed


def _sharded_derived_cases(case: Any) -> list[tuple[str, Any]]:
    """The failing sharded case's sizes, world size, layout and masks with every logit far
    below zero and the ranks' blocks a few units apart: near e^-740 (float64) or e^-103
    (the other dtypes, whose partial results merge in float32), where a merge that
    exponentiates each rank's LSE without subtracting the running max loses the blocks'
    weights to subnormal rounding or underflow and returns finite wrong rows (its NaN
    elsewhere is weak evidence). Query i is a multiple of the first axis, key j one
    whose logit is ``base - 2·(j's rank block) - j / S``; values are kept."""
    from spec.emulate import round_to

    out = _two_ranks(case) if case.world_size == 1 else []
    if case.E < 1 or case.L < 2:
        return out
    base = -740.0 if case.dtype == "float64" else -103.0
    scale = case.scale if case.scale is not None else 1.0 / math.sqrt(case.E)
    length = case.L
    shard = max(1, -(-length // max(case.world_size, 1)))
    a = 16.0
    wanted = base - 2.0 * (np.arange(length) // shard) - np.arange(length) / length   # (S,)
    query = np.zeros(case.query.shape)
    query[..., 0] = a
    key = np.zeros(case.key.shape)
    key[..., 0] = (wanted / (a * scale))[None, None, :]
    query, key = (round_to(x, case.dtype) for x in (query, key))
    return [(f"every logit near {base:g}, the rank blocks 2 apart", case.replace(query=query, key=key)), *out]


def _two_ranks(case: Any) -> list[tuple[str, Any]]:
    """A one-rank case sharded over two ranks (L grown to 2 at least, new entries seeded
    normal values in the dtype): a bug that loses a whole rank's block gives every row 0
    on one rank (zeros, which many bugs give) and wrong nonzero rows on two."""
    from conformance.diagnosis.family_cases import _grown

    rng = np.random.default_rng(zlib.crc32(f"diagnosis/sharded/{case.dtype}".encode()))
    more = max(0, 2 - case.L)
    query, key, value = (_grown(rng, x, 2, more, case.dtype) for x in (case.query, case.key, case.value))
    return [(f"two ranks (world_size=2, L={case.L + more})",
             case.replace(query=query, key=key, value=value, world_size=2))]


def _could_confirm(problem: Any, variant_id: str, allowed: Any = None) -> bool:
    """Whether ``variant_id`` predicts on ``problem`` an output that is wrong (beyond the
    allowed error of the oracle) with an element that is finite and not zero: a case that
    can confirm it (agreeing NaN or zeros confirm nothing, ``V.finite_evidence``)."""
    output = V.VARIANTS[variant_id].compute(problem).output
    return _finite_nonzero(output) and V.correct_fit(output, problem, allowed) > 1.0


def _finite_nonzero(output: Any) -> bool:
    """Whether ``output`` has an element that is finite and not zero (NaN and zeros are
    what many bugs make: they confirm nothing)."""
    output = np.asarray(output, dtype=np.float64)
    with np.errstate(all="ignore"):
        return bool((np.isfinite(output) & (output != 0)).any())


def _derived_cases(case: Any) -> list[tuple[str, Any]]:
    """Small changes of ``case`` that separate the usual ties: one or two more queries
    or keys (causal alignments, a one-query shortcut), a key block more (a ragged last
    block), other explicit scales (a falsy or ignored scale; a much smaller one, under
    which q·kᵀ overflowing before the scale still overflows), one more batch item,
    for a masked case KERNEL_BLOCK more queries whose first key block is blocked (a
    kernel's NaN first block against NaN fully masked rows), and for a causal case
    KERNEL_BLOCK more queries and keys (a ragged block dropped, seen past the first block).
    The new entries are seeded normal values rounded to the dtype; new mask entries
    attend. Keys that equal the values (shared kv) stay equal. Contiguous, so any target
    that claims the sizes takes them; ``_discriminating_calls`` keeps only the cases the
    target claims (``directed.examples.admitted``: sizes, max_seq_len, self-attention lengths,
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

    def sized(b: int, l: int, s: int) -> tuple[str, Any]:
        q = grown(case.query, (b, case.N, l, case.E))
        k = grown(case.key, (b, case.K, s, case.E))
        v = k if shared else grown(case.value, (b, case.K, s, case.Ev))
        mask_shape = (b, case.N, l, s)
        return (f"B={b}, L={l}, S={s}", case.replace(
            query=q, key=k, value=v, attend_mask=grown(case.attend_mask, mask_shape, True),
            additive_mask=grown(case.additive_mask, mask_shape, 0.0), layout="contiguous", notes=()))

    out = [sized(b, l, s) for b, l, s in sizes]
    blocked = _first_block_blocked(case, rng, shared)
    if blocked is not None:
        out.append(blocked)
    default = 1.0 / math.sqrt(case.E)
    # a scale 1024 times smaller: logits that overflowed in exp are tame, products that
    # overflow before the scale still do (float16_overflow against no_max_subtraction)
    for scale in (None, 1.5 * default, (default if case.scale is None else case.scale) / 1024):
        if scale != case.scale:
            out.append((f"scale={scale!r}", case.replace(scale=scale, layout="contiguous", notes=())))
    # a key block and as many queries more: under either causal alignment some query then
    # attends keys of a second block, where a variant that reads no key of a short case
    # (a dropped ragged block: all zeros) predicts a nonzero output that can confirm it
    if case.causal is not None:
        out.append(sized(B, L + V.KERNEL_BLOCK, S + V.KERNEL_BLOCK))
    return out
