"""Packed variable-length and KV-cache calls: the cases, the calls, and what the oracle says.

The varlen and kvcache levels (``implementations.base``) take FlashAttention's
``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` conventions; the oracle is
``spec.varlen_attention`` / ``spec.kvcache_attention``. Every call goes through
``runner.call_guarded``. The error bound is the SDPA rule (``conformance.tolerance``,
computed by ``conformance.calls``) applied sequence by sequence: each sequence of a
packed batch, and each row of a cache, is one SDPA problem of its own (B = 1, the
sequence's own L and S, FlashAttention's bottom-right causal).

Dimension letters: B sequences, N query heads, K kv heads, L query length, S key length,
E q/k head dim, Ev value head dim, T packed total length.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

import spec
from conformance import calls
from conformance.calls import assert_returned_tensor
from conformance.cases import SDPACase
from conformance.compare import compare_values, fail
from conformance.runner import Target, call_guarded
from conformance.tensors import dtype_of, to_numpy

__all__ = [
    "KVCacheCall",
    "KVCacheCase",
    "VarlenCase",
    "assert_same_cache",
    "check_kvcache_against_oracle",
    "check_varlen_against_oracle",
    "compare_pair",
    "kvcache_bounds",
    "run_kvcache",
    "run_varlen",
    "varlen_bounds",
]


def _scale_sign(scale: float | None) -> str:
    return "default" if scale is None else "positive" if scale > 0 else "zero" if scale == 0 else "negative"


def _replace(case: Any, **changes: Any) -> Any:
    values = {f.name: getattr(case, f.name) for f in fields(case)}
    values.update(changes)
    return type(case)(**values)


@dataclass(frozen=True, eq=False, repr=False)
class VarlenCase:
    """B sequences packed along one axis: query (T_q, N, E), key (T_k, K, E), value
    (T_k, K, Ev); sequence b owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key
    rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` (an empty sequence is allowed). ``causal``:
    FlashAttention's flag (bottom-right per sequence)."""

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    cu_seqlens_q: tuple[int, ...]
    cu_seqlens_k: tuple[int, ...]
    causal: bool = False
    scale: float | None = None
    dtype: str = "float64"
    device: str = "cpu"

    @property
    def B(self) -> int:
        return len(self.cu_seqlens_q) - 1

    @property
    def N(self) -> int:
        return int(self.query.shape[1])

    @property
    def K(self) -> int:
        return int(self.key.shape[1])

    @property
    def E(self) -> int:
        return int(self.query.shape[2])

    @property
    def Ev(self) -> int:
        return int(self.value.shape[2])

    def sequences(self) -> list[tuple[slice, slice]]:
        """(query rows, key rows) of each sequence in the packed arrays."""
        q, k = self.cu_seqlens_q, self.cu_seqlens_k
        return [(slice(q[b], q[b + 1]), slice(k[b], k[b + 1])) for b in range(self.B)]

    def lengths(self) -> list[tuple[int, int]]:
        """(L_b, S_b) of each sequence."""
        return [(r.stop - r.start, c.stop - c.start) for r, c in self.sequences()]

    def alone(self, b: int) -> VarlenCase:
        """Sequence b as a batch of its own."""
        rows, keys = self.sequences()[b]
        L, S = rows.stop - rows.start, keys.stop - keys.start
        return _replace(self, query=self.query[rows], key=self.key[keys], value=self.value[keys],
                        cu_seqlens_q=(0, L), cu_seqlens_k=(0, S))

    def attrs(self, **extra: Any) -> dict[str, Any]:
        """Attributes for capability checks (``Implementation.not_supported_reasons``)."""
        lengths = self.lengths() or [(0, 0)]
        out = {"level": "varlen", "device": self.device, "dtype": self.dtype,
               "causal": "lower_right" if self.causal else None, "scale": self.scale,
               "scale_sign": _scale_sign(self.scale), "B": self.B, "N": self.N, "K": self.K,
               "L": max(L for L, _ in lengths), "S": max(S for _, S in lengths), "E": self.E,
               "Ev": self.Ev, "gqa": self.K != self.N, "different_v_dim": self.E != self.Ev}
        out.update(extra)
        return out

    def replace(self, **changes: Any) -> VarlenCase:
        return _replace(self, **changes)

    def describe(self) -> str:
        return (f"varlen B={self.B} N={self.N} K={self.K} E={self.E} Ev={self.Ev} "
                f"cu_seqlens_q={list(self.cu_seqlens_q)} cu_seqlens_k={list(self.cu_seqlens_k)} "
                f"causal={self.causal} scale={self.scale} dtype={self.dtype} device={self.device}")

    def __repr__(self) -> str:
        return f"VarlenCase({self.describe()})"


@dataclass(frozen=True, eq=False, repr=False)
class KVCacheCase:
    """One decoding step: query (B, L, N, E) against the logical caches k_cache (B, S_cache,
    K, E), v_cache (B, S_cache, K, Ev) of which ``cache_seqlens[b]`` rows are valid; the new
    keys ``k_new`` (B, S_new, K, E) / ``v_new`` are appended first (None: no append).

    ``page_size`` (None: contiguous only) divides S_cache; paged, the caches are handed over
    as pages (num_pages, page_size, K, E|Ev): logical page j of sequence b is physical page
    ``page_order[b * max_pages + j]`` (``len(page_order) = num_pages >= B * max_pages``; the
    spare pages hold ``spare``-seeded garbage), and ``block_table[b, j]`` says so."""

    query: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    cache_seqlens: tuple[int, ...]
    k_new: np.ndarray | None = None
    v_new: np.ndarray | None = None
    causal: bool = False
    scale: float | None = None
    page_size: int | None = None
    page_order: tuple[int, ...] | None = None
    dtype: str = "float64"
    device: str = "cpu"

    @property
    def B(self) -> int:
        return int(self.query.shape[0])

    @property
    def L(self) -> int:
        return int(self.query.shape[1])

    @property
    def N(self) -> int:
        return int(self.query.shape[2])

    @property
    def K(self) -> int:
        return int(self.k_cache.shape[2])

    @property
    def E(self) -> int:
        return int(self.query.shape[3])

    @property
    def Ev(self) -> int:
        return int(self.v_cache.shape[3])

    @property
    def S_cache(self) -> int:
        return int(self.k_cache.shape[1])

    @property
    def S_new(self) -> int:
        return 0 if self.k_new is None else int(self.k_new.shape[1])

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    def valid_lengths(self) -> list[int]:
        """S_b = cache_seqlens[b] + S_new: the keys sequence b attends."""
        return [n + self.S_new for n in self.cache_seqlens]

    def oracle(self) -> spec.KVCacheResult:
        """``spec.kvcache_attention`` on the logical (contiguous) caches."""
        return spec.kvcache_attention(self.query, self.k_cache, self.v_cache,
                                      cache_seqlens=np.array(self.cache_seqlens), k=self.k_new,
                                      v=self.v_new, causal=self.causal, scale=self.scale)

    def attrs(self, **extra: Any) -> dict[str, Any]:
        out = {"level": "kvcache", "device": self.device, "dtype": self.dtype,
               "causal": "lower_right" if self.causal else None, "scale": self.scale,
               "scale_sign": _scale_sign(self.scale), "B": self.B, "N": self.N, "K": self.K,
               "L": self.L, "S": max(self.valid_lengths()), "E": self.E, "Ev": self.Ev,
               "gqa": self.K != self.N, "different_v_dim": self.E != self.Ev,
               "kv_paged": self.paged, "kv_append": self.k_new is not None}
        out.update(extra)
        return out

    def replace(self, **changes: Any) -> KVCacheCase:
        return _replace(self, **changes)

    def describe(self) -> str:
        pages = (f" page_size={self.page_size} page_order={list(self.page_order or ())}"
                 if self.paged else "")
        return (f"kvcache B={self.B} L={self.L} N={self.N} K={self.K} E={self.E} Ev={self.Ev} "
                f"S_cache={self.S_cache} cache_seqlens={list(self.cache_seqlens)} S_new={self.S_new}"
                f"{pages} causal={self.causal} scale={self.scale} dtype={self.dtype} device={self.device}")

    def __repr__(self) -> str:
        return f"KVCacheCase({self.describe()})"


# -- the tolerance rule, sequence by sequence ------------------------------------------


def _sequence_bounds(target: Target, q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool,
                     scale: float | None, dtype: str, device: str) -> tuple[np.ndarray, ...]:
    """One sequence, q (L, N, E), k (S, K, E), v (S, K, Ev): (expected (L, N, Ev), allowed
    (L, N, Ev), live (L, N, 1): rows that attend at least one key), by ``calls.allowed_for``
    on the sequence as an SDPA case (B = 1, bottom-right causal, fully-masked rows -> 0)."""
    L, N, _ = q.shape
    S, _, Ev = v.shape
    if L == 0 or S == 0:
        zeros = np.zeros((L, N, Ev))
        return zeros, zeros, np.zeros((L, N, 1), dtype=bool)
    case = SDPACase(np.transpose(q, (1, 0, 2))[None], np.transpose(k, (1, 0, 2))[None],
                    np.transpose(v, (1, 0, 2))[None], causal="lower_right" if causal else None,
                    scale=scale, dtype=dtype, device=device)     # (1, N, L, E), (1, K, S, E|Ev)
    allowed, ref = calls.allowed_for(target, case)                  # (1, N, L, Ev)
    live = calls.valid_rows(case)                                   # (1, N, L, 1)

    def back(x: np.ndarray) -> np.ndarray:                          # (1, N, L, X) -> (L, N, X)
        return np.transpose(x[0], (1, 0, 2))

    return back(ref.output), back(allowed), back(live)


def varlen_bounds(target: Target, case: VarlenCase) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(expected (T_q, N, Ev) = ``spec.varlen_attention``, allowed, live rows (T_q, N, 1))."""
    T = case.query.shape[0]
    expected, allowed = np.zeros((T, case.N, case.Ev)), np.zeros((T, case.N, case.Ev))
    live = np.zeros((T, case.N, 1), dtype=bool)
    for rows, keys in case.sequences():
        expected[rows], allowed[rows], live[rows] = _sequence_bounds(
            target, case.query[rows], case.key[keys], case.value[keys], causal=case.causal,
            scale=case.scale, dtype=case.dtype, device=case.device)
    return expected, allowed, live


def kvcache_bounds(target: Target, case: KVCacheCase) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(expected (B, L, N, Ev) = ``spec.kvcache_attention``, allowed, live rows (B, L, N, 1))."""
    ref = case.oracle()
    shape = (case.B, case.L, case.N, case.Ev)
    expected, allowed = np.zeros(shape), np.zeros(shape)
    live = np.zeros((*shape[:3], 1), dtype=bool)
    for b, S_b in enumerate(case.valid_lengths()):
        expected[b], allowed[b], live[b] = _sequence_bounds(
            target, case.query[b], ref.k_cache[b, :S_b], ref.v_cache[b, :S_b], causal=case.causal,
            scale=case.scale, dtype=case.dtype, device=case.device)
    return expected, allowed, live


def _compared_rows(target: Target, live: np.ndarray) -> np.ndarray | None:
    """Rows to compare: all of them under the ``zero`` policy (FlashAttention's: a row
    with no key gives 0), only the live ones otherwise (``fully_masked`` declares the rest)."""
    return None if target.caps.fully_masked == "zero" else live


def compare_pair(target: Target, what: str, actual: np.ndarray, other: np.ndarray,
                 allowed: np.ndarray, live: np.ndarray) -> float:
    """Two outputs of the implementation that must agree: each is within ``allowed`` of
    the oracle, so they may differ by twice that."""
    __tracebackhide__ = True
    return compare_values(what, actual, other, 2 * allowed, where=_compared_rows(target, live)).ratio


def check_varlen_against_oracle(target: Target, case: VarlenCase, output: np.ndarray) -> float:
    __tracebackhide__ = True
    expected, allowed, live = varlen_bounds(target, case)
    return compare_values("packed output", output, expected, allowed,
                          where=_compared_rows(target, live)).ratio


def check_kvcache_against_oracle(target: Target, case: KVCacheCase, output: np.ndarray) -> float:
    __tracebackhide__ = True
    expected, allowed, live = kvcache_bounds(target, case)
    return compare_values("kv-cache output", output, expected, allowed,
                          where=_compared_rows(target, live)).ratio


# -- calling the implementation ------------------------------------------------------------


def _tensor(array: np.ndarray, case: Any) -> Any:
    import torch

    return torch.tensor(np.asarray(array, dtype=np.float64), dtype=dtype_of(case.dtype), device=case.device)


def _int32(values: Any, device: str) -> Any:
    import torch

    return torch.tensor(np.asarray(values, dtype=np.int64), dtype=torch.int32, device=device)


def run_varlen(target: Target, case: VarlenCase) -> np.ndarray:
    """``target.impl.varlen`` on ``case`` (FlashAttention's arguments); the output (T_q, N, Ev)."""
    __tracebackhide__ = True
    lengths = case.lengths() or [(0, 0)]
    out = call_guarded(
        target, target.impl.varlen,
        _tensor(case.query, case), _tensor(case.key, case), _tensor(case.value, case),
        _int32(case.cu_seqlens_q, case.device), _int32(case.cu_seqlens_k, case.device),
        max(L for L, _ in lengths), max(S for _, S in lengths),
        softmax_scale=case.scale, causal=case.causal,
    )
    assert_returned_tensor("output", out, device=case.device, shape=(case.query.shape[0], case.N, case.Ev),
                           dims="(T_q, N, Ev)")
    if out.dtype != dtype_of(case.dtype):
        fail(f"output dtype={out.dtype}, but should be {dtype_of(case.dtype)} (the input dtype)")
    return to_numpy(out)


@dataclass
class KVCacheCall:
    output: np.ndarray   # (B, L, N, Ev), float64 copy
    k_cache: np.ndarray  # the key cache after the call, in the logical layout (B, S_cache, K, E)
    v_cache: np.ndarray  # (B, S_cache, K, Ev)


def _pages(case: KVCacheCase, cache: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The logical cache (B, S_cache, K, X) as pages (num_pages, page_size, K, X) and the
    block table (B, max_pages); spare pages hold integers up to ±30 (exact in every dtype),
    seeded by the page count and size, so a read from one shows."""
    B, S_cache, K, X = cache.shape
    size = case.page_size
    max_pages = S_cache // size
    order = np.asarray(case.page_order, dtype=np.int64)
    table = order[:B * max_pages].reshape(B, max_pages)
    rng = np.random.default_rng(len(order) * 7919 + size)
    pages = np.round(rng.standard_normal((len(order), size, K, X)) * 8, 0)   # exact in every dtype
    pages[table.reshape(-1)] = cache.reshape(B * max_pages, size, K, X)
    return pages, table


def _unpage(pages: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Pages (num_pages, page_size, K, X) -> the logical cache (B, max_pages·page_size, K, X)."""
    return spec.gather_pages(pages, table)


def run_kvcache(target: Target, case: KVCacheCase, *, paged: bool | None = None) -> KVCacheCall:
    """``target.impl.kvcache`` on ``case`` (paged when the case has pages, unless ``paged``
    says otherwise); the output and the caches after the call (FlashAttention writes the
    new keys and values into them in place), read back in the logical layout."""
    __tracebackhide__ = True
    paged = case.paged if paged is None else paged
    if paged:
        k_pages, table = _pages(case, case.k_cache)
        v_pages, _ = _pages(case, case.v_cache)
        k_cache, v_cache, block_table = _tensor(k_pages, case), _tensor(v_pages, case), _int32(table, case.device)
    else:
        k_cache, v_cache, block_table = _tensor(case.k_cache, case), _tensor(case.v_cache, case), None
    new = {} if case.k_new is None else {"k": _tensor(case.k_new, case), "v": _tensor(case.v_new, case)}
    out = call_guarded(
        target, target.impl.kvcache, _tensor(case.query, case), k_cache, v_cache, **new,
        cache_seqlens=_int32(case.cache_seqlens, case.device), block_table=block_table,
        softmax_scale=case.scale, causal=case.causal,
    )
    assert_returned_tensor("output", out, device=case.device, shape=(case.B, case.L, case.N, case.Ev),
                           dims="(B, L, N, Ev)")
    if out.dtype != dtype_of(case.dtype):
        fail(f"output dtype={out.dtype}, but should be {dtype_of(case.dtype)} (the input dtype)")
    k_after, v_after = to_numpy(k_cache), to_numpy(v_cache)
    if paged:
        k_after, v_after = _unpage(k_after, table), _unpage(v_after, table)
    return KVCacheCall(to_numpy(out), k_after, v_after)


def assert_same_cache(what: str, actual: np.ndarray, expected: np.ndarray, valid: list[int]) -> None:
    """The first ``valid[b]`` rows of each sequence's cache hold exactly the expected values
    (copies of stored values: no rounding is allowed)."""
    __tracebackhide__ = True
    for b, S_b in enumerate(valid):
        differ = actual[b, :S_b] != expected[b, :S_b]
        if differ.any():
            t, *rest = (int(i) for i in np.argwhere(differ)[0])
            fail(f"{what}[{b}, {t}, {', '.join(map(str, rest))}]={actual[b, t][tuple(rest)]!r}, but should be "
                 f"{expected[b, t][tuple(rest)]!r}: row t={t} of sequence {b} (cache_seqlens + S_new = {S_b} "
                 "valid rows after the append)")
