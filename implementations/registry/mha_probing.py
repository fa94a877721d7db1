"""Probing an nn.MultiheadAttention drop-in: which of the module's options and forward
arguments it supports, in which dtypes, and the value of a fully-masked row.

As at the SDPA level (``implementations.registry.probing``), probes find capabilities,
never semantics: the meaning of each argument is nn.MultiheadAttention's contract.
"""

from __future__ import annotations

from typing import Any, Callable

from implementations.base import ALL_MASK_KINDS, Capabilities, ImplementationError
from implementations.guard import CallRaised
from implementations.registry._errors import summarise
from implementations.registry.probe_plan import NOT_DECLARED
from implementations.registry.prober import (
    DEFAULT_PROBE_TIMEOUT,
    _describe_result,
    _dtypes_that_run,
    _fully_masked_declaration,
    _is_output,
    _per_dtype_capabilities,
    _Prober,
)

__all__ = ["probe_mha"]

# L == S and query = key = value unless a feature needs otherwise, so that a
# self-attention-only module is probed feature by feature too.
_D, _N, _L, _S, _B = 4, 2, 3, 3, 2
#: The key length of the cross-attention probes: not L, so that a module that takes S = L
#: only is not taken for one that attends over keys of another length (its key and value
#: apart for ``cross_attention``, one tensor for ``kv_cross_attention``).
_S_CROSS = 4


def probe_mha(factory: Callable[..., Any], *, origin: str,
              timeout: float | None = DEFAULT_PROBE_TIMEOUT) -> Capabilities:
    """Capabilities of an nn.MultiheadAttention drop-in, found by tiny calls on CPU
    (each limited to ``timeout`` seconds)."""
    import torch

    probe = _Prober(origin, timeout, "mha")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_L, _B, _D, generator=gen)
    kv = (torch.randn(_S_CROSS, _B, _D, generator=gen), torch.randn(_S_CROSS, _B, _D, generator=gen))

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
    # A field a declaration gives is not probed (probe_plan.unprobed_value): its value is read.
    declared = {name: probe.given(name) for name in ("mha_features", "mask_kinds", "fully_masked", "dropout")}
    mha_features = set() if declared["mha_features"] is NOT_DECLARED else set(declared["mha_features"])
    notes: list[str] = []
    feature_probes = _mha_feature_probes(factory, call, x, kv) if declared["mha_features"] is NOT_DECLARED else {}
    for feature, run in feature_probes.items():
        said = probe.tried(f"feature {feature}", run)
        if said:
            notes.append(f"mha_features: {feature} in float32 {said}; declared unsupported")
        else:
            mha_features.add(feature)
    # Masks are features when their bool form runs; their float form is the mask kind
    # "additive", probed apart (a module with bool masks only is certified with bool masks).
    mask_kinds = set(ALL_MASK_KINDS) if declared["mask_kinds"] is NOT_DECLARED else set(declared["mask_kinds"])
    for feature, run in (_mha_float_mask_probes(call, x) if declared["mask_kinds"] is NOT_DECLARED else {}).items():
        said = probe.tried(f"a float {feature}", run) if feature in mha_features else None
        if said:
            notes.append(f"mask_kinds: a float {feature} in float32 {said}; float masks declared unsupported "
                         "(MHA masks are drawn bool only)")
            mask_kinds.discard("additive")

    def built(d: str) -> Any:
        return call({"dtype": getattr(torch, d)}, *[x.to(getattr(torch, d))] * 3)

    dtypes = _dtypes_that_run(probe, built, notes)
    if declared["fully_masked"] is not NOT_DECLARED:
        fully_masked, source = declared["fully_masked"], "declared"
    elif "key_padding_mask" in mha_features:
        fully_masked, source, masked_by_dtype = _fully_masked_per_dtype(probe, factory, x, mask_kinds, dtypes,
                                                                        notes)
    else:
        fully_masked, source = "zero", "contract"

    def backward(d: str) -> str | None:
        xx = x.to(getattr(torch, d)).clone().requires_grad_()
        try:
            out = probe.call("backward", lambda: factory(_D, _N, dtype=getattr(torch, d))(xx, xx, xx))
            if not (isinstance(out, (tuple, list)) and isinstance(out[0], torch.Tensor)):
                return f"returned {_describe_result(out)}"
            probe.call("backward", lambda: out[0].sum().backward())
        except CallRaised as exc:
            return f"raised {summarise(exc.error)}"
        return None if xx.grad is not None else "left the input without a gradient"

    found, by_dtype = _per_dtype_capabilities(
        probe, lambda d: {"autograd": ("backward through query, key, value", lambda: backward(d), "direct")},
        dtypes, notes)
    if declared["fully_masked"] is NOT_DECLARED and "key_padding_mask" in mha_features:
        for d, policy in masked_by_dtype.items():
            by_dtype.setdefault(d, {})["fully_masked"] = policy
    return Capabilities(
        devices=("cpu",),
        dtypes=dtypes or ("float32",),
        causal="upper_left",
        fully_masked=fully_masked,
        mask_kinds=frozenset(mask_kinds),
        dropout="dropout" in mha_features if declared["dropout"] is NOT_DECLARED else declared["dropout"],
        autograd=found["autograd"],
        mask_grad=False,
        mha_features=frozenset(mha_features),
        by_dtype=by_dtype,
        probe_notes=tuple(notes),
        sources={"causal": "contract", "fully_masked": source},
    )


def _mha_feature_probes(factory, call, x, kv) -> dict[str, Callable[[], Any]]:
    """MHA feature name -> a call that raises (or returns False) when it is unsupported.
    ``kv``: a key and a value of length ``_S_CROSS`` != L, two tensors."""
    import torch

    key, value = kv

    kpm = torch.tensor([[False, False, True], [False, True, False]])
    causal = torch.ones(_L, _S, dtype=torch.bool).tril().logical_not()
    return {
        "cross_attention": lambda: call(None, x, key, value),
        "kv_cross_attention": lambda: call(None, x, key, key),
        "no_bias": lambda: call({"bias": False}),
        "kdim_vdim": lambda: call({"kdim": 3, "vdim": 5}, x, torch.randn(_S_CROSS, _B, 3),
                                  torch.randn(_S_CROSS, _B, 5)),
        "bias_kv": lambda: call({"add_bias_kv": True}),
        "zero_attn": lambda: call({"add_zero_attn": True}),
        "batch_first": lambda: call({"batch_first": True}, *[x.transpose(0, 1)] * 3),
        "unbatched": lambda: call(None, *[x[:, 0]] * 3),
        "key_padding_mask": lambda: call(None, key_padding_mask=kpm),
        "attn_mask": lambda: call(None, attn_mask=causal),
        "per_head_attn_mask": lambda: call(None, attn_mask=causal.expand(_B * _N, _L, _S)),
        "is_causal": lambda: call(None, attn_mask=causal, is_causal=True),
        "need_weights": lambda: call(None, need_weights=True)[1] is not None,
        "per_head_weights": lambda: call(None, need_weights=True, average_attn_weights=False)[1].dim() == 4,
        "dropout": lambda: factory(_D, _N, dropout=0.5).train()(x, x, x),
    }


def _mha_float_mask_probes(call, x) -> dict[str, Callable[[], Any]]:
    """MHA mask feature -> a call with its float form (0/-inf key padding, a float attn_mask)."""
    import torch

    kpm = torch.tensor([[False, False, True], [False, True, False]])
    return {
        "key_padding_mask": lambda: call(None, key_padding_mask=torch.zeros(_B, _S).masked_fill(kpm, float("-inf"))),
        "attn_mask": lambda: call(None, attn_mask=torch.randn(_L, _S)),
    }


_MASKED_BLOCKED_BY = {"bool": "a bool key_padding_mask", "additive": "a -inf float key_padding_mask"}


def _fully_masked_per_dtype(probe: _Prober, factory, x, kinds, dtypes, notes: list[str]
                            ) -> tuple[Any, str, dict[str, Any]]:
    """``(policy, source, {dtype: policy where it differs})``: the fully-masked rows probed in
    every dtype that runs (a fill that is finite in one dtype and -inf in another makes the
    rows uniform in one and NaN in the other), float32's (else the first dtype's) as the
    policy, each other dtype's by :func:`_fully_masked_declaration` where it differs. Where
    the dtypes disagree, each note's hint is a per-dtype declaration (``float16.fully_masked=``):
    a global one would break the other dtypes."""
    order = sorted(dtypes or ("float32",), key=lambda d: d != "float32")  # float32 first, then as run
    observed = {d: _probe_mha_fully_masked(probe, factory, x, kinds=kinds, dtype=d) for d in order}
    main = order[0]
    differ = any(seen != observed[main] for seen in observed.values())
    policy, source = _fully_masked_declaration(observed[main], notes, level="MHA", blocked_by=_MASKED_BLOCKED_BY,
                                               dtype=main if differ else None)
    others: dict[str, Any] = {}
    for d in order[1:]:
        if observed[d] == observed[main]:
            continue
        d_policy, _ = _fully_masked_declaration(observed[d], notes, level="MHA", blocked_by=_MASKED_BLOCKED_BY,
                                                dtype=d)
        if d_policy != policy:
            others[d] = d_policy
    return policy, source, others


def _probe_mha_fully_masked(probe: _Prober, factory, x, kinds=ALL_MASK_KINDS, dtype: str = "float32"
                            ) -> dict[str, str]:
    """Kind -> policy of a query row whose keys a key_padding_mask blocks all of, bool
    (``bool``) and -inf float (``additive``), in ``dtype``: ``nan``, ``zero`` (module output
    = out_proj.bias), ``uniform`` (out_proj of the mean value projection, read through
    nn.MultiheadAttention's parameter names) or ``unspecified`` (anything else, or the call
    raised). Compared within the dtype's rounding (1e-5 in float32 and float64, 2e-2 in the
    16-bit dtypes, relative to the row's size)."""
    import torch

    t = getattr(torch, dtype)
    xd = x.to(t)
    blocked = torch.tensor([[True, True, True], [False, False, False]])
    masks = {"bool": blocked, "additive": torch.zeros(2, 3, dtype=t).masked_fill(blocked, float("-inf"))}
    tol = 1e-5 if dtype in ("float32", "float64") else 2e-2

    def close(out: Any, want: Any) -> bool:
        want = want.expand_as(out)
        return bool(((out - want).abs() <= tol * (1 + want.abs())).all())

    def policy(mask: Any) -> str:
        def run() -> tuple[Any, Any]:
            m = factory(_D, _N, dtype=t) if dtype != "float32" else factory(_D, _N)
            m.eval()
            out = m(xd, xd, xd, key_padding_mask=mask, need_weights=False)[0]
            return out, m

        try:
            out, module = probe.call("a fully-masked row", run)
        except CallRaised:
            return "unspecified"
        if not _is_output(out, (_L, _B, _D)):
            return "unspecified"
        out = out.detach()[:, 0].double()  # (L, D), batch 0
        if torch.isnan(out).all():
            return "nan"
        try:  # the module's own parameter names; a module that cannot show them is not classified
            bias = getattr(getattr(module, "out_proj", None), "bias", None)
        except Exception:  # noqa: BLE001 - the implementation's code, whatever it raises
            bias = None
        if isinstance(bias, torch.Tensor) and close(out, bias.detach().double()):
            return "zero"  # attention output 0, so the module output is out_proj.bias
        uniform = _mha_uniform_row(module, xd[:, 0])
        if uniform is not None and close(out, uniform):
            return "uniform"
        return "unspecified"

    return {kind: policy(mask) for kind, mask in masks.items() if kind in kinds}


def _mha_uniform_row(module: Any, keys: Any) -> Any:
    """out_proj(mean over keys of the value projection), the output of a row attending
    every key equally, in float64 from nn.MultiheadAttention's parameter names; None
    without them."""
    import torch

    try:
        with torch.no_grad():
            weight, bias = module.in_proj_weight, module.in_proj_bias
            if not isinstance(weight, torch.Tensor):
                return None
            w_v = weight[2 * _D:].double()
            b_v = bias[2 * _D:].double() if isinstance(bias, torch.Tensor) else 0.0
            mean_v = (keys.double() @ w_v.T + b_v).mean(dim=0)
            out_bias = module.out_proj.bias.double() if module.out_proj.bias is not None else 0.0
            return mean_v @ module.out_proj.weight.double().T + out_bias
    except Exception:  # noqa: BLE001 - the implementation's code, whatever it raises
        return None
