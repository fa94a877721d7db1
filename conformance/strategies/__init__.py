"""Hypothesis strategies that draw attention problems: SDPA and MHA cases.

Dimension letters: B batch, N query heads, K kv heads, L query length, S key
length, E q/k head dim, Ev value head dim, D model dim. Bool masks of an
:class:`~conformance.core.cases.SDPACase` are **True = may attend**; MHA cases keep
``nn.MultiheadAttention``'s convention (bool **True = blocked**, float added).

Modules, one job each:

* :mod:`.sizes`: dtypes, head counts, lengths, head dims (``dtypes``,
  ``head_configs``, ``sdpa_shapes``);
* :mod:`.sdpa_masks`: SDPA masks, one :class:`MaskPattern` record per pattern (``masks``);
* :mod:`.values`: value regimes, scales, layouts and the q/k/v arrays
  (``value_regimes``, ``scales``, ``layouts``);
* :mod:`.sdpa`: whole SDPA cases (``sdpa_cases``);
* :mod:`.mha`: whole MHA cases (``mha_cases``);
* :mod:`.varlen`: packed variable-length batches and KV-cache decoding steps
  (``varlen_cases``, ``kvcache_cases``; imported from there, not re-exported here:
  their case types live in ``conformance.calls.varlen`` and ``conformance.calls.kvcache``);
* ``_validation`` / ``_drawing``: argument checks, weighted draws, seeds, reprs.

How the strategies draw:

* Structure (sizes, mask kind and shape, regime, layout, scale, causal) is drawn
  by Hypothesis, each choice ordered so that it shrinks toward the simplest case:
  B = N = K = L = S = 1, small E = Ev, no mask, regime ``"normal"``, layout
  ``"contiguous"``, default scale, no causal flag.
* Array values come from one drawn integer seed fed to a NumPy Generator (never
  element by element): fast, and the seed shrinks to 0.
* Values are drawn in float64 and rounded through the case's dtype
  (``spec.emulate.round_to``), so a case holds exactly the values an
  implementation stores.
* When ``caps`` (an :class:`implementations.base.Capabilities`) is given, only
  cases inside its claims are drawn, so nothing is generated and then skipped.
  Arguments that force something the capabilities (or the other arguments) rule
  out raise :class:`hypothesis.errors.InvalidArgument` at once, naming the
  argument as ``name=value`` and the fix.
* Keyword arguments name one concept each: ``mask_kinds`` ⊆ :data:`MASK_KINDS`
  (:data:`MHA_MASK_KINDS` for MHA), ``mask_patterns`` ⊆ :data:`MASK_PATTERNS`,
  ``regimes`` ⊆ :data:`REGIMES`, ``scale_kinds`` ⊆ :data:`SCALE_KINDS`,
  ``layouts`` ⊆ :data:`~conformance.core.cases.LAYOUTS`; bounds are ``min_x``/``max_x``.
* ``repr`` of a strategy is its call, e.g. ``sdpa_cases(dtype='float16')``.

Notes a case may carry (``case.notes``): the layout instructions
:data:`~conformance.core.cases.NOTE_MASK_EXPANDED` (hand the mask over expanded to
(B, N, L, S) with stride 0), :data:`~conformance.core.cases.NOTE_STRIDE0_BATCH` /
:data:`~conformance.core.cases.NOTE_STRIDE0_HEADS` (key/value expanded along that dim
with stride 0; the drawn values are equal along it), read by
:mod:`conformance.core.tensors`; and descriptive labels ``"mask_pattern=..."``,
``"mask_shape=..."``, ``"additive=..."``, ``"fully_masked:forced"``,
``"self_attention"``.
"""

from __future__ import annotations

from conformance.core.cases import (
    NOTE_MASK_EXPANDED,
    NOTE_STRIDE0_BATCH,
    NOTE_STRIDE0_HEADS,
)
from conformance.strategies.mha import MHA_MASK_KINDS, mha_cases
from conformance.strategies.sdpa import sdpa_cases
from conformance.strategies.sdpa_masks import (
    MASK_KINDS,
    MASK_PATTERN_TABLE,
    MASK_PATTERNS,
    MASK_SHAPES,
    MaskDraw,
    MaskPattern,
    masks,
)
from conformance.strategies.sizes import (
    BLOCK_LENGTHS,
    LENGTH_RELATIONS,
    dtypes,
    head_configs,
    sdpa_shapes,
)
from conformance.strategies.values import (
    REGIMES,
    SCALE_KINDS,
    layouts,
    scales,
    value_regimes,
)

__all__ = [
    "BLOCK_LENGTHS",
    "LENGTH_RELATIONS",
    "MASK_KINDS",
    "MASK_PATTERNS",
    "MASK_PATTERN_TABLE",
    "MASK_SHAPES",
    "MHA_MASK_KINDS",
    "NOTE_MASK_EXPANDED",
    "NOTE_STRIDE0_BATCH",
    "NOTE_STRIDE0_HEADS",
    "REGIMES",
    "SCALE_KINDS",
    "MaskDraw",
    "MaskPattern",
    "dtypes",
    "head_configs",
    "layouts",
    "masks",
    "mha_cases",
    "scales",
    "sdpa_cases",
    "sdpa_shapes",
    "value_regimes",
]
