"""KV-cache decoding calls: the cases, the calls, and what the oracle says.

The kvcache level (``implementations.base``) takes FlashAttention's
``flash_attn_with_kvcache`` convention; the oracle is ``spec.kvcache_attention``. Every
call goes through ``core.target.call_guarded`` (:func:`run_kvcache`, logged as a
:class:`KVCacheCallSpec`, made by :func:`run_kvcache_call`: the same code a failure's
reproducer runs through :func:`show_kvcache_call`). The call writes the new keys and
values into the caches in place: every call hands over fresh tensors made from the
case's arrays, so the case (and a saved or replayed one) keeps the caches as they were
before the call. The error bound is the SDPA rule applied sequence by sequence of the
cache, as at the varlen level (``conformance.calls.varlen``): the rule, the tensors handed
over and the report are the pieces both levels share (``conformance.calls.sequences``).

Dimension letters: B sequences, N query heads, K kv heads, L query length, S key length,
E q/k head dim, Ev value head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

import spec
from conformance.calls.cache_options import (
    _DESCALES,
    attended_keys,
    cache_call_kwargs,
    cache_features,
    cache_fields_from_meta,
    cache_meta,
    cache_spec_kwargs,
    cache_text,
    check_cache_after,
    check_lse_against_oracle,
    descale_forms,
    descale_kwargs,
    descale_spec_kwargs,
    flash_options,
    float32_tensor,
    fp8_cache_bounds,
    fp8_text,
    option_features,
    option_kwargs,
    option_text,
    rotated_query,
    split_lse,
)
from conformance.calls.call_reports import CallReport
from conformance.calls.call_specs import call_directly
from conformance.calls.sequences.bounds import (
    compare_with_oracle,
    sequences_bounds,
    sequences_lse_bounds,
)
from conformance.calls.sequences.calling import (
    as_pages,
    check_returned_output,
    int32,
    log_call,
    tensor,
)
from conformance.calls.sequences.cases import (
    fp8_meta,
    head_attrs,
    option_fields_from_meta,
    replace,
)
from conformance.calls.sequences.reports import report_against_oracle
from conformance.core.compare import fail
from conformance.core.observe import observe_kvcache
from conformance.core.target import Target, call_guarded
from conformance.core.tensors import to_numpy

__all__ = [
    "ATTRIBUTES",
    "KVCACHE_ATTRIBUTES",
    "SHOW",
    "CallSpec",
    "Case",
    "KVCacheCall",
    "KVCacheCallSpec",
    "KVCacheCase",
    "assert_same_cache",
    "case_from_meta",
    "case_meta",
    "check_kvcache_against_oracle",
    "kvcache_bounds",
    "kvcache_lse_bounds",
    "report_call",
    "report_kvcache_call",
    "run_kvcache",
    "run_kvcache_call",
    "show_kvcache_call",
    "validate",
]

#: Attributes of a kvcache-level call (``KVCacheCase.attrs()``; the call sets ``kv_paged``
#: to whether it handed the caches over as pages): the keys an expected failure's
#: ``match`` may use at this level.
KVCACHE_ATTRIBUTES = frozenset({
    "level", "device", "dtype", "causal", "scale", "scale_sign", "B", "N", "K", "L", "S", "E", "Ev",
    "gqa", "different_v_dim", "kv_paged", "kv_append", "window", "softcap", "alibi", "kvcache_features", "lse",
    "rotary", "rotary_dim", "rotary_interleaved", "cache_batch_idx", "cache_leftpad", "num_splits",
    "fp8", "descale_forms",
})


@dataclass(frozen=True, eq=False, repr=False)
class KVCacheCase:
    """One decoding step: query (B, L, N, E) against the logical caches k_cache (B, S_cache,
    K, E), v_cache (B, S_cache, K, Ev) of which ``cache_seqlens[b]`` rows are valid; the new
    keys ``k_new`` (B, S_new, K, E) / ``v_new`` are appended first (None: no append).

    ``page_size`` (None: contiguous only) divides S_cache; paged, the caches are handed over
    as pages (num_pages, page_size, K, E|Ev): logical page j of sequence b is physical page
    ``page_order[b * max_pages + j]`` (``len(page_order) = num_pages >= B * max_pages``; the
    spare pages hold ``spare``-seeded garbage), and ``block_table[b, j]`` says so.

    The cache options (``conformance.calls.cache_options``): rotary tables ``rotary_cos``/
    ``rotary_sin`` (seqlen_ro, R/2), exact in the dtype (handed over in it); sequence b
    reads and writes cache row ``cache_batch_idx[b]`` (k_cache then (B_cache, S_cache, K,
    E)); its keys start at ``cache_leftpad[b]``; ``num_splits`` is passed when not None.

    FP8 (FlashAttention-3): ``fp8`` names the format q, the caches and the new keys and
    values hold, with descales None, (1,) or (B, K), row b for sequence b
    (``spec.kvcache_attention``'s FP8 inputs). ``notes``: labels that change no call (a
    directed case's ``directed: NAME``, which the report names it by)."""

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
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: np.ndarray | None = None    # (N,) or (B, N), float32-exact
    rotary_cos: np.ndarray | None = None      # (seqlen_ro, R/2), exact in the dtype
    rotary_sin: np.ndarray | None = None
    rotary_interleaved: bool = True           # FlashAttention's default
    cache_batch_idx: tuple[int, ...] | None = None
    cache_leftpad: tuple[int, ...] | None = None
    num_splits: int | None = None
    fp8: str | None = None
    q_descale: np.ndarray | None = None
    k_descale: np.ndarray | None = None
    v_descale: np.ndarray | None = None
    notes: tuple[str, ...] = ()

    @property
    def level(self) -> str:
        return "kvcache"

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
                                      v=self.v_new, causal=self.causal, scale=self.scale, **flash_options(self),
                                      **cache_spec_kwargs(self), **descale_spec_kwargs(self))

    def sequence_slopes(self, b: int) -> np.ndarray | None:
        """ALiBi slopes of sequence b alone: (N,) kept, row b of (B, N) as (1, N)."""
        if self.alibi_slopes is None or np.ndim(self.alibi_slopes) == 1:
            return self.alibi_slopes
        return np.asarray(self.alibi_slopes)[b:b + 1]

    def attrs(self, **extra: Any) -> dict[str, Any]:
        out = head_attrs(self, L=self.L, S=max(self.valid_lengths()))
        out.update({"kv_paged": self.paged, "kv_append": self.k_new is not None,
               "window": tuple(self.window) != (-1, -1), "softcap": self.softcap,
               "alibi": self.alibi_slopes is not None,
               "kvcache_features": option_features(self) | cache_features(self),
               "rotary": self.rotary_cos is not None,
               "rotary_dim": None if self.rotary_cos is None else 2 * int(np.shape(self.rotary_cos)[1]),
               "rotary_interleaved": None if self.rotary_cos is None else bool(self.rotary_interleaved),
               "cache_batch_idx": self.cache_batch_idx is not None, "cache_leftpad": self.cache_leftpad is not None,
               "num_splits": self.num_splits, "fp8": self.fp8, "descale_forms": descale_forms(self)})
        if self.fp8 is not None:
            out["kvcache_features"] = out["kvcache_features"] | {"fp8"}
        out.update(extra)
        return out

    def replace(self, **changes: Any) -> KVCacheCase:
        return replace(self, **changes)

    def named_with(self, what: str) -> tuple[str, ...]:
        """``notes`` with ``what`` added to the directed case's name (a variant of it)."""
        return tuple(f"{note}, {what}" if note.startswith("directed: ") else note for note in self.notes)

    def describe(self) -> str:
        pages = (f" page_size={self.page_size} page_order={list(self.page_order or ())}"
                 if self.paged else "")
        return (f"kvcache B={self.B} L={self.L} N={self.N} K={self.K} E={self.E} Ev={self.Ev} "
                f"S_cache={self.S_cache} cache_seqlens={list(self.cache_seqlens)} S_new={self.S_new}"
                f"{pages} causal={self.causal}{option_text(self)}{cache_text(self)}{fp8_text(self)} "
                f"scale={self.scale} dtype={self.dtype} device={self.device}")

    def __repr__(self) -> str:
        return f"KVCacheCase({self.describe()})"


# -- the tolerance rule, row by row of the cache ----------------------------------------


def kvcache_bounds(target: Target, case: KVCacheCase) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(expected (B, L, N, Ev) = ``spec.kvcache_attention``, allowed, live rows (B, L, N, 1))."""
    if case.fp8 is not None:  # on the dequantised values, FP8's bound (for the bfloat16 output FA3 returns)
        return fp8_cache_bounds(case, out_dtype="bfloat16")
    return sequences_bounds(target, case, _sequences(case), (case.B, case.L, case.N, case.Ev))


def kvcache_lse_bounds(target: Target, case: KVCacheCase, stored: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(expected LSE (B, N, L) = ``spec.kvcache_attention``'s, allowed error (B, N, L))."""
    return sequences_lse_bounds(target, case, _sequences(case), (case.B, case.N, case.L), stored)


def _sequences(case: KVCacheCase) -> Any:
    """Each sequence as ``(b, b, q, k, v)`` (``sequences.bounds``): its rotated queries and
    the keys and values it attends in the spec's caches after the append."""
    ref = case.oracle()
    query = rotated_query(case)
    for b in range(case.B):
        keys, values = attended_keys(case, ref.k_cache, ref.v_cache, b)
        yield b, b, query[b], keys, values


def check_kvcache_against_oracle(target: Target, case: KVCacheCase, output: np.ndarray) -> float:
    __tracebackhide__ = True
    return compare_with_oracle(target, "kv-cache output", output, kvcache_bounds(target, case))


@dataclass
class KVCacheCall:
    output: np.ndarray   # (B, L, N, Ev), float64 copy
    k_cache: np.ndarray  # the key cache after the call, in the logical layout (B | B_cache, S_cache, K, E)
    v_cache: np.ndarray  # (B | B_cache, S_cache, K, Ev)
    lse: np.ndarray | None = None  # (B, N, L) with return_softmax_lse=True
    lse_dtype: str | None = None


# -- calling the implementation ------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class KVCacheCallSpec:
    """One call of ``impl.kvcache`` exactly as made: the case, and whether its caches were
    handed over as pages (``paged``; None: as the case has them). ``grad_output`` is
    always None at this level."""

    case: KVCacheCase
    paged: bool | None = None
    grad_output: np.ndarray | None = None
    lse: bool = False  # return_softmax_lse=True: (output, softmax_lse (B, N, L))

    def __post_init__(self) -> None:
        object.__setattr__(self, "paged", self.case.paged if self.paged is None else bool(self.paged))

    @property
    def level(self) -> str:
        return "kvcache"

    def attrs(self) -> dict[str, Any]:
        attrs = self.case.attrs(kv_paged=self.paged, lse=self.lse)
        if self.lse:
            attrs["kvcache_features"] = attrs["kvcache_features"] | {"lse"}
        return attrs

    def arguments(self) -> str:
        c = self.case
        text = "k=k_new, v=v_new, " if c.k_new is not None else ""
        text += f"cache_seqlens={list(c.cache_seqlens)}, "
        if self.paged:
            text += f"block_table=<page_order {list(c.page_order or ())} in pages of {c.page_size}>, "
        options = "".join(f", {k}={v!r}" for k, v in option_kwargs(c, lambda a: "<float32 tensor>").items())
        options += cache_text(c, arguments=True)
        options += "".join(f", {n}=<float32 tensor {tuple(np.shape(getattr(c, n)))}>" for n in _DESCALES
                           if c.fp8 is not None and getattr(c, n) is not None)
        return (text + f"softmax_scale={c.scale!r}, causal={c.causal!r}{options}"
                + (", return_softmax_lse=True" if self.lse else ""))

    def describe(self) -> str:
        return f"{self.case.describe()}; {self.arguments()}"

    def same_as(self, case: Any) -> bool:
        return self.case is case and self.paged == case.paged and not self.lse


def run_kvcache_call(impl: Any, call: KVCacheCallSpec, *, invoke: Any = call_directly,
                     check_output: bool = True) -> KVCacheCall:
    """Make ``call`` on ``impl.kvcache`` (through ``invoke``) on fresh tensors of the case
    (the caches as pages when ``call.paged``); the output and the caches after the call
    (FlashAttention writes the new keys and values into them in place), read back in the
    logical layout. With ``check_output``, check what came back first."""
    __tracebackhide__ = True
    case = call.case
    if call.paged:
        k_pages, table = as_pages(case, case.k_cache)
        v_pages, _ = as_pages(case, case.v_cache)
        k_cache, v_cache, block_table = tensor(k_pages, case), tensor(v_pages, case), int32(table, case.device)
    else:
        k_cache, v_cache, block_table = tensor(case.k_cache, case), tensor(case.v_cache, case), None
    new = {} if case.k_new is None else {"k": tensor(case.k_new, case), "v": tensor(case.v_new, case)}
    extra = option_kwargs(case, lambda a: float32_tensor(a, case))
    extra.update(cache_call_kwargs(case, lambda a: tensor(a, case), lambda x: int32(x, case.device)))
    extra.update(descale_kwargs(case, lambda a: float32_tensor(a, case)))
    if call.lse:
        extra["return_softmax_lse"] = True
    out = invoke(
        impl.kvcache, tensor(case.query, case), k_cache, v_cache, **new,
        cache_seqlens=int32(case.cache_seqlens, case.device), block_table=block_table,
        softmax_scale=case.scale, causal=case.causal, **extra,
    )
    if not check_output:
        return KVCacheCall(np.zeros(0), case.k_cache, case.v_cache)
    lse = None
    if call.lse:
        out, lse = split_lse(out, (case.B, case.N, case.L), "return_softmax_lse", "(B, N, L)")
    check_returned_output(out, case, (case.B, case.L, case.N, case.Ev), "(B, L, N, Ev)")
    k_after, v_after = to_numpy(k_cache), to_numpy(v_cache)
    if call.paged:
        k_after, v_after = spec.gather_pages(k_after, table), spec.gather_pages(v_after, table)
    return KVCacheCall(to_numpy(out), k_after, v_after, None if lse is None else to_numpy(lse),
                       None if lse is None else str(lse.dtype).removeprefix("torch."))


def run_kvcache(target: Target, case: KVCacheCase, *, paged: bool | None = None, lse: bool = False) -> KVCacheCall:
    """``target.impl.kvcache`` on ``case`` through ``core.target.call_guarded``, the call logged
    (paged when the case has pages, unless ``paged`` says otherwise; ``lse``: with
    ``return_softmax_lse=True``)."""
    __tracebackhide__ = True
    call = KVCacheCallSpec(case, paged=paged, lse=lse)
    log_call(target, call)
    result = run_kvcache_call(target.impl, call, invoke=partial(call_guarded, target))
    lse = None if result.lse is None else np.where(np.isposinf(result.lse), -np.inf, result.lse)
    observe_kvcache(case, result.output, paged=call.paged, k_cache=result.k_cache, v_cache=result.v_cache,
                    lse=lse, lse_dtype=result.lse_dtype)
    return result


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


# -- saving and reproducing ------------------------------------------------------------------


_ARRAYS = ("query", "k_cache", "v_cache", "k_new", "v_new")


def case_meta(case: KVCacheCase) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(meta, arrays)`` of a kvcache case for ``conformance.reporting.failures`` (kind ``"kvcache"``):
    the caches as they were before the call."""
    arrays = {n: np.asarray(getattr(case, n)) for n in _ARRAYS if getattr(case, n) is not None}
    meta = {"kind": "kvcache", "cache_seqlens": [int(n) for n in case.cache_seqlens], "causal": bool(case.causal),
            "scale": case.scale, "page_size": None if case.page_size is None else int(case.page_size),
            "page_order": None if case.page_order is None else [int(n) for n in case.page_order],
            "dtype": case.dtype, "device": case.device, "window": [int(x) for x in case.window],
            "softcap": float(case.softcap), "notes": list(case.notes)}
    if case.alibi_slopes is not None:
        arrays["alibi_slopes"] = np.asarray(case.alibi_slopes)
    options, tables = cache_meta(case)
    meta.update(options)
    arrays.update(tables)
    return fp8_meta(case, meta, arrays)


def case_from_meta(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> KVCacheCase:
    order = meta["page_order"]
    return KVCacheCase(**{n: arrays.get(n) for n in _ARRAYS},
                       cache_seqlens=tuple(int(n) for n in meta["cache_seqlens"]), page_size=meta["page_size"],
                       page_order=None if order is None else tuple(int(n) for n in order),
                       **cache_fields_from_meta(meta, arrays), **option_fields_from_meta(meta, arrays),
                       notes=tuple(meta.get("notes", ())))  # absent in older files


def validate(case: KVCacheCase) -> None:
    """ValueError (``spec.SpecError``) when the spec calls ``case`` invalid, or its pages
    do not lay the cache out (a page size dividing S_cache, distinct pages, enough of them)."""
    for name in ("query", "k_cache", "v_cache"):
        if np.ndim(getattr(case, name)) != 4:
            raise ValueError(f"{name} has shape {np.shape(getattr(case, name))}, but should be 4-D")
    if case.paged:
        size, order = case.page_size, list(case.page_order or ())
        if size <= 0 or case.S_cache % size:
            raise ValueError(f"page_size={size} should be positive and divide S_cache={case.S_cache}")
        if sorted(order) != list(range(len(order))) or len(order) < case.B * (case.S_cache // size):
            raise ValueError(f"page_order={order} should be a permutation of at least "
                             f"B * S_cache / page_size = {case.B * (case.S_cache // size)} pages")
    if case.fp8 is not None:
        for name in _ARRAYS:
            if getattr(case, name) is not None and not spec.fp8.representable(getattr(case, name), case.fp8).all():
                raise ValueError(f"{name} holds values that are not {case.fp8} values")
    case.oracle()


def report_kvcache_call(impl: Any, call: KVCacheCallSpec, *, invoke: Any = call_directly) -> CallReport:
    """Make ``call`` and compare its output with ``spec.kvcache_attention`` and the caches
    after it (the new keys and values written in place at ``cache_seqlens``) with the
    spec's updated caches, exactly."""
    case = call.case
    target = Target(impl, "kvcache", case.dtype, case.device)
    report = CallReport(call, [f"call: impl.kvcache(q, k_cache, v_cache, {call.arguments()})",
                               f"case as called: {case.describe()}"])
    def oracle(result: KVCacheCall) -> str:
        options = "".join(f", {k}={v!r}" for k, v in flash_options(case).items() if k != "alibi_slopes")
        return (f"oracle: spec.kvcache_attention(causal={case.causal!r}, scale={case.scale!r}{options}"
                f"{cache_text(case, arguments=True)}), "
                + (f"on the dequantised {case.fp8} values (descale row b for sequence b), "
                   "tolerance.fp8_allowed" if case.fp8 is not None else "tolerance rule")
                + " per sequence; the caches after the call exactly (rotated keys within the rounding "
                "of a rotation)")

    def checks(result: KVCacheCall) -> list[Any]:
        ref = case.oracle()
        found = [lambda: check_kvcache_against_oracle(target, case, result.output),
                 lambda: check_cache_after("k_cache after the call", result.k_cache, ref.k_cache, case, keys=True),
                 lambda: check_cache_after("v_cache after the call", result.v_cache, ref.v_cache, case, keys=False)]
        if result.lse is not None:
            found.append(lambda: check_lse_against_oracle("softmax_lse", result.lse,
                                                          *kvcache_lse_bounds(target, case, result.lse_dtype)))
        return found

    return report_against_oracle(
        report, validate=lambda: validate(case),
        run_unchecked=lambda: run_kvcache_call(impl, call, invoke=invoke, check_output=False),
        run=lambda: run_kvcache_call(impl, call, invoke=invoke), oracle=oracle,
        checks=checks, output=lambda result: result.output, expected=lambda: kvcache_bounds(target, case)[0])


def show_kvcache_call(impl: Any, call: KVCacheCallSpec) -> CallReport:
    """Make ``call`` in this interpreter and print how it differs from ``spec.kvcache_attention``."""
    report = report_kvcache_call(impl, call)
    print(report.text())
    return report


# The level's entries of conformance.core.levels (what the shared machinery reads).
Case = KVCacheCase
CallSpec = KVCacheCallSpec
ATTRIBUTES = KVCACHE_ATTRIBUTES
report_call = report_kvcache_call
SHOW = "show_kvcache_call"
