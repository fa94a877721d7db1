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
from conformance.calls.kvcache import KVCacheCase
from conformance.calls.varlen import VarlenCase
from conformance.core.cases import MHACase, SDPACase
from conformance.strategies import REGIMES, mha_cases, sdpa_cases
from conformance.strategies.kvcache_features import rotary_multiple
from conformance.strategies.sizes import size_bounds
from conformance.strategies.varlen import OPTION_FEATURES, kvcache_head_dims
from conformance.strategies.varlen import _head_dims as value_head_dims

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
    multiple of K), its values positive where the property's strategy makes them so
    (``positive_values``: a dropout expectation's bound holds for samples in [0, c] only),
    and the target claims the case (``outside_declarations``: head dims, GQA, equal
    lengths, features, FP8 forms)."""
    caps = target.caps
    longest = arguments.get("max_len", 7)
    if caps.max_seq_len is not None:
        longest = min(longest, caps.max_seq_len)
    inside = (1 <= case.B <= arguments.get("max_batch", 4) and case.N % case.K == 0
              and all(L <= longest and S <= longest for L, S in case.lengths())
              and (not arguments.get("positive_values") or bool(np.all(np.asarray(case.value) > 0))))
    return inside and not outside_declarations(target, case)


def _kvcache_features(case: KVCacheCase) -> dict[str, bool]:
    """Which of the options ``kvcache_cases`` draws ``case`` uses, by argument name."""
    return {"window": tuple(case.window) != (-1, -1), "softcap": bool(case.softcap),
            "alibi": case.alibi_slopes is not None, "rotary": case.rotary_cos is not None,
            "cache_batch_idx": case.cache_batch_idx is not None, "cache_leftpad": case.cache_leftpad is not None,
            "num_splits": case.num_splits is not None}


def _kvcache_pages_drawn(case: KVCacheCase, need: int, paged: bool) -> bool:
    """Whether ``kvcache_cases`` draws the case's capacity and pages: ``need`` valid rows
    (cache_seqlens + S_new) plus 0..3 rows of room, paged in whole pages of 1..4 rows (at
    least one page per sequence) with a page order that permutes them and 0..2 spare pages."""
    if case.paged != paged:
        return False
    if not paged:
        return need <= case.S_cache <= need + 3
    size = case.page_size
    if not 1 <= size <= 4 or case.S_cache % size:
        return False
    pages = case.S_cache // size
    if not max(1, -(-need // size)) <= pages <= max(1, -(-(need + 3) // size)):
        return False
    order = list(case.page_order or ())
    return sorted(order) == list(range(len(order))) and 0 <= len(order) - case.B * pages <= 2


def _kvcache_admitted(target: Any, case: KVCacheCase, arguments: dict[str, Any]) -> bool:
    """Whether ``kvcache_cases`` (``kvcache_fp8_cases`` with ``fp8``) with the property's
    ``arguments`` draws ``case``: 1..max_batch sequences of 1..max_query queries, K of 1 or
    2 and N a multiple of it by 1..3 (1 without GQA), E among the head dims it draws (Ev
    too, or E), 0..2 new keys (none without an append, some with rotary tables or
    ``append``), cache_seqlens[b] <= max_cache - S_new, the capacity and pages it draws,
    the options it draws (each True, False or None; one of window, softcap and ALiBi with
    ``at_least_one``) in the ranges it draws them (distinct cache rows with 0..2 spare,
    pads within the valid rows, an even rotary dim within E and tables covering every
    position, a bounded window side below a rotated cache's capacity, 2..4 splits), and
    the target claims the case (``outside_declarations``)."""
    caps = target.caps
    bound = caps.max_seq_len

    def within(wanted: int) -> int:
        return wanted if bound is None else min(wanted, bound)

    max_query, max_cache = within(arguments.get("max_query", 3)), within(arguments.get("max_cache", 9))
    B, L, N, K, E, Ev, new = case.B, case.L, case.N, case.K, case.E, case.Ev, case.S_new
    seqlens = [int(n) for n in case.cache_seqlens]
    used = _kvcache_features(case)
    fp8 = bool(arguments.get("fp8"))
    if (case.fp8 is not None) != fp8 or fp8 and used["rotary"]:
        return False
    for name, present in used.items():
        wanted = arguments.get(name, False)
        if wanted is not None and wanted != present:
            return False
    if arguments.get("at_least_one") and not any(used[n] for n in OPTION_FEATURES) and any(
            n in caps.kvcache_features and arguments.get(n, False) is not False for n in OPTION_FEATURES):
        return False
    append = arguments.get("append")
    dims = kvcache_head_dims(caps)
    if arguments.get("rotary") is True:
        dims = [d for d in dims if d >= rotary_multiple(caps)] or dims
    inside = (1 <= B <= arguments.get("max_batch", 3) and 1 <= L <= max_query and len(seqlens) == B
              and K in (1, 2) and N % K == 0 and 1 <= N // K <= (3 if caps.gqa else 1)
              and E in dims and (Ev == E or caps.different_v_dim and Ev in value_head_dims(caps, (1, 2, 5)))
              and 0 <= new <= min(2, max_cache) and all(0 <= n <= max_cache - new for n in seqlens)
              and (new == 0 or caps.kv_append and append is not False)
              and (new >= 1 or not (append or used["rotary"]))
              and _kvcache_pages_drawn(case, max(seqlens) + new, bool(arguments.get("paged", False))))
    if not inside:
        return False
    rows = case.k_cache.shape[0]
    if case.cache_batch_idx is None:
        if rows != B:
            return False
    elif (len(set(case.cache_batch_idx)) != B or not 0 <= rows - B <= 2
          or not all(0 <= r < rows for r in case.cache_batch_idx)):
        return False
    if case.cache_leftpad is not None and (len(case.cache_leftpad) != B or not all(
            0 <= a <= n for a, n in zip(case.cache_leftpad, seqlens, strict=True))):
        return False
    if case.num_splits is not None and not 2 <= case.num_splits <= 4:
        return False
    if used["rotary"]:
        R = 2 * int(np.shape(case.rotary_cos)[1])
        if not (R >= 2 and R <= E and R % rotary_multiple(caps) == 0
                and np.shape(case.rotary_cos)[0] >= max(case.S_cache, max(seqlens) + max(L, new))):
            return False
        if used["window"] and not any(0 <= side < case.S_cache for side in case.window):
            return False
    return not outside_declarations(target, case)


def admitted(target: Any, case: SDPACase | MHACase | FlashCase | VarlenCase | KVCacheCase,
             **arguments: Any) -> bool:
    """Whether ``cases_for(target, **arguments)`` (``mha_cases_for`` for an MHA
    case) could draw ``case``: the strategy accepts the case's attributes as
    forcing arguments, so the target claims the case and the property takes it
    (a flash case: :func:`_flash_admitted`; varlen and kvcache cases likewise; a sharded
    case: ``conformance.sharded.shrinking.admitted``)."""
    if isinstance(case, FlashCase):
        return _flash_admitted(target, case, arguments)
    if isinstance(case, VarlenCase):
        return _varlen_admitted(target, case, arguments)
    if isinstance(case, KVCacheCase):
        return _kvcache_admitted(target, case, arguments)
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
