"""Flash and varlen levels, FP8 inputs (spec.fp8): q, k, v in an 8-bit float format with
FlashAttention-3's ``q_descale``, ``k_descale``, ``v_descale``, against the float64 oracle
on the dequantised values (exact), within a bound derived from the formats' unit
roundoffs (``tolerance.fp8_allowed``).

FP8 is certified here, at the flash level (``flash_attn_func``), the varlen level
(``flash_attn_varlen_func``, descales (B, K) with one row per packed sequence,
``spec.fp8.dequantize_varlen``) and the kvcache level (``flash_attn_with_kvcache``, descales
(B, K) with row b for everything sequence b attends, cached and appended keys alike,
``spec.kvcache_attention``'s descales), the FlashAttention-3 APIs that take FP8 q, k, v with
descale factors; an SDPA-signature function has no
descale arguments, and ``torch.nn.functional.scaled_dot_product_attention`` takes no FP8
inputs. An FP8 call's output is 16- or 32-bit whatever the target's dtype
(FlashAttention-3 returns bfloat16): the property runs on every flash target (so that a
run restricted with ``--dtype`` still checks it), the target's dtype only the one the drawn
values pass through before they are quantised.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conformance.calls.declarations import fit_head_dims, fit_lengths
from functools import partial

from conformance.calls.declarations import require_inside
from conformance.calls.flash import FlashCase, check_fp8, run_flash
from conformance.calls.cache_options import fp8_sequence_bounds
from conformance.calls.varlen import VarlenCallSpec, VarlenCase, run_varlen_call
from conformance.calls.cache_options import check_cache_after
from conformance.calls.kvcache import KVCacheCase, check_kvcache_against_oracle, run_kvcache
from conformance.strategies.varlen import kvcache_directed, kvcache_fp8_cases
from conformance.core.compare import compare_values
from conformance.core.target import call_guarded
from conformance.core.tensors import to_numpy
from conformance.strategies.varlen import varlen_directed, varlen_fp8_cases
from conformance.core.target import Target
from conformance.directed.helpers import flash_named, skip_unless
from conformance.directed.shrink import remember_arguments
from conformance.harness.runner import conformance_property
from conformance.strategies.flash import flash_cases
from spec import fp8 as spec_fp8


def _skip(target: Target) -> str | None:
    return skip_unless(bool(target.caps.fp8_dtypes), "no FP8 formats declared (fp8_dtypes; a function naming "
                       "q_descale/k_descale/v_descale is probed, or --impl-option dtypes=...,float8_e4m3fn)")


def _cases(target: Target) -> Any:
    return flash_cases(dtype=target.dtype, device=target.device, caps=target.caps, shape_budget=target.shape_budget,
                       window=None, softcap=None, alibi=None, sinks=None, fp8=True)


def _directed(target: Target) -> list[FlashCase]:
    """The smallest case of each FP8 bug class: descales that differ between q, k and v and
    between kv heads (a descale applied twice, ignored, or read by the query head), GQA
    (N = 4 query heads on K = 2 kv heads), per-tensor descales, causal rows, L > S."""
    caps = target.caps
    rng = np.random.default_rng(17)
    out = []
    shapes = [(1, 2, 2, 1, 3, 2, 2), (1, 4, 2, 2, 3, 2, 2), (1, 1, 1, 3, 2, 2, 2)]
    if not caps.gqa:
        shapes = [(B, N, N, L, S, E, Ev) for B, N, _, L, S, E, Ev in shapes]
    for fmt in caps.fp8_dtypes:
        for B, N, K, L, S, E, Ev in shapes:
            lengths, dims = fit_lengths(caps, L, S), fit_head_dims(caps, E, Ev)
            if lengths is None or dims is None:
                continue
            (L, S), (E, Ev) = lengths, dims
            q, k, v = (spec_fp8.quantize(rng.standard_normal(s) * 8, fmt)
                       for s in ((B, L, N, E), (B, S, K, E), (B, S, K, Ev)))
            per_head = [np.float32(0.5 * 2.0 ** np.arange(K) + i / 8).astype(np.float64)[None].repeat(B, 0)
                        for i in range(3)]
            base = FlashCase(q, k, v, fp8=fmt, dtype=target.dtype, device=target.device, notes=("directed",))
            variants = [dict(q_descale=per_head[0], k_descale=per_head[1], v_descale=per_head[2]),
                        dict(q_descale=np.array([0.25]), k_descale=np.array([0.375]), v_descale=np.array([3.0]))]
            if caps.causal == "lower_right":
                variants.append(dict(variants[0], causal=True))
            for changes in variants:
                forms = {"per_head" if d.shape != (1,) else "per_tensor"
                         for d in (changes["q_descale"], changes["k_descale"], changes["v_descale"])}
                if not forms <= set(caps.fp8_descales):
                    continue
                if caps.causal_only:
                    changes = {**changes, "causal": True}
                out.append(flash_named(base, changes))
    return remember_arguments(out, {"fp8": True})  # for directed.shrink


@conformance_property(
    "fp8_agreement", level="flash", section="spec.fp8 (stored · descale, then spec.flash_attention)",
    cases=_cases,
    directed=_directed,
    skip_reason=_skip,
)
def test_fp8_agreement(target: Target, case: FlashCase) -> float:
    """q, k, v in an FP8 format (fp8_dtypes) with q_descale, k_descale, v_descale (none, per
    tensor, or (B, K) per batch element and kv head; query head h uses its kv head's) stand
    for stored · descale: the output (bfloat16, float16 or float32) equals spec.flash_attention
    on those exact values within a bound derived from the formats' unit roundoffs
    (tolerance.fp8_allowed: probabilities rounded to FP8 before P·V, the scores'
    accumulation, the output's own rounding); the LSE likewise, when declared."""
    call = run_flash(target, case, lse="lse" in target.caps.flash_features)
    return check_fp8(target, case, call)


# --------------------------------------------------------------------------- varlen level


def _varlen_skip(target: Target) -> str | None:
    return skip_unless("fp8" in target.caps.varlen_features and bool(target.caps.fp8_dtypes),
                       "FP8 not declared at the varlen level (varlen_features fp8 with fp8_dtypes; a "
                       "q_descale/k_descale/v_descale parameter of flash_attn_varlen_func claims it)")


def _varlen_directed(target: Target) -> list[VarlenCase]:
    """The varlen level's directed layouts in each FP8 format with descales that differ
    between the sequences, between q, k and v and between kv heads (a descale row read by
    the batch element instead of the sequence, or ignored), and per tensor."""
    caps = target.caps
    out = []
    for fmt in caps.fp8_dtypes:
        for case in varlen_directed(dtype=target.dtype, device=target.device, caps=caps):
            q, k, v = (spec_fp8.quantize(x * 8, fmt) for x in (case.query, case.key, case.value))
            rows = [np.float32(0.5 * 2.0 ** (np.arange(case.K) + b) + j / 8).astype(np.float64)
                    for j in range(3) for b in range(case.B)]
            per_sequence = [np.stack(rows[j * case.B:(j + 1) * case.B]) for j in range(3)]
            variants = [dict(zip(("q_descale", "k_descale", "v_descale"), per_sequence, strict=True)),
                        dict(q_descale=np.array([0.25]), k_descale=np.array([0.375]), v_descale=np.array([3.0]))]
            for changes in variants:
                forms = {"per_head" if d.shape != (1,) else "per_tensor" for d in changes.values()}
                if forms <= set(caps.fp8_descales):
                    per = "per sequence and kv head" if forms == {"per_head"} else "per tensor"
                    out.append(case.replace(query=q, key=k, value=v, fp8=fmt, **changes,
                                            notes=case.named_with(f"{fmt}, descales {per}")))
    return remember_arguments(out, {})  # for directed.shrink (sizes only: FP8 values as written)


@conformance_property(
    "varlen_fp8_agreement", level="varlen", section="spec.fp8 (dequantize_varlen, then spec.varlen_attention)",
    cases=lambda t: varlen_fp8_cases(dtype=t.dtype, device=t.device, caps=t.caps),
    directed=_varlen_directed,
    skip_reason=_varlen_skip,
)
def test_varlen_fp8_agreement(target: Target, case: VarlenCase) -> float:
    """Packed FP8 q, k, v with q_descale, k_descale, v_descale (none, per tensor, or (B, K):
    row b for packed sequence b, query head h reading kv head h // (N // K)'s) stand for
    stored · descale: each sequence's rows of the output (16- or 32-bit) equal
    spec.varlen_attention on those exact values within tolerance.fp8_allowed for the dtype
    it came back in, sequence by sequence (empty and one-token sequences included)."""
    call = VarlenCallSpec(case)
    require_inside(target, call)
    if target.log is not None:
        target.log.calls.append(call)
    out = run_varlen_call(target.impl, call, invoke=partial(call_guarded, target))
    expected, allowed, live = fp8_sequence_bounds(case, out_dtype=str(out.dtype).removeprefix("torch."))
    where = None if target.caps.fully_masked == "zero" else live
    return compare_values(f"packed output (q, k, v in {case.fp8})", to_numpy(out), expected, allowed,
                          where=where).ratio


# --------------------------------------------------------------------------- kvcache level


def _kvcache_skip(target: Target) -> str | None:
    return skip_unless("fp8" in target.caps.kvcache_features and bool(target.caps.fp8_dtypes),
                       "FP8 not declared at the kvcache level (kvcache_features fp8 with fp8_dtypes; a "
                       "q_descale/k_descale/v_descale parameter of flash_attn_with_kvcache claims it)")


#: FlashAttention's options and the cache's own (not rotary: FP8 has none) drawn half the time where declared.
_KVCACHE_DRAWN = {"window": None, "softcap": None, "alibi": None, "cache_batch_idx": None, "cache_leftpad": None,
                  "num_splits": None}


def _kvcache_cases(target: Target) -> Any:
    from hypothesis import strategies as st

    def drawn(paged: bool) -> Any:
        return kvcache_fp8_cases(dtype=target.dtype, device=target.device, caps=target.caps, paged=paged,
                                 append=None, **({} if paged else _KVCACHE_DRAWN))

    return st.one_of(drawn(False), drawn(True)) if target.caps.kv_paged else drawn(False)


def _kvcache_fp8_directed(target: Target) -> list[KVCacheCase]:
    """The kvcache level's directed steps (an empty cache with a stale row, an append into a
    cache with room, causal L = 2; paged with pages in reverse order where declared) in each
    FP8 format with descales that differ between the sequences, between q, k and v and between
    kv heads (a descale applied to the cached keys only, or read by the cache row), and per
    tensor."""
    caps = target.caps
    out: list[KVCacheCase] = []
    layouts = [False, True] if caps.kv_paged else [False]
    for fmt in caps.fp8_dtypes:
        for case in (c for paged in layouts
                     for c in kvcache_directed(dtype=target.dtype, device=target.device, caps=caps, paged=paged)):
            changes = {n: None if getattr(case, n) is None else spec_fp8.quantize(getattr(case, n) * 8, fmt)
                       for n in ("query", "k_cache", "v_cache", "k_new", "v_new")}
            per_sequence = [np.stack([np.float32(0.5 * 2.0 ** (np.arange(case.K) + b) + j / 8).astype(np.float64)
                                      for b in range(case.B)]) for j in range(3)]
            variants = [dict(zip(("q_descale", "k_descale", "v_descale"), per_sequence, strict=True)),
                        dict(q_descale=np.array([0.25]), k_descale=np.array([0.375]), v_descale=np.array([3.0]))]
            for descales in variants:
                forms = {"per_head" if d.shape != (1,) else "per_tensor" for d in descales.values()}
                if forms <= set(caps.fp8_descales):
                    per = "per sequence and kv head" if forms == {"per_head"} else "per tensor"
                    out.append(case.replace(**changes, fp8=fmt, **descales,
                                            notes=case.named_with(f"{fmt}, descales {per}")))
    # for directed.shrink: the arguments of the _kvcache_cases strategy that draws each layout
    for case in out:
        remember_arguments([case], {"fp8": True, "paged": case.paged, "append": None,
                                    **({} if case.paged else _KVCACHE_DRAWN)})
    return out


@conformance_property(
    "kvcache_fp8_agreement", level="kvcache", section="spec.kvcache_attention (FP8: q_descale, k_descale, v_descale)",
    cases=_kvcache_cases,
    directed=_kvcache_fp8_directed,
    skip_reason=_kvcache_skip,
)
def test_kvcache_fp8_agreement(target: Target, case: KVCacheCase) -> float:
    """FP8 q, caches and new keys and values with q_descale, k_descale, v_descale (none, per
    tensor, or (B, K): row b for everything sequence b attends, its cached and its appended
    keys alike, query head h reading kv head h // (N // K)'s) stand for stored · descale: each
    sequence's output (bfloat16) equals spec.kvcache_attention on those exact values within
    tolerance.fp8_allowed, batch row by batch row; the caches after the call hold the stored
    values, the new ones written in at cache_seqlens[b] exactly."""
    call = run_kvcache(target, case)
    ratio = check_kvcache_against_oracle(target, case, call.output)
    ref = case.oracle()
    check_cache_after("k_cache after the call", call.k_cache, ref.k_cache, case, keys=True)
    check_cache_after("v_cache after the call", call.v_cache, ref.v_cache, case, keys=False)
    return ratio
