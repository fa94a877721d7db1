"""The table of variants: every id, in tie-breaking order, SDPA first, then MHA, sharded,
flash, varlen and kvcache."""

from __future__ import annotations

from ..errors import fail
from ._core import Variant
from .flash import FLASH_VARIANTS
from .kvcache import KVCACHE_VARIANTS
from .mha import MHA_VARIANTS
from .sdpa import SDPA_VARIANTS
from .sharded import SHARDED_VARIANTS
from .varlen import VARLEN_VARIANTS

__all__ = ["VARIANTS", "ALIASES", "lookup"]

#: Every variant by id. Iteration order is the order :func:`spec.variants.rank` keeps
#: among equal fits: within each level, narrower conventions come first.
VARIANTS: dict[str, Variant] = {variant.id: variant for variant in (*SDPA_VARIANTS, *MHA_VARIANTS,
                                                                    *SHARDED_VARIANTS, *FLASH_VARIANTS,
                                                                    *VARLEN_VARIANTS, *KVCACHE_VARIANTS)}

#: Other names for a variant. A fully-masked row with uniform weights outputs the mean
#: of V, so "mean of V" is the same convention, not a second one.
ALIASES: dict[str, str] = {"fully_masked_mean": "fully_masked_uniform"}


def lookup(name: str) -> Variant:
    """The variant called ``name`` (an id or an alias)."""
    variant = VARIANTS.get(ALIASES.get(name, name))
    if variant is None:
        fail("name", name, "is not a variant id or alias", "pick one of " + ", ".join(sorted(VARIANTS)))
    return variant
