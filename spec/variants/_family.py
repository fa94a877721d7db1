"""The problems of the FlashAttention levels: one call of ``flash_attn_func`` (flash),
``flash_attn_varlen_func`` (varlen) or ``flash_attn_with_kvcache`` (kvcache), described as
the implementation received it, in FlashAttention's layouts (``spec.flash``,
``spec.varlen``, ``spec.kvcache``).

Dimension letters: B batch, N query heads, K kv heads, L query length, S key length,
E q/k head dim, Ev value head dim, T packed length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from .. import _checks
from .. import _flash_checks as checks
from ..errors import fail
from ..flash import prepare
from ..kvcache import kvcache_attention
from ..varlen import _sequences
from ._core import _check_common, _from_case

__all__ = ["FlashProblem", "VarlenProblem", "KVCacheProblem", "FamilyProblem"]


def _arrays(problem: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(problem, name)
        if value is not None:
            object.__setattr__(problem, name, _checks.as_float64(name, value))


def _window(problem: Any) -> None:
    object.__setattr__(problem, "window", checks.window_pair(tuple(problem.window)))


@dataclass(frozen=True, eq=False)
class FlashProblem:
    """One ``flash_attn_func`` call: ``query`` (B, L, N, E), ``key`` (B, S, K, E), ``value``
    (B, S, K, Ev); ``causal`` (bottom-right), ``window`` (left, right), ``softcap``,
    ``alibi_slopes`` (N,) or (B, N), ``scale`` (None = 1/sqrt(E)), ``sinks`` (N,) as
    :func:`spec.flash_attention` takes them; ``dtype`` the precision it computed in;
    ``fully_masked`` the declared policy of a row that attends no key. Field names are the
    runner's flash case's (``from_case``)."""

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: np.ndarray | None = None
    scale: float | None = None
    sinks: np.ndarray | None = None
    dtype: str = "float64"
    fully_masked: str = "zero"

    level = "flash"

    def __post_init__(self) -> None:
        _arrays(self, ("query", "key", "value", "alibi_slopes", "sinks"))
        _window(self)
        prepare(self.query, self.key, self.value, causal=self.causal, window=self.window, softcap=self.softcap,
                alibi_slopes=self.alibi_slopes, scale=self.scale, sinks=self.sinks)   # checks every argument
        _check_common(self.dtype, self.fully_masked)

    @classmethod
    def from_case(cls, case: Any, **changes: Any) -> "FlashProblem":
        """Copy the fields ``case`` has under the same names; ``changes`` override."""
        return _from_case(cls, case, changes)

    @property
    def resolved_scale(self) -> float:
        return _checks.resolve_scale(self.scale, self.query.shape[-1])


@dataclass(frozen=True, eq=False)
class VarlenProblem:
    """One ``flash_attn_varlen_func`` call: ``query`` (T_q, N, E), ``key`` (T_k, K, E),
    ``value`` (T_k, K, Ev) holding B sequences at ``cu_seqlens_q`` / ``cu_seqlens_k``
    (B + 1 ints each), and :class:`FlashProblem`'s options (no sinks). Field names are the
    runner's varlen case's (``from_case``)."""

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    cu_seqlens_q: tuple[int, ...]
    cu_seqlens_k: tuple[int, ...]
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: np.ndarray | None = None
    scale: float | None = None
    dtype: str = "float64"
    fully_masked: str = "zero"

    level = "varlen"

    def __post_init__(self) -> None:
        _arrays(self, ("query", "key", "value", "alibi_slopes"))
        _window(self)
        checks.head_layout(self.query, self.key, self.value, 1, ("(T_q, N, E)", "(T_k, K, E)", "(T_k, K, Ev)"))
        sequences = _sequences(self.cu_seqlens_q, self.cu_seqlens_k, self.query.shape[0], self.key.shape[0])
        object.__setattr__(self, "cu_seqlens_q", tuple(int(x) for x in self.cu_seqlens_q))
        object.__setattr__(self, "cu_seqlens_k", tuple(int(x) for x in self.cu_seqlens_k))
        checks.slopes_array(self.alibi_slopes, len(sequences), self.query.shape[1])
        checks.softcap_value(self.softcap)
        checks.causal_flag(self.causal)
        _check_common(self.dtype, self.fully_masked)

    @classmethod
    def from_case(cls, case: Any, **changes: Any) -> "VarlenProblem":
        """Copy the fields ``case`` has under the same names; ``changes`` override."""
        return _from_case(cls, case, changes)

    def sequences(self) -> list[tuple[slice, slice]]:
        """(query rows, key rows) of each sequence in the packed arrays."""
        q, k = self.cu_seqlens_q, self.cu_seqlens_k
        return [(slice(q[b], q[b + 1]), slice(k[b], k[b + 1])) for b in range(len(q) - 1)]

    @property
    def resolved_scale(self) -> float:
        return _checks.resolve_scale(self.scale, self.query.shape[-1])


@dataclass(frozen=True, eq=False)
class KVCacheProblem:
    """One ``flash_attn_with_kvcache`` call as the implementation received it: ``query``
    (B, L, N, E); the caches ``k_cache``/``v_cache`` before the call, contiguous
    (B_cache, S_cache, K, E|Ev) or, with ``block_table`` (B, max_pages), the pages
    (num_pages, page_size, K, E|Ev) exactly as handed over (spare pages included);
    ``cache_seqlens`` (B,), the new keys ``k_new``/``v_new`` (B, S_new, K, E|Ev) or None, the
    cache options (``rotary_cos``/``rotary_sin``/``rotary_interleaved``,
    ``cache_batch_idx``, ``cache_leftpad``, ``num_splits``: None = not passed) and
    :class:`FlashProblem`'s options (no sinks), as :func:`spec.kvcache_attention` takes them.
    Field names are the runner's kvcache case's (``from_case``; the runner passes the
    pages and ``block_table`` of a paged call)."""

    query: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    cache_seqlens: tuple[int, ...]
    k_new: np.ndarray | None = None
    v_new: np.ndarray | None = None
    block_table: np.ndarray | None = None
    rotary_cos: np.ndarray | None = None
    rotary_sin: np.ndarray | None = None
    rotary_interleaved: bool = True
    cache_batch_idx: tuple[int, ...] | None = None
    cache_leftpad: tuple[int, ...] | None = None
    num_splits: int | None = None
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: np.ndarray | None = None
    scale: float | None = None
    dtype: str = "float64"
    fully_masked: str = "zero"

    level = "kvcache"

    def __post_init__(self) -> None:
        _arrays(self, ("query", "k_cache", "v_cache", "k_new", "v_new", "rotary_cos", "rotary_sin", "alibi_slopes"))
        _window(self)
        for name in ("cache_seqlens", "cache_batch_idx", "cache_leftpad"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(int(x) for x in checks.int_vector(name, np.asarray(value))))
        if self.block_table is not None:
            table = np.asarray(self.block_table)
            if table.ndim != 2 or not np.issubdtype(table.dtype, np.integer):
                fail("block_table", table, "must be a 2-D int array (B, max_pages)",
                     "pass the block table of a paged call, or None for a contiguous cache")
            object.__setattr__(self, "block_table", table.astype(np.int64))
        if self.num_splits is not None:
            object.__setattr__(self, "num_splits", checks.size("num_splits", self.num_splits))
        kvcache_attention(**self.spec_arguments())                               # checks every argument
        _check_common(self.dtype, self.fully_masked)

    @classmethod
    def from_case(cls, case: Any, **changes: Any) -> "KVCacheProblem":
        """Copy the fields ``case`` has under the same names; ``changes`` override."""
        return _from_case(cls, case, changes)

    def spec_arguments(self) -> dict[str, Any]:
        """The keyword arguments of :func:`spec.kvcache_attention` for this call."""
        args: dict[str, Any] = dict(query=self.query, k_cache=self.k_cache, v_cache=self.v_cache,
                                    cache_seqlens=np.asarray(self.cache_seqlens, dtype=np.int64), k=self.k_new,
                                    v=self.v_new, block_table=self.block_table, causal=self.causal,
                                    window=self.window, softcap=self.softcap, alibi_slopes=self.alibi_slopes,
                                    scale=self.scale, rotary_interleaved=bool(self.rotary_interleaved),
                                    num_splits=self.num_splits or 0)
        if self.rotary_cos is not None:
            args.update(rotary_cos=self.rotary_cos, rotary_sin=self.rotary_sin)
        for name in ("cache_batch_idx", "cache_leftpad"):
            if getattr(self, name) is not None:
                args[name] = np.asarray(getattr(self, name), dtype=np.int64)
        return args

    @property
    def B(self) -> int:
        return int(self.query.shape[0])

    @property
    def S_new(self) -> int:
        return 0 if self.k_new is None else int(self.k_new.shape[1])

    @property
    def page_size(self) -> int | None:
        return None if self.block_table is None else int(self.k_cache.shape[1])

    @property
    def capacity(self) -> int:
        """The logical cache length of a sequence: S_cache, or max_pages · page_size."""
        if self.block_table is None:
            return int(self.k_cache.shape[1])
        return int(self.block_table.shape[1]) * int(self.k_cache.shape[1])

    def rows(self) -> list[int]:
        """The cache row each sequence reads and writes (``cache_batch_idx``, or b)."""
        return list(range(self.B)) if self.cache_batch_idx is None else list(self.cache_batch_idx)

    @property
    def resolved_scale(self) -> float:
        return _checks.resolve_scale(self.scale, self.query.shape[-1])


FamilyProblem = Union[FlashProblem, VarlenProblem, KVCacheProblem]
