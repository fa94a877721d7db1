"""The smallest case of each flash-, varlen- and kvcache-level variant, built from the
record of the bug-zoo mutant it models (``smallest_case``, in the vocabulary of
``implementations/mutants/flash/flash_mutants.py`` and ``varlen_mutants.py``), and the mutant
run through torch on a problem (:func:`run_mutant`), read back as the runner reads it.

Shared by ``test_variants.py`` (every deterministic variant has a case) and
``test_flash_variants.py``.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

import spec
from spec import variants as V

#: Variant -> the bug-zoo mutant whose smallest case is the variant's case.
MUTANT_OF = {
    "flash_causal_upper_left": "flash_causal_top_left",
    "flash_window_left_off_by_one": "flash_window_left_off_by_one",
    "flash_window_ignored": "contract_flash_window_no_effect",
    "flash_softcap_before_scale": "flash_softcap_before_scale",
    "flash_alibi_upper_left": "flash_alibi_top_left",
    "flash_lse_log2": "flash_lse_log2",
    "flash_lse_uncapped": "flash_lse_uncapped",
    "flash_sink_with_value": "flash_sink_key_with_value",
    "flash_sink_after_shift": "flash_sink_after_shift",
    "flash_sink_per_row": "flash_sink_per_row",
    "flash_sink_weight_kept": "flash_sink_weight_kept",
    "flash_sink_scaled": "flash_sink_scaled",
    "varlen_neighbour_key": "varlen_neighbour_key",
    "varlen_scale_over_e": "varlen_scale_over_e",
    "varlen_softcap_after_mask": "varlen_softcap_after_mask",
    "varlen_lse_packed": "varlen_lse_packed",
    "kvcache_seqlens_off_by_one": "kvcache_seqlens_off_by_one",
    "kvcache_append_at_start": "kvcache_append_at_start",
    "kvcache_append_not_written": "kvcache_append_not_written",
    "kvcache_causal_upper_left": "kvcache_causal_top_left",
    "kvcache_block_table_ignored": "paged_block_table_ignored",
    "kvcache_window_ignores_cache": "kvcache_window_ignores_cache",
    "kvcache_lse_whole_cache": "kvcache_lse_whole_cache",
    "kvcache_rotary_relative_positions": "kvcache_rotary_relative_positions",
    "kvcache_rotary_queries_per_row": "kvcache_rotary_queries_per_row",
    "kvcache_rotary_interleave_swapped": "kvcache_rotary_interleave_swapped",
    "kvcache_leftpad_causal_offset": "kvcache_leftpad_causal_offset",
    "kvcache_leftpad_ignored": "kvcache_leftpad_ignored",
    "kvcache_batch_idx_ignored_on_write": "kvcache_batch_idx_ignored_on_write",
    "kvcache_batch_idx_ignored_on_read": "kvcache_batch_idx_ignored_on_read",
    "kvcache_split_merge_without_max": "kvcache_split_merge_without_max",
    "kvcache_split_merge_without_rescale": "kvcache_split_merge_without_rescale",
}


def _float32(values: Any) -> np.ndarray | None:
    """Slopes and sinks are handed over as float32: exact there."""
    return None if values is None else np.asarray(values, dtype=np.float32).astype(np.float64)


def flash_problem(case: dict, seed: int = 0) -> V.FlashProblem:
    rng = np.random.default_rng(seed)
    B, N, K, L, S, E, Ev = (case.get(d, 1) for d in ("B", "N", "K", "L", "S", "E", "Ev"))
    q, k, v = (rng.standard_normal(shape) for shape in ((B, L, N, E), (B, S, K, E), (B, S, K, Ev)))
    return V.FlashProblem(q, k, v, causal=bool(case.get("causal")), window=tuple(case.get("window", (-1, -1))),
                          softcap=float(case.get("softcap", 0.0)), alibi_slopes=_float32(case.get("alibi")),
                          sinks=_float32(case.get("sinks")))


def varlen_problem(case: dict, seed: int = 0) -> V.VarlenProblem:
    rng = np.random.default_rng(seed)
    lengths = case["lengths"]
    cu_q = tuple(int(x) for x in np.cumsum([0] + [L for L, _ in lengths]))
    cu_k = tuple(int(x) for x in np.cumsum([0] + [S for _, S in lengths]))
    q = rng.standard_normal((cu_q[-1], case["N"], case["E"]))
    k = rng.standard_normal((cu_k[-1], case["K"], case["E"]))
    v = rng.standard_normal((cu_k[-1], case["K"], case["Ev"]))
    return V.VarlenProblem(q, k, v, cu_q, cu_k, causal=bool(case.get("causal")),
                           window=tuple(case.get("window", (-1, -1))), softcap=float(case.get("softcap", 0.0)),
                           alibi_slopes=_float32(case.get("alibi")))


def kvcache_problem(case: dict, seed: int = 0) -> V.KVCacheProblem:
    rng = np.random.default_rng(seed)
    seqlens = tuple(case["cache_seqlens"])
    B, L, N, K, E, Ev, new = len(seqlens), case["L"], case["N"], case["K"], case["E"], case["Ev"], case["S_new"]
    table = None
    if case.get("page_size"):
        rows = (case["num_pages"], case["page_size"])
        table = np.array(case["block_table"])
    else:
        rows = (case.get("B_cache", B), case["S_cache"])
    q = rng.standard_normal((B, L, N, E))
    k_cache, v_cache = rng.standard_normal((*rows, K, E)), rng.standard_normal((*rows, K, Ev))
    if case.get("values") == "huge":  # q = 30, keys ±30: logits beyond float64's exp range
        q = np.full(q.shape, 30.0)
        k_cache = np.where(np.arange(k_cache.size).reshape(k_cache.shape) % 3 == 1, -30.0, 30.0)
    k_new = rng.standard_normal((B, new, K, E)) if new else None
    v_new = rng.standard_normal((B, new, K, Ev)) if new else None
    options: dict[str, Any] = {}
    if case.get("rotary_dim"):
        angle = rng.uniform(0, 2 * np.pi, (case["S_cache"] + L + 2, case["rotary_dim"] // 2))
        options.update(rotary_cos=np.cos(angle), rotary_sin=np.sin(angle),
                       rotary_interleaved=bool(case.get("rotary_interleaved", True)))
    for name in ("cache_batch_idx", "cache_leftpad", "num_splits"):
        if case.get(name) is not None:
            options[name] = case[name]
    return V.KVCacheProblem(q, k_cache, v_cache, seqlens, k_new=k_new, v_new=v_new, block_table=table,
                            causal=bool(case.get("causal")), window=tuple(case.get("window", (-1, -1))),
                            softcap=float(case.get("softcap", 0.0)), alibi_slopes=_float32(case.get("alibi")),
                            **options)


BUILDERS: dict[str, Callable[..., Any]] = {"flash": flash_problem, "varlen": varlen_problem,
                                           "kvcache": kvcache_problem}


def smallest_problem(variant_id: str) -> Any:
    """The smallest case of the mutant that ``variant_id`` models, as a problem."""
    from implementations.mutants import MUTANTS

    mutant = MUTANTS[MUTANT_OF[variant_id]]
    return BUILDERS[mutant.level](mutant.smallest_case)


#: The smallest case of each FlashAttention-level variant (every one is deterministic).
FAMILY_CASES: dict[str, Callable[[], Any]] = {
    variant_id: (lambda variant_id=variant_id: smallest_problem(variant_id)) for variant_id in MUTANT_OF}


def observed_parts(result: V.VariantResult) -> dict[str, np.ndarray]:
    """What a call returns, as an observation: the output and the parts the result has."""
    return {part: getattr(result, part) for part in ("output", "lse", "k_cache", "v_cache")
            if getattr(result, part) is not None}


def run_mutant(name: str, problem: Any) -> dict[str, np.ndarray]:
    """The mutant's output on ``problem`` through torch, in the problem's dtype: the output,
    the LSE (+inf read as -inf) and, at the kvcache level, the caches after the call (a
    paged call's gathered through its block table)."""
    import torch

    from implementations.mutants import MUTANTS

    impl = MUTANTS[name].build()
    dtype = getattr(torch, problem.dtype)

    def tensor(array: Any, kind: Any = None) -> Any:
        return None if array is None else torch.tensor(np.asarray(array), dtype=kind or dtype)

    def ints(values: Any) -> Any:
        return torch.tensor(np.asarray(values), dtype=torch.int32)

    def lse_of(lse: Any) -> np.ndarray:
        lse = lse.double().numpy()
        return np.where(np.isposinf(lse), -np.inf, lse)

    options: dict[str, Any] = {"softmax_scale": problem.scale, "causal": bool(problem.causal)}
    if tuple(problem.window) != (-1, -1):
        options["window_size"] = tuple(problem.window)
    if problem.softcap:
        options["softcap"] = float(problem.softcap)
    if problem.alibi_slopes is not None:
        options["alibi_slopes"] = tensor(problem.alibi_slopes, torch.float32)
    if problem.level == "flash":
        if problem.sinks is not None:
            options["sinks"] = tensor(problem.sinks, torch.float32)
        out, lse, _ = impl.flash(tensor(problem.query), tensor(problem.key), tensor(problem.value),
                                 return_attn_probs=True, **options)
        return {"output": out.detach().double().numpy(), "lse": lse_of(lse)}
    if problem.level == "varlen":
        lengths = [(b.stop - b.start, c.stop - c.start) for b, c in problem.sequences()]
        out, lse, _ = impl.varlen(tensor(problem.query), tensor(problem.key), tensor(problem.value),
                                  ints(problem.cu_seqlens_q), ints(problem.cu_seqlens_k),
                                  max(L for L, _ in lengths), max(S for _, S in lengths), return_attn_probs=True,
                                  **options)
        return {"output": out.double().numpy(), "lse": lse_of(lse)}
    k_cache, v_cache = tensor(problem.k_cache), tensor(problem.v_cache)
    if problem.block_table is not None:
        options["block_table"] = ints(problem.block_table)
    if problem.k_new is not None:
        options.update(k=tensor(problem.k_new), v=tensor(problem.v_new))
    if problem.rotary_cos is not None:
        options.update(rotary_cos=tensor(problem.rotary_cos), rotary_sin=tensor(problem.rotary_sin),
                       rotary_interleaved=bool(problem.rotary_interleaved))
    for name in ("cache_batch_idx", "cache_leftpad"):
        if getattr(problem, name) is not None:
            options[name] = ints(getattr(problem, name))
    if problem.num_splits is not None:
        options["num_splits"] = int(problem.num_splits)
    out, lse = impl.kvcache(tensor(problem.query), k_cache, v_cache, cache_seqlens=ints(problem.cache_seqlens),
                            return_softmax_lse=True, **options)
    k_after, v_after = k_cache.double().numpy(), v_cache.double().numpy()
    if problem.block_table is not None:
        k_after, v_after = (spec.gather_pages(x, problem.block_table) for x in (k_after, v_after))
    return {"output": out.double().numpy(), "lse": lse_of(lse), "k_cache": k_after, "v_cache": v_after}
