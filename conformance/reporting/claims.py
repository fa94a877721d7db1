"""Where "a case it claims to support" comes from, and the declaration that withdraws it.

An implementation that raises on a case fails the property only because it claims the
case: a level's features (``kvcache_features``, ``varlen_features``, ``flash_features``)
are claimed by the implementation's declaration, by an ``--impl-option``, or, for a
function recognised by its signature, by the parameters it has (``rotary_cos`` and
``rotary_sin``: rotary; ``return_attn_probs``: the LSE). :func:`claim_note` names, for
each feature the failing call used, its source and the exact ``--impl-option`` that
withdraws it (the claimed features less that one), so a kernel that does not support
rotary is told "this came from your signature; declare ``--impl-option
kvcache_features=window,softcap`` if you do not support it".
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["claim_note"]

#: The parameters whose presence in a recognised function's signature claims a feature,
#: per level (``implementations.registry.recognition``'s tables, the flash level's LSE).
def _parameters(level: str) -> dict[str, tuple[str, ...]]:
    from implementations.registry.recognition import (
        KVCACHE_FEATURE_PARAMETERS,
        VARLEN_FEATURE_PARAMETERS,
    )

    return {"kvcache": KVCACHE_FEATURE_PARAMETERS, "varlen": VARLEN_FEATURE_PARAMETERS,
            "flash": {"lse": ("return_attn_probs",)}}.get(level, {})


def _signature(fn: Any) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def claim_note(target: Any, attrs: dict[str, Any], options: dict[str, str]) -> str:
    """The lines naming where each feature the failing call used was claimed and how to
    withdraw it ("" when the call used no feature of the level, or the level has none)."""
    level = target.level
    field = f"{level}_features"
    claimed = getattr(target.caps, field, None)
    used = attrs.get(field)
    if not claimed or not used:
        return ""
    used = sorted(set(used) & set(claimed))
    if not used:
        return ""
    parameters = _parameters(level)
    names = _signature(getattr(target.impl, level, None))
    lines = []
    for feature in used:
        params = parameters.get(feature, ())
        if field in options:
            source = f"--impl-option {field}={options[field]}"
        elif params and set(params) <= names:
            source = "the signature's parameter" + ("s " if len(params) > 1 else " ") + ", ".join(
                f"`{p}`" for p in params)
        else:
            source = f"the implementation's declared capabilities ({field})"
        rest = ",".join(sorted(set(claimed) - {feature})) or "none"
        lines.append(f"  {feature}: claimed by {source}; if it is not supported, declare "
                     f"--impl-option {field}={rest}")
    return "the claims this call relied on (the failing call used these features):\n" + "\n".join(lines) + "\n"
