"""Probing: what a bare SDPA function or nn.MultiheadAttention drop-in supports.

Each optional feature is tried on a tiny CPU input and recorded as unsupported when
the call raises. The causal alignment is read off the float64 oracle ``spec.sdpa``,
so probing depends on nothing but ``spec`` (and torch, to make the calls).

Every call goes through :func:`implementations.guard.guarded_call` (timeout, every
exception captured, global state and random generators restored), so a probe cannot
hang the run, end it with an exception the registry does not expect, or change the
NumPy or torch settings the suite computes under. A probe that does not return in
time is an :class:`~implementations.base.ImplementationError` naming it; an
implementation that cannot be probed declares its capabilities itself (an
``Implementation``). Where a probe's answer is not a plain yes or no (``is_causal``
has no effect, say) the capability is declared unsupported and
``Capabilities.probe_notes`` says why.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

import spec
from implementations.base import ALL_DTYPES, Capabilities, ImplementationError
from implementations.guard import CallRaised, CallTimedOut, guarded_call
from implementations.registry._errors import summarise

__all__ = ["BUILD_TIMEOUT", "DEFAULT_PROBE_TIMEOUT", "build_limit", "probe_mha", "probe_sdpa"]

#: Seconds a probe call may take when the caller gives no timeout.
DEFAULT_PROBE_TIMEOUT = 60.0
#: Seconds an import or a zero-argument builder may take at least: importing torch or
#: compiling kernels is slow (a longer call timeout applies when one is given).
BUILD_TIMEOUT = 300.0


def build_limit(timeout: float | None) -> float | None:
    """The limit for importing or building an implementation under call timeout ``timeout``."""
    return max(timeout, BUILD_TIMEOUT) if timeout else None


class _Prober:
    """Makes the probe calls of one implementation: ``call`` returns the result or
    raises the implementation's exception as :class:`CallRaised`; a probe that does
    not return within ``timeout`` is an ImplementationError."""

    def __init__(self, origin: str, timeout: float | None) -> None:
        self.origin, self.timeout = origin, timeout

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        # The first probe call is the first call into the implementation: it may compile
        # (guard.COMPILE_FACTOR x the timeout); a slow one is noted in ``slow_first_call``.
        import time

        from implementations.guard import COMPILE_FACTOR

        started = time.monotonic()
        try:
            return guarded_call(fn, timeout=self.timeout, rng=True, warm_key=self.__dict__.setdefault("_warm_key", ("probe", self.origin, object())))
        except CallTimedOut as exc:
            raise ImplementationError(
                f"{self.origin}: probing {what} {exc} (--example-timeout); fix the hang, or "
                "skip probing by declaring the capabilities yourself with "
                "implementations.Implementation(..., capabilities=Capabilities(...))"
            ) from None
        finally:
            seconds = time.monotonic() - started
            if self.timeout and not getattr(self, "slow_first_call", "") and seconds > self.timeout:
                self.slow_first_call = (f"first call took {seconds:.0f} s: compile time allowed "
                                        f"(up to {COMPILE_FACTOR:g} x --example-timeout)")

    def runs(self, what: str, fn: Callable[[], Any]) -> bool:
        """Whether ``fn()`` returns without raising (and does not return False)."""
        try:
            return self.call(what, fn) is not False
        except CallRaised:
            return False


def _describe_result(out: Any) -> str:
    import torch

    if isinstance(out, torch.Tensor):
        return f"a {out.device.type} tensor of shape {tuple(out.shape)} and dtype {out.dtype}"
    return "None" if out is None else f"a {type(out).__module__}.{type(out).__qualname__}"


def _is_output(out: Any, shape: tuple[int, ...]) -> bool:
    import torch

    return isinstance(out, torch.Tensor) and tuple(out.shape) == shape and out.device.type == "cpu"


# --------------------------------------------------------------------------- SDPA


def probe_sdpa(fn: Callable[..., Any], *, origin: str,
               timeout: float | None = DEFAULT_PROBE_TIMEOUT) -> Capabilities:
    """Capabilities of an SDPA-signature function, found by tiny calls on CPU
    (each limited to ``timeout`` seconds)."""
    import torch

    probe = _Prober(origin, timeout)
    gen = torch.Generator().manual_seed(0)

    def qkv(N=2, K=2, L=2, S=3, E=4, Ev=4, dtype=torch.float32):
        return (torch.randn(1, N, L, E, generator=gen).to(dtype), torch.randn(1, K, S, E, generator=gen).to(dtype),
                torch.randn(1, K, S, Ev, generator=gen).to(dtype))

    q, k, v = qkv()
    plain = "a plain float32 call with query (1, 2, 2, 4), key (1, 2, 3, 4), value (1, 2, 3, 4)"
    notes: list[str] = []
    equal_lengths = False
    try:
        out = probe.call("a plain call", lambda: fn(q, k, v))
    except CallRaised as exc:
        # Self-attention kernels take L == S only: that is a declaration, not a failure.
        q3 = torch.randn(1, 2, 3, 4, generator=gen)
        if not _is_output(_try(probe, "a call with L == S", lambda: fn(q3, k, v)), (1, 2, 3, 4)):
            raise ImplementationError(
                f"{origin} has SDPA's signature but {plain} raised {summarise(exc.error)}; it must at "
                "least run that"
            ) from exc.error
        equal_lengths, q = True, q3
        notes.append(f"self_attention_lengths: query length 2 with key length 3 raised "
                     f"{summarise(exc.error)}, query length 3 runs; declared L == S only")
        out = probe.call("a plain call", lambda: fn(q, k, v))
    L = q.shape[2]
    if not _is_output(out, (1, 2, L, 4)):
        raise ImplementationError(
            f"{origin} has SDPA's signature but {plain} returned {_describe_result(out)}; it must "
            f"return a torch.Tensor of shape (1, 2, {L}, 4) (B, N, L, Ev) on the inputs' device, "
            "as torch.nn.functional.scaled_dot_product_attention does"
        )
    shared_kv = _probe_shared_kv(out, q, k, v, notes)
    if shared_kv:
        v = k  # what it attends over: the probes below compare with the oracle on (q, k, k)
    runs = probe.runs
    batch_dims = None
    if not runs("3-D inputs", lambda: fn(q[0], k[0], v[0])) and \
            not runs("5-D inputs", lambda: fn(q[None], k[None], v[None])):
        batch_dims = 1
        notes.append("batch_dims: 3-D and 5-D inputs raise; declared exactly (B, N, L, E), "
                     "the suite reshapes other ranks and masks to 4-D")

    def as_mask(mask: Any) -> Any:  # (L, S) -> (1, 1, L, S) for a 4-D-only callable
        return mask.reshape(1, 1, *mask.shape) if batch_dims == 1 else mask

    def qkv_for(**sizes: Any) -> tuple[Any, Any, Any]:
        if equal_lengths:
            sizes["L"] = sizes.get("S", 3)
        return qkv(**sizes)

    # The order of the calls below fixes what each draw from ``gen`` is: keep it.
    dtypes = tuple(d for d in ALL_DTYPES if runs(f"dtype {d}", lambda d=d: fn(*qkv_for(dtype=getattr(torch, d)))))
    mask_kinds = {"none"}
    bool_mask = torch.tensor([[True, False, True], [True, True, False], [False, True, True]])[:L]
    if runs("a bool mask", lambda: fn(q, k, v, attn_mask=as_mask(bool_mask))):
        mask_kinds.add("bool")
    if runs("a float mask", lambda: fn(q, k, v, attn_mask=as_mask(torch.randn(L, 3, generator=gen)))):
        mask_kinds.add("additive")

    def backward(mask_grad: bool = False) -> bool:
        # Forward and backward are two guarded calls: the suite's own ``.sum()`` runs
        # under the suite's grad mode, whatever the forward did to its thread's.
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        mask = torch.randn(L, 3, generator=gen).requires_grad_() if mask_grad else None
        what = "a mask gradient" if mask_grad else "backward"
        try:
            out = probe.call(what, lambda: fn(qq, kk, vv, attn_mask=None if mask is None else as_mask(mask)))
            if not isinstance(out, torch.Tensor):
                return False
            probe.call(what, lambda: out.sum().backward())
        except CallRaised:
            return False
        return qq.grad is not None and (mask is None or mask.grad is not None)

    causal = _probe_causal(probe, fn, q, k, v, notes, equal_lengths)
    fully_masked = {
        kind: _probe_fully_masked(probe, fn, q, k, v, kind, as_mask)
        for kind in ("bool", "additive") if kind in mask_kinds
    }
    caps = Capabilities(
        devices=("cpu",),
        dtypes=dtypes or ("float32",),
        mask_kinds=frozenset(mask_kinds),
        causal=causal,
        different_v_dim=not shared_kv and runs("Ev != E", lambda: fn(*qkv_for(Ev=3))),
        gqa=runs("GQA", lambda: fn(*qkv_for(N=2, K=1), enable_gqa=True)),
        dropout=runs("dropout", lambda: fn(q, k, v, dropout_p=0.5)),
        custom_scale=runs("scale=", lambda: fn(q, k, v, scale=0.5)),
        autograd=backward(),
        mask_grad="additive" in mask_kinds and backward(mask_grad=True),
        non_contiguous=runs("a transposed input", lambda: fn(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v)),
        self_attention_lengths=equal_lengths,
        shared_kv=shared_kv,
        batch_dims=batch_dims,
        probe_notes=tuple(notes),
    )
    if causal == "lower_right" and not equal_lengths:  # the flag alone empties row 0 at L=3 > S=2
        fully_masked["causal"] = _probe_fully_masked(probe, fn, *qkv(L=3, S=2), "causal", as_mask)
    return caps.replace(fully_masked=_fully_masked_declaration(fully_masked))


def _try(probe: _Prober, what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``'s result, or None when it raises."""
    try:
        return probe.call(what, fn)
    except CallRaised:
        return None


def _probe_shared_kv(out: Any, q, k, v, notes: list[str]) -> bool:
    """Whether the plain call's output is attention over the keys with the keys as
    values (one memory tensor; ``value`` ignored) rather than over the values."""
    q64, k64, v64 = (x.double().numpy() for x in (q, k, v))
    got = out.detach().double().numpy()
    if np.allclose(got, spec.sdpa(q64, k64, v64).output, atol=1e-4):
        return False
    if np.allclose(got, spec.sdpa(q64, k64, k64).output, atol=1e-4):
        notes.append("shared_kv: the output is attention with the keys as values (value is "
                     "ignored); declared key is value, the suite passes one tensor as both")
        return True
    return False


def _fully_masked_declaration(policies: dict[str, str]) -> str | dict[str, str]:
    """One policy when the probed kinds agree (kinds not probed take it), else per kind."""
    if not policies:
        return "unspecified"
    if len(set(policies.values())) == 1:
        return next(iter(policies.values()))
    default = policies.get("bool", "unspecified")
    return {kind: policies.get(kind, default) for kind in ("bool", "additive", "causal")}


def _probe_causal(probe: _Prober, fn, q, k, v, notes: list[str], equal_lengths: bool = False) -> str | None:
    """The alignment ``is_causal=True`` means; None, with a note in ``notes``, when the
    flag raises, has no effect, or matches neither alignment. With L == S only the
    alignments coincide: a flag that matches them is declared ``upper_left``."""
    shape = (1, 2, q.shape[2], 4)
    try:
        got = probe.call("is_causal=True", lambda: fn(q, k, v, is_causal=True))  # L=2, S=3: alignments differ
    except CallRaised:
        return None
    if not _is_output(got, shape):
        notes.append(f"causal: is_causal=True returned {_describe_result(got)}, not the {shape} "
                     "output; declared as no causal flag")
        return None
    got = got.detach().double().numpy()
    q64, k64, v64 = (x.double().numpy() for x in (q, k, v))

    def close_to(alignment: str | None) -> bool:
        return bool(np.allclose(got, spec.sdpa(q64, k64, v64, causal=alignment).output, atol=1e-4))

    upper, lower = close_to("upper_left"), close_to("lower_right")
    if equal_lengths and upper:
        return "upper_left"
    if upper != lower:
        return "upper_left" if upper else "lower_right"
    fix = ("; declared as no causal flag (--impl-option causal=upper_left or lower_right "
           "tests it anyway)")
    if close_to(None):
        notes.append("causal: is_causal=True has no effect (the output equals the non-causal one)" + fix)
    else:
        notes.append("causal: is_causal=True matches neither alignment, upper_left nor lower_right "
                     "(query length 2, key length 3)" + fix)
    return None


def _probe_fully_masked(probe: _Prober, fn, q, k, v, kind: str, as_mask: Callable[[Any], Any]) -> str:
    """The policy for a query row whose every key is blocked by ``kind``: a bool mask,
    a -inf additive mask, or (``causal``: L > S) the lower-right causal flag alone."""
    import torch

    L, S = q.shape[2], k.shape[2]
    attend = torch.ones(L, S, dtype=torch.bool)
    attend[0] = False  # row 0 sees nothing
    if kind == "bool":
        call = lambda: fn(q, k, v, attn_mask=as_mask(attend))
    elif kind == "additive":
        bias = torch.zeros(L, S).masked_fill(~attend, float("-inf"))
        call = lambda: fn(q, k, v, attn_mask=as_mask(bias))
    else:
        call = lambda: fn(q, k, v, is_causal=True)
    try:
        out = probe.call(f"a fully-masked row ({kind})", call)
    except CallRaised:
        return "unspecified"
    if not _is_output(out, (1, 2, L, 4)):
        return "unspecified"
    row = out.detach()[0, :, 0]  # (N, Ev)
    if torch.isnan(row).all():
        return "nan"
    if torch.equal(row, torch.zeros_like(row)):
        return "zero"
    if torch.allclose(row, v.mean(dim=-2)[0], atol=1e-5):
        return "uniform"
    return "unspecified"


# --------------------------------------------------------------------------- MHA

# L == S and query = key = value unless a feature needs otherwise, so that a
# self-attention-only module is probed feature by feature too.
_D, _N, _L, _S, _B = 4, 2, 3, 3, 2


def probe_mha(factory: Callable[..., Any], *, origin: str,
              timeout: float | None = DEFAULT_PROBE_TIMEOUT) -> Capabilities:
    """Capabilities of an nn.MultiheadAttention drop-in, found by tiny calls on CPU
    (each limited to ``timeout`` seconds)."""
    import torch

    probe = _Prober(origin, timeout)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_L, _B, _D, generator=gen)
    kv = torch.randn(_S, _B, _D, generator=gen)

    def first() -> Any:
        module = factory(_D, _N)
        module.eval()
        return module(x, x, x)

    plain = ("building it with (embed_dim=4, num_heads=2) and calling it on query = key = value "
             "of shape (3, 2, 4)")
    try:
        out = probe.call("a plain call", first)
    except CallRaised as exc:
        raise ImplementationError(
            f"{origin} has nn.MultiheadAttention's signature but {plain} raised "
            f"{summarise(exc.error)}; it must at least run that"
        ) from exc.error
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and _is_output(out[0], (_L, _B, _D))):
        shown = (f"a pair whose output is {_describe_result(out[0])}"
                 if isinstance(out, (tuple, list)) and len(out) == 2 else _describe_result(out))
        raise ImplementationError(
            f"{origin} has nn.MultiheadAttention's signature but {plain} returned {shown}; it must "
            "return (output, weights) with output a torch.Tensor of shape (3, 2, 4) (L, B, D), as "
            "torch.nn.MultiheadAttention does"
        )

    def call(build: dict | None = None, *args, **forward) -> Any:
        m = factory(_D, _N, **(build or {}))
        m.eval()
        q_, k_, v_ = args or (x, x, x)
        return m(q_, k_, v_, **forward)

    # The order below (features, dtypes, fully-masked rows, backward) fixes what each
    # module built from torch's global generator is: keep it. (Probe calls restore the
    # global generator afterwards, so each module is built from the same state.)
    mha_features = frozenset(f for f, run in _mha_feature_probes(factory, call, x, kv).items()
                             if probe.runs(f"feature {f}", run))
    dtypes = tuple(
        d for d in ALL_DTYPES
        if probe.runs(f"dtype {d}", lambda d=d: call({"dtype": getattr(torch, d)}, *[x.to(getattr(torch, d))] * 3))
    )
    fully_masked = (_probe_mha_fully_masked(probe, factory, x) if "key_padding_mask" in mha_features
                    else "unspecified")

    def backward() -> bool:
        xx = x.clone().requires_grad_()
        try:
            out = probe.call("backward", lambda: factory(_D, _N)(xx, xx, xx))
            if not (isinstance(out, (tuple, list)) and isinstance(out[0], torch.Tensor)):
                return False
            probe.call("backward", lambda: out[0].sum().backward())
        except CallRaised:
            return False
        return xx.grad is not None

    return Capabilities(
        devices=("cpu",),
        dtypes=dtypes or ("float32",),
        causal="upper_left",
        fully_masked=fully_masked,
        dropout="dropout" in mha_features,
        autograd=backward(),
        mask_grad=False,
        mha_features=mha_features,
    )


def _mha_feature_probes(factory, call, x, kv) -> dict[str, Callable[[], Any]]:
    """MHA feature name -> a call that raises (or returns False) when it is unsupported."""
    import torch

    kpm = torch.tensor([[False, False, True], [False, True, False]])
    causal = torch.ones(_L, _S, dtype=torch.bool).tril().logical_not()
    return {
        "cross_attention": lambda: call(None, x, kv, kv),
        "no_bias": lambda: call({"bias": False}),
        "kdim_vdim": lambda: call({"kdim": 3, "vdim": 5}, x, torch.randn(_S, _B, 3), torch.randn(_S, _B, 5)),
        "bias_kv": lambda: call({"add_bias_kv": True}),
        "zero_attn": lambda: call({"add_zero_attn": True}),
        "batch_first": lambda: call({"batch_first": True}, *[x.transpose(0, 1)] * 3),
        "unbatched": lambda: call(None, *[x[:, 0]] * 3),
        "key_padding_mask": lambda: (call(None, key_padding_mask=kpm),
                                     call(None, key_padding_mask=torch.zeros(_B, _S).masked_fill(kpm, float("-inf")))),
        "attn_mask": lambda: (call(None, attn_mask=causal), call(None, attn_mask=torch.randn(_L, _S))),
        "is_causal": lambda: call(None, attn_mask=causal, is_causal=True),
        "need_weights": lambda: call(None, need_weights=True)[1] is not None,
        "per_head_weights": lambda: call(None, need_weights=True, average_attn_weights=False)[1].dim() == 4,
        "dropout": lambda: factory(_D, _N, dropout=0.5).train()(x, x, x),
    }


def _probe_mha_fully_masked(probe: _Prober, factory, x) -> str:
    """``nan``, ``zero`` (module output = out_proj.bias) or ``unspecified``."""
    import torch

    blocked = torch.tensor([[True, True, True], [False, False, False]])

    def run() -> tuple[Any, Any]:
        m = factory(_D, _N)
        m.eval()
        out = m(x, x, x, key_padding_mask=blocked, need_weights=False)[0]
        return out, getattr(getattr(m, "out_proj", None), "bias", None)

    try:
        out, bias = probe.call("a fully-masked row", run)
    except CallRaised:
        return "unspecified"
    if not _is_output(out, (_L, _B, _D)):
        return "unspecified"
    out = out.detach()[:, 0]  # (L, D), batch 0
    if torch.isnan(out).all():
        return "nan"
    if isinstance(bias, torch.Tensor) and torch.allclose(out, bias.detach().expand_as(out)):
        return "zero"  # attention output 0, so the module output is out_proj.bias
    return "unspecified"
