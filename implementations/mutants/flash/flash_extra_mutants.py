"""Flash-level mutants of FP8 inputs and dropout: :class:`~.flash_mutants.FlashBase` with
one step of its FP8 path (FlashAttention-3's numerics) or of its dropout wrong.

Records (``level="flash"``): ``smallest_case`` adds ``fp8`` (the format of q, k, v),
``descale`` (``"per_head"``: (B, K) factors differing per kv head and between q, k and v;
``"per_tensor"``: one factor each), ``dropout_p`` (with ``lse``: the LSE of the dropout call;
with ``dropout_pattern``: the output and gradients against the returned pattern). Each is
exposed on its smallest case through the call alone (``tests/implementations/test_flash_fp8.py``,
``tests/implementations/test_flash_dropout.py``).
"""

from __future__ import annotations

import torch

from implementations.mutants.flash.flash_mutants import FlashBase, flash_implementation
from implementations.mutants.record import Mutant

__all__ = ["FLASH_EXTRA_MUTANTS"]


# --------------------------------------------------------------------------- FP8


class VDescaleTwice(FlashBase):
    """v_descale is applied twice: V is dequantised with it before P·V and the output is
    multiplied by it again (FlashAttention-3 applies it once, to the output)."""

    def value_fp8(self, v, v_descale):
        return v.float() * v_descale[:, None, :, None]


class KDescaleIgnored(FlashBase):
    """k_descale is ignored: the scores use the stored FP8 keys as they are."""

    def descale_k(self, k, k_descale):
        return k.float()


class QDescaleTiledOverHeads(FlashBase):
    """q_descale (B, K) is expanded to the N query heads by tiling (query head h reads
    q_descale[b, h % K]) instead of by group (h // (N // K)), as k and v are."""

    def descale_q(self, q, q_descale, group):
        return q.float() * q_descale.repeat(1, group)[:, None, :, None]


class Fp8LseOffsetKept(FlashBase):
    """The LSE of an FP8 call keeps the 2^8 offset P was scaled by before its FP8 cast:
    log(2^8 · Σ exp(s - m)) + m, 8·ln 2 too large (the output is right: the offset cancels there)."""

    def fp8_lse(self, row_max, scaled_total, offset):
        return row_max + torch.log(scaled_total)


# --------------------------------------------------------------------------- dropout


class DropoutWithoutRescale(FlashBase):
    """Dropout zeroes the dropped weights but does not rescale the kept ones by 1/(1 - p)."""

    def drop(self, s, weights, keep, p):
        return weights * keep


class DropoutBeforeSoftmax(FlashBase):
    """Dropout is applied to the scores before the softmax (``F.dropout(scores)``): a dropped
    score becomes 0 (its key still attended, blocked keys too) and a kept one is scaled by
    1/(1 - p); the softmax then renormalises."""

    def drop(self, s, weights, keep, p):
        dropped = torch.where(keep, s / (1.0 - p), torch.zeros_like(s))
        return torch.softmax(dropped, dim=-1)


class DropoutInLse(FlashBase):
    """The returned LSE is the log of the kept (dropped-out) row sum: log Σ_j keep_ij exp(s_ij)."""

    def dropout_lse(self, lse, e, keep, row_max):
        kept = (e * keep).sum(dim=-1, keepdim=True)
        return row_max + torch.log(kept)


class DropoutBackwardNewPattern(FlashBase):
    """The backward draws a new dropout pattern instead of replaying the forward's (the
    random state not saved for it): the gradients are those of another pattern."""

    def drop(self, s, weights, keep, p):
        fresh = torch.rand(weights.shape, device=weights.device) >= p
        forward = weights * keep / (1.0 - p)
        backward = weights * fresh / (1.0 - p)
        return backward + (forward - backward).detach()       # the value of one, the gradient of the other


def _case(**changes):
    return {"B": 1, "N": 1, "K": 1, "L": 1, "S": 1, "E": 1, "Ev": 1, **changes}


def _mutant(name, cls, bug, origin, smallest, safe, prop):
    return Mutant(name=name, bug=bug, origin=origin, smallest_case=smallest, expected_property=prop,
                  build=lambda: flash_implementation(name, cls(), bug), level="flash", safe_case=safe)


E4M3 = "float8_e4m3fn"

FLASH_EXTRA_MUTANTS = [
    _mutant("flash_fp8_v_descale_twice", VDescaleTwice,
            "v_descale is applied twice: to V before the P·V product and to the output after it",
            "hand-written pitfall: FlashAttention-3's epilogue scaling (O · v_descale) ported onto a kernel "
            "that already dequantised V",
            _case(S=2, fp8=E4M3, descale="per_tensor"), _case(S=2, fp8=E4M3), "fp8_agreement"),
    _mutant("flash_fp8_k_descale_ignored", KDescaleIgnored,
            "k_descale is ignored: the scores are computed from the stored FP8 keys",
            "hand-written pitfall: only q_descale folded into the softmax scale (softmax_scale · q_descale "
            "instead of softmax_scale · q_descale · k_descale)",
            _case(S=2, fp8=E4M3, descale="per_tensor"), _case(S=2, fp8=E4M3), "fp8_agreement"),
    _mutant("flash_fp8_q_descale_tiled", QDescaleTiledOverHeads,
            "q_descale (B, K) reaches query head h as q_descale[b, h % K] (tiled) instead of h // (N // K)",
            "hand-written pitfall: the per-kv-head descale expanded with repeat() while K and V heads are "
            "expanded with repeat_interleave() (GQA)",
            _case(N=4, K=2, S=2, fp8=E4M3, descale="per_head"), _case(N=2, K=2, S=2, fp8=E4M3, descale="per_head"),
            "fp8_agreement"),
    _mutant("flash_fp8_lse_offset_kept", Fp8LseOffsetKept,
            "the LSE of an FP8 call keeps the 2^8 offset P is scaled by before its FP8 cast (8·ln 2 too large)",
            "kernel bug: FlashAttention-3's FP8 path scales P by 2^8 (Max_offset) to use the format's range; "
            "the softmax_lse written from the offset row sum",
            _case(S=2, fp8=E4M3, lse=True), _case(S=2, fp8=E4M3), "fp8_agreement"),
    _mutant("flash_dropout_without_rescale", DropoutWithoutRescale,
            "dropout zeroes the dropped weights but does not rescale the kept ones by 1/(1 - p)",
            "hand-written pitfall: the dropout mask multiplied in without the 1/(1 - p) of inverted dropout",
            _case(S=2, dropout_p=0.5, dropout_pattern=True), _case(S=2), "flash_dropout_expectation"),
    _mutant("flash_dropout_before_softmax", DropoutBeforeSoftmax,
            "dropout is applied to the scores before the softmax (a dropped score becomes 0, not a dropped weight)",
            "hand-written pitfall: F.dropout(scores) written before softmax instead of after it",
            _case(S=2, dropout_p=0.5, dropout_pattern=True), _case(S=2), "flash_dropout_expectation"),
    _mutant("flash_dropout_in_lse", DropoutInLse,
            "the returned LSE is that of the kept weights (log Σ keep·exp(s)) instead of the softmax's",
            "hand-written pitfall: the row sum accumulated after the dropout mask, and the LSE written from it",
            _case(S=2, dropout_p=0.5, lse=True), _case(S=2, lse=True), "flash_dropout_expectation"),
    _mutant("flash_dropout_backward_new_pattern", DropoutBackwardNewPattern,
            "the backward draws a new dropout pattern instead of replaying the forward's",
            "kernel bug: the Philox seed and offset of the forward not saved for the backward "
            "(FlashAttention-2 keeps them in rng_state)",
            _case(S=2, dropout_p=0.5, dropout_pattern=True, grad=True), _case(S=2, dropout_p=0.5, dropout_pattern=True),
            "dropout_pattern_agreement"),
]
