"""The flash-level variants: ``flash_attn_func`` with one step done the way real code gets
it wrong (causal aligned top-left, the window's left edge off by one, soft-capping before
the scale, ALiBi top-left, the LSE in base 2 or of the uncapped scores, a learned sink
mishandled), each computed in float64 on the call's own inputs (``spec.variants._kernel``).

Layouts are FlashAttention's: query (B, L, N, E), output (B, L, N, Ev), LSE (B, N, L).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ._core import Variant, VariantResult
from ._family import FlashProblem
from ._kernel import Attended, Steps, attend

__all__ = ["FLASH_VARIANTS", "reference", "compute", "live_rows"]


def _slopes(p: FlashProblem, b: int) -> np.ndarray | None:
    if p.alibi_slopes is None:
        return None
    rows = np.asarray(p.alibi_slopes).reshape(-1, p.query.shape[2])
    return rows[b % rows.shape[0]]


def _sequences(p: FlashProblem, steps: Steps, policy: str | None = None) -> list[Attended]:
    policy = p.fully_masked if policy is None else policy
    policy = "zero" if policy == "unspecified" else policy
    return [attend(p.query[b], p.key[b], p.value[b], scale=p.resolved_scale, causal=bool(p.causal),
                   window=p.window, softcap=float(p.softcap), slopes=_slopes(p, b), sinks=p.sinks, policy=policy,
                   dtype=p.dtype, steps=steps) for b in range(p.query.shape[0])]


def compute(p: FlashProblem, steps: Steps | None = None) -> VariantResult:
    """What ``flash_attn_func`` under ``steps`` (None: the spec's) returns on ``p``: output,
    LSE, and the sizes."""
    parts = _sequences(p, steps or Steps())
    return VariantResult(np.stack([a.output for a in parts]), lse=np.stack([a.lse for a in parts]),
                         magnitude=np.stack([a.magnitude for a in parts]),
                         score_size=np.stack([a.score_size for a in parts]))


def reference(p: FlashProblem) -> VariantResult:
    """The correct convention: :func:`spec.flash_attention` (with its LSE)."""
    return compute(p)


def live_rows(p: FlashProblem) -> np.ndarray:
    """Bool (B, L, 1, 1): rows that attend a key under the correct convention."""
    return np.stack([a.live for a in _sequences(p, Steps())])[:, :, None, None]


def _with(**changes: object):
    steps = replace(Steps(), **changes)
    return lambda p: compute(p, steps)


def _window_bounded(p: FlashProblem) -> bool:
    return tuple(p.window) != (-1, -1)


def _right_side_zero(p: FlashProblem) -> bool:
    """The right side is 0 (causal, or window right 0) and some query's p_i differs from i."""
    L, S = p.query.shape[1], p.key.shape[1]
    return (bool(p.causal) or p.window[1] == 0) and S != L


def _variant(id: str, summary: str, models: str, applies, steps: dict) -> Variant:
    return Variant(id=id, level="flash", summary=summary, models=models, applies=applies, compute=_with(**steps))


FLASH_VARIANTS = (
    _variant(
        "flash_causal_upper_left",
        "aligns causal=True (a right side of 0) top-left: query i sees keys j <= i instead of j <= i + S - L; "
        "the window's left edge and ALiBi stay bottom-right",
        "flash-attn < 2.1 aligned the causal triangle top-left; 2.1 moved it to the bottom-right corner "
        "(bug zoo: flash_causal_top_left, contract_flash_causal_upper_left)",
        _right_side_zero, {"causal_upper_left": True}),
    _variant(
        "flash_window_left_off_by_one",
        "keeps keys j > p_i - left at the window's left edge instead of j >= p_i - left: one key short",
        "an off-by-one at the sliding window's left edge (strict <), by hand or in a kernel's mask "
        "(bug zoo: flash_window_left_off_by_one, triton_window_left_off_by_one)",
        lambda p: p.window[0] >= 0, {"window_left_strict": True}),
    _variant(
        "flash_window_ignored",
        "accepts window_size and ignores it: every key inside the causal rule is attended",
        "a flash_attn_func wrapper that takes window_size and never passes it on "
        "(bug zoo: contract_flash_window_no_effect)",
        _window_bounded, {"window_ignored": True}),
    _variant(
        "flash_softcap_before_scale",
        "soft-caps the raw q·k and scales afterwards: scale·c·tanh(q·k / c) instead of c·tanh(scale·q·k / c)",
        "softcap and softmax_scale applied in the wrong order (bug zoo: flash_softcap_before_scale)",
        lambda p: bool(p.softcap) and p.resolved_scale != 1.0, {"softcap_before_scale": True}),
    _variant(
        "flash_alibi_upper_left",
        "measures the ALiBi distance top-left, |i - j|, instead of from the aligned position, |i + S - L - j|",
        "ALiBi aligned to PyTorch's top-left convention (bug zoo: flash_alibi_top_left)",
        lambda p: p.alibi_slopes is not None and p.query.shape[1] != p.key.shape[1], {"alibi_upper_left": True}),
    _variant(
        "flash_lse_log2",
        "returns the LSE in base-2 units (log2 of the sum of 2^(s·log2 e)), not the natural log",
        "an exp2 kernel's log2 bookkeeping returned as softmax_lse, as Triton and FlashAttention-3 style "
        "kernels keep it internally (bug zoo: flash_lse_log2)",
        lambda p: True, {"lse": "log2"}),
    _variant(
        "flash_lse_uncapped",
        "returns the LSE of the scores before soft-capping (the output is capped)",
        "the LSE buffer written from the uncapped scores (bug zoo: flash_lse_uncapped)",
        lambda p: bool(p.softcap), {"lse": "uncapped"}),
    _variant(
        "flash_sink_with_value",
        "treats the learned sink as a key with a value: its weight multiplies the first key's value instead "
        "of being dropped",
        "the sink appended as a BOS-like key whose value is kept (bug zoo: flash_sink_key_with_value)",
        lambda p: p.sinks is not None, {"sink": "with_value"}),
    _variant(
        "flash_sink_after_shift",
        "adds the sink after the row max is subtracted: exp(sink) unshifted joins the denominator (read as "
        "sink + max; it overflows at a sink past exp's range)",
        "scores shifted by their max before the sink column is concatenated (bug zoo: flash_sink_after_shift)",
        lambda p: p.sinks is not None, {"sink": "after_shift"}),
    _variant(
        "flash_sink_per_row",
        "reads the sinks along the query rows (row i of every head uses sinks[i % N]) instead of one per head",
        "sinks (N,) broadcast against the (B, L, N) layout's wrong axis (bug zoo: flash_sink_per_row)",
        lambda p: p.sinks is not None and p.query.shape[2] > 1, {"sink": "per_row"}),
    _variant(
        "flash_sink_weight_kept",
        "keeps the sink's weight in the output: it is added to every output feature instead of dropped",
        "the sink column not sliced off after the softmax (bug zoo: flash_sink_weight_kept)",
        lambda p: p.sinks is not None, {"sink": "weight_kept"}),
    _variant(
        "flash_sink_scaled",
        "multiplies the sink logit by softmax_scale as if it were a q·k logit",
        "the sink concatenated to the raw q·k before the scale is applied (bug zoo: flash_sink_scaled)",
        lambda p: p.sinks is not None and p.resolved_scale != 1.0, {"sink": "scaled"}),
)
