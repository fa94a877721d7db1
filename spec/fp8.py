"""FP8 inputs with descale factors, as FlashAttention-3's ``flash_attn_func`` takes them.

q, k, v are stored in an 8-bit float format (:data:`FORMATS`: ``float8_e4m3fn``, 3
mantissa bits, no infinities, largest 448; ``float8_e5m2``, 2 mantissa bits, largest
57344) with float32 **descale** factors ``q_descale``, ``k_descale``, ``v_descale``: the
value a stored element stands for is ``stored · descale``. Attention is then exactly
attention on those dequantised values (:func:`dequantize`, then ``spec.flash_attention``).

The product is exact in float64: an fp8 value has at most 4 significant bits and a
float32 descale at most 24, so ``stored · descale`` has at most 28 (< 53). The oracle
therefore sees the very numbers the kernel is told the inputs are; any error a kernel
makes comes from its own internal rounding (the scores' accumulation, the probabilities
rounded to fp8 before the PV product, the output rounded to its 16-bit dtype).

Descale shapes (``descale_array``): None (no descale: 1), a scalar or shape (1,) (one per
tensor), or (B, K), one per batch element and **kv head** (FlashAttention-3's
``CHECK_SHAPE(q_descale, batch_size, num_heads_k)``). ``q_descale[b, g]`` applies to the
query heads that read kv head g, i.e. query head h uses ``q_descale[b, h // (N // K)]``
(FlashAttention-3's test reference repeats it ``"b h -> b 1 (h g) 1"``).

Packed sequences (``flash_attn_varlen_func``, :func:`dequantize_varlen`): the descales are
(B, K) with B the number of **sequences** (``len(cu_seqlens_q) - 1``): sequence b's rows
use row b (FlashAttention-3's varlen ``batch_size`` is ``cu_seqlens_q.size(0) - 1``).

KV cache (``flash_attn_with_kvcache``, ``spec.kvcache_attention``'s ``q_descale``,
``k_descale``, ``v_descale``): the descales are (B, K) with B the **query's** batch: row b
applies to everything sequence b attends, its cached keys and its appended ones alike
(also when ``cache_batch_idx`` sends it to another cache row, and whatever pages hold its
keys); the caches after the call hold the stored values (the append copies them).

Pure NumPy (+ ``ml_dtypes``, imported when a value is rounded); never imports torch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import _checks
from .errors import fail

__all__ = ["FORMATS", "FP8Format", "dequantize", "dequantize_varlen", "descale_array", "format_of", "quantize",
           "representable"]


class FP8Format(NamedTuple):
    """One 8-bit float format: its name (torch's and ml_dtypes'), significand bits after
    the leading one, largest finite value, smallest normal and subnormal magnitudes, and
    unit roundoff ``2^-(mantissa_bits + 1)`` (half the spacing just above 1)."""

    name: str
    mantissa_bits: int
    max: float
    smallest_normal: float
    smallest_subnormal: float

    @property
    def unit_roundoff(self) -> float:
        return 2.0 ** -(self.mantissa_bits + 1)

    @property
    def numpy_type(self) -> Any:
        """ml_dtypes' scalar type (imported here: ml_dtypes costs start-up time)."""
        import ml_dtypes

        return getattr(ml_dtypes, self.name)


#: The formats, by the name torch and ml_dtypes give them (OCP FP8: E4M3 without
#: infinities, E5M2 IEEE-like; ``tests/spec/test_spec_fp8.py`` checks them against
#: ml_dtypes' bit patterns).
FORMATS: dict[str, FP8Format] = {
    "float8_e4m3fn": FP8Format("float8_e4m3fn", 3, 448.0, 2.0 ** -6, 2.0 ** -9),
    "float8_e5m2": FP8Format("float8_e5m2", 2, 57344.0, 2.0 ** -14, 2.0 ** -16),
}


def format_of(name: Any) -> FP8Format:
    """The :class:`FP8Format` called ``name`` (SpecError naming the known ones)."""
    if name not in FORMATS:
        fail("fp8", name, f"must be one of {tuple(FORMATS)}",
             "pass the name torch gives the 8-bit float type of q, k and v, e.g. 'float8_e4m3fn'")
    return FORMATS[name]


def quantize(values: Any, fmt: str, *, saturate: bool = False) -> np.ndarray:
    """``values`` rounded to the nearest ``fmt`` value (ties to even), as float64.

    A finite value beyond the format's largest raises, unless ``saturate`` clips it to
    ±max first (what ``torch.Tensor.to(torch.float8_e4m3fn)`` does); NaN raises.
    """
    f = format_of(fmt)
    values = _checks.as_float64("values", values)
    if np.isnan(values).any():
        fail("values", values, "must not be NaN", "quantize finite values")
    if saturate:
        values = np.clip(values, -f.max, f.max)
    elif (np.abs(values) > f.max).any():
        fail("values", values, f"must lie within ±{f.max:g}, the largest {fmt} value",
             "divide them by a descale factor first (values / descale, descale = amax / max), "
             "or pass saturate=True")
    return values.astype(f.numpy_type).astype(np.float64)


def representable(values: Any, fmt: str) -> np.ndarray:
    """Bool array: which of ``values`` are exactly ``fmt`` values (finite, within range)."""
    f = format_of(fmt)
    values = _checks.as_float64("values", values)
    inside = np.isfinite(values) & (np.abs(values) <= f.max)
    rounded = np.where(inside, values, 0.0).astype(f.numpy_type).astype(np.float64)
    return inside & (rounded == values)


def descale_array(name: str, descale: Any, batch: int, kv_heads: int) -> np.ndarray:
    """A descale factor as float64 (B, K): None -> ones; a scalar or shape (1,) -> filled;
    (B, K) as given. Each factor must be finite and > 0 (a quantisation scale,
    ``amax / format max``)."""
    if descale is None:
        return np.ones((batch, kv_heads))
    d = _checks.as_float64(name, descale)
    if d.shape in ((), (1,)):
        d = np.full((batch, kv_heads), float(d.reshape(())))
    elif d.shape != (batch, kv_heads):
        fail(name, d, f"must be a scalar, shape (1,) or (B, K) = ({batch}, {kv_heads}) (one per batch "
                      "element and kv head)",
             "pass one float32 factor per tensor, or one per batch element and kv head "
             "(FlashAttention-3's layout; query head h uses the factor of kv head h // (N // K))")
    if not (np.isfinite(d).all() and (d > 0).all()):
        fail(name, d, "must be finite and > 0", "pass the positive factor the stored values are "
             "multiplied by (amax / format max when quantising)")
    return d


def dequantize(query: np.ndarray, key: np.ndarray, value: np.ndarray, *, q_descale: Any = None,
               k_descale: Any = None, v_descale: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(q · q_descale, k · k_descale, v · v_descale)`` in FlashAttention's layout, exact.

    query (B, L, N, E), key (B, S, K, E), value (B, S, K, Ev) (float64 arrays holding the
    stored values); each descale None, per tensor or (B, K). Query head h is multiplied by
    ``q_descale[b, h // (N // K)]``, kv head g of key and value by ``k_descale[b, g]`` and
    ``v_descale[b, g]``.
    """
    B, _, N, _ = query.shape
    K = key.shape[2]
    qd = descale_array("q_descale", q_descale, B, K)
    kd = descale_array("k_descale", k_descale, B, K)
    vd = descale_array("v_descale", v_descale, B, K)
    per_query_head = np.repeat(qd, N // K, axis=1)                       # (B, K) -> (B, N)
    return (query * per_query_head[:, None, :, None],                    # (B, 1, N, 1)
            key * kd[:, None, :, None],                                  # (B, 1, K, 1)
            value * vd[:, None, :, None])


def dequantize_varlen(query: np.ndarray, key: np.ndarray, value: np.ndarray, cu_seqlens_q: Any,
                      cu_seqlens_k: Any, *, q_descale: Any = None, k_descale: Any = None,
                      v_descale: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Packed ``(q · q_descale, k · k_descale, v · v_descale)``, exact: query (T_q, N, E),
    key (T_k, K, E), value (T_k, K, Ev); each descale None, per tensor or (B, K), B the
    number of sequences; sequence b's query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (and
    key rows likewise) use row b (query head h: ``[b, h // (N // K)]``)."""
    cu_q = np.asarray(cu_seqlens_q, dtype=np.int64).reshape(-1)
    cu_k = np.asarray(cu_seqlens_k, dtype=np.int64).reshape(-1)
    if cu_q.size < 1 or cu_q.size != cu_k.size:
        fail("cu_seqlens_k", cu_k, f"must have as many entries as cu_seqlens_q ({cu_q.size})",
             "pass one query and one key range per sequence")
    B, N, K = cu_q.size - 1, query.shape[1], key.shape[1]
    qd = np.repeat(descale_array("q_descale", q_descale, B, K), N // K, axis=1)      # (B, N)
    kd = descale_array("k_descale", k_descale, B, K)
    vd = descale_array("v_descale", v_descale, B, K)
    q, k, v = (np.array(x, dtype=np.float64) for x in (query, key, value))
    for b in range(B):
        q[cu_q[b]:cu_q[b + 1]] *= qd[b][None, :, None]
        k[cu_k[b]:cu_k[b + 1]] *= kd[b][None, :, None]
        v[cu_k[b]:cu_k[b + 1]] *= vd[b][None, :, None]
    return q, k, v
