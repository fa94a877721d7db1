"""Probing: what a bare SDPA function or nn.MultiheadAttention drop-in supports.

Each optional feature is tried on a tiny CPU input and recorded as unsupported when
the call raises. The causal alignment is read off the float64 oracle ``spec.sdpa``,
so probing depends on nothing but ``spec`` (and torch, to make the calls).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

import spec
from implementations.base import ALL_DTYPES, Capabilities, ImplementationError
from implementations.registry._errors import summarise

__all__ = ["probe_mha", "probe_sdpa"]


def _runs(call: Callable[[], Any]) -> bool:
    """Whether ``call()`` returns without raising (and does not return False)."""
    try:
        return call() is not False
    except Exception:
        return False


# --------------------------------------------------------------------------- SDPA


def probe_sdpa(fn: Callable[..., Any], *, origin: str) -> Capabilities:
    """Capabilities of an SDPA-signature function, found by tiny calls on CPU."""
    import torch

    gen = torch.Generator().manual_seed(0)

    def qkv(N=2, K=2, L=2, S=3, E=4, Ev=4, dtype=torch.float32):
        return (torch.randn(1, N, L, E, generator=gen).to(dtype), torch.randn(1, K, S, E, generator=gen).to(dtype),
                torch.randn(1, K, S, Ev, generator=gen).to(dtype))

    q, k, v = qkv()
    try:
        fn(q, k, v)
    except Exception as exc:
        raise ImplementationError(
            f"{origin} has SDPA's signature but a plain float32 call with query (1, 2, 2, 4), key "
            f"(1, 2, 3, 4), value (1, 2, 3, 4) raised {summarise(exc)}; it must at least run that"
        ) from exc
    # The order of the calls below fixes what each draw from ``gen`` is: keep it.
    dtypes = tuple(d for d in ALL_DTYPES if _runs(lambda d=d: fn(*qkv(dtype=getattr(torch, d)))))
    mask_kinds = {"none"}
    if _runs(lambda: fn(q, k, v, attn_mask=torch.tensor([[True, False, True], [True, True, False]]))):
        mask_kinds.add("bool")
    if _runs(lambda: fn(q, k, v, attn_mask=torch.randn(2, 3, generator=gen))):
        mask_kinds.add("additive")

    def backward(mask_grad: bool = False) -> bool:
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        mask = torch.randn(2, 3, generator=gen).requires_grad_() if mask_grad else None
        fn(qq, kk, vv, attn_mask=mask).sum().backward()
        return qq.grad is not None and (mask is None or mask.grad is not None)

    return Capabilities(
        devices=("cpu",),
        dtypes=dtypes or ("float32",),
        mask_kinds=frozenset(mask_kinds),
        causal=_probe_causal(fn, q, k, v),
        fully_masked=_probe_fully_masked(fn, q, k, v) if "bool" in mask_kinds else "unspecified",
        different_v_dim=_runs(lambda: fn(*qkv(Ev=3))),
        gqa=_runs(lambda: fn(*qkv(N=2, K=1), enable_gqa=True)),
        dropout=_runs(lambda: fn(q, k, v, dropout_p=0.5)),
        custom_scale=_runs(lambda: fn(q, k, v, scale=0.5)),
        autograd=_runs(backward),
        mask_grad="additive" in mask_kinds and _runs(lambda: backward(mask_grad=True)),
        non_contiguous=_runs(lambda: fn(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v)),
    )


def _probe_causal(fn, q, k, v) -> str | None:
    """The alignment ``is_causal=True`` means, None when the flag raises."""
    try:
        got = fn(q, k, v, is_causal=True)  # L=2, S=3: the two alignments differ
    except Exception:
        return None
    got = got.detach().double().numpy()
    q64, k64, v64 = (x.double().numpy() for x in (q, k, v))

    def close_to(alignment: str) -> bool:
        return np.allclose(got, spec.sdpa(q64, k64, v64, causal=alignment).output, atol=1e-4)

    return "lower_right" if close_to("lower_right") and not close_to("upper_left") else "upper_left"


def _probe_fully_masked(fn, q, k, v) -> str:
    """The policy for a query row whose every key is blocked."""
    import torch

    mask = torch.tensor([[False, False, False], [True, True, False]])  # row 0 sees nothing
    try:
        row = fn(q, k, v, attn_mask=mask)[0, :, 0]  # (N, Ev)
    except Exception:
        return "unspecified"
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


def probe_mha(factory: Callable[..., Any], *, origin: str) -> Capabilities:
    """Capabilities of an nn.MultiheadAttention drop-in, found by tiny calls on CPU."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_L, _B, _D, generator=gen)
    kv = torch.randn(_S, _B, _D, generator=gen)
    try:
        module = factory(_D, _N)
        module.eval()
        module(x, x, x)
    except Exception as exc:
        raise ImplementationError(
            f"{origin} has nn.MultiheadAttention's signature but building it with (embed_dim=4, "
            f"num_heads=2) and calling it on query = key = value of shape (3, 2, 4) raised "
            f"{summarise(exc)}; it must at least run that"
        ) from exc

    def call(build: dict | None = None, *args, **forward) -> Any:
        m = factory(_D, _N, **(build or {}))
        m.eval()
        q_, k_, v_ = args or (x, x, x)
        return m(q_, k_, v_, **forward)

    # The order below (features, dtypes, fully-masked rows, backward) fixes what each
    # module built from torch's global generator is: keep it.
    mha_features = frozenset(f for f, probe in _mha_feature_probes(factory, call, x, kv).items() if _runs(probe))
    dtypes = tuple(
        d for d in ALL_DTYPES
        if _runs(lambda d=d: call({"dtype": getattr(torch, d)}, *[x.to(getattr(torch, d))] * 3))
    )
    fully_masked = _probe_mha_fully_masked(factory, x) if "key_padding_mask" in mha_features else "unspecified"

    def backward() -> bool:
        m = factory(_D, _N)
        xx = x.clone().requires_grad_()
        m(xx, xx, xx)[0].sum().backward()
        return xx.grad is not None

    return Capabilities(
        devices=("cpu",),
        dtypes=dtypes or ("float32",),
        causal="upper_left",
        fully_masked=fully_masked,
        dropout="dropout" in mha_features,
        autograd=_runs(backward),
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
        "bias": lambda: call({"bias": False}),
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
        "average_weights": lambda: call(None, need_weights=True, average_attn_weights=False)[1].dim() == 4,
        "dropout": lambda: factory(_D, _N, dropout=0.5).train()(x, x, x),
    }


def _probe_mha_fully_masked(factory, x) -> str:
    """``nan``, ``zero`` (module output = out_proj.bias) or ``unspecified``."""
    import torch

    blocked = torch.tensor([[True, True, True], [False, False, False]])
    m = factory(_D, _N)
    m.eval()
    out = m(x, x, x, key_padding_mask=blocked, need_weights=False)[0][:, 0]  # (L, D), batch 0
    bias = getattr(getattr(m, "out_proj", None), "bias", None)
    if torch.isnan(out).all():
        return "nan"
    if bias is not None and torch.allclose(out, bias.detach().expand_as(out)):
        return "zero"  # attention output 0, so the module output is out_proj.bias
    return "unspecified"
