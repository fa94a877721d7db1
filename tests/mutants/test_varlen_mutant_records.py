"""The varlen / kvcache mutants' records are complete and true (fast; no conformance runner).

For each mutant of ``implementations/mutants/varlen/varlen_mutants.py``: its record names a
registered property of its own level; it claims exactly the built-in's capabilities; its
smallest case lies inside them and gives a result (output, or the caches after the
call) that differs from ``spec.varlen_attention`` / ``spec.kvcache_attention`` (with
``dropout_p``: whose packed copies' mean or spread differs from it; with ``dropout_pattern``:
whose output differs from it with the S_dmask pattern returned; with ``fp8``: on the
dequantised values); and its
safe case agrees with the spec (the bug is the only one there). The correct built-in
agrees on every mutant's cases.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import spec
from spec import flash as spec_flash
from conformance.core.registry import registered_properties
from implementations.builtins.references.varlen_reference import (
    VARLEN_CAPABILITIES,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)
from implementations.mutants import MUTANTS

NAMES = sorted(name for name, m in MUTANTS.items() if m.level in ("varlen", "kvcache"))


#: Packed copies of a dropout case (``dropout_p`` in the vocabulary).
DROPOUT_COPIES = 2048


def _dropout_agrees(fn, case: dict) -> bool:
    """With ``dropout_p``: the case's sequences (V positive) packed DROPOUT_COPIES times in
    one call; the mean of the copies is spec.varlen_attention within 5 standard errors and
    their standard deviation that of dropping each weight independently within 15%."""
    rng = np.random.default_rng(0)
    lengths, p = case["lengths"], case["dropout_p"]
    T_q, T_k = sum(L for L, _ in lengths), sum(S for _, S in lengths)
    q, k = rng.standard_normal((T_q, case["N"], case["E"])), rng.standard_normal((T_k, case["K"], case["E"]))
    v = np.abs(rng.standard_normal((T_k, case["K"], case["Ev"]))) + 0.5
    cu_q, cu_k = np.cumsum([0] + [L for L, _ in lengths]), np.cumsum([0] + [S for _, S in lengths])
    want = spec.varlen_attention(q, k, v, cu_q, cu_k)
    # sigma of each output element: sqrt(p / (1 - p) · Σ_j w_j² v_j²), sequence by sequence
    sigma = np.zeros_like(want)
    for b in range(len(lengths)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        problem = spec_flash.prepare(q[None, rows], k[None, keys], v[None, keys])
        w = spec_flash.attend(problem).weights[0]                                        # (N, L, S)
        sigma[rows] = np.sqrt(p / (1 - p) * (w ** 2 @ problem.value[0] ** 2)).transpose(1, 0, 2)
    copies = [x for _ in range(DROPOUT_COPIES) for x in lengths]
    cq, ck = np.cumsum([0] + [L for L, _ in copies]), np.cumsum([0] + [S for _, S in copies])
    got = fn(torch.tensor(np.tile(q, (DROPOUT_COPIES, 1, 1))), torch.tensor(np.tile(k, (DROPOUT_COPIES, 1, 1))),
             torch.tensor(np.tile(v, (DROPOUT_COPIES, 1, 1))), torch.tensor(cq, dtype=torch.int32),
             torch.tensor(ck, dtype=torch.int32), max(L for L, _ in lengths), max(S for _, S in lengths),
             dropout_p=p).numpy().reshape(DROPOUT_COPIES, *want.shape)
    mean_ok = np.all(np.abs(got.mean(0) - want) <= 5 * sigma / np.sqrt(DROPOUT_COPIES) + 1e-12)
    spread_ok = np.allclose(got.std(0, ddof=1), sigma, rtol=0.15, atol=1e-12)
    return bool(mean_ok and spread_ok)


def _pattern_agrees(fn, case: dict) -> bool:
    """With ``dropout_pattern``: one call with ``return_attn_probs=True`` and ``dropout_p``
    (torch seeded); S_dmask is (B, N, >= max L, >= max S) and each sequence's output equals
    spec.flash_attention with the pattern read off its row (``[b, :, :L_b, :S_b]``, negative
    where dropped)."""
    rng = np.random.default_rng(0)
    lengths, p = case["lengths"], case["dropout_p"]
    T_q, T_k = sum(L for L, _ in lengths), sum(S for _, S in lengths)
    q, k = rng.standard_normal((T_q, case["N"], case["E"])), rng.standard_normal((T_k, case["K"], case["E"]))
    v = rng.standard_normal((T_k, case["K"], case["Ev"]))
    cu_q, cu_k = np.cumsum([0] + [L for L, _ in lengths]), np.cumsum([0] + [S for _, S in lengths])
    torch.manual_seed(0)
    got, _, probs = fn(torch.tensor(q), torch.tensor(k), torch.tensor(v), torch.tensor(cu_q, dtype=torch.int32),
                       torch.tensor(cu_k, dtype=torch.int32), max(L for L, _ in lengths), max(S for _, S in lengths),
                       dropout_p=p, return_attn_probs=True)
    probs = probs.numpy()
    if probs.shape[:2] != (len(lengths), case["N"]):
        return False
    for b, (L, S) in enumerate(lengths):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        keep = ~(probs[b, :, :L, :S] < 0)
        want = spec.flash_attention(q[None, rows], k[None, keys], v[None, keys], dropout_p=p,
                                    dropout_mask=keep[None])[0]
        if not np.allclose(got.numpy()[rows], want, rtol=1e-12, atol=1e-12):
            return False
    return True


def _fp8_agrees(fn, case: dict) -> bool:
    """With ``fp8`` (a format): q, k, v quantised to it with descales (B, K) that differ by a
    power of two per sequence; the bfloat16 output equals spec.varlen_attention on the
    dequantised values (spec.fp8.dequantize_varlen) within bfloat16's rounding."""
    rng = np.random.default_rng(0)
    lengths, fmt, K = case["lengths"], case["fp8"], case["K"]
    T_q, T_k = sum(L for L, _ in lengths), sum(S for _, S in lengths)
    q, k, v = (spec.fp8.quantize(rng.standard_normal(shape) * 4, fmt) for shape in
               ((T_q, case["N"], case["E"]), (T_k, K, case["E"]), (T_k, K, case["Ev"])))
    cu_q, cu_k = np.cumsum([0] + [L for L, _ in lengths]), np.cumsum([0] + [S for _, S in lengths])
    d = [2.0 ** (np.arange(len(lengths))[:, None] * 2 + np.arange(K)[None] + j - 3) for j in range(3)]
    want = spec.varlen_attention(*spec.fp8.dequantize_varlen(q, k, v, cu_q, cu_k, q_descale=d[0], k_descale=d[1],
                                                             v_descale=d[2]), cu_q, cu_k)
    f8 = getattr(torch, fmt)
    got = fn(*(torch.tensor(x).to(f8) for x in (q, k, v)), torch.tensor(cu_q, dtype=torch.int32),
             torch.tensor(cu_k, dtype=torch.int32), max(L for L, _ in lengths), max(S for _, S in lengths),
             **{n: torch.tensor(x, dtype=torch.float32) for n, x in zip(("q_descale", "k_descale", "v_descale"), d,
                                                                        strict=True)})
    return bool(np.allclose(got.float().numpy(), want, rtol=2.0 ** -7, atol=1e-6))


def _varlen_agrees(fn, case: dict) -> bool:
    """``fn`` (flash_attn_varlen_func's signature) = spec.varlen_attention on ``case``."""
    if case.get("dropout_pattern"):
        return _pattern_agrees(fn, case)
    if case.get("dropout_p"):
        return _dropout_agrees(fn, case)
    if case.get("fp8"):
        return _fp8_agrees(fn, case)
    rng = np.random.default_rng(0)
    lengths = case["lengths"]
    T_q, T_k = sum(L for L, _ in lengths), sum(S for _, S in lengths)
    q = rng.standard_normal((T_q, case["N"], case["E"]))
    k = rng.standard_normal((T_k, case["K"], case["E"]))
    v = rng.standard_normal((T_k, case["K"], case["Ev"]))
    cu_q = np.cumsum([0] + [L for L, _ in lengths])
    cu_k = np.cumsum([0] + [S for _, S in lengths])
    causal = bool(case.get("causal"))
    options, kwargs = _options(case)
    want = spec.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, **options)
    got = fn(torch.tensor(q), torch.tensor(k), torch.tensor(v), torch.tensor(cu_q, dtype=torch.int32),
             torch.tensor(cu_k, dtype=torch.int32), max(L for L, _ in lengths), max(S for _, S in lengths),
             causal=causal, **kwargs, **({"return_attn_probs": True} if case.get("lse") else {}))
    if case.get("lse"):
        got, lse = got[0], got[1]
        if not _same_lse(lse.numpy(), want.lse):
            return False
    return bool(np.allclose(got.numpy(), want.output, rtol=1e-12, atol=1e-12))


def _options(case: dict) -> tuple[dict, dict]:
    """(spec options, FlashAttention keyword arguments) of the vocabulary's ``window``
    [left, right], ``softcap`` and ``alibi`` (slopes per head)."""
    options, kwargs = {}, {}
    if case.get("window") is not None:
        options["window"] = kwargs["window_size"] = tuple(case["window"])
    if case.get("softcap"):
        options["softcap"] = kwargs["softcap"] = float(case["softcap"])
    if case.get("alibi") is not None:
        options["alibi_slopes"] = np.array(case["alibi"], dtype=float)
        kwargs["alibi_slopes"] = torch.tensor(case["alibi"], dtype=torch.float32)
    return options, kwargs


def _same_lse(got: np.ndarray, want: np.ndarray) -> bool:
    got = np.where(np.isposinf(got), -np.inf, got)
    return bool(np.array_equal(np.isneginf(got), np.isneginf(want))
                and np.allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-12, atol=1e-12))


def _cache_options(case: dict, rng: np.random.Generator) -> tuple[dict, dict]:
    """(spec options, FlashAttention keyword arguments) of the cache vocabulary:
    ``rotary_dim``/``rotary_interleaved`` (a table of random angles), ``cache_batch_idx``,
    ``cache_leftpad``, ``num_splits``."""
    options, kwargs = {}, {}
    if case.get("rotary_dim"):
        angle = rng.uniform(0, 2 * np.pi, (case["S_cache"] + case["L"] + 2, case["rotary_dim"] // 2))
        options.update(rotary_cos=np.cos(angle), rotary_sin=np.sin(angle),
                       rotary_interleaved=bool(case.get("rotary_interleaved", True)))
        kwargs.update(rotary_cos=torch.tensor(np.cos(angle)), rotary_sin=torch.tensor(np.sin(angle)),
                      rotary_interleaved=bool(case.get("rotary_interleaved", True)))
    for name in ("cache_batch_idx", "cache_leftpad"):
        if case.get(name) is not None:
            options[name] = np.array(case[name])
            kwargs[name] = torch.tensor(case[name], dtype=torch.int32)
    if case.get("num_splits") is not None:
        options["num_splits"] = kwargs["num_splits"] = int(case["num_splits"])
    return options, kwargs


def _kvcache_fp8_agrees(fn, case: dict) -> bool:
    """With ``fp8`` (a format): q, the contiguous caches and the new keys and values
    quantised to it with descales (B, K) that differ by a power of two per sequence; the
    bfloat16 output equals spec.kvcache_attention with those descales within bfloat16's
    rounding, and the caches after the call hold the stored values exactly."""
    rng = np.random.default_rng(0)
    seqlens, fmt, K = case["cache_seqlens"], case["fp8"], case["K"]
    B, L, N, E, Ev, new, S_cache = len(seqlens), case["L"], case["N"], case["E"], case["Ev"], case["S_new"], \
        case["S_cache"]
    q, k_cache, v_cache, k_new, v_new = (spec.fp8.quantize(rng.standard_normal(shape) * 4, fmt) for shape in
                                         ((B, L, N, E), (B, S_cache, K, E), (B, S_cache, K, Ev), (B, new, K, E),
                                          (B, new, K, Ev)))
    d = [2.0 ** (np.arange(B)[:, None] * 2 + np.arange(K)[None] + j - 3) for j in range(3)]
    descales = dict(zip(("q_descale", "k_descale", "v_descale"), d, strict=True))
    want = spec.kvcache_attention(q, k_cache, v_cache, cache_seqlens=np.array(seqlens), k=k_new if new else None,
                                  v=v_new if new else None, **descales)
    f8 = getattr(torch, fmt)
    k_t, v_t = torch.tensor(k_cache).to(f8), torch.tensor(v_cache).to(f8)
    extra = {"k": torch.tensor(k_new).to(f8), "v": torch.tensor(v_new).to(f8)} if new else {}
    got = fn(torch.tensor(q).to(f8), k_t, v_t, **extra, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
             **{n: torch.tensor(x, dtype=torch.float32) for n, x in descales.items()})
    return (bool(np.allclose(got.float().numpy(), want.output, rtol=2.0 ** -7, atol=1e-6))
            and np.array_equal(k_t.double().numpy(), want.k_cache) and np.array_equal(v_t.double().numpy(),
                                                                                     want.v_cache))


def _kvcache_agrees(fn, case: dict) -> bool:
    """``fn`` (flash_attn_with_kvcache's signature) = spec.kvcache_attention on ``case``:
    the output and the caches after the call."""
    if case.get("fp8"):
        return _kvcache_fp8_agrees(fn, case)
    rng = np.random.default_rng(0)
    seqlens = case["cache_seqlens"]
    B, L, N, K, E, Ev, new = len(seqlens), case["L"], case["N"], case["K"], case["E"], case["Ev"], case["S_new"]
    q = rng.standard_normal((B, L, N, E))
    table = None
    if case.get("page_size"):
        rows = (case["num_pages"], case["page_size"])
        table = np.array(case["block_table"])
    else:
        rows = (case.get("B_cache", B), case["S_cache"])
    k_cache, v_cache = rng.standard_normal((*rows, K, E)), rng.standard_normal((*rows, K, Ev))
    if case.get("values") == "huge":  # q = 30, keys ±30: logits beyond float64's exp range
        q = np.full(q.shape, 30.0)
        k_cache = np.where(np.arange(k_cache.size).reshape(k_cache.shape) % 3 == 1, -30.0, 30.0)
    k_new = rng.standard_normal((B, new, K, E)) if new else None
    v_new = rng.standard_normal((B, new, K, Ev)) if new else None
    causal = bool(case.get("causal"))
    options, kwargs = _options(case)
    cache_options, cache_kwargs = _cache_options(case, rng)
    options.update(cache_options)
    kwargs.update(cache_kwargs)
    want = spec.kvcache_attention(q, k_cache, v_cache, cache_seqlens=np.array(seqlens), k=k_new, v=v_new,
                                  block_table=table, causal=causal, **options)
    k_t, v_t = torch.tensor(k_cache), torch.tensor(v_cache)
    extra = {} if k_new is None else {"k": torch.tensor(k_new), "v": torch.tensor(v_new)}
    if case.get("lse"):
        kwargs["return_softmax_lse"] = True
    got = fn(torch.tensor(q), k_t, v_t, **extra, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
             block_table=None if table is None else torch.tensor(table, dtype=torch.int32), causal=causal, **kwargs)
    if case.get("lse"):
        got, lse = got
        if not _same_lse(lse.numpy(), want.lse):
            return False
    return (bool(np.allclose(got.numpy(), want.output, rtol=1e-12, atol=1e-12))      # NaN never agrees
            and bool(np.allclose(k_t.numpy(), want.k_cache, rtol=1e-13, atol=0))        # rotated keys: computed
            and np.array_equal(v_t.numpy(), want.v_cache))


def _agrees(level: str, fn, case: dict) -> bool:
    return (_varlen_agrees if level == "varlen" else _kvcache_agrees)(fn, case)


def _callable(mutant):
    implementation = mutant.build()
    return getattr(implementation, mutant.level)


def test_both_levels_have_mutants():
    assert {MUTANTS[n].level for n in NAMES} == {"varlen", "kvcache"}, NAMES


@pytest.mark.parametrize("name", NAMES)
def test_record_is_complete(name):
    mutant = MUTANTS[name]
    info = registered_properties().get(mutant.expected_property)
    assert info is not None, f"expected_property={mutant.expected_property!r} is not registered"
    assert info.level == mutant.level, f"{mutant.expected_property} is a {info.level}-level property"
    assert mutant.bug and "\n" not in mutant.bug and len(mutant.bug) < 240
    implementation = mutant.build()
    assert implementation.name == f"mutant:{name}" and implementation.listed is False
    assert implementation.sdpa is None and implementation.mha is None
    assert implementation.capabilities.replace(devices=VARLEN_CAPABILITIES.devices) == VARLEN_CAPABILITIES


@pytest.mark.parametrize("name", NAMES)
def test_smallest_case_is_claimed(name):
    mutant = MUTANTS[name]
    case = mutant.smallest_case
    attrs = {"level": mutant.level, "device": "cpu", "dtype": "float64",
             "causal": "lower_right" if case.get("causal") else None, "N": case["N"], "K": case["K"],
             "E": case["E"], "Ev": case["Ev"], "kv_paged": bool(case.get("page_size")),
             "kv_append": bool(case.get("S_new"))}
    options = {name for name, key in (("window", "window"), ("softcap", "softcap"), ("alibi", "alibi"),
                                      ("lse", "lse"), ("rotary", "rotary_dim"), ("cache_batch_idx", "cache_batch_idx"),
                                      ("cache_leftpad", "cache_leftpad"), ("num_splits", "num_splits"),
                                      ("dropout", "dropout_p"), ("dropout_pattern", "dropout_pattern"),
                                      ("fp8", "fp8"))
               if case.get(key) is not None and case.get(key) is not False}
    attrs[f"{mutant.level}_features"] = options
    if case.get("fp8"):
        attrs.update(fp8=case["fp8"], descale_forms={"per_head"})
    assert mutant.build().not_supported_reasons(attrs) == []


@pytest.mark.parametrize("name", NAMES)
def test_smallest_case_exposes_the_bug(name):
    mutant = MUTANTS[name]
    assert not _agrees(mutant.level, _callable(mutant), mutant.smallest_case), (
        f"{name} agrees with the spec on its smallest case {mutant.smallest_case}")


@pytest.mark.parametrize("name", NAMES)
def test_safe_case_agrees(name):
    mutant = MUTANTS[name]
    assert _agrees(mutant.level, _callable(mutant), mutant.safe_case), (
        f"{name} disagrees with the spec on its safe case {mutant.safe_case}: it has more than one bug")


@pytest.mark.parametrize("name", NAMES)
def test_builtin_agrees_on_every_case(name):
    mutant = MUTANTS[name]
    fn = flash_attn_varlen_func if mutant.level == "varlen" else flash_attn_with_kvcache
    for case in (mutant.smallest_case, mutant.safe_case):
        assert _agrees(mutant.level, fn, case), f"varlen-reference disagrees with the spec on {case}"
