"""MHA cases: one ``nn.MultiheadAttention`` call with ``spec.MHAParams.random`` weights.

Masks keep ``nn.MultiheadAttention``'s convention (bool **True = blocked**, float
added). ``mha_cases`` checks its arguments into a :class:`_MHAPlan` once; each
example then draws, in this order: the feature switches and flags, the mask
dtype, sizes (and kdim/vdim, self-attention), the seed, and from the seed the
weights, inputs and masks.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from conformance.core.cases import MHACase
from conformance.strategies._drawing import draw_seed, named_strategy, weighted
from conformance.strategies._validation import (
    check_bool_or_none,
    check_device,
    check_dtype,
    check_range,
    choices,
    fail,
    mha_feature_sets,
    resolve_flag,
)
from conformance.strategies.sdpa_masks import NOTE_FORCED, nonzero_bias
from conformance.strategies.sizes import SizeBounds, draw_sizes, size_bounds
from implementations.base import Capabilities
from spec import MHAParams
from spec.emulate import round_arrays_to, round_to

__all__ = ["MHA_MASK_KINDS", "mha_cases"]

#: MHA mask dtypes: "bool" (True = blocked) or "float" (added).
MHA_MASK_KINDS = ("bool", "float")
#: Features a case turns on by a drawn boolean (the rest follow from other draws).
_MHA_TOGGLES = ("no_bias", "kdim_vdim", "bias_kv", "zero_attn", "batch_first", "unbatched",
                "key_padding_mask", "attn_mask")
NOTE_SELF_ATTENTION = "self_attention"


@dataclass(frozen=True)
class _MHAPlan:
    """Checked arguments of ``mha_cases``; None in a flag or toggle means "draw it"."""

    dtype: str
    device: str
    mask_kinds: list[str]
    need_weights: bool | None
    average_attn_weights: bool | None
    is_causal: bool | None
    #: feature in _MHA_TOGGLES -> True (on), False (off) or None (drawn).
    toggles: dict[str, bool | None]
    #: a non-causal attn_mask per head (B*N, L, S): True, False ((L, S) only) or None (drawn).
    per_head_mask: bool | None
    #: a cross-attention case's key and value one array: True, False (apart) or None (drawn).
    shared_kv: bool | None
    fully_masked: bool | None
    self_attention: bool | None
    bounds: SizeBounds


@dataclass(frozen=True)
class _MHASizes:
    B: int
    N: int
    E: int
    L: int
    S: int
    kdim: int
    vdim: int
    same: bool  # self-attention: query, key and value are one array
    shared_kv: bool = False  # cross-attention with key and value one array (kdim = vdim)

    @property
    def D(self) -> int:
        return self.N * self.E


# ---------------------------------------------------------------------------
# checking the arguments
# ---------------------------------------------------------------------------

def _toggles(allowed: set[str], required: set[str], causal: bool | None,
             self_attention: bool | None, fully_masked: bool | None) -> dict[str, bool | None]:
    """Each toggled feature forced on, off, or left to draw, by the arguments."""
    toggles: dict[str, bool | None] = {}
    for feature in _MHA_TOGGLES:
        toggles[feature] = True if feature in required else (None if feature in allowed else False)
    if causal:
        toggles["attn_mask"] = True
    if self_attention:
        if "kdim_vdim" in required:
            raise fail("self_attention", self_attention, "needs kdim = vdim = D but "
                       "required_features has 'kdim_vdim'", "drop one of them")
        toggles["kdim_vdim"] = False
    if fully_masked:
        for feature in ("bias_kv", "zero_attn"):
            if feature in required:
                raise fail("fully_masked", fully_masked, f"is impossible with required feature "
                           f"{feature!r} (it adds a key no mask blocks)", "drop one of them")
            toggles[feature] = False
        if toggles["key_padding_mask"] is False and (toggles["attn_mask"] is False or causal):
            raise fail("fully_masked", fully_masked, "needs a key_padding_mask, or a non-causal "
                       "attn_mask, allowed by features/caps", "allow one or pass fully_masked=None")
    return toggles


def _check_sizes_fit(toggles: dict[str, bool | None], bounds: SizeBounds, min_batch: int,
                     self_attention: bool | None) -> None:
    """Raise when the size bounds rule out a forced option; turn off "unbatched" when B > 1."""
    if toggles["unbatched"] and bounds.min_batch > 1:
        raise fail("min_batch", min_batch, "contradicts a required 'unbatched' (B = 1)",
                   "pass min_batch=1")
    if toggles["unbatched"] is None and bounds.min_batch > 1:
        toggles["unbatched"] = False
    if self_attention and bounds.min_L > bounds.max_S or self_attention and bounds.min_S > bounds.max_L:
        raise fail("self_attention", self_attention, "needs S = L but the length bounds "
                   "do not overlap", "widen min_L/max_L/min_S/max_S")


# ---------------------------------------------------------------------------
# drawing one case
# ---------------------------------------------------------------------------

def _draw_switches(draw: st.DrawFn, plan: _MHAPlan) -> tuple[dict[str, bool], bool]:
    """Which toggled features are on, and is_causal; a forced fully-masked row
    gets a key_padding_mask or a non-causal attn_mask to live in."""
    on = {f: (draw(st.booleans()) if v is None else v) for f, v in plan.toggles.items()}
    is_causal = draw(st.booleans()) if plan.is_causal is None else plan.is_causal
    if is_causal:
        on["attn_mask"] = True
    if plan.fully_masked and not on["key_padding_mask"] and (is_causal or not on["attn_mask"]):
        if plan.toggles["key_padding_mask"] is not False:
            on["key_padding_mask"] = True
        else:  # validated: a non-causal attn_mask is allowed
            on["attn_mask"], is_causal = True, False
    return on, is_causal


def _draw_mha_sizes(draw: st.DrawFn, plan: _MHAPlan, on: dict[str, bool]) -> _MHASizes:
    sizes = draw_sizes(draw, plan.bounds)
    N, E, L, S = sizes["N"], sizes["E"], sizes["L"], sizes["S"]
    B = 1 if on["unbatched"] else sizes["B"]
    D = N * E
    kdim = vdim = D
    if on["kdim_vdim"]:
        kdim = draw(st.integers(1, 12))
        vdim = draw(st.integers(1, 12))
        if kdim == D and vdim == D:
            kdim = D + 1
    same = False
    if kdim == D and vdim == D and plan.self_attention is not False:
        lo, hi = max(plan.bounds.min_L, plan.bounds.min_S), min(plan.bounds.max_L, plan.bounds.max_S)
        if lo <= hi:
            same = True if plan.self_attention else draw(st.booleans())
            if same:
                L = S = min(max(L, lo), hi)
    shared = not same and (draw(st.booleans()) if plan.shared_kv is None else plan.shared_kv)
    if shared:
        if on["kdim_vdim"] and kdim == D:
            kdim = D + 1
        vdim = kdim
    return _MHASizes(B=B, N=N, E=E, L=L, S=S, kdim=kdim, vdim=vdim, same=same, shared_kv=shared)


def _mha_arrays(rng: np.random.Generator, plan: _MHAPlan, on: dict[str, bool],
                dims: _MHASizes) -> tuple[MHAParams, np.ndarray, np.ndarray, np.ndarray]:
    """Weights and query, key, value, exact in the dtype (one array when self-attention)."""
    params = MHAParams.random(rng, dims.D, dims.N, bias=not on["no_bias"], add_bias_kv=on["bias_kv"],
                              add_zero_attn=on["zero_attn"],
                              kdim=dims.kdim if on["kdim_vdim"] else None,
                              vdim=dims.vdim if on["kdim_vdim"] else None)
    params = round_arrays_to(params, plan.dtype)

    def inputs(length: int, dim: int) -> np.ndarray:
        if on["unbatched"]:
            shape: tuple[int, ...] = (length, dim)
        elif on["batch_first"]:
            shape = (dims.B, length, dim)
        else:
            shape = (length, dims.B, dim)
        return round_to(rng.standard_normal(shape), plan.dtype)

    query = inputs(dims.L, dims.D)
    if dims.same:
        return params, query, query, query
    if dims.shared_kv:
        key = inputs(dims.S, dims.kdim)
        return params, query, key, key
    return params, query, inputs(dims.S, dims.kdim), inputs(dims.S, dims.vdim)


def _mha_fully_masked(draw: st.DrawFn, rng: np.random.Generator, kpm: np.ndarray | None,
                      attn: np.ndarray | None, *, B: int, N: int, L: int, S: int,
                      extra_key: bool, causal: bool, fully_masked: bool | None,
                      notes: list[str]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Force, forbid or leave fully-masked rows (True = blocked masks, (B, S) and
    (L, S) / (B*N, L, S)); bias_kv / zero_attn keys are never blocked."""
    if kpm is None and attn is None:
        return kpm, attn
    blocked = np.zeros((B, N, L, S), dtype=bool)
    if kpm is not None:
        blocked |= kpm.reshape(B, 1, 1, S)
    if attn is not None:
        blocked |= attn.reshape((B, N, L, S) if attn.ndim == 3 else (1, 1, L, S))
    has_rows = bool(blocked.all(axis=-1).any()) and not extra_key
    force = fully_masked
    if fully_masked is None:
        force = not extra_key and weighted(draw, [(False, 3), (True, 1)])
    if force and not has_rows and (kpm is not None or not causal):
        if kpm is not None:
            kpm = kpm.copy()
            kpm[int(rng.integers(0, B))] = True                     # a batch item sees no key
        else:
            attn = attn.copy()
            head = (int(rng.integers(0, attn.shape[0])),) if attn.ndim == 3 else ()
            attn[head + (int(rng.integers(0, L)),)] = True          # one query row sees no key
        notes.append(NOTE_FORCED)
    elif fully_masked is False and has_rows:
        # Key 0 is never blocked by the upper-left causal mask: open it everywhere.
        if kpm is not None:
            kpm = kpm.copy()
            kpm[:, 0] = False
        if attn is not None and not causal:
            attn = attn.copy()
            attn[..., 0] = False
    return kpm, attn


def _mha_mask(rng: np.random.Generator, blocked: np.ndarray, kind: str, dtype: str,
              bias: bool) -> np.ndarray:
    """``blocked`` (True = blocked) in MHA convention: bool as is, float 0 / bias and -inf."""
    if kind == "bool":
        return blocked
    values = nonzero_bias(rng, blocked.shape, dtype) if bias else np.zeros(blocked.shape)
    return np.where(blocked, -np.inf, values)


def _draw_mha_masks(draw: st.DrawFn, rng: np.random.Generator, plan: _MHAPlan,
                    on: dict[str, bool], dims: _MHASizes, kind: str, is_causal: bool,
                    notes: list[str]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """key_padding_mask (B, S) or (S,) and attn_mask (L, S) or (B*N | N, L, S), as switched on."""
    B, N, L, S = dims.B, dims.N, dims.L, dims.S
    kpm_blocked = attn_blocked = None
    if on["key_padding_mask"]:
        lengths = rng.integers(1, S + 1, size=B)
        kpm_blocked = np.arange(S)[None, :] >= lengths[:, None]                 # (B, S)
    if is_causal:
        attn_blocked = np.triu(np.ones((L, S), dtype=bool), k=1)                # upper-left
    elif on["attn_mask"]:
        per_head = draw(st.booleans()) if plan.per_head_mask is None else plan.per_head_mask
        shape = (B * N, L, S) if per_head else (L, S)
        attn_blocked = rng.random(shape) < rng.uniform(0.05, 0.6)
    kpm_blocked, attn_blocked = _mha_fully_masked(
        draw, rng, kpm_blocked, attn_blocked, B=B, N=N, L=L, S=S,
        extra_key=on["bias_kv"] or on["zero_attn"], causal=is_causal,
        fully_masked=plan.fully_masked, notes=notes)
    key_padding_mask = attn_mask = None
    if kpm_blocked is not None:
        if on["unbatched"]:
            kpm_blocked = kpm_blocked[0]                                        # (S,)
        key_padding_mask = _mha_mask(rng, kpm_blocked, kind, plan.dtype, bias=False)
    if attn_blocked is not None:
        if on["unbatched"] and attn_blocked.ndim == 3:
            attn_blocked = attn_blocked.reshape(N, L, S)
        bias = not is_causal and draw(st.booleans())
        attn_mask = _mha_mask(rng, attn_blocked, kind, plan.dtype, bias=bias)
    return key_padding_mask, attn_mask


def _draw_mha_case(draw: st.DrawFn, plan: _MHAPlan) -> MHACase:
    on, is_causal = _draw_switches(draw, plan)
    need_weights = draw(st.booleans()) if plan.need_weights is None else plan.need_weights
    # Shrinks toward the default average_attn_weights=True.
    average = plan.average_attn_weights
    if average is None:
        average = not draw(st.booleans())
    kind = draw(st.sampled_from(plan.mask_kinds))
    dims = _draw_mha_sizes(draw, plan, on)
    rng = draw_seed(draw)
    params, query, key, value = _mha_arrays(rng, plan, on, dims)
    notes: list[str] = [NOTE_SELF_ATTENTION] if dims.same else []
    key_padding_mask, attn_mask = _draw_mha_masks(draw, rng, plan, on, dims, kind, is_causal, notes)
    return MHACase(params=params, query=query, key=key, value=value,
                   key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                   is_causal=is_causal, need_weights=need_weights,
                   average_attn_weights=average, batch_first=on["batch_first"],
                   unbatched=on["unbatched"], dtype=plan.dtype, device=plan.device,
                   notes=tuple(notes))


def mha_cases(
    *,
    dtype: str,
    device: str = "cpu",
    caps: Capabilities | None = None,
    features: Collection[str] | None = None,
    required_features: Collection[str] = (),
    need_weights: bool | None = None,
    average_attn_weights: bool | None = None,
    is_causal: bool | None = None,
    mask_kinds: Sequence[str] | None = None,
    fully_masked: bool | None = None,
    self_attention: bool | None = None,
    min_batch: int = 1,
    max_batch: int = 3,
    min_heads: int = 1,
    max_heads: int = 4,
    min_head_dim: int | None = None,
    max_head_dim: int | None = None,
    min_L: int = 1,
    max_L: int | None = None,
    min_S: int = 1,
    max_S: int | None = None,
) -> st.SearchStrategy[MHACase]:
    """:class:`~conformance.core.cases.MHACase` problems: an ``nn.MultiheadAttention``
    call with ``spec.MHAParams.random`` weights, every array exact in ``dtype``.

    D = N * E with N <= 4 and E <= 8 by default. Features used come only from
    ``features`` (default: ``caps.mha_features``); each of bias=False, kdim/vdim,
    add_bias_kv, add_zero_attn, batch_first, unbatched, key_padding_mask and
    attn_mask is drawn on or off unless ``required_features`` forces it on.
    ``need_weights``, ``average_attn_weights``, ``is_causal``: True/False force,
    None draws (within the features). ``is_causal=True`` carries attn_mask = the
    upper-left causal mask (True = blocked / 0 and -inf) as torch requires.
    ``mask_kinds`` ⊆ :data:`MHA_MASK_KINDS`: the type of both masks (bool True =
    blocked; float: key_padding_mask 0/-inf, attn_mask 0 or a no-zero bias, -inf
    blocked), shapes key_padding_mask (B, S) ((S,) unbatched), attn_mask (L, S) or
    (B*N, L, S) (the latter with feature "per_head_attn_mask"). ``fully_masked``: True forces a query row with every key blocked
    (then no bias_kv/zero_attn), False forbids, None allows. ``self_attention``:
    True passes the same array as query, key and value (kdim = vdim = D, S = L;
    the module's fast path needs it), False never, None sometimes.
    Shrinks toward B = N = 1, small E, L = S = 1, default options, no masks,
    need_weights as allowed, seed 0.
    """
    arguments = dict(locals())
    check_dtype(dtype, caps)
    check_device(device, caps)
    check_bool_or_none("fully_masked", fully_masked)
    check_bool_or_none("self_attention", self_attention)
    allowed, required = mha_feature_sets(caps, features, required_features)
    kinds = choices("mask_kinds", mask_kinds, MHA_MASK_KINDS, MHA_MASK_KINDS)
    if caps is not None and "additive" not in caps.mask_kinds:  # bool masks only (a float one is refused)
        kinds = [k for k in kinds if k != "float"]
        if not kinds:
            raise fail("mask_kinds", mask_kinds, "needs float masks, which the capabilities do not declare "
                       "(mask_kinds without 'additive')", "allow 'bool' or declare additive masks")
    need = resolve_flag("need_weights", need_weights, "need_weights", allowed, required)
    average = resolve_flag("average_attn_weights", average_attn_weights, "per_head_weights",
                            allowed, required, on_means_feature=False)
    causal = resolve_flag("is_causal", is_causal, "is_causal", allowed, required)
    if caps is not None and caps.causal_only:  # an always-causal module: every call causal
        if causal is False:
            raise fail("is_causal", is_causal, "asks for non-causal calls, but causal_only declares causal "
                       "calls only", "pass is_causal=None or True")
        causal = True
    if causal and "attn_mask" not in allowed:
        raise fail("is_causal", is_causal, "needs feature 'attn_mask' (torch wants the causal "
                   "mask passed along)", "allow 'attn_mask' or pass is_causal=None")
    if causal is None and "attn_mask" not in allowed:
        causal = False
    per_head_mask = True if "per_head_attn_mask" in required else (
        None if "per_head_attn_mask" in allowed else False)
    if per_head_mask and (causal or "attn_mask" not in allowed):
        raise fail("required_features", sorted(required), "has 'per_head_attn_mask', which needs a non-causal "
                   "attn_mask (a causal call's is the (L, S) causal mask)",
                   "allow 'attn_mask' and pass is_causal=False, or drop 'per_head_attn_mask'")
    if per_head_mask:
        causal = False
    # Cross-attention draws key and value apart with "cross_attention", as one array with
    # "kv_cross_attention" (implied by the former), either where both are allowed.
    apart, shared = "cross_attention" in allowed, "kv_cross_attention" in allowed
    shared_kv = True if "kv_cross_attention" in required and "cross_attention" not in required else (
        False if "cross_attention" in required or not shared else None if apart else True)
    if {"cross_attention", "kv_cross_attention"} & required:  # a cross-attention case
        if self_attention:
            raise fail("required_features", sorted(required), "asks for cross-attention, but "
                       "self_attention=True", "drop one of them")
        self_attention = False
    toggles = _toggles(allowed, required, causal, self_attention, fully_masked)
    if per_head_mask:
        toggles["attn_mask"] = True
    check_range("min_batch", min_batch, "max_batch", max_batch)
    check_range("min_heads", min_heads, "max_heads", max_heads)
    bounds = size_bounds(caps, min_batch=min_batch, max_batch=max_batch, min_heads=min_heads,
                         max_heads=max_heads, gqa=False, min_L=min_L, max_L=max_L, min_S=min_S,
                         max_S=max_S, min_head_dim=min_head_dim, max_head_dim=max_head_dim,
                         different_v_dim=False, default_max_length=16, default_max_head_dim=8)
    _check_sizes_fit(toggles, bounds, min_batch, self_attention)
    plan = _MHAPlan(dtype=dtype, device=device, mask_kinds=kinds, need_weights=need,
                    average_attn_weights=average, is_causal=causal, toggles=toggles, per_head_mask=per_head_mask,
                    shared_kv=shared_kv,
                    fully_masked=fully_masked, self_attention=self_attention, bounds=bounds)
    return named_strategy(mha_cases, arguments, lambda draw: _draw_mha_case(draw, plan))
