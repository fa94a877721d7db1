"""What the directed examples of both levels share: whether a property's strategy could
draw a case (:func:`admitted`: the case's attributes handed to ``sdpa_cases`` /
``mha_cases`` as forcing arguments), the regimes a property can draw
(:func:`producible_regimes`), the cap per property and the seeding of example values.

``conformance.directed.examples`` re-exports the public names; the examples and their
building are in ``directed_sdpa`` and ``directed_mha``.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from hypothesis.errors import InvalidArgument

from conformance.core.cases import MHACase, SDPACase
from conformance.strategies import REGIMES, mha_cases, sdpa_cases

__all__ = ["MAX_DIRECTED", "admitted", "producible_regimes"]

#: Most directed cases a property runs per target (regime and layout coverage first).
MAX_DIRECTED = 9


def _scale_kind(scale: float | None) -> str:
    if scale is None:
        return "default"
    if scale == 0:
        return "zero"
    if scale < 0:
        return "negative"
    return "tiny" if abs(scale) <= 1e-5 else "positive"


def _sdpa_forcing(case: SDPACase, arguments: dict[str, Any]) -> dict[str, Any] | None:
    """``arguments`` narrowed to exactly ``case`` (None: the arguments rule it out)."""
    narrowed = dict(arguments)
    checks = (("mask_kinds", case.mask_kind, None), ("causal", case.causal, None),
              ("regimes", case.regime, None), ("layouts", case.layout, ("contiguous",)))
    for name, value, default in checks:
        allowed = arguments.get(name, default)
        if allowed is not None and value not in allowed:
            return None
        narrowed[name] = (value,)
    pattern = next((n.split("=", 1)[1] for n in case.notes if n.startswith("mask_pattern=")), None)
    if pattern is not None and arguments.get("mask_patterns") is not None:
        if pattern not in arguments["mask_patterns"]:
            return None
    kinds = arguments.get("scale_kinds", True)
    kind = _scale_kind(case.scale)
    if kinds is False and kind != "default" or kinds not in (True, False) and kind not in kinds:
        return None
    narrowed["scale_kinds"] = (kind,)
    for name, value in (("gqa", case.K != case.N), ("different_v_dim", case.E != case.Ev)):
        if arguments.get(name) not in (None, value):
            return None
        narrowed[name] = value
    if arguments.get("fully_masked") not in (None, bool(case.fully_masked_rows().any())):
        return None
    sizes = (("batch", case.B, 1, 3), ("heads", case.N, 1, 8), ("L", case.L, 1, None),
             ("S", case.S, 1, None), ("head_dim", min(case.E, case.Ev), None, None),
             ("head_dim", max(case.E, case.Ev), None, None))
    for dim, value, low, high in sizes:
        lo, hi = arguments.get(f"min_{dim}", low), arguments.get(f"max_{dim}", high)
        if lo is not None and value < lo or hi is not None and value > hi:
            return None
    narrowed.update(min_batch=case.B, max_batch=case.B, min_heads=case.N, max_heads=case.N,
                    min_L=case.L, max_L=case.L, min_S=case.S, max_S=case.S,
                    min_head_dim=min(case.E, case.Ev), max_head_dim=max(case.E, case.Ev))
    return narrowed


def _mha_forcing(case: MHACase, arguments: dict[str, Any]) -> dict[str, Any] | None:
    """``arguments`` narrowed to exactly ``case`` (None: the arguments rule it out)."""
    narrowed = dict(arguments)
    features = case.mha_features() - {"dropout"}
    self_attention = case.self_attention
    if not self_attention and case.value is not case.key:
        features.add("cross_attention")
    narrowed["required_features"] = features
    for name in ("need_weights", "average_attn_weights", "is_causal"):
        value = getattr(case, name)
        if arguments.get(name) not in (None, value):
            return None
        narrowed[name] = value
    if arguments.get("fully_masked") not in (None, case.fully_masked_rows()):
        return None
    if arguments.get("self_attention") not in (None, self_attention):
        return None
    narrowed["self_attention"] = self_attention
    kinds = {("bool" if m.dtype == np.bool_ else "float")
             for m in (case.key_padding_mask, case.attn_mask) if m is not None}
    if len(kinds) == 1:
        (kind,) = kinds
        if arguments.get("mask_kinds") is not None and kind not in arguments["mask_kinds"]:
            return None
        narrowed["mask_kinds"] = (kind,)
    E = case.D // case.N
    sizes = (("batch", case.B, 1, 3), ("heads", case.N, 1, 4), ("head_dim", E, None, None),
             ("L", case.L, 1, None), ("S", case.S, 1, None))
    for dim, value, low, high in sizes:
        lo, hi = arguments.get(f"min_{dim}", low), arguments.get(f"max_{dim}", high)
        if lo is not None and value < lo or hi is not None and value > hi:
            return None
        narrowed[f"min_{dim}"] = narrowed[f"max_{dim}"] = value
    return narrowed


def _freeze(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(value))
    if isinstance(value, list):
        return tuple(value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "set":
        return set(value[1])
    return value


@functools.lru_cache(maxsize=4096)
def _strategy_accepts(level: str, caps: Any, device: str, dtype: str,
                      frozen: tuple[tuple[str, Any], ...]) -> bool:
    """Whether ``sdpa_cases`` / ``mha_cases`` accepts these arguments (a pure
    function of them, memoized: building a strategy costs milliseconds)."""
    strategy = mha_cases if level == "mha" else sdpa_cases
    try:
        strategy(dtype=dtype, device=device, caps=caps, **{k: _thaw(v) for k, v in frozen})
    except InvalidArgument:
        return False
    return True


def _accepts(level: str, target: Any, arguments: dict[str, Any]) -> bool:
    frozen = tuple(sorted((k, _freeze(v)) for k, v in arguments.items()))
    if target.dtype not in target.caps.dtypes:
        return False
    # Past the dtype check the strategies' argument checks do not depend on the
    # dtype: one declared dtype stands for all of them.
    return _strategy_accepts(level, target.caps, target.device, target.caps.dtypes[0], frozen)


def admitted(target: Any, case: SDPACase | MHACase, **arguments: Any) -> bool:
    """Whether ``cases_for(target, **arguments)`` (``mha_cases_for`` for an MHA
    case) could draw ``case``: the strategy accepts the case's attributes as
    forcing arguments, so the target claims the case and the property takes it."""
    if isinstance(case, MHACase):
        narrowed = _mha_forcing(case, arguments)
        level = "mha"
    else:
        narrowed = _sdpa_forcing(case, arguments)
        level = "sdpa"
    return narrowed is not None and _accepts(level, target, narrowed)


def producible_regimes(target: Any, **arguments: Any) -> list[str]:
    """The regimes ``sdpa_cases(dtype=target.dtype, ..., **arguments)`` can draw
    (the strategy accepts ``regimes=(r,)`` with the rest of ``arguments``)."""
    given = arguments.get("regimes")
    return [r for r in REGIMES if (given is None or r in given)
            and _accepts("sdpa", target, {**arguments, "regimes": (r,)})]


def _pick(preferred: Sequence[Any], allowed: Sequence[Any]) -> Any:
    """The first of ``preferred`` that is allowed, else the first allowed (None: none)."""
    for option in preferred:
        if option in allowed:
            return option
    return allowed[0] if allowed else None


def _seed(name: str, dtype: str) -> np.random.Generator:
    # crc32, not hash(): the same values in every process.
    return np.random.default_rng(zlib.crc32(f"{name}/{dtype}".encode()))
