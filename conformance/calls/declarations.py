"""Whether a case or a call is inside a target's declarations: the one check every path
that builds a case goes through.

A certificate must never blame an implementation for a case it does not claim: every
case the suite hands over — a random draw, a directed example, a sweep's size, or a
second case a property derives from the first (more batch, padded, re-chunked, split
keys, an appended cache) — is inside the target's ``Capabilities`` at its level.
:func:`outside_declarations` says whether it is, and why not, judging the call **as it
is made** (an SDPA case's causal constraint folded into a bool mask when the declared
flag means another alignment, copies along the batch, the LSE asked for, the caches
handed over as pages). The strategies and the directed examples keep their cases inside
by construction; :func:`require_inside`, run by each level's ``run_*`` before it calls
the implementation, is the guarantee: a call outside is not made, and the test fails as
the suite's error (:class:`OutsideDeclarations`), never as the implementation's.

What is checked: ``Implementation.not_supported_reasons`` on the call's attributes
(device, dtype, mask kind, causal alignment, Ev != E, GQA, dropout, custom scale,
autograd, mask gradient, layout, min/max head dim, max sequence length, paged cache,
cache append, MHA and flash features), plus what those attributes alone cannot say:
``self_attention_lengths`` at every level (per sequence at the varlen level),
``shared_kv`` (the value handed over is the key) and the flash level's LSE
(``return_attn_probs`` needs the ``lse`` feature).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conformance.calls.call_specs import MHACallSpec, SDPACallSpec, uses_causal_flag
from conformance.core import levels
from implementations.capabilities import draw_length_cap

__all__ = ["OutsideDeclarations", "call_of", "call_attrs", "fit_head_dims", "fit_lengths",
           "outside_declarations", "require_inside"]


class OutsideDeclarations(RuntimeError):
    """The suite built a call outside the target's declarations (the suite's error: the
    call is not made, and no implementation is blamed)."""


def call_of(target: Any, item: Any) -> Any:
    """The call spec ``item`` is (a call spec), or the plain call the level's ``run_*``
    makes of the case ``item``."""
    if hasattr(item, "called_case") or type(item).__name__.endswith("CallSpec"):
        return item
    level = {"SDPACase": "sdpa", "MHACase": "mha"}.get(type(item).__name__, getattr(item, "level", None))
    if level == "sdpa":
        return SDPACallSpec(item, is_causal=uses_causal_flag(target, item))
    if level == "mha":
        return MHACallSpec(item)
    if level in levels.LEVEL_MODULES:  # the level's own module (which imports this one)
        return levels.module(level).CallSpec(item)
    raise TypeError(f"item={item!r} is neither a case nor a call spec of a known level")


def call_attrs(target: Any, call: Any) -> dict[str, Any]:
    """The attributes ``Implementation.not_supported_reasons`` judges, of ``call`` as made."""
    level = call.level
    if level == "sdpa":
        passed = call.passed_case
        attrs = passed.attrs(dropout_p=call.dropout_p, grad=call.grad, mask_grad=call.mask_grad)
        # A causal constraint goes over as the flag only when the flag means its alignment;
        # otherwise it is folded into the mask (``passed_case``): no flag is used.
        attrs["causal"] = target.caps.causal if call.is_causal else None
        return attrs
    if level == "flash":
        attrs = call.attrs()
        features = set(attrs.get("flash_features", ()))
        if call.lse:
            features.add("lse")
        attrs["flash_features"] = features
        return attrs
    if level == "mha":
        attrs = call.attrs()
        features = set(call.case.mha_features())
        if not attrs.get("self_attention") and call.case.value is not call.case.key:
            features.add("cross_attention")
        if call.dropout:
            features.add("dropout")
        attrs["mha_features"] = features
        attrs["dropout_p"] = 0.0  # a module's dropout is the MHA feature "dropout"
        attrs["mask_kind"] = "none"  # MHA masks are MHA features (attn_mask, key_padding_mask)
        return attrs
    if level == "kvcache":
        return call.attrs()
    return call.attrs()


def outside_declarations(target: Any, item: Any) -> list[str]:
    """Why ``item`` (a case or a call spec of ``target``'s level) is outside ``target``'s
    declarations, one reason each; [] when it is inside."""
    call = call_of(target, item)
    if call.level != target.level:
        return [f"a {call.level}-level call on a {target.level}-level target"]
    attrs = call_attrs(target, call)
    reasons = list(target.impl.not_supported_reasons(attrs))
    caps = target.caps
    case = call.case
    if caps.self_attention_lengths and target.level != "sdpa":  # sdpa: not_supported_reasons
        if target.level == "varlen":
            unequal = [(L, S) for L, S in case.lengths() if L != S]
            if unequal:
                reasons.append(f"sequence lengths (L, S) {unequal[:3]} differ but "
                               "self_attention_lengths declares L == S only")
        elif target.level in ("flash", "mha") and attrs.get("L") != attrs.get("S"):
            reasons.append(f"L={attrs.get('L')} != S={attrs.get('S')} but self_attention_lengths "
                           "declares L == S only")
    if caps.shared_kv and target.level == "sdpa":
        passed = call.passed_case
        if passed.key.shape != passed.value.shape or not np.array_equal(passed.key, passed.value):
            reasons.append("value != key but shared_kv declares key is value")
    if target.level == "sdpa" and call.is_causal and caps.causal is None:
        reasons.append("is_causal=True but no causal flag is declared")
    return list(dict.fromkeys(reasons))


def require_inside(target: Any, call: Any, *, what: str = "") -> None:
    """Raise :class:`OutsideDeclarations` when ``call`` is outside ``target``'s
    declarations (before it is made: it is not made)."""
    reasons = outside_declarations(target, call)
    if reasons:
        raise OutsideDeclarations(
            f"the suite built a {target.level}-level call outside {target.impl.name}'s declarations"
            f"{f' ({what})' if what else ''}: {'; '.join(reasons)}. The call was not made; this is "
            f"an error of the conformance suite, not of the implementation (please report it "
            f"with the case: {call.describe()})"
        )


def fit_head_dims(caps: Any, E: int, Ev: int) -> tuple[int, int] | None:
    """An example's head dims (E, Ev) brought inside ``caps``' bounds: each raised to
    ``min_head_dim`` or lowered to ``max_head_dim``; an example with Ev != E keeps the
    difference (Ev = E ± 1) where the bounds leave two head dims and Ev != E is declared.
    None when the bounds leave no head dim. With ``head_dims`` each is the smallest
    declared head dim at least it (else the largest), Ev != E kept where two are declared."""
    dims = getattr(caps, "head_dims", None)
    if dims:
        inside = [d for d in dims if (caps.min_head_dim or 1) <= d <= (caps.max_head_dim or d)]
        if not inside:
            return None
        e = next((d for d in inside if d >= E), inside[-1])
        if E == Ev or not caps.different_v_dim or caps.shared_kv or len(inside) < 2:
            return e, e
        ev = next((d for d in inside if d >= Ev and d != e), next(d for d in inside if d != e))
        return e, ev
    lo = caps.min_head_dim or 1
    hi = caps.max_head_dim if caps.max_head_dim is not None else max(E, Ev, lo) + 1
    if lo > hi:
        return None
    e, ev = min(max(E, lo), hi), min(max(Ev, lo), hi)
    if E == Ev or not caps.different_v_dim or caps.shared_kv:
        return e, e
    if ev == e and hi > lo:
        ev = e + 1 if e < hi else e - 1
    return e, ev


def fit_lengths(caps: Any, L: int, S: int) -> tuple[int, int] | None:
    """An example's lengths (L, S) inside ``caps.max_seq_len`` keeping how L relates to S
    (L < S, L == S, L > S) where the bound allows; L == S with ``self_attention_lengths``.
    None when the relation cannot be kept. With ``seq_multiple`` m both are m times
    the example's (the relation kept), within the bound; with ``seq_block`` both inside
    one block."""
    if caps.self_attention_lengths:
        L = S = max(L, S)
    m = getattr(caps, "seq_multiple", None) or 1
    if m > 1:
        L, S = L * m, S * m
        bound = caps.max_seq_len
        if bound is None or max(L, S) <= bound:
            return L, S
        top = bound // m * m
        if L == S:
            return (top, top) if top else None
        if top < 2 * m:
            return None
        return (top - m, top) if L < S else (top, top - m)
    bound = draw_length_cap(caps)  # max_seq_len, or one seq_block: an example stays inside one block
    if bound is None or max(L, S) <= bound:
        return L, S
    if L == S:
        return bound, bound
    if bound < 2:
        return None
    return (bound - 1, bound) if L < S else (bound, bound - 1)
