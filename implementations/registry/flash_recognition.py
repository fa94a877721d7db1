"""Recognition and probing of a function with FlashAttention's ``flash_attn_func`` signature.

``flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
return_attn_probs=False)``: q (B, L, N, E), k (B, S, K, E), v (B, S, K, Ev), causal
lower-right (``spec.flash``). A function whose first three parameters are named
``q, k, v`` is taken as one; an optional parameter it lacks is dropped while it keeps
its default and refused otherwise (:class:`FlashAdapter`), so that feature probes as
unsupported.

Each feature is probed with a tiny CPU call and declared supported when the call runs
and the feature has an effect; a feature that runs without effect is declared
unsupported with a note (``Capabilities.probe_notes``). A wrong but effective feature is
declared, so the suite tests it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

import spec
from implementations.base import (
    ALL_DTYPES,
    Capabilities,
    Implementation,
    ImplementationError,
)
from implementations.guard import CallRaised
from implementations.registry._errors import summarise
from implementations.registry.probing import (
    DEFAULT_PROBE_TIMEOUT,
    _describe_result,
    _Prober,
)

__all__ = ["FLASH_PARAMETERS", "FlashAdapter", "is_flash_signature", "probe_flash", "recognise_flash"]

FLASH_PARAMETERS = ("q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                    "alibi_slopes", "deterministic", "return_attn_probs")
_DEFAULTS = {"dropout_p": 0.0, "softmax_scale": None, "causal": False, "window_size": (-1, -1),
             "softcap": 0.0, "alibi_slopes": None, "deterministic": False, "return_attn_probs": False}


def is_flash_signature(parameters: list[inspect.Parameter]) -> bool:
    """Whether ``parameters`` are ``flash_attn_func``'s: q, k, v first, then only names of
    its own (at least one, so that a bare ``f(q, k, v)``, whose layout could be either,
    is not taken for it), ``*args``/``**kwargs`` aside. A function such as
    ``attention(q, k, v, mask=None)`` is not: it has a parameter flash_attn_func lacks."""
    if [p.name for p in parameters[:3]] != ["q", "k", "v"]:
        return False
    rest = [p.name for p in parameters[3:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return bool(rest) and all(name in FLASH_PARAMETERS for name in rest)


def recognise_flash(fn: Callable[..., Any], parameters: list[inspect.Parameter], *, name: str,
                    origin: str, version: str, timeout: float | None) -> Implementation:
    """A flash-level :class:`Implementation` for ``fn``, capabilities probed."""
    unknown = [p.name for p in parameters[3:] if p.name not in FLASH_PARAMETERS
               and p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if unknown:
        raise ImplementationError(
            f"{origin} looks like flash_attn_func (q, k, v) but also requires {unknown}, which "
            f"flash_attn_func does not have; give them defaults. Expected parameters: "
            f"{', '.join(FLASH_PARAMETERS)}"
        )
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in parameters)
    names = {p.name for p in parameters}
    accepted = set(FLASH_PARAMETERS) if has_var_kw else names & set(FLASH_PARAMETERS)
    flash = fn if accepted == set(FLASH_PARAMETERS) else FlashAdapter(fn, accepted)
    caps = probe_flash(flash, origin=origin, timeout=timeout)
    return Implementation(name=name, capabilities=caps, flash=flash, version=version,
                          description=f"flash_attn_func-signature function {origin}; capabilities probed")


class FlashAdapter:
    """Calls a function lacking some of flash_attn_func's optional parameters: a missing
    one is dropped while it has its default value and refused otherwise."""

    def __init__(self, fn: Callable[..., Any], accepted: set[str]) -> None:
        self.fn, self.accepted = fn, accepted
        self.__name__ = getattr(fn, "__name__", "flash_attn_func")

    def __call__(self, q, k, v, **options: Any) -> Any:
        kwargs = {}
        for key_name, given in options.items():
            if key_name in self.accepted:
                kwargs[key_name] = given
            elif not _is_default(key_name, given):
                raise NotImplementedError(f"{self.__name__} has no {key_name} parameter")
        return self.fn(q, k, v, **kwargs)


def _is_default(key_name: str, given: Any) -> bool:
    default = _DEFAULTS.get(key_name, object())
    if key_name == "window_size":
        return tuple(given) == default
    return given is default or given == default


def _output_of(result: Any) -> Any:
    return result[0] if isinstance(result, (tuple, list)) and result else result


def probe_flash(fn: Callable[..., Any], *, origin: str,
                timeout: float | None = DEFAULT_PROBE_TIMEOUT) -> Capabilities:
    """Capabilities of a ``flash_attn_func``-signature function, found by tiny CPU calls."""
    import torch

    probe = _Prober(origin, timeout)
    gen = torch.Generator().manual_seed(0)

    def qkv(B=1, L=2, S=3, N=2, K=2, E=4, Ev=4, dtype=torch.float32):
        return (torch.randn(B, L, N, E, generator=gen).to(dtype), torch.randn(B, S, K, E, generator=gen).to(dtype),
                torch.randn(B, S, K, Ev, generator=gen).to(dtype))

    q, k, v = qkv()
    plain = "a plain float32 call with q (1, 2, 2, 4), k (1, 3, 2, 4), v (1, 3, 2, 4)"
    try:
        out = probe.call("a plain call", lambda: fn(q, k, v))
    except CallRaised as exc:
        raise ImplementationError(
            f"{origin} has flash_attn_func's signature but {plain} raised {summarise(exc.error)}; it "
            "must at least run that") from exc.error
    if not _is_tensor(out, (1, 2, 2, 4)):
        raise ImplementationError(
            f"{origin} has flash_attn_func's signature but {plain} returned {_describe_result(out)}; it "
            "must return a torch.Tensor of shape (1, 2, 2, 4) (B, L, N, Ev)")
    q64, k64, v64 = (x.double().numpy() for x in (q, k, v))
    base = out.detach().double().numpy()
    notes: list[str] = []

    def effective(feature: str, call: Callable[[], Any], **options: Any) -> bool:
        """The call runs, returns the output, differs from the plain one and matches the
        oracle's change in direction (not checked here: the suite checks values)."""
        try:
            got = _output_of(probe.call(feature, call))
        except CallRaised:
            return False
        if not _is_tensor(got, (1, 2, 2, 4)):
            notes.append(f"{feature}: returned {_describe_result(got)}, not the (1, 2, 2, 4) output; "
                         "declared unsupported")
            return False
        got = got.detach().double().numpy()
        want = spec.flash_attention(q64, k64, v64, **options)
        if np.allclose(got, base, atol=1e-6) and not np.allclose(want, base, atol=1e-6):
            notes.append(f"{feature}: has no effect (the output equals the plain call's); declared "
                         f"unsupported (--impl-option flash_features=... tests it anyway)")
            return False
        return True

    slopes = torch.tensor([0.5, 0.25])
    features = set()
    if effective("window", lambda: fn(q, k, v, window_size=(0, 0)), window=(0, 0)):
        features.add("window")
    if effective("softcap", lambda: fn(q, k, v, softcap=0.05), softcap=0.05):
        features.add("softcap")
    if effective("alibi", lambda: fn(q, k, v, alibi_slopes=slopes), alibi_slopes=slopes.numpy()):
        features.add("alibi")
    if _probe_lse(probe, fn, q, k, v):
        features.add("lse")
    causal = "lower_right" if _probe_causal(probe, fn, q, k, v, q64, k64, v64, notes) else None

    def backward() -> bool:
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        try:
            got = _output_of(probe.call("backward", lambda: fn(qq, kk, vv)))
            if not isinstance(got, torch.Tensor):
                return False
            probe.call("backward", lambda: got.sum().backward())
        except CallRaised:
            return False
        return qq.grad is not None and kk.grad is not None and vv.grad is not None

    runs = probe.runs
    dtypes = tuple(d for d in ALL_DTYPES if runs(f"dtype {d}", lambda d=d: fn(*qkv(dtype=getattr(torch, d)))))
    return Capabilities(
        devices=("cpu",),
        dtypes=dtypes or ("float32",),
        mask_kinds=frozenset({"none"}),
        causal=causal,
        fully_masked=_probe_fully_masked(probe, fn, qkv) if causal else "zero",
        different_v_dim=runs("Ev != E", lambda: fn(*qkv(Ev=3))),
        gqa=runs("GQA", lambda: fn(*qkv(N=2, K=1))),
        dropout=False,
        custom_scale=runs("softmax_scale=", lambda: fn(q, k, v, softmax_scale=0.5)),
        autograd=backward(),
        mask_grad=False,
        non_contiguous=runs("a transposed input", lambda: fn(q.transpose(1, 2).contiguous().transpose(1, 2), k, v)),
        flash_features=frozenset(features),
        probe_notes=tuple(notes),
    )


def _is_tensor(out: Any, shape: tuple[int, ...]) -> bool:
    import torch

    return isinstance(out, torch.Tensor) and tuple(out.shape) == shape and out.device.type == "cpu"


def _probe_fully_masked(probe: _Prober, fn, qkv) -> str:
    """The output of a row attending no key (causal with L = 3 > S = 1 empties rows 0 and 1):
    zero (FlashAttention's), nan, or unspecified."""
    import torch

    q, k, v = qkv(L=3, S=1)
    try:
        got = _output_of(probe.call("a row attending no key", lambda: fn(q, k, v, causal=True)))
    except CallRaised:
        return "unspecified"
    if not _is_tensor(got, (1, 3, 2, 4)):
        return "unspecified"
    rows = got.detach()[:, :2]
    if torch.isnan(rows).all():
        return "nan"
    return "zero" if torch.equal(rows, torch.zeros_like(rows)) else "unspecified"


def _probe_lse(probe: _Prober, fn, q, k, v) -> bool:
    """``return_attn_probs=True`` returns a sequence whose second entry is a (B, N, L) LSE."""
    try:
        got = probe.call("lse", lambda: fn(q, k, v, return_attn_probs=True))
    except CallRaised:
        return False
    return isinstance(got, (tuple, list)) and len(got) >= 2 and _is_tensor(got[1], (1, 2, 2))


def _probe_causal(probe: _Prober, fn, q, k, v, q64, k64, v64, notes: list[str]) -> bool:
    """``causal=True`` is FlashAttention's lower-right rule (L=2 < S=3: the alignments differ)."""
    try:
        got = _output_of(probe.call("causal=True", lambda: fn(q, k, v, causal=True)))
    except CallRaised:
        return False
    if not _is_tensor(got, (1, 2, 2, 4)):
        return False
    got = got.detach().double().numpy()
    if np.allclose(got, spec.flash_attention(q64, k64, v64, causal=True), atol=1e-4):
        return True
    if np.allclose(got, spec.flash_attention(q64, k64, v64, causal=True, alignment="upper_left"), atol=1e-4):
        notes.append("causal: causal=True is aligned upper-left (flash-attn < 2.1), not FlashAttention-2's "
                     "lower-right; declared as no causal flag (--impl-option causal=lower_right tests it)")
    else:
        notes.append("causal: causal=True matches neither alignment; declared as no causal flag "
                     "(--impl-option causal=lower_right tests it)")
    return False
