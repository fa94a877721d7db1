"""Correct bases the mutants are built from; each step is a method a mutant overrides.

Three SDPA-level bases, all with torch SDPA's calling convention
``f(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
enable_gqa=False)`` (bool mask **True = may attend**, float mask **added**):

* :class:`NaiveSDPA` — straight-line math: scores, mask, safe softmax, dropout, weights @ V.
* :class:`ManualBackwardSDPA` — the same forward in an ``autograd.Function`` with a
  hand-written backward, output stored in FlashAttention's (B, L, N, Ev) layout.
* :class:`TiledSDPA` — a pure-torch FlashAttention-style kernel: online softmax over
  key blocks of :data:`BLOCK` keys, running max, rescaled accumulator.
* :class:`LowerRightSDPA` — :class:`NaiveSDPA` whose ``is_causal`` means
  FlashAttention's lower-right triangle (declared in :data:`LOWER_RIGHT_CAPABILITIES`).

One MHA-level base, :class:`HandwrittenMHA`, a drop-in for ``nn.MultiheadAttention``
(same constructor, parameter names and forward; its bool masks are **True = blocked**),
written the way tutorials write it: batch-first internally, explicit head split/merge.

Every base is correct (``tests/mutants/test_mutant_records.py`` checks them against
torch in float64); a mutant is a subclass overriding exactly one method.

The SDPA bases live in :mod:`._sdpa_bases`, the MHA base in :mod:`._mha_base`; this
module re-exports both (mutants import from here).

Dimension letters: B batch, N query heads, K kv heads, L query length, S key length,
E q/k head dim, Ev value head dim, D model dim.
"""

from __future__ import annotations

from implementations.builtins.pytorch._torch_common import contiguous_strides, load_mha_weights
from implementations.mutants.mha._mha_base import (
    MHA_CAPABILITIES,
    HandwrittenMHA,
    mha_implementation,
)
from implementations.mutants.sdpa._sdpa_bases import (
    BLOCK,
    LOWER_RIGHT_CAPABILITIES,
    SDPA_CAPABILITIES,
    AttentionInputError,
    LowerRightSDPA,
    ManualBackwardSDPA,
    NaiveSDPA,
    TiledSDPA,
    read_as_contiguous,
    safe_softmax,
    sdpa_implementation,
)

__all__ = [
    "BLOCK",
    "AttentionInputError",
    "HandwrittenMHA",
    "LowerRightSDPA",
    "ManualBackwardSDPA",
    "NaiveSDPA",
    "TiledSDPA",
    "contiguous_strides",
    "load_mha_weights",
    "mha_implementation",
    "read_as_contiguous",
    "safe_softmax",
    "sdpa_implementation",
    "LOWER_RIGHT_CAPABILITIES",
    "MHA_CAPABILITIES",
    "SDPA_CAPABILITIES",
]
