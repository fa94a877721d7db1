"""Dropout that keeps the expectation and gets the spread wrong.

The mean of many dropout samples is the dropout-free output whether a weight is dropped
with the right probability, with none at all, or with one mask for every sample: these
mutants pass a check of the mean and fail ``dropout_expectation`` /
``mha_dropout_expectation`` on the samples' standard deviation alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from implementations.mutants._base import (
    MHA_CAPABILITIES,
    SDPA_CAPABILITIES,
    HandwrittenMHA,
    NaiveSDPA,
    mha_implementation,
    sdpa_implementation,
)
from implementations.mutants.flash.flash_mutants import FlashBase, flash_implementation
from implementations.mutants.record import Mutant

__all__ = ["DROPOUT_MUTANTS"]

ONE = {"B": 1, "N": 1, "K": 1, "L": 1, "S": 1, "E": 1, "Ev": 1}


class DropoutIgnored(NaiveSDPA):
    """``dropout_p`` is accepted and never applied."""

    def dropout(self, weights, dropout_p):
        return weights


class DropoutMaskSharedAcrossBatch(NaiveSDPA):
    """One dropout mask of shape (1, N, L, S) serves every batch item."""

    def dropout(self, weights, dropout_p):
        if dropout_p == 0.0:
            return weights
        keep = torch.rand_like(weights[:1]) >= dropout_p
        return weights * keep / (1 - dropout_p)


class DropoutOnOutput(NaiveSDPA):
    """Dropout is applied to the output ``weights @ V`` instead of the weights."""

    def attend(self, q, k, v, mask, is_causal, scale, dropout_p, in_dtype):
        out = super().attend(q, k, v, mask, is_causal, scale, 0.0, in_dtype)
        return F.dropout(out, p=dropout_p, training=True) if dropout_p else out


class MHADropoutNeverCalled(HandwrittenMHA):
    """The module builds its dropout but never applies it, in train mode too."""

    def dropout_weights(self, weights, dropout_p):
        return weights


class FlashDropoutMaskSharedAcrossBatch(FlashBase):
    """``flash_attn_func`` whose dropout pattern is drawn for batch item 0 and reused by every
    other item (the ``S_dmask`` it returns is the pattern it was meant to use)."""

    def drop(self, s, weights, keep, p):
        return super().drop(s, weights, keep[:1].expand_as(keep), p)


def _sdpa(name, cls, *, bug, origin, smallest_case):
    return Mutant(
        name=name, bug=bug, origin=origin, smallest_case=smallest_case,
        expected_property="dropout_expectation", level="sdpa",
        build=lambda: sdpa_implementation(f"mutant:{name}", cls(), SDPA_CAPABILITIES, bug),
        safe_case={**ONE, "S": 2},
    )


DROPOUT_MUTANTS = [
    _sdpa(
        "dropout_ignored", DropoutIgnored,
        bug="dropout_p is accepted and silently ignored: every sample is the dropout-free output, "
            "so the mean is right and training gets no regularisation",
        origin="kernel bug: a kernel without dropout behind an SDPA-compatible signature (the "
               "argument kept for the call sites, never passed on)",
        smallest_case={**ONE, "dropout_p": 0.5},
    ),
    _sdpa(
        "dropout_mask_shared_across_batch", DropoutMaskSharedAcrossBatch,
        bug="one dropout mask of shape (1, N, L, S) is broadcast over the batch, so every batch "
            "item drops the same keys",
        origin="kernel bug: a dropout RNG offset derived from the head and position but not the "
               "batch index",
        smallest_case={**ONE, "B": 2, "dropout_p": 0.5},
    ),
    _sdpa(
        "dropout_on_output", DropoutOnOutput,
        bug="dropout is applied to weights @ V instead of the attention weights: the mean is "
            "right, but whole outputs are dropped instead of single keys",
        origin="hand-written pitfall (attention dropout placed after the value product, where "
               "residual dropout goes)",
        smallest_case={**ONE, "S": 3, "dropout_p": 0.5},
    ),
    Mutant(
        name="mha_dropout_never_called",
        bug="the module creates its dropout (nn.Dropout or a p) but forward never applies it, so "
            "train mode equals eval mode",
        origin="hand-written pitfall (self.dropout defined in __init__, forgotten in forward)",
        smallest_case={**ONE, "dropout": 0.5, "training": True},
        expected_property="mha_dropout_expectation",
        level="mha",
        build=lambda: mha_implementation(
            "mutant:mha_dropout_never_called", MHADropoutNeverCalled, MHA_CAPABILITIES,
            "the module never applies its dropout"),
        safe_case={**ONE, "S": 2, "dropout": 0.0},
    ),
    Mutant(
        name="flash_dropout_mask_shared_across_batch",
        bug="one dropout pattern, batch item 0's, is applied to every batch item of a "
            "flash_attn_func call",
        origin="kernel bug: a dropout RNG offset derived from the head and position but not the "
               "batch index",
        smallest_case={**ONE, "B": 2, "dropout_p": 0.5},
        expected_property="flash_dropout_expectation",
        level="flash",
        build=lambda: flash_implementation(
            "flash_dropout_mask_shared_across_batch", FlashDropoutMaskSharedAcrossBatch(),
            "one dropout pattern for the whole batch"),
        safe_case={**ONE, "S": 2},
    ),
]
