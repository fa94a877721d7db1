"""Flash level, FP8 inputs (spec.fp8): q, k, v in an 8-bit float format with
FlashAttention-3's ``q_descale``, ``k_descale``, ``v_descale``, against the float64 oracle
on the dequantised values (exact), within a bound derived from the formats' unit
roundoffs (``tolerance.fp8_allowed``).

FP8 is certified here, at the flash level only: ``flash_attn_func`` (FlashAttention-3) is
the API that takes FP8 q, k, v with descale factors; an SDPA-signature function has no
descale arguments, and ``torch.nn.functional.scaled_dot_product_attention`` takes no FP8
inputs. An FP8 call's output is 16- or 32-bit whatever the target's dtype
(FlashAttention-3 returns bfloat16): the property runs on every flash target (so that a
run restricted with ``--dtype`` still checks it), the target's dtype only the one the drawn
values pass through before they are quantised.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conformance.calls.declarations import fit_head_dims, fit_lengths
from conformance.calls.flash import FlashCase, check_fp8, run_flash
from conformance.core.target import Target
from conformance.directed.helpers import skip_unless
from conformance.harness.runner import conformance_property
from conformance.strategies.flash import flash_cases
from spec import fp8 as spec_fp8


def _skip(target: Target) -> str | None:
    return skip_unless(bool(target.caps.fp8_dtypes), "no FP8 formats declared (fp8_dtypes; a function naming "
                       "q_descale/k_descale/v_descale is probed, or --impl-option dtypes=...,float8_e4m3fn)")


def _cases(target: Target) -> Any:
    return flash_cases(dtype=target.dtype, device=target.device, caps=target.caps, shape_budget=target.shape_budget,
                       window=None, softcap=None, alibi=None, sinks=None, fp8=True)


def _directed(target: Target) -> list[FlashCase]:
    """The smallest case of each FP8 bug class: descales that differ between q, k and v and
    between kv heads (a descale applied twice, ignored, or read by the query head), GQA
    (N = 4 query heads on K = 2 kv heads), per-tensor descales, causal rows, L > S."""
    caps = target.caps
    rng = np.random.default_rng(17)
    out = []
    shapes = [(1, 2, 2, 1, 3, 2, 2), (1, 4, 2, 2, 3, 2, 2), (1, 1, 1, 3, 2, 2, 2)]
    if not caps.gqa:
        shapes = [(B, N, N, L, S, E, Ev) for B, N, _, L, S, E, Ev in shapes]
    for fmt in caps.fp8_dtypes:
        for B, N, K, L, S, E, Ev in shapes:
            lengths, dims = fit_lengths(caps, L, S), fit_head_dims(caps, E, Ev)
            if lengths is None or dims is None:
                continue
            (L, S), (E, Ev) = lengths, dims
            q, k, v = (spec_fp8.quantize(rng.standard_normal(s) * 8, fmt)
                       for s in ((B, L, N, E), (B, S, K, E), (B, S, K, Ev)))
            per_head = [np.float32(0.5 * 2.0 ** np.arange(K) + i / 8).astype(np.float64)[None].repeat(B, 0)
                        for i in range(3)]
            base = FlashCase(q, k, v, fp8=fmt, dtype=target.dtype, device=target.device, notes=("directed",))
            variants = [dict(q_descale=per_head[0], k_descale=per_head[1], v_descale=per_head[2]),
                        dict(q_descale=np.array([0.25]), k_descale=np.array([0.375]), v_descale=np.array([3.0]))]
            if caps.causal == "lower_right":
                variants.append(dict(variants[0], causal=True))
            for changes in variants:
                forms = {"per_head" if d.shape != (1,) else "per_tensor"
                         for d in (changes["q_descale"], changes["k_descale"], changes["v_descale"])}
                if not forms <= set(caps.fp8_descales):
                    continue
                if caps.causal_only:
                    changes = {**changes, "causal": True}
                out.append(base.replace(**changes))
    return out


@conformance_property(
    "fp8_agreement", level="flash", section="spec.fp8 (stored · descale, then spec.flash_attention)",
    cases=_cases,
    directed=_directed,
    skip_reason=_skip,
)
def test_fp8_agreement(target: Target, case: FlashCase) -> float:
    """q, k, v in an FP8 format (fp8_dtypes) with q_descale, k_descale, v_descale (none, per
    tensor, or (B, K) per batch element and kv head; query head h uses its kv head's) stand
    for stored · descale: the output (bfloat16, float16 or float32) equals spec.flash_attention
    on those exact values within a bound derived from the formats' unit roundoffs
    (tolerance.fp8_allowed: probabilities rounded to FP8 before P·V, the scores'
    accumulation, the output's own rounding); the LSE likewise, when declared."""
    call = run_flash(target, case, lse="lse" in target.caps.flash_features)
    return check_fp8(target, case, call)
