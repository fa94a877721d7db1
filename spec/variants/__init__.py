"""Wrong conventions of attention, as data: the oracle run the ways real code gets it wrong.

On a failing case, the question after "wrong" is "wrong how?". Each :class:`Variant` is
one known wrong convention (causal alignment, GQA head map, scale, mask polarity,
fully-masked rows, softmax precision, head split/merge, ...) computed in float64 on the
same inputs; :func:`rank` says which of them the observed output matches.

Public API::

    SDPAProblem(query, key, value, *, attend_mask, additive_mask, causal, scale, dtype,
                dropout_p, fully_masked)                    # SDPAProblem.from_case(case, **changes)
    MHAProblem(params, query, key, value, *, key_padding_mask, attn_mask, is_causal,
               need_weights, average_attn_weights, batch_first, dtype, dropout, training,
               fully_masked)                                # MHAProblem.from_case(case, **changes)
    ShardedProblem(query, key, value, *, world_size, layout, causal, window, scale, dtype)
                                                            # ShardedProblem.from_case(case)
    FlashProblem(query, key, value, *, causal, window, softcap, alibi_slopes, scale, sinks, dtype,
                 fully_masked)                              # flash_attn_func's layout
    VarlenProblem(query, key, value, cu_seqlens_q, cu_seqlens_k, *, causal, window, softcap,
                  alibi_slopes, scale, dtype, fully_masked)  # flash_attn_varlen_func's
    KVCacheProblem(query, k_cache, v_cache, cache_seqlens, *, k_new, v_new, block_table,
                   rotary_cos, rotary_sin, rotary_interleaved, cache_batch_idx, cache_leftpad,
                   num_splits, causal, window, softcap, alibi_slopes, scale, dtype, fully_masked)
    Variant(id, level, summary, models, applies, compute, detect, precision)
        variant.applies(problem) -> bool
        variant.compute(problem) -> VariantResult(output, weights, slack, lse, k_cache, v_cache,
                                                  magnitude, score_size)   # None: not deterministic
    VARIANTS: dict[str, Variant]    ALIASES: dict[str, str]    lookup(name) -> Variant
    reference(problem) -> VariantResult                    # the correct convention
    rank(observed, problem, variants=None, allowed=None) -> list[Match(variant_id, fit)]
    correct_fit(observed, problem, allowed=None) -> float  # <= 1: the oracle explains it
    variant_fit(observed, problem, variant, allowed=None) -> float   # <= 1: the variant explains it
    partition(problem, variants, allowed=None, outputs_only=False) -> [[id, ...], ...]  # grouped by output
    finite_evidence(observed, problem, variant, allowed=None) -> bool  # False: NaN- or zero-only agreement
    as_correct(level) -> Variant                           # the oracle as a pseudo-variant "correct"
    fit(actual, expected, allowed, where=None) -> float    default_allowed(problem)

An observation is the output, an ``(output, weights)`` pair, or a dict of the parts a call
returned (``output``, ``weights``, ``lse``, ``k_cache``, ``v_cache``).
Conventions are the spec's: SDPA bool masks True = may attend, MHA bool masks True =
blocked, float masks added. A problem's ``fully_masked`` is the policy the implementation
declares ("zero", "nan", "uniform" or "unspecified"). docs/DIAGNOSIS.md lists every
variant with the real bug it stands for.
"""

from __future__ import annotations

from ._core import (FLASH_FAMILY, LEVELS, POLICIES, MHAProblem, Problem, SDPAProblem, ShardedProblem, Variant,
                    VariantResult)
from ._family import FamilyProblem, FlashProblem, KVCacheProblem, VarlenProblem
from .flash import FLASH_VARIANTS
from .kvcache import KVCACHE_VARIANTS
from ._rank import (COARSE_ERROR_FLOOR, CONCRETE_POLICIES, DEFAULT_ULPS, Allowed, Match, Observed, as_correct,
                    correct_fit, default_allowed, finite_evidence, fit, partition, precision_factor, rank, reference,
                    variant_fit)
from .mha import MHA_VARIANTS
from .registry import ALIASES, VARIANTS, lookup
from .sdpa import KERNEL_BLOCK, SDPA_VARIANTS
from .sharded import SHARDED_VARIANTS
from .varlen import VARLEN_VARIANTS

__all__ = [
    "SDPAProblem",
    "MHAProblem",
    "ShardedProblem",
    "FlashProblem",
    "VarlenProblem",
    "KVCacheProblem",
    "FamilyProblem",
    "Problem",
    "Variant",
    "VariantResult",
    "VARIANTS",
    "SDPA_VARIANTS",
    "MHA_VARIANTS",
    "SHARDED_VARIANTS",
    "FLASH_VARIANTS",
    "VARLEN_VARIANTS",
    "KVCACHE_VARIANTS",
    "ALIASES",
    "lookup",
    "reference",
    "rank",
    "correct_fit",
    "variant_fit",
    "partition",
    "finite_evidence",
    "as_correct",
    "CONCRETE_POLICIES",
    "precision_factor",
    "Match",
    "fit",
    "default_allowed",
    "Allowed",
    "Observed",
    "DEFAULT_ULPS",
    "COARSE_ERROR_FLOOR",
    "KERNEL_BLOCK",
    "LEVELS",
    "FLASH_FAMILY",
    "POLICIES",
]
