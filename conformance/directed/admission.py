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

from conformance.calls.declarations import outside_declarations
from conformance.calls.flash_cases import FlashCase
from conformance.calls.varlen import VarlenCase
from conformance.core.cases import MHACase, SDPACase
from conformance.strategies import REGIMES, mha_cases, sdpa_cases
from conformance.strategies.sizes import size_bounds

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


def _flash_admitted(target: Any, case: FlashCase, arguments: dict[str, Any]) -> bool:
    """Whether ``flash_cases`` with the property's ``arguments`` draws ``case``'s sizes (the
    bounds it tightens by the capabilities: batch, heads, GQA, lengths, head dims, a split
    case's S >= 2) and the target claims the case (``outside_declarations``: features,
    dtypes, FP8 forms, lengths). Its features are a directed example's, as written; a JIT
    target's shapes are budgeted, so its cases are not resized at all."""
    if target.shape_budget is not None:
        return False
    caps, split = target.caps, bool(arguments.get("split"))
    try:
        b = size_bounds(caps, min_batch=1, max_batch=2, min_heads=1, max_heads=arguments.get("max_heads", 4),
                        gqa=arguments.get("gqa"), min_L=1, max_L=arguments.get("max_L", 33),
                        min_S=max(arguments.get("min_S", 1), 2 * (caps.seq_multiple or 1) if split else 1),
                        max_S=arguments.get("max_S", 33), min_head_dim=None, max_head_dim=None,
                        different_v_dim=None, default_max_length=33, default_max_head_dim=16)
    except InvalidArgument:
        return False
    s = case.sizes()
    dims = (s["E"], s["Ev"])
    inside = (b.min_batch <= s["B"] <= b.max_batch and b.min_heads <= s["N"] <= b.max_heads
              and s["N"] % s["K"] == 0 and (b.gqa is not False or s["N"] == s["K"])
              and b.min_L <= s["L"] <= b.max_L and b.min_S <= s["S"] <= b.max_S
              and (not b.equal_lengths or s["L"] == s["S"])
              and all(d % b.seq_multiple == 0 for d in (s["L"], s["S"]) if b.seq_multiple > 1)
              and all(b.min_head_dim <= d <= b.max_head_dim for d in dims)
              and (b.head_dims is None or all(d in b.head_dims for d in dims))
              and (b.different_v_dim is not False or s["E"] == s["Ev"]))
    return inside and not outside_declarations(target, case)


def _varlen_admitted(target: Any, case: VarlenCase, arguments: dict[str, Any]) -> bool:
    """Whether ``varlen_cases`` with the property's ``arguments`` draws ``case``'s sizes
    (1..max_batch sequences, each 0..max_len long within the declared max_seq_len, N a
    multiple of K) and the target claims the case (``outside_declarations``: head dims,
    GQA, equal lengths, features, FP8 forms)."""
    caps = target.caps
    longest = arguments.get("max_len", 7)
    if caps.max_seq_len is not None:
        longest = min(longest, caps.max_seq_len)
    inside = (1 <= case.B <= arguments.get("max_batch", 4) and case.N % case.K == 0
              and all(L <= longest and S <= longest for L, S in case.lengths()))
    return inside and not outside_declarations(target, case)


def admitted(target: Any, case: SDPACase | MHACase | FlashCase | VarlenCase, **arguments: Any) -> bool:
    """Whether ``cases_for(target, **arguments)`` (``mha_cases_for`` for an MHA
    case) could draw ``case``: the strategy accepts the case's attributes as
    forcing arguments, so the target claims the case and the property takes it
    (a flash case: :func:`_flash_admitted`)."""
    if isinstance(case, FlashCase):
        return _flash_admitted(target, case, arguments)
    if isinstance(case, VarlenCase):
        return _varlen_admitted(target, case, arguments)
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
