"""FlashAttention's options at the varlen and kvcache levels: window, soft-capping, ALiBi, LSE;
and the KV cache's own: rotary embeddings in the call, ``cache_batch_idx``, ``cache_leftpad``,
``num_splits``.

``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` take the options of
``flash_attn_func`` (``spec.flash``): each sequence of a packed batch or of a cache is one
flash problem of its own (B = 1, its own L and S, its ALiBi slopes row), bounded by the
flash level's rule (``conformance.calls.flash_bounds``). Here: the options a case uses (as
``spec`` keywords, as FlashAttention's keyword arguments, as text), one sequence as a
:class:`~conformance.calls.flash_cases.FlashCase`, and the LSE's bounds and check.

The cache's own options (``spec.kvcache_attention``, ``spec.rotary``): which of them a
:class:`~conformance.calls.kvcache.KVCacheCase` uses (as ``ALL_KVCACHE_FEATURES`` names, as
``spec`` keywords, as FlashAttention's keyword arguments, as text, as saved metadata), what
each sequence attends (its rotated queries and the keys from ``cache_leftpad[b]`` to
``S_b`` of its cache row), and the check of the caches after a call: the rows each
sequence names hold exactly what the spec wrote (rotated keys within
``conformance.core.tolerance.rotation_allowed``), the rows no sequence names are untouched.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import spec
from conformance.calls.flash_bounds import (
    FP8_OUTPUT_DTYPES,
    allowed_lse,
    fp8_allowed_output,
)
from conformance.calls.flash_bounds import oracle as flash_oracle
from conformance.calls.flash_cases import FlashCase
from conformance.core import tolerance
from conformance.core.compare import compare_values, fail
from conformance.core.target import Target

__all__ = ["attended_keys", "cache_call_kwargs", "cache_features", "cache_fields_from_meta", "cache_meta",
           "cache_rows", "cache_spec_kwargs", "cache_text", "check_cache_after", "check_lse_against_oracle",
           "descale_spec_kwargs", "fp8_cache_bounds",
           "flash_options", "float32_tensor", "option_features", "option_kwargs", "option_text", "rotated_new_keys",
           "rotated_query", "rotation_positions", "sequence_flash_case", "sequence_lse_bounds", "slopes_row",
           "split_lse"]


def flash_options(case: Any) -> dict[str, Any]:
    """The FlashAttention options a varlen or kvcache case uses, as ``spec`` keywords
    (window, softcap, alibi_slopes; those at their default left out)."""
    options: dict[str, Any] = {}
    if tuple(case.window) != (-1, -1):
        options["window"] = tuple(case.window)
    if case.softcap:
        options["softcap"] = float(case.softcap)
    if case.alibi_slopes is not None:
        options["alibi_slopes"] = case.alibi_slopes
    return options


def option_features(case: Any) -> set[str]:
    """The features (``ALL_VARLEN_FEATURES`` names) a case's options use."""
    names = {"window": "window", "softcap": "softcap", "alibi_slopes": "alibi"}
    return {names[k] for k in flash_options(case)}


def option_kwargs(case: Any, tensor: Any) -> dict[str, Any]:
    """FlashAttention's keyword arguments for the options a case uses (defaults not
    passed, so a function lacking an unused parameter is still called); ``tensor(a)``
    makes the float32 slopes tensor."""
    kwargs: dict[str, Any] = {}
    if tuple(case.window) != (-1, -1):
        kwargs["window_size"] = tuple(int(x) for x in case.window)
    if case.softcap:
        kwargs["softcap"] = float(case.softcap)
    if case.alibi_slopes is not None:
        kwargs["alibi_slopes"] = tensor(case.alibi_slopes)
    return kwargs


def option_text(case: Any) -> str:
    """The options a case uses, for its description ("" when none)."""
    text = ""
    if tuple(case.window) != (-1, -1):
        text += f" window={tuple(case.window)}"
    if case.softcap:
        text += f" softcap={case.softcap!r}"
    if case.alibi_slopes is not None:
        text += f" alibi_slopes={tuple(np.shape(case.alibi_slopes))}"
    return text


def slopes_row(slopes: np.ndarray | None, b: int) -> np.ndarray | None:
    """Sequence b's ALiBi slopes (N,) from (N,) or (B, N)."""
    if slopes is None:
        return None
    slopes = np.asarray(slopes)
    return slopes if slopes.ndim == 1 else slopes[b]


def sequence_flash_case(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool, scale: float | None,
                        dtype: str, device: str, options: dict[str, Any]) -> FlashCase:
    """One sequence (q (L, N, E), k (S, K, E), v (S, K, Ev)) as a flash case (B = 1) with
    the options (window, softcap, alibi_slopes (N,)) in ``spec.flash_attention``'s names."""
    return FlashCase(q[None], k[None], v[None], causal=causal, window=options.get("window", (-1, -1)),
                     softcap=options.get("softcap", 0.0), alibi_slopes=options.get("alibi_slopes"),
                     scale=scale, dtype=dtype, device=device)


def sequence_lse_bounds(target: Target, q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool,
                        scale: float | None, dtype: str, device: str, options: dict[str, Any],
                        stored: str | None) -> tuple[np.ndarray, np.ndarray]:
    """One sequence's (expected LSE (N, L), allowed error (N, L)): the flash level's rule;
    -inf (allowed 0) in rows attending no key, an empty sequence has no rows."""
    L, N = q.shape[0], q.shape[1]
    if L == 0:
        return np.zeros((N, 0)), np.zeros((N, 0))
    if k.shape[0] == 0:
        return np.full((N, L), -np.inf), np.zeros((N, L))
    flash_case = sequence_flash_case(q, k, v, causal=causal, scale=scale, dtype=dtype, device=device,
                                     options=options)
    ref = flash_oracle(flash_case)
    return ref.lse[0], allowed_lse(target, flash_case, ref, stored=stored)[0]


def check_lse_against_oracle(what: str, lse: np.ndarray, expected: np.ndarray, allowed: np.ndarray) -> float:
    """An LSE (FlashAttention-2's +inf for a row with no key read as -inf) against the oracle's."""
    __tracebackhide__ = True
    lse = np.where(np.isposinf(lse), -np.inf, lse)
    with np.errstate(invalid="ignore"):  # -inf against -inf
        return compare_values(what, lse, expected, allowed).ratio


def float32_tensor(array: np.ndarray, case: Any) -> Any:
    import torch

    return torch.tensor(np.asarray(array, dtype=np.float64), dtype=torch.float32, device=case.device)


def split_lse(result: Any, lse_shape: tuple[int, ...], what: str, shape_text: str) -> tuple[Any, Any]:
    """(output, lse) of a call made with the LSE asked for: a tuple whose second item is the
    LSE tensor of ``lse_shape``."""
    __tracebackhide__ = True
    import torch

    if not isinstance(result, (tuple, list)) or len(result) < 2:
        fail(f"{what}=True returned {type(result).__name__}, but should return (output, softmax_lse, ...) "
             "as FlashAttention does")
    out, lse = result[0], result[1]
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != tuple(lse_shape):
        fail(f"softmax_lse shape={tuple(getattr(lse, 'shape', ()))}, but should be {tuple(lse_shape)} {shape_text}")
    return out, lse


# -- the KV cache's own options ------------------------------------------------------------


def cache_features(case: Any) -> set[str]:
    """The cache options ``case`` uses, by ``ALL_KVCACHE_FEATURES`` name."""
    used = set()
    if case.rotary_cos is not None:
        used.add("rotary")
    if case.cache_batch_idx is not None:
        used.add("cache_batch_idx")
    if case.cache_leftpad is not None:
        used.add("cache_leftpad")
    if case.num_splits is not None:
        used.add("num_splits")
    return used


def cache_spec_kwargs(case: Any) -> dict[str, Any]:
    """The options as ``spec.kvcache_attention`` keywords (those not used left out)."""
    kwargs: dict[str, Any] = {}
    if case.rotary_cos is not None:
        kwargs.update(rotary_cos=case.rotary_cos, rotary_sin=case.rotary_sin,
                      rotary_interleaved=bool(case.rotary_interleaved))
    if case.cache_batch_idx is not None:
        kwargs["cache_batch_idx"] = np.asarray(case.cache_batch_idx, dtype=np.int64)
    if case.cache_leftpad is not None:
        kwargs["cache_leftpad"] = np.asarray(case.cache_leftpad, dtype=np.int64)
    if case.num_splits is not None:
        kwargs["num_splits"] = int(case.num_splits)
    return kwargs


def cache_call_kwargs(case: Any, table: Any, ints: Any) -> dict[str, Any]:
    """FlashAttention's keyword arguments for the options ``case`` uses (defaults not
    passed, so a function lacking an unused parameter is still called): ``table(a)``
    makes a rotary table tensor (in the case's dtype, as FlashAttention asks),
    ``ints(values)`` an int32 tensor."""
    kwargs: dict[str, Any] = {}
    if case.rotary_cos is not None:
        kwargs.update(rotary_cos=table(case.rotary_cos), rotary_sin=table(case.rotary_sin),
                      rotary_interleaved=bool(case.rotary_interleaved))
    if case.cache_batch_idx is not None:
        kwargs["cache_batch_idx"] = ints(case.cache_batch_idx)
    if case.cache_leftpad is not None:
        kwargs["cache_leftpad"] = ints(case.cache_leftpad)
    if case.num_splits is not None:
        kwargs["num_splits"] = int(case.num_splits)
    return kwargs


def cache_text(case: Any, *, arguments: bool = False) -> str:
    """The options ``case`` uses as text ("" when none): for a description, or (with
    ``arguments``) as the call's keyword arguments."""
    text = ""
    if case.rotary_cos is not None:
        shape = tuple(np.shape(case.rotary_cos))
        text += (f", rotary_cos=<{shape} table>, rotary_sin=<{shape} table>" if arguments
                 else f" rotary_dim={2 * shape[1]} seqlen_ro={shape[0]}")
        text += f"{', ' if arguments else ' '}rotary_interleaved={bool(case.rotary_interleaved)}"
    for name in ("cache_batch_idx", "cache_leftpad"):
        value = getattr(case, name)
        if value is not None:
            text += f"{', ' if arguments else ' '}{name}={list(value)}"
            if name == "cache_batch_idx" and not arguments:
                text += f" B_cache={case.k_cache.shape[0]}"
    if case.num_splits is not None:
        text += f"{', ' if arguments else ' '}num_splits={case.num_splits}"
    return text


def cache_meta(case: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The options as saved metadata and arrays (``conformance.reporting.failures``)."""
    meta: dict[str, Any] = {"rotary_interleaved": bool(case.rotary_interleaved)}
    for name in ("cache_batch_idx", "cache_leftpad"):
        value = getattr(case, name)
        meta[name] = None if value is None else [int(x) for x in value]
    meta["num_splits"] = None if case.num_splits is None else int(case.num_splits)
    arrays = {}
    if case.rotary_cos is not None:
        arrays["rotary_cos"], arrays["rotary_sin"] = np.asarray(case.rotary_cos), np.asarray(case.rotary_sin)
    return meta, arrays


def cache_fields_from_meta(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """The case fields of :func:`cache_meta`'s output (a file saved without them: none used)."""
    def ints(name: str) -> tuple[int, ...] | None:
        value = meta.get(name)
        return None if value is None else tuple(int(x) for x in value)

    splits = meta.get("num_splits")
    return {"rotary_cos": arrays.get("rotary_cos"), "rotary_sin": arrays.get("rotary_sin"),
            "rotary_interleaved": bool(meta.get("rotary_interleaved", True)),
            "cache_batch_idx": ints("cache_batch_idx"), "cache_leftpad": ints("cache_leftpad"),
            "num_splits": None if splits is None else int(splits)}


# -- what each sequence attends ---------------------------------------------------------


def cache_rows(case: Any) -> list[int]:
    """The cache row each sequence reads and writes."""
    return list(range(case.B)) if case.cache_batch_idx is None else [int(r) for r in case.cache_batch_idx]


def rotation_positions(case: Any) -> tuple[np.ndarray, np.ndarray]:
    """(query positions (B, L), new-key positions (B, S_new)): ``spec.rotary_positions``."""
    return spec.rotary_positions(np.asarray(case.cache_seqlens), case.L, case.S_new, causal=bool(case.causal),
                                 window=tuple(case.window))


def rotated_query(case: Any) -> np.ndarray:
    """The query (B, L, N, E) as the attention reads it: rotated (float64, exact) when the
    case has rotary tables."""
    if case.rotary_cos is None:
        return case.query
    positions, _ = rotation_positions(case)
    return spec.apply_rotary(case.query, case.rotary_cos, case.rotary_sin, positions,
                             interleaved=bool(case.rotary_interleaved))


def rotated_new_keys(case: Any) -> np.ndarray | None:
    """The new keys (B, S_new, K, E) as the cache stores them (rotated when the case has tables)."""
    if case.k_new is None or case.rotary_cos is None:
        return case.k_new
    _, positions = rotation_positions(case)
    return spec.apply_rotary(case.k_new, case.rotary_cos, case.rotary_sin, positions,
                             interleaved=bool(case.rotary_interleaved))


def attended_keys(case: Any, k_cache: np.ndarray, v_cache: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequence b's attended keys (S, K, E) and values (S, K, Ev) in caches after the
    call (the spec's): cache row ``cache_rows[b]``, from ``cache_leftpad[b]`` to S_b."""
    row = cache_rows(case)[b]
    start = 0 if case.cache_leftpad is None else int(case.cache_leftpad[b])
    end = case.valid_lengths()[b]
    return k_cache[row, start:end], v_cache[row, start:end]


# -- the caches after the call -----------------------------------------------------------


def _rotation_sizes(case: Any) -> np.ndarray:
    """(B, S_new, K, E): |x_a·c| + |x_b·s| of each rotated new-key entry, 0 past R."""
    k = np.asarray(case.k_new, dtype=np.float64)
    sizes = np.zeros_like(k)
    _, positions = rotation_positions(case)
    c, s = np.abs(case.rotary_cos[positions])[..., None, :], np.abs(case.rotary_sin[positions])[..., None, :]
    first, second = spec.rotary.rotary_pairs(2 * case.rotary_cos.shape[1], bool(case.rotary_interleaved))
    sizes[..., first] = np.abs(k[..., first]) * c + np.abs(k[..., second]) * s
    sizes[..., second] = np.abs(k[..., second]) * c + np.abs(k[..., first]) * s
    return sizes


def check_cache_after(what: str, actual: np.ndarray, expected: np.ndarray, case: Any, *, keys: bool) -> None:
    """The cache (``keys``: k_cache, else v_cache) after the call, in the logical layout,
    against the spec's: each sequence's cache row holds exactly the spec's first S_b rows
    (the new keys, rotated when the case has tables, within ``tolerance.rotation_allowed``:
    a rotation is computed, not copied), and a row no sequence names is untouched."""
    __tracebackhide__ = True
    allowed = np.zeros(actual.shape)
    checked = np.zeros(actual.shape, dtype=bool)
    rows = cache_rows(case)
    for r in range(actual.shape[0]):
        if r not in rows:
            checked[r] = True
    sizes = _rotation_sizes(case) if keys and case.rotary_cos is not None and case.k_new is not None else None
    for b, (row, S_b) in enumerate(zip(rows, case.valid_lengths(), strict=True)):
        checked[row, :S_b] = True
        if sizes is not None:
            n = case.cache_seqlens[b]
            allowed[row, n:n + case.S_new] = tolerance.rotation_allowed(case.dtype, sizes[b])
    with np.errstate(invalid="ignore"):
        bad = checked & ~(np.abs(actual - expected) <= allowed)
    if bad.any():
        r, t, *rest = (int(i) for i in np.argwhere(bad)[0])
        owner = [b for b, row in enumerate(rows) if row == r]
        where = (f"row t={t} of cache row {r} (sequence {owner[0]}: cache_seqlens + S_new = "
                 f"{case.valid_lengths()[owner[0]]} valid rows after the append)" if owner
                 else f"cache row {r}, which no sequence names in cache_batch_idx (it must stay untouched)")
        bound = f" (allowed {allowed[r, t][tuple(rest)]:.3g}: a rotated key)" if allowed[r, t][tuple(rest)] else ""
        fail(f"{what}[{r}, {t}, {', '.join(map(str, rest))}]={actual[r, t][tuple(rest)]!r}, but should be "
             f"{expected[r, t][tuple(rest)]!r}{bound}: {where}")


# -- FP8 inputs with descales (FlashAttention-3) --------------------------------------------

#: FlashAttention-3's descale arguments of FP8 q, k, v.
_DESCALES = ("q_descale", "k_descale", "v_descale")


def descale_forms(case: Any) -> frozenset[str]:
    """How q's, k's and v's descales are each given (``Capabilities.fp8_descales``): ``none``,
    ``per_tensor`` (1,), ``per_head`` (one row per sequence and kv head); empty without FP8."""
    if getattr(case, "fp8", None) is None:
        return frozenset()
    return frozenset("none" if d is None else "per_tensor" if np.shape(d) == (1,) else "per_head"
                     for d in (getattr(case, n) for n in _DESCALES))


def descale_kwargs(case: Any, tensor: Any) -> dict[str, Any]:
    """The descales a case gives, as keyword arguments (``tensor(a)``: a float32 tensor)."""
    if getattr(case, "fp8", None) is None:
        return {}
    return {n: tensor(getattr(case, n)) for n in _DESCALES if getattr(case, n) is not None}


def fp8_text(case: Any) -> str:
    """The FP8 format and descale shapes, for a description ("" without FP8)."""
    if getattr(case, "fp8", None) is None:
        return ""
    shapes = {n: None if getattr(case, n) is None else tuple(np.shape(getattr(case, n))) for n in _DESCALES}
    return f" q/k/v={case.fp8} descales={shapes}"


def check_fp8_output_dtype(out: Any, fmt: str) -> None:
    """An FP8 call's output is 16- or 32-bit (FlashAttention-3 returns bfloat16)."""
    __tracebackhide__ = True
    name = str(out.dtype).removeprefix("torch.")
    if name not in FP8_OUTPUT_DTYPES:
        fail(f"output dtype={out.dtype} for q, k, v in {fmt}, but should be one of {', '.join(FP8_OUTPUT_DTYPES)} "
             "(an FP8 call's output is not FP8; FlashAttention-3 returns bfloat16)")


def fp8_sequence_bounds(case: Any, *, out_dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A packed FP8 case (``case.fp8``, descales (1,) or one row per sequence): (expected
    (T_q, N, Ev), allowed, live rows (T_q, N, 1)), sequence by sequence as a flash case with
    its own descale row: ``spec.flash_attention`` on the exactly dequantised values
    (``spec.fp8``) and ``tolerance.fp8_allowed`` for an output returned in ``out_dtype``."""
    T, N, Ev = case.query.shape[0], case.N, case.Ev
    expected, allowed = np.zeros((T, N, Ev)), np.zeros((T, N, Ev))
    live = np.zeros((T, N, 1), dtype=bool)
    options = flash_options(case)
    for b, (rows, keys) in enumerate(case.sequences()):
        if rows.stop == rows.start or keys.stop == keys.start:
            continue
        if options.get("alibi_slopes") is not None:
            options["alibi_slopes"] = slopes_row(case.alibi_slopes, b)
        descales = {n: None if d is None else d if np.shape(d) == (1,) else np.asarray(d)[b:b + 1]
                    for n, d in ((n, getattr(case, n)) for n in _DESCALES)}
        flash_case = sequence_flash_case(case.query[rows], case.key[keys], case.value[keys], causal=case.causal,
                                         scale=case.scale, dtype=case.dtype, device=case.device,
                                         options=options).replace(fp8=case.fp8, **descales)
        ref = flash_oracle(flash_case)
        expected[rows] = ref.output[0]
        allowed[rows] = fp8_allowed_output(flash_case, ref, out_dtype)[0]
        live[rows] = ~flash_case.empty_rows()[:, None, None]
    return expected, allowed, live


def descale_spec_kwargs(case: Any) -> dict[str, Any]:
    """The descales a kvcache case gives, as ``spec.kvcache_attention`` keywords."""
    if getattr(case, "fp8", None) is None:
        return {}
    return {n: getattr(case, n) for n in _DESCALES if getattr(case, n) is not None}


def _descale_row(descale: Any, b: int) -> Any:
    """Sequence b's descale: None and (1,) kept, row b of (B, K) as (1, K)."""
    return descale if descale is None or np.shape(descale) == (1,) else np.asarray(descale)[b:b + 1]


def fp8_cache_bounds(case: Any, *, out_dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A kvcache FP8 case (``case.fp8``, descales (1,) or (B, K)): (expected (B, L, N, Ev),
    allowed, live rows (B, L, N, 1)), sequence by sequence as a flash case of its stored
    query and the stored keys it attends (cached and appended, ``attended_keys`` of the
    spec's caches after the call) with descale row b: ``spec.flash_attention`` on the exactly
    dequantised values and ``tolerance.fp8_allowed`` for an output returned in ``out_dtype``."""
    ref = case.oracle()
    shape = (case.B, case.L, case.N, case.Ev)
    expected, allowed = np.zeros(shape), np.zeros(shape)
    live = np.zeros((*shape[:3], 1), dtype=bool)
    options = flash_options(case)
    for b in range(case.B):
        if options.get("alibi_slopes") is not None:
            options["alibi_slopes"] = slopes_row(case.alibi_slopes, b)
        keys, values = attended_keys(case, ref.k_cache, ref.v_cache, b)
        if keys.shape[0] == 0:  # no key: the output is 0, allowed 0
            continue
        descales = {n: _descale_row(getattr(case, n), b) for n in _DESCALES}
        flash_case = sequence_flash_case(case.query[b], keys, values, causal=case.causal, scale=case.scale,
                                         dtype=case.dtype, device=case.device,
                                         options=options).replace(fp8=case.fp8, **descales)
        result = flash_oracle(flash_case)
        expected[b] = result.output[0]
        allowed[b] = fp8_allowed_output(flash_case, result, out_dtype)[0]
        live[b] = ~flash_case.empty_rows()[:, None, None]
    return expected, allowed, live
