"""A flash level derived from an SDPA callable: ``flash_attn_func`` through masks.

An implementation that has an SDPA-level callable but no flash callable of its own can
still be certified at the flash level: :class:`FlashFromSDPA` implements FlashAttention-2's
``flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
alibi_slopes, deterministic, return_attn_probs)`` by one call of the implementation's own
``sdpa``:

1. q (B, L, N, E), k (B, S, K, E), v (B, S, K, Ev) -> heads first (B, N, L, E) ...;
2. ``causal`` (FlashAttention's lower-right) and ``window_size`` -> one attend mask (L, S),
   **True = may attend**: query i attends key j iff ``p_i - left <= j <= p_i + right``,
   ``p_i = i + S - L``, a negative side unbounded, causal = right side 0. It goes as a bool
   ``attn_mask`` when the SDPA declares bool masks, else as its 0/-inf additive form;
3. ``alibi_slopes`` (N,) or (B, N) -> the additive mask ``-slope_h * |p_i - j|`` (-inf where
   the attend mask blocks), computed in float64 and rounded once to the input dtype;
4. ``softmax_scale`` -> ``scale``; K < N -> ``enable_gqa=True``; ``dropout_p`` as given;
5. the output (B, N, L, Ev) -> (B, L, N, Ev).

Causality is folded into ``is_causal`` only when the SDPA declares no mask at all and its
flag means lower-right (the only case where the flag and the mask are the same rule);
otherwise it is always a mask, so that everything the flash level adds is an SDPA mask.
A failure at a derived flash level is therefore read as an SDPA mask bug (window or
causal: the bool or additive mask; ALiBi: the additive mask).

Soft-capping (applied to the scores before bias and masks) and the log-sum-exp
(``return_attn_probs``) cannot be expressed through SDPA: the adapter raises
NotImplementedError for them, and :func:`derived_flash_capabilities` declares the features
{window, alibi} at most (window needs a mask kind, ALiBi the additive one).

Rows attending no key (causal or a window with L > S) are FlashAttention's zeros. Where
the SDPA's declared fully-masked policy for the mask kind used is ``zero`` the rows go to
the SDPA as they are (so its handling of them is tested too); under another policy
(``nan``, ``uniform``, ``unspecified``: a declared convention, not a bug) the adapter
hands over only the rows that attend a key, which are the last rows (the lower-right
alignment empties a prefix), and gives the others 0.

Dimension letters: B batch, N query heads, K kv heads, L query length, S key length,
E q/k head dim, Ev value head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from implementations.base import PER_DTYPE_FIELDS, Capabilities, Implementation

__all__ = [
    "DERIVED_FLASH_FEATURES",
    "DERIVED_FLASH_NOTE",
    "FlashFromSDPA",
    "derive_flash",
    "derived_flash_capabilities",
    "is_derived_flash",
]

#: The flash features an SDPA can express: the window as a mask, ALiBi as an additive mask.
DERIVED_FLASH_FEATURES = frozenset({"window", "alibi"})
#: The probe note (``Capabilities.probe_notes`` of the flash level) that marks a derived
#: flash level; it travels with the capabilities (isolation, certificate).
DERIVED_FLASH_NOTE = (
    "flash: derived from the SDPA callable through masks (flash_attn_func's causal and "
    "window_size as an attend mask, alibi_slopes as an additive mask, GQA via enable_gqa); "
    "a failure at this level is an SDPA mask bug; softcap and the LSE cannot be expressed; "
    "--impl-option derived_flash=false turns it off"
)


def is_derived_flash(impl: Implementation) -> bool:
    """Whether ``impl``'s flash level is derived from its SDPA callable (this module)."""
    return impl.flash is not None and DERIVED_FLASH_NOTE in impl.caps("flash").probe_notes


def _window_kind(caps: Capabilities) -> str | None:
    """The mask kind a window (and causality) is handed over as: bool, else additive."""
    for kind in ("bool", "additive"):
        if kind in caps.mask_kinds:
            return kind
    return None


def derived_flash_capabilities(caps: Capabilities) -> Capabilities:
    """The flash-level capabilities of :class:`FlashFromSDPA` over an SDPA with ``caps``,
    dtype by dtype: where the SDPA's capabilities differ in a dtype (``by_dtype``: masks
    that raise in float16, say), the flash level's differ there too (no window without a
    mask). Its causal alignment and fully-masked rows are FlashAttention's, set by the
    adapter: their source is the contract."""
    flash = _derived_flash_capabilities(caps)
    per_dtype = {}
    for dtype, _ in caps.by_dtype:
        there = _derived_flash_capabilities(caps.for_dtype(dtype))
        changed = {name: getattr(there, name) for name in PER_DTYPE_FIELDS
                   if getattr(there, name) != getattr(flash, name)}
        if changed:
            per_dtype[dtype] = changed
    sources = {name: source for name, source in caps.sources if name not in ("causal", "fully_masked")}
    if flash.causal is not None:
        sources["causal"] = "contract"
    sources["fully_masked"] = "contract"
    return flash.replace(by_dtype=per_dtype, sources=sources)


def _derived_flash_capabilities(caps: Capabilities) -> Capabilities:
    """The flash-level capabilities of :class:`FlashFromSDPA` over an SDPA with ``caps``.

    Devices, dtypes, GQA, Ev != E, scale, autograd, size bounds and length declarations are
    the SDPA's; no dropout (the SDPA level certifies the SDPA's) and no FP8 inputs; ``causal`` is lower-right when a mask can carry it (or the SDPA's flag is
    lower-right); ``flash_features`` is {window, alibi} within what the masks allow (and
    within ``caps.flash_features``, so ``--impl-option flash_features=...`` narrows it);
    rows attending no key are 0 (FlashAttention's; see the module docstring).
    """
    window_kind = _window_kind(caps)
    features = set()
    if window_kind is not None:
        features.add("window")
    if "additive" in caps.mask_kinds:
        features.add("alibi")
    causal = "lower_right" if window_kind is not None or caps.causal == "lower_right" else None
    notes = [DERIVED_FLASH_NOTE]
    for kind in {k for k in (window_kind, "additive" if "alibi" in features else None,
                             "causal" if window_kind is None and causal else None) if k}:
        policy = caps.fully_masked_policy(kind)
        if policy != "zero":
            blocker = {"bool": "a bool mask", "additive": "an additive -inf mask",
                       "causal": "the causal flag"}[kind]
            notes.append(f"fully_masked: the SDPA declares {policy!r} for rows {blocker} "
                         "blocks entirely; the adapter hands over only rows attending a key "
                         "and gives the others 0 (FlashAttention's)")
    return caps.replace(
        mask_kinds=frozenset({"none"}),
        causal=causal,
        fully_masked="zero",
        mask_grad=False,
        batch_dims=None,
        # The SDPA's dropout is certified at the SDPA level (dropout_expectation); the flash
        # level's dropout properties are for a flash callable of its own.
        dropout=False,
        fp8_dtypes=(),
        flash_features=frozenset(features & DERIVED_FLASH_FEATURES & set(caps.flash_features)),
        probe_notes=tuple(sorted(set(notes), key=notes.index)),
    )


def derive_flash(impl: Implementation) -> Implementation:
    """``impl`` with a flash level derived from its SDPA callable, when it has an SDPA
    callable, no flash callable of its own, is available, and its SDPA takes key and
    value apart (``shared_kv`` cannot be called with k != v), and is not causal-only with a
    flag of the other alignment (``causal_only`` with an upper-left flag cannot express
    FlashAttention's lower-right calls); else ``impl`` unchanged."""
    caps = impl.caps("sdpa")
    if impl.flash is not None or impl.sdpa is None or not impl.available or caps.shared_kv:
        return impl
    if caps.causal_only and caps.causal != "lower_right":
        return impl
    return dataclasses.replace(impl, flash=FlashFromSDPA(impl.sdpa, caps),
                               flash_capabilities=derived_flash_capabilities(caps))


class FlashFromSDPA:
    """``flash_attn_func`` by one call of an SDPA callable (see the module docstring).

    ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``'s signature; ``caps``:
    its SDPA-level capabilities (which mask kinds it takes, what its causal flag means,
    its fully-masked policies, whether it takes non-contiguous inputs).
    """

    def __init__(self, sdpa: Callable[..., Any], caps: Capabilities) -> None:
        self.sdpa = sdpa
        self.caps = caps
        self.window_kind = _window_kind(caps)
        self.__name__ = f"flash_attn_func_from_{getattr(sdpa, '__name__', 'sdpa')}"

    def __repr__(self) -> str:
        return f"FlashFromSDPA({getattr(self.sdpa, '__name__', self.sdpa)!r})"

    def __call__(self, q: Any, k: Any, v: Any, dropout_p: float = 0.0, softmax_scale: float | None = None,
                 causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                 alibi_slopes: Any = None, deterministic: bool = False,
                 return_attn_probs: bool = False) -> Any:
        if softcap:
            raise NotImplementedError("softcap cannot be expressed through SDPA (it caps the scores "
                                      "before bias and masks); the derived flash level has no softcap")
        if return_attn_probs:
            raise NotImplementedError("the log-sum-exp is not an SDPA output; the derived flash level "
                                      "has no return_attn_probs")
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError(f"q, k, v must be 4-D (B, L, N, E), (B, S, K, E), (B, S, K, Ev); got "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        L, N, S, K = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
        left, right = (int(side) for side in window_size)
        right = 0 if causal else right                       # FlashAttention: causal = right side 0
        windowed = left >= 0 or right >= 0
        attend = _attend_mask(L, S, left, right, q.device) if windowed else None          # (L, S)
        flag = False
        if windowed and self.window_kind is None:
            if not (causal and left < 0 and self.caps.causal == "lower_right"):
                raise NotImplementedError("the SDPA declares no attn_mask, so a window (or causal=True "
                                          "without a lower-right is_causal) cannot be expressed")
            flag, attend_kind = True, "causal"
        elif alibi_slopes is not None:
            if "additive" not in self.caps.mask_kinds:
                raise NotImplementedError("the SDPA declares no additive attn_mask, so alibi_slopes "
                                          "cannot be expressed")
            attend_kind = "additive"
        else:
            attend_kind = self.window_kind

        # Rows attending no key are a prefix (lower-right alignment); under a policy other
        # than zero they are not handed over (see the module docstring).
        first = 0
        if attend is not None and self.caps.fully_masked_policy(attend_kind) != "zero":
            attended = attend.any(dim=-1)                                                 # (L,)
            first = int(attended.int().argmax()) if bool(attended.any()) else L
        query, key, value = (t.transpose(1, 2) for t in (q[:, first:], k, v))     # heads first
        if not self.caps.non_contiguous:
            query, key, value = (t.contiguous() for t in (query, key, value))
        mask = None
        if alibi_slopes is not None:
            mask = _alibi_mask(L, S, alibi_slopes.to(q.device), attend, q.dtype)[..., first:, :]     # (1|B, N, L', S)
        elif attend is not None and not flag:
            part = attend[first:][None, None]                                         # (1, 1, L', S)
            mask = part if attend_kind == "bool" else _additive(part, q.dtype)
        if first == L:  # no row attends a key (S = 0): FlashAttention's zeros, still on the graph
            zeros = q.new_zeros(q.shape[0], L, N, v.shape[3])
            return zeros + 0 * (q.sum() + k.sum() + v.sum())
        out = self.sdpa(query, key, value, attn_mask=mask, dropout_p=dropout_p, is_causal=flag,
                        scale=softmax_scale, enable_gqa=K != N)                      # (B, N, L', Ev)
        out = out.transpose(1, 2)                                                     # (B, L', N, Ev)
        if first:
            import torch

            out = torch.cat([out.new_zeros(out.shape[0], first, *out.shape[2:]), out], dim=1)
        return out


def _attend_mask(L: int, S: int, left: int, right: int, device: Any) -> Any:
    """Bool (L, S), True = may attend: ``p_i - left <= j <= p_i + right``, ``p_i = i + S - L``,
    a negative side unbounded."""
    import torch

    position = torch.arange(L, device=device)[:, None] + (S - L)                      # (L, 1)
    keys = torch.arange(S, device=device)[None, :]                                     # (1, S)
    allowed = torch.ones(L, S, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= keys >= position - left
    if right >= 0:
        allowed &= keys <= position + right
    return allowed


def _additive(attend: Any, dtype: Any) -> Any:
    """The 0/-inf additive form of a bool attend mask, in ``dtype``."""
    import torch

    zero = torch.zeros((), dtype=dtype, device=attend.device)
    return torch.where(attend, zero, torch.tensor(float("-inf"), dtype=dtype, device=attend.device))


def _alibi_mask(L: int, S: int, slopes: Any, attend: Any | None, dtype: Any) -> Any:
    """(1, N, L, S) or (B, N, L, S): ``-slope_h * |p_i - j|`` (float64, rounded once to
    ``dtype``), -inf where ``attend`` blocks."""
    import torch

    device = slopes.device
    position = torch.arange(L, device=device, dtype=torch.float64)[:, None] + (S - L)     # (L, 1)
    distance = (position - torch.arange(S, device=device, dtype=torch.float64)[None, :]).abs()
    bias = -slopes.to(torch.float64)[..., None, None] * distance                        # (..., N, L, S)
    if bias.dim() == 3:
        bias = bias[None]                                                               # (1, N, L, S)
    if attend is not None:
        bias = bias.masked_fill(~attend, float("-inf"))
    return bias.to(dtype)
