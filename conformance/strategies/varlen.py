"""Packed variable-length batches and KV-cache decoding steps (``varlen_cases``, ``kvcache_cases``).

Structure (sequence lengths, heads, head dims, causal, scale, page size, page order) is
drawn by Hypothesis and shrinks toward the simplest case: one sequence of length 1, N =
K = 1, E = Ev = 1, no causal flag, default scale, contiguous pages in order. Lengths are
drawn with extra weight on 0 and 1 (an empty sequence, a single token), and page sizes
both dividing and not dividing the lengths. Array values come from one drawn seed (the
seed shrinks to 0), drawn in float64 and rounded through the dtype (``round_to``).

With ``caps`` given, only cases inside the claims are drawn: GQA only with ``gqa``,
Ev != E only with ``different_v_dim``, causal only when the flag means FlashAttention's
bottom-right alignment, appended keys only with ``kv_append``, pages only with ``kv_paged``;
FlashAttention's options (a sliding window, soft-capping, ALiBi slopes (N,) or (B, N))
only where ``caps.varlen_features`` / ``caps.kvcache_features`` declare them, drawn as the
flash level draws them (``conformance.strategies.flash``) against the longest sequence.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from conformance.calls.declarations import fit_head_dims
from conformance.calls.kvcache import KVCacheCase
from conformance.calls.varlen import VarlenCase
from conformance.strategies._drawing import draw_seed, named_strategy, weighted
from conformance.strategies.flash import _descale, alibi_slopes, softcaps, window_sides
from conformance.strategies.kvcache_features import (
    CACHE_FEATURES,
    batch_rows,
    fit_rotary_window,
    leftpads,
    num_splits_fields,
    rotary_multiple,
    rotary_tables,
    wanted_cache,
)
from implementations.base import Capabilities
from spec import fp8 as spec_fp8
from spec.emulate import round_to

__all__ = ["kvcache_cases", "kvcache_directed", "kvcache_fp8_cases", "kvcache_head_dims", "varlen_cases",
           "varlen_directed",
           "varlen_fp8_cases"]


def _length(draw: st.DrawFn, max_len: int) -> int:
    """A sequence length: 1 (one token), 0 (empty), or anything up to ``max_len``; shrinks to 1."""
    if not max_len:
        return 0
    picked = weighted(draw, [(1, 3), (0, 2), (None, 6)])
    return draw(st.integers(0, max_len)) if picked is None else picked


def _heads(draw: st.DrawFn, caps: Capabilities | None, min_e: int = 1) -> tuple[int, int, int, int]:
    """(N, K, E, Ev) within the claims (E >= ``min_e`` where a declared head dim is)."""
    K = draw(st.integers(1, 2))
    group = draw(st.integers(1, 3)) if caps is None or caps.gqa else 1
    dims = kvcache_head_dims(caps)
    E = draw(st.sampled_from([d for d in dims if d >= min_e] or dims))
    if caps is not None and not caps.different_v_dim:
        return K * group, K, E, E
    Ev = draw(st.sampled_from([E] + [d for d in _head_dims(caps, (1, 2, 5)) if d != E]))
    return K * group, K, E, Ev


def _head_dims(caps: Capabilities | None, typical: tuple[int, ...]) -> list[int]:
    """The ``typical`` head dims inside the declared [min_head_dim, max_head_dim]; where
    none is, the bound's smallest ones (min_head_dim, + 1, twice it)."""
    lo = (caps.min_head_dim if caps is not None else None) or 1
    hi = caps.max_head_dim if caps is not None and caps.max_head_dim is not None else None
    if hi is not None and lo > hi:
        raise InvalidArgument(f"caps.min_head_dim={lo} > caps.max_head_dim={hi} leaves no head dim; "
                              "declare bounds that overlap")
    if caps is not None and caps.head_dims is not None:  # a declared set: its smallest three inside
        return [d for d in caps.head_dims if d >= lo and (hi is None or d <= hi)][:3]
    inside = [d for d in typical if d >= lo and (hi is None or d <= hi)]
    if inside:
        return inside
    return sorted({d for d in (lo, lo + 1, 2 * lo) if hi is None or d <= hi})


def kvcache_head_dims(caps: Capabilities | None) -> list[int]:
    """The head dims E the kvcache strategies draw from, inside the declarations."""
    return _head_dims(caps, (1, 2, 3, 4, 8))


def _max_length(caps: Capabilities | None, wanted: int) -> int:
    """``wanted`` within the declared ``max_seq_len``."""
    bound = caps.max_seq_len if caps is not None else None
    return wanted if bound is None else min(wanted, bound)


def _causal(draw: st.DrawFn, caps: Capabilities | None, causal: bool | None) -> bool:
    allowed = caps is None or caps.causal == "lower_right"
    if caps is not None and caps.causal_only and allowed:
        return True
    return causal if causal is not None else (allowed and draw(st.booleans()))


def _scale(draw: st.DrawFn, caps: Capabilities | None, dtype: str) -> float | None:
    if caps is not None and not caps.custom_scale:
        return None
    kind = weighted(draw, [("default", 3), ("drawn", 1)])
    drawn = (0.5, 0.125, 1.0) if getattr(caps, "positive_scale", False) else (0.5, 0.125, 1.0, -0.5)
    return None if kind == "default" else float(round_to(draw(st.sampled_from(drawn)), dtype))


def _values(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return round_to(rng.standard_normal(shape), dtype)


#: The options the varlen and kvcache strategies draw, by feature name.
OPTION_FEATURES = ("window", "softcap", "alibi")


def _wanted(draw: st.DrawFn, declared: frozenset[str], wanted: dict[str, bool | None],
            at_least_one: bool) -> set[str]:
    """The options to draw: each True (always, where declared), False (never) or None
    (half the time, where declared); with ``at_least_one``, one declared option is forced
    when none came up."""
    chosen = {name for name in OPTION_FEATURES if name in declared
              and (wanted.get(name) is True or (wanted.get(name) is None and draw(st.booleans())))}
    available = [name for name in OPTION_FEATURES if name in declared and wanted.get(name) is not False]
    if at_least_one and not chosen and available:
        chosen.add(draw(st.sampled_from(available)))
    return chosen


def _options(draw: st.DrawFn, rng: np.random.Generator, chosen: set[str], *, B: int, N: int, L: int, S: int,
             max_logit: float) -> dict[str, Any]:
    """The drawn options as case fields (window, softcap, alibi_slopes), against the longest
    query (L) and key (S) sequence and the largest |scaled logit|."""
    fields: dict[str, Any] = {}
    if "window" in chosen:
        left, right = window_sides(draw, L, S), window_sides(draw, L, S)
        if (left, right) == (-1, -1):
            right = draw(st.integers(0, max(L, S)))
        fields["window"] = (left, right)
    if "softcap" in chosen:
        fields["softcap"] = softcaps(draw, max_logit)
    if "alibi" in chosen:
        fields["alibi_slopes"] = alibi_slopes(draw, rng, B, N)
    return fields


def _max_logit(q: np.ndarray, k: np.ndarray, scale: float | None) -> float:
    """A bound on the largest |scaled logit| (Σ_e max|q| max|k| · |scale|)."""
    if not q.size or not k.size:
        return 1.0
    s = 1 / np.sqrt(q.shape[-1]) if scale is None else abs(scale)
    return float(np.abs(q).max() * np.abs(k).max() * q.shape[-1] * s) or 1.0


def varlen_cases(*, dtype: str = "float64", device: str = "cpu", caps: Capabilities | None = None,
                 causal: bool | None = None, max_batch: int = 4, max_len: int = 7,
                 window: bool | None = False, softcap: bool | None = False, alibi: bool | None = False,
                 at_least_one: bool = False) -> st.SearchStrategy[VarlenCase]:
    """Packed batches of ``1..max_batch`` sequences, each with ``0..max_len`` queries and keys
    (``causal=None``: drawn where declared). Shrinks toward one sequence of one query and
    one key, N = K = E = Ev = 1. ``window``/``softcap``/``alibi``: True, False or None
    (drawn) where ``caps.varlen_features`` declares them; ``at_least_one``: one of them always."""
    if max_batch < 1 or max_len < 0:
        raise InvalidArgument(f"max_batch={max_batch!r}, max_len={max_len!r}: need max_batch >= 1, max_len >= 0")
    if causal and caps is not None and caps.causal != "lower_right":
        raise InvalidArgument(f"causal={causal!r} but caps.causal={caps.causal!r}; FlashAttention's "
                              "flag is bottom-right: declare causal='lower_right' or pass causal=None")

    longest = _max_length(caps, max_len)
    equal = caps is not None and caps.self_attention_lengths

    def draw_example(draw: st.DrawFn) -> VarlenCase:
        B = draw(st.integers(1, max_batch))
        lengths = []
        for _ in range(B):
            L = _length(draw, longest)
            S = L if equal or draw(st.booleans()) else _length(draw, longest)   # self-attention often
            lengths.append((L, S))
        N, K, E, Ev = _heads(draw, caps)
        is_causal = _causal(draw, caps, causal)
        scale = _scale(draw, caps, dtype)
        rng = draw_seed(draw)
        T_q, T_k = sum(L for L, _ in lengths), sum(S for _, S in lengths)
        q, k = _values(rng, (T_q, N, E), dtype), _values(rng, (T_k, K, E), dtype)
        v = _values(rng, (T_k, K, Ev), dtype)
        chosen = _wanted(draw, declared, wanted, at_least_one)
        fields = _options(draw, rng, chosen, B=B, N=N, L=max(L for L, _ in lengths),
                          S=max(S for _, S in lengths), max_logit=_max_logit(q, k, scale))
        return VarlenCase(
            q, k, v,
            cu_seqlens_q=tuple(int(x) for x in np.cumsum([0] + [L for L, _ in lengths])),
            cu_seqlens_k=tuple(int(x) for x in np.cumsum([0] + [S for _, S in lengths])),
            causal=is_causal, scale=scale, dtype=dtype, device=device, **fields)

    declared = caps.varlen_features if caps is not None else frozenset(OPTION_FEATURES)
    wanted = {"window": window, "softcap": softcap, "alibi": alibi}
    return named_strategy(varlen_cases, {"dtype": dtype, "device": device, "caps": caps, "causal": causal,
                                             "max_batch": max_batch, "max_len": max_len, **wanted,
                                             "at_least_one": at_least_one}, draw_example)


def kvcache_cases(*, dtype: str = "float64", device: str = "cpu", caps: Capabilities | None = None,
                  paged: bool = False, append: bool | None = None, max_batch: int = 3,
                  max_query: int = 3, max_cache: int = 9, window: bool | None = False,
                  softcap: bool | None = False, alibi: bool | None = False,
                  at_least_one: bool = False, rotary: bool | None = False, cache_batch_idx: bool | None = False,
                  cache_leftpad: bool | None = False,
                  num_splits: bool | None = False) -> st.SearchStrategy[KVCacheCase]:
    """Decoding steps: B in ``1..max_batch`` sequences of ``1..max_query`` queries against
    caches of ``cache_seqlens[b]`` valid rows (0 included) and room to spare (so reading
    past the valid rows shows); ``append`` (None: drawn where declared) adds 1..2 new keys.
    ``paged``: the case carries a page size (1..4, dividing the valid lengths or not) and
    a page order (a permutation, spare pages included). Shrinks toward B = L = 1, an empty
    cache, no append, pages in order. ``window``/``softcap``/``alibi``: as for
    :func:`varlen_cases`, where ``caps.kvcache_features`` declares them. ``rotary``,
    ``cache_batch_idx``, ``cache_leftpad``, ``num_splits``: the cache's own options, likewise
    True, False or None where declared (``conformance.strategies.kvcache_features``:
    rotary forces appended keys; the two others keep the cache contiguous)."""
    can_append = caps is None or caps.kv_append
    if append and not can_append:
        raise InvalidArgument("append=True but caps.kv_append is False; pass append=None or False")
    if paged and caps is not None and not caps.kv_paged:
        raise InvalidArgument("paged=True but caps.kv_paged is False; check paged layouts only where declared")
    if paged and (cache_batch_idx or cache_leftpad):
        raise InvalidArgument("cache_batch_idx/cache_leftpad=True with paged=True: FlashAttention pages neither; "
                              "draw them with contiguous caches")

    max_query, max_cache = _max_length(caps, max_query), _max_length(caps, max_cache)

    def draw_example(draw: st.DrawFn) -> KVCacheCase:
        B = draw(st.integers(1, max_batch))
        L = draw(st.integers(1, max_query))
        N, K, E, Ev = _heads(draw, caps, rotary_multiple(caps) if rotary is True else 1)
        chosen_cache = wanted_cache(draw, cache_declared, cache_wanted, can_append=can_append and append is not False,
                                    paged=paged, E=E, caps=caps)
        if "rotary" in chosen_cache:  # rotation needs new keys
            new = draw(st.integers(1, 2))
        else:
            new = draw(st.integers(0, 2)) if (append is None and can_append) else (
                draw(st.integers(1, 2)) if append else 0)
        new = min(new, max_cache)
        seqlens = tuple(_length(draw, max_cache - new) for _ in range(B))
        capacity = max(seqlens) + new + draw(st.integers(0, 3))           # room past the valid rows
        page_size = order = None
        if paged:
            page_size = draw(st.integers(1, 4))
            max_pages = max(1, -(-capacity // page_size))
            capacity = max_pages * page_size
            spare = draw(st.integers(0, 2))
            order = tuple(draw(st.permutations(range(B * max_pages + spare))))
        is_causal = _causal(draw, caps, None)
        scale = _scale(draw, caps, dtype)
        rows, cache_fields = B, {}
        if "cache_batch_idx" in chosen_cache:
            rows, cache_fields["cache_batch_idx"] = batch_rows(draw, B)
        if "cache_leftpad" in chosen_cache:
            cache_fields["cache_leftpad"] = leftpads(draw, seqlens)
        boost = 1.0
        if "num_splits" in chosen_cache:
            cache_fields["num_splits"], boost = num_splits_fields(draw)
        rng = draw_seed(draw)
        k_new = _values(rng, (B, new, K, E), dtype) if new else None
        v_new = _values(rng, (B, new, K, Ev), dtype) if new else None
        q, k_cache = _values(rng, (B, L, N, E), dtype) * boost, _values(rng, (rows, capacity, K, E), dtype)
        v_cache = _values(rng, (rows, capacity, K, Ev), dtype)
        if "rotary" in chosen_cache:  # a row for the capacity and every rotated position
            ro_rows = max(capacity, max(seqlens) + max(L, new)) + draw(st.integers(0, 1))
            cache_fields.update(rotary_tables(draw, rng, E=E, caps=caps, rows=ro_rows, dtype=dtype))
        chosen = _wanted(draw, declared, wanted, at_least_one)
        fields = _options(draw, rng, chosen, B=B, N=N, L=L, S=max(seqlens) + new,
                          max_logit=_max_logit(q, k_cache, scale))
        if "rotary" in chosen_cache and "window" in fields:
            fields["window"] = fit_rotary_window(draw, fields["window"], capacity)
        return KVCacheCase(
            q, k_cache, v_cache, cache_seqlens=seqlens, k_new=k_new, v_new=v_new,
            causal=is_causal, scale=scale, page_size=page_size, page_order=order, dtype=dtype, device=device,
            **fields, **cache_fields)

    declared = caps.kvcache_features if caps is not None else frozenset(OPTION_FEATURES)
    cache_declared = caps.kvcache_features if caps is not None else frozenset(CACHE_FEATURES)
    wanted = {"window": window, "softcap": softcap, "alibi": alibi}
    cache_wanted = {"rotary": rotary, "cache_batch_idx": cache_batch_idx, "cache_leftpad": cache_leftpad,
                    "num_splits": num_splits}
    arguments: dict[str, Any] = {"dtype": dtype, "device": device, "caps": caps, "paged": paged, "append": append,
                                     "max_batch": max_batch, "max_query": max_query, "max_cache": max_cache,
                                     **wanted, "at_least_one": at_least_one, **cache_wanted}
    return named_strategy(kvcache_cases, arguments, draw_example)


# -- directed examples: the smallest case of each bug class, run before the search --------


def _seeded(seed: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return round_to(np.random.default_rng(seed).standard_normal(shape), dtype)


def _fit_sequence(caps: Capabilities, L: int, S: int) -> tuple[int, int]:
    """One packed sequence's (L, S) inside the declarations (an empty side stays empty
    unless L == S is declared: then both are the longer)."""
    if caps.self_attention_lengths:
        L = S = max(L, S)
    bound = caps.max_seq_len
    return (L, S) if bound is None else (min(L, bound), min(S, bound))


def varlen_directed(*, dtype: str = "float64", device: str = "cpu",
                    caps: Capabilities | None = None) -> list[VarlenCase]:
    """A query whose neighbour's first key sits right after its own (B = 2, the second
    sequence with no query), empty and one-token sequences side by side, and (where
    declared) causal with L > S and with L < S in one packed batch. Each carries its name
    (``notes``: ``directed: NAME``), true of its lengths as fitted to the declarations."""
    N, K, E = (2, 1, 2) if caps is None or caps.gqa else (1, 1, 2)
    Ev = 3 if caps is None or caps.different_v_dim else E
    causal_ok = caps is None or caps.causal == "lower_right"
    layouts = [([(1, 1), (0, 1)], False), ([(0, 2), (1, 0), (1, 1), (2, 3)], False)]
    if causal_ok:
        layouts.append(([(3, 1), (1, 3), (2, 2)], True))
    if caps is not None:  # inside the declared head dims and lengths
        dims = fit_head_dims(caps, E, Ev)
        if dims is None:
            return []
        E, Ev = dims
        layouts = [([_fit_sequence(caps, L, S) for L, S in lengths], causal or (caps.causal_only and causal_ok))
                   for lengths, causal in layouts]
    cases = []
    for i, (lengths, causal) in enumerate(layouts):
        T_q, T_k = sum(L for L, _ in lengths), sum(S for _, S in lengths)
        cases.append(VarlenCase(
            _seeded(3 * i, (T_q, N, E), dtype), _seeded(3 * i + 1, (T_k, K, E), dtype),
            _seeded(3 * i + 2, (T_k, K, Ev), dtype),
            cu_seqlens_q=tuple(int(x) for x in np.cumsum([0] + [L for L, _ in lengths])),
            cu_seqlens_k=tuple(int(x) for x in np.cumsum([0] + [S for _, S in lengths])),
            causal=causal, dtype=dtype, device=device, notes=(f"directed: {_layout_name(i, lengths, causal)}",)))
    return cases


def _layout_name(i: int, lengths: list[tuple[int, int]], causal: bool) -> str:
    """What ``varlen_directed``'s layout ``i`` is, with its (L, S) as fitted: a name true of
    the case (a declaration can make L == S or cap the lengths)."""
    if i == 0:
        name = "a query whose neighbour's first key sits right after its own"
    elif i == 1:
        empty = any(0 in pair for pair in lengths)
        name = "empty and one-token sequences side by side" if empty else "one-token sequences beside longer ones"
    elif any(L > S for L, S in lengths) and any(L < S for L, S in lengths):
        return "causal with L > S and L < S in one packed batch"
    else:
        return f"causal sequences of (L, S) = {', '.join(f'({L}, {S})' for L, S in lengths)} in one packed batch"
    return f"{name}{', causal' if causal else ''}"


def kvcache_directed(*, dtype: str = "float64", device: str = "cpu", caps: Capabilities | None = None,
                     paged: bool = False) -> list[KVCacheCase]:
    """An empty cache with a stale row after it, an append into a cache with room past it
    (where declared), causal decoding of L = 2 against S_b = 3 (where declared); paged:
    page size 2 (not dividing the valid length 3) with the pages in reverse order and a
    spare page. Each carries its name (``notes``: ``directed: NAME``)."""
    N, K, E, Ev = 2, 1, 2, 2
    if caps is not None and not caps.gqa:
        N = 1
    if caps is not None:  # inside the declared head dims
        dims = fit_head_dims(caps, E, Ev)
        if dims is None:
            return []
        E, Ev = dims
    append = caps is None or caps.kv_append
    causal = caps is None or caps.causal == "lower_right"
    specs = [((0, 2), 0, 4, 1, False, "an empty cache beside one of 2 keys, stale rows past both"),
             ((1, 0), 1 if append else 0, 4, 1, False,
              "an append of one key into a cache with room past it" if append else "a cache of 1 key beside an empty one")]
    if causal:
        specs.append(((3, 2), 0, 4, 2, True, "causal decoding of 2 queries against caches of 3 and 2 keys"))
    cases = []
    for i, (seqlens, new, capacity, L, is_causal, name) in enumerate(specs):
        is_causal = is_causal or bool(caps is not None and caps.causal_only and causal)
        B = len(seqlens)
        order = tuple(reversed(range(B * capacity // 2 + 1))) if paged else None
        name += "; paged: pages of 2 rows in reverse order, one spare" if paged else ""
        cases.append(KVCacheCase(
            _seeded(5 * i, (B, L, N, E), dtype), _seeded(5 * i + 1, (B, capacity, K, E), dtype),
            _seeded(5 * i + 2, (B, capacity, K, Ev), dtype), cache_seqlens=seqlens,
            k_new=_seeded(5 * i + 3, (B, new, K, E), dtype) if new else None,
            v_new=_seeded(5 * i + 4, (B, new, K, Ev), dtype) if new else None,
            causal=is_causal, page_size=2 if paged else None, page_order=order, dtype=dtype, device=device,
            notes=(f"directed: {name}",)))
    return cases


def _row_factors(d: np.ndarray, case: VarlenCase, rows_of: str, heads: int) -> np.ndarray:
    """(T, heads): each packed row's descale, (1,) or row b for sequence b's rows (query
    heads read their kv head's, h // (N // K))."""
    cu = case.cu_seqlens_q if rows_of == "query" else case.cu_seqlens_k
    if d.shape == (1,):
        return np.full((cu[-1], heads), d[0])
    per_head = np.repeat(d, heads // d.shape[1], axis=1)                         # (B, heads)
    return np.repeat(per_head, np.diff(cu), axis=0)


def varlen_fp8_cases(*, dtype: str = "float64", device: str = "cpu", caps: Capabilities | None = None,
                     **kwargs: Any) -> st.SearchStrategy[VarlenCase]:
    """:func:`varlen_cases` with q, k, v quantised to one of ``caps.fp8_dtypes`` (all formats
    without caps), each tensor's descale given in one of ``caps.fp8_descales``: none, (1,) or
    (B, K), one row per **sequence** (drawn as the flash level draws them: a quantiser's
    amax / max, powers of two, random; float32-exact), the values divided by it first."""
    formats = tuple(caps.fp8_dtypes) if caps is not None else tuple(spec_fp8.FORMATS)
    descales = tuple(caps.fp8_descales) if caps is not None else ("none", "per_tensor", "per_head")
    base = varlen_cases(dtype=dtype, device=device, caps=caps, **kwargs)

    @st.composite
    def draw_example(draw: st.DrawFn) -> VarlenCase:
        case = draw(base)
        rng = draw_seed(draw)
        fmt = spec_fp8.format_of(draw(st.sampled_from(formats)))
        forms = [(form, weight) for form, weight in (("none", 1), ("per_tensor", 2), ("per_head", 3))
                 if form in descales]
        changes: dict[str, Any] = {"fp8": fmt.name}
        for name, descale in (("query", "q_descale"), ("key", "k_descale"), ("value", "v_descale")):
            x = getattr(case, name)
            form = weighted(draw, forms)
            if form == "none":
                d = None
            elif form == "per_tensor":
                d = _descale(draw, rng, x[None], fmt, False, case.K) if x.size else np.ones(1)
            else:  # one row per sequence, from its own rows (an empty sequence: a power of two)
                cu = case.cu_seqlens_q if name == "query" else case.cu_seqlens_k
                d = np.concatenate([_descale(draw, rng, x[cu[b]:cu[b + 1]][None], fmt, True, case.K)
                                    if cu[b + 1] > cu[b] else np.ones((1, case.K)) for b in range(case.B)])
            scaled = x if d is None else x / _row_factors(d, case, name, x.shape[1])[..., None]
            changes[name] = spec_fp8.quantize(scaled, fmt.name, saturate=True)
            changes[descale] = d
        return case.replace(**changes)

    return draw_example()


def _divided(x: np.ndarray, d: np.ndarray | None, rows: list[int]) -> np.ndarray:
    """x (R, T, H, X) divided by its descale: None -> as is, (1,) -> by it, (B, K) -> row
    ``rows[b]`` of x by row b (head h by kv head h // (H // K)); rows no sequence names as is."""
    if d is None:
        return x
    if d.shape == (1,):
        return x / d[0]
    factors = np.ones((x.shape[0], x.shape[2]))
    factors[rows] = np.repeat(d, x.shape[2] // d.shape[1], axis=1)
    return x / factors[:, None, :, None]


def kvcache_fp8_cases(*, dtype: str = "float64", device: str = "cpu", caps: Capabilities | None = None,
                      **kwargs: Any) -> st.SearchStrategy[KVCacheCase]:
    """:func:`kvcache_cases` (no rotary tables: a rotated FP8 key is no FP8 value) with q, the
    caches and the new keys and values quantised to one of ``caps.fp8_dtypes`` (all formats
    without caps), each descale given in one of ``caps.fp8_descales``: none, (1,) or (B, K),
    row b for **sequence** b, covering its query, or its cache row (``cache_batch_idx[b]``)
    and its new keys alike (drawn as the flash level draws them, from those values: a
    quantiser's amax / max, powers of two, random; float32-exact); the values divided by it
    first, cache rows no sequence names quantised as they are."""
    formats = tuple(caps.fp8_dtypes) if caps is not None else tuple(spec_fp8.FORMATS)
    descales = tuple(caps.fp8_descales) if caps is not None else ("none", "per_tensor", "per_head")
    base = kvcache_cases(dtype=dtype, device=device, caps=caps, **{**kwargs, "rotary": False})

    @st.composite
    def draw_example(draw: st.DrawFn) -> KVCacheCase:
        case = draw(base)
        rng = draw_seed(draw)
        fmt = spec_fp8.format_of(draw(st.sampled_from(formats)))
        forms = [(form, weight) for form, weight in (("none", 1), ("per_tensor", 2), ("per_head", 3))
                 if form in descales]
        rows = list(range(case.B)) if case.cache_batch_idx is None else list(case.cache_batch_idx)
        changes: dict[str, Any] = {"fp8": fmt.name}
        for descale, cache, new in (("q_descale", "query", None), ("k_descale", "k_cache", "k_new"),
                                    ("v_descale", "v_cache", "v_new")):
            x = getattr(case, cache)
            seen = x if new is None else x[rows]                          # (B, T, H, X): what row b covers
            if new is not None and getattr(case, new) is not None:
                seen = np.concatenate([seen, getattr(case, new)], axis=1)
            form = weighted(draw, forms)
            if form == "none" or not seen.size:
                d = None if form == "none" else np.ones(1 if form == "per_tensor" else (case.B, case.K))
            else:
                d = _descale(draw, rng, seen, fmt, form == "per_head", case.K)
            changes[descale] = d
            changes[cache] = spec_fp8.quantize(_divided(x, d, rows if new is not None else list(range(case.B))),
                                               fmt.name, saturate=True)
            if new is not None and getattr(case, new) is not None:
                changes[new] = spec_fp8.quantize(_divided(getattr(case, new), d, list(range(case.B))), fmt.name,
                                                 saturate=True)
        return case.replace(**changes)

    return draw_example()
