"""The attention spec: a float64 NumPy oracle for scaled dot-product and multi-head attention.

Pure NumPy; never imports torch. Dimension letters used everywhere: B batch, N query
heads, K key/value heads, L query length, S key length, E q/k head dim, Ev value head
dim, D model dim.

Mask polarity: ``attend_mask`` is bool with **True = may attend**; ``additive_mask`` is
float and **added** to the scaled scores. ``mha_forward`` takes nn.MultiheadAttention's
masks in its own convention (bool **True = blocked**). :mod:`spec.masks` converts.

Public API::

    sdpa(query, key, value, *, attend_mask, additive_mask, causal, scale, fully_masked) -> SDPAResult
    sdpa_vjp(query, key, value, grad_output, *, attend_mask, additive_mask, causal, scale) -> SDPAGrads
    emulate_sdpa(query, key, value, *, dtype, attend_mask, additive_mask, causal, scale, fully_masked)
    MHAParams, mha_forward(params, query, key, value, *, key_padding_mask, attn_mask, ...)
    masks (module), SpecError
    variants (module): wrong conventions as data, VARIANTS, rank(observed, problem, ...)
"""

from __future__ import annotations

from . import masks, variants
from ._sdpa import SDPAGrads, SDPAResult, sdpa, sdpa_vjp
from .emulate import emulate_sdpa
from .errors import SpecError
from .mha import MHAParams, mha_forward
from .variants import VARIANTS

__all__ = [
    "SpecError",
    "sdpa",
    "SDPAResult",
    "sdpa_vjp",
    "SDPAGrads",
    "emulate_sdpa",
    "MHAParams",
    "mha_forward",
    "masks",
    "variants",
    "VARIANTS",
]
