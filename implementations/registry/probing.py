"""Probing: what a bare SDPA function or nn.MultiheadAttention drop-in supports.

Probes find *capabilities*, never semantics. What an argument or a result means is the
contract of the signature the callable was recognised by (scaled_dot_product_attention's:
``is_causal`` upper-left, bool mask True = attend, ``value`` used; nn.MultiheadAttention's),
so a bug stays inside the claims and the suite's properties fail on it. Each optional
feature is tried on a tiny CPU input and declared unsupported when the call raises, with a
note of what was tried, in which dtype, and what it raised; autograd, the mask kinds, GQA
and Ev != E are tried in every dtype a plain call runs in (``Capabilities.by_dtype``). A
flag that runs but behaves otherwise than the contract (``is_causal`` without effect, the
other alignment, ``value`` ignored) keeps the contract's declaration and gets a note of
what the probe saw and the ``--impl-option`` that would declare it if intended, read off
the float64 oracle ``spec.sdpa``. Only the value of a fully-masked row, which the contract
leaves open, may be probed (:func:`_fully_masked_declaration`: adopted when consistent).
``Capabilities.sources`` says which values are the contract's and which probed.

Every call goes through :func:`implementations.guard.guarded_call` (timeout, every
exception captured, global state and random generators restored), so a probe cannot
hang the run, end it with an exception the registry does not expect, or change the
NumPy or torch settings the suite computes under. A probe that does not return in
time is an :class:`~implementations.base.ImplementationError` naming it; an
implementation that cannot be probed declares its capabilities itself (an
``Implementation``).

Here the SDPA level's probes (:func:`probe_sdpa`); the MHA level's are in
``implementations.registry.mha_probing`` (:func:`probe_mha`, re-exported here); the probe
calls both make, and the fully-masked declaration, in ``implementations.registry.prober``.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

import spec
from implementations.base import Capabilities, ImplementationError
from implementations.guard import CallRaised
from implementations.registry._errors import summarise
from implementations.registry.mha_probing import probe_mha
from implementations.registry.probe_plan import NOT_DECLARED, current_declarations, first_call_hint, probe_plan
from implementations.registry.prober import (
    BUILD_TIMEOUT,
    DEFAULT_PROBE_TIMEOUT,
    _describe_result,
    _dtypes_that_run,
    _fully_masked_declaration,
    _is_output,
    _per_dtype_capabilities,
    _Prober,
    _supports,
    _try,
    build_limit,
)

__all__ = ["BUILD_TIMEOUT", "DEFAULT_PROBE_TIMEOUT", "build_limit", "probe_mha", "probe_sdpa"]


# --------------------------------------------------------------------------- SDPA

#: The contract of scaled_dot_product_attention's signature, as the notes name it.
_SDPA_CONTRACT = "scaled_dot_product_attention's"


def _gqa_call(fn: Callable[..., Any], qkv: tuple[Any, Any, Any]) -> Any:
    """The GQA probe's call. A function that takes K < N heads only as they are (a bridged
    one without an ``enable_gqa`` parameter: ``fn.gqa_by_behaviour``) is read from what it
    computes: its output must be its own output with the key/value heads repeated, as
    repeat_interleave or as tile (a tiled grouping is then a failure of gqa_equivalence,
    not absorbed); anything else is no GQA (a kernel that indexes kv heads by the query
    head reads past them), raised as NotImplementedError so the probe declares it off."""
    import torch

    q, k, v = qkv
    out = fn(q, k, v, enable_gqa=True)
    if not getattr(fn, "gqa_by_behaviour", False) or not isinstance(out, torch.Tensor):
        return out
    group = q.shape[-3] // k.shape[-3]
    tol = 1e-5 if q.dtype in (torch.float32, torch.float64) else 2e-2
    for repeated in ((k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)),
                     (k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1))):
        same = fn(q, *repeated)
        if isinstance(same, torch.Tensor) and same.shape == out.shape and torch.allclose(
                out.double(), same.double(), rtol=tol, atol=tol, equal_nan=True):
            return out
    raise NotImplementedError("K < N key/value heads ran but did not compute grouped-query attention (the output "
                              "is neither the function's own with the heads repeated as repeat_interleave nor as "
                              "tile); it takes no enable_gqa parameter, so GQA is declared off")


def probe_sdpa(fn: Callable[..., Any], *, origin: str,
               timeout: float | None = DEFAULT_PROBE_TIMEOUT) -> Capabilities:
    """Capabilities of an SDPA-signature function, found by tiny calls on CPU
    (each limited to ``timeout`` seconds). Semantics are the signature's contract
    (``is_causal`` upper-left, ``value`` used); probes find what it accepts, per dtype."""
    import torch

    probe = _Prober(origin, timeout, "sdpa")
    gen = torch.Generator().manual_seed(0)
    # Declarations first: every call is built inside the declarations in force (.probe_plan).
    plan = probe_plan(level="sdpa")
    L0, S0, E0 = plan.L, plan.S, plan.E
    t0 = getattr(torch, plan.dtype)
    tol = _TOLERANCE.get(plan.dtype, 1e-4)
    user_fn = fn
    if plan.causal_only:  # every call of a causal-only kernel passes the flag (and no mask)
        def fn(query, key, value, **kw):  # noqa: F811
            return user_fn(query, key, value, **{**kw, "is_causal": True})

    def qkv(N=2, K=2, L=L0, S=S0, E=E0, Ev=E0, dtype=t0):
        return (torch.randn(1, N, L, E, generator=gen).to(dtype), torch.randn(1, K, S, E, generator=gen).to(dtype),
                torch.randn(1, K, S, Ev, generator=gen).to(dtype))

    q, k, v = qkv()
    plain = (f"the first call, {plan.describe()} (query (1, 2, {L0}, {E0}), key (1, 2, {S0}, {E0}), "
             f"value (1, 2, {S0}, {E0}))")
    notes: list[str] = []
    equal_lengths = False
    try:
        out = probe.call("a plain call", lambda: fn(q, k, v))
    except CallRaised as exc:
        # Self-attention kernels take L == S only: that is a declaration, not a failure.
        q3 = torch.randn(1, 2, S0, E0, generator=gen).to(t0)
        if not _is_output(_try(probe, "a call with L == S", lambda: fn(q3, k, v)), (1, 2, S0, E0)):
            hint = first_call_hint(lambda p: _sdpa_attempt_runs(probe, user_fn, p), level="sdpa")
            raise ImplementationError(
                f"{origin} has SDPA's signature but {plain} raised {summarise(exc.error)} (and so did "
                f"L == S = {S0}){hint}"
            ) from exc.error
        equal_lengths, q = True, q3
        notes.append(f"self_attention_lengths: query length {L0} with key length {S0} raised "
                     f"{summarise(exc.error)}, query length {S0} runs; declared L == S only")
        out = probe.call("a plain call", lambda: fn(q, k, v))
    L = q.shape[2]
    if not _is_output(out, (1, 2, L, E0)):
        raise ImplementationError(
            f"{origin} has SDPA's signature but {plain} returned {_describe_result(out)}; it must "
            f"return a torch.Tensor of shape (1, 2, {L}, {E0}) (B, N, L, Ev) on the inputs' device, "
            "as torch.nn.functional.scaled_dot_product_attention does"
        )
    # What it attends over, for the notes below: the values, or the keys where it ignores value.
    seen_v = k if _value_ignored(out, q, k, v, notes, tol, "upper_left" if plan.causal_only else None) else v
    runs = probe.runs
    batch_dims = probe.given("batch_dims")  # a declared field is not probed (probe_plan.unprobed_value)
    if batch_dims is NOT_DECLARED:
        batch_dims = None
        probed_batch_dims = not runs("3-D inputs", lambda: fn(q[0], k[0], v[0])) and \
            not runs("5-D inputs", lambda: fn(q[None], k[None], v[None]))
    else:
        probed_batch_dims = False
    if probed_batch_dims:
        batch_dims = 1
        notes.append("batch_dims: 3-D and 5-D inputs raise; declared exactly (B, N, L, E), "
                     "the suite reshapes other ranks and masks to 4-D")

    def as_mask(mask: Any) -> Any:  # (L, S) -> (1, 1, L, S) for a 4-D-only callable
        return mask.reshape(1, 1, *mask.shape) if batch_dims == 1 else mask

    def qkv_for(**sizes: Any) -> tuple[Any, Any, Any]:
        if equal_lengths:
            sizes["L"] = sizes.get("S", S0)
        return qkv(**sizes)

    # The order of the calls below fixes what each draw from ``gen`` is: keep it.
    dtypes = _dtypes_that_run(probe, lambda d: fn(*qkv_for(dtype=getattr(torch, d))), notes, plan.dtypes)
    # Key j blocked in row i where j = i + 1 (mod 3): every row keeps a key.
    rows, cols = torch.arange(L)[:, None], torch.arange(S0)[None, :]
    bool_mask = cols % 3 != (rows + 1) % 3
    float_mask = torch.randn(L, S0, generator=gen)

    def backward(qq, kk, vv, mask: Any = None) -> str | None:
        """None when backward gives query (and ``mask``) a gradient, else what happened."""
        # Forward and backward are two guarded calls: the suite's own ``.sum()`` runs
        # under the suite's grad mode, whatever the forward did to its thread's.
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (qq, kk, vv))
        mask = None if mask is None else mask.detach().clone().requires_grad_()
        what = "backward" if mask is None else "a mask gradient"
        try:
            got = probe.call(what, lambda: fn(qq, kk, vv, attn_mask=None if mask is None else as_mask(mask)))
            if not isinstance(got, torch.Tensor):
                return f"returned {_describe_result(got)}"
            probe.call(what, lambda: got.sum().backward())
        except CallRaised as exc:
            return f"raised {summarise(exc.error)}"
        if qq.grad is None:
            return "left query without a gradient"
        return "left the mask without a gradient" if mask is not None and mask.grad is None else None

    # A declared limit of the backward alone (backward_seq_multiple): gradients are probed
    # at lengths it takes, not at the forward's.
    grad_len = current_declarations("sdpa").get("backward_seq_multiple")

    def capability_probes(dtype: str) -> dict[str, tuple[str, Callable[[], Any]]]:
        """Capability -> (what is tried, the call) of the probes that may differ per dtype."""
        t = getattr(torch, dtype)
        qd, kd, vd = (x.to(t) for x in (q, k, v))
        probes = {
            "mask_kinds:bool": ("a bool mask", lambda: fn(qd, kd, vd, attn_mask=as_mask(bool_mask))),
            "mask_kinds:additive": ("a float mask", lambda: fn(qd, kd, vd, attn_mask=as_mask(float_mask.to(t)))),
            # K = 2: a call that only broadcasts one key/value head over the query heads
            # raises here, where K = 1 would pass it as GQA
            "gqa": ("GQA (N=4, K=2, enable_gqa=True)", lambda: _gqa_call(fn, qkv_for(N=4, K=2, dtype=t))),
            "different_v_dim": (f"Ev={plan.Ev_other} != E={E0}", lambda: fn(*qkv_for(Ev=plan.Ev_other, dtype=t))),
            # backward makes its own guarded calls: it returns None or what happened.
            "autograd": ("backward through query, key, value" + (f" (L = S = {grad_len})" if grad_len else ""),
                         lambda: backward(*(qkv_for(L=grad_len, S=grad_len, dtype=t) if grad_len else (qd, kd, vd))),
                         "direct"),
        }
        if plan.causal_only:  # the suite folds a causal constraint into a mask: no mask is passed
            probes = {key: value for key, value in probes.items() if not key.startswith("mask_kinds")}
        if plan.Ev_other is None:
            del probes["different_v_dim"]
        return probes

    found, by_dtype = _per_dtype_capabilities(probe, capability_probes, dtypes, notes, plan.dtype)
    if plan.causal_only:
        found.update({"mask_kinds:bool": False, "mask_kinds:additive": False})
        notes.append("mask_kinds: causal_only declares causal calls only, and the suite folds a causal "
                     "constraint with a mask into the mask: masks are not tried; declared none")
    if plan.Ev_other is None:
        found["different_v_dim"] = False
        notes.append(f"different_v_dim: the declarations leave one head dim (E={E0}); Ev != E not tried")
    mask_kinds = {"none"} | {kind for kind in ("bool", "additive") if found[f"mask_kinds:{kind}"]}
    for values in by_dtype.values():
        kinds = {"none"} | {kind for kind in ("bool", "additive")
                            if values.pop(f"mask_kinds:{kind}", found[f"mask_kinds:{kind}"])}
        if kinds != mask_kinds:
            values["mask_kinds"] = frozenset(kinds)
    mask_grad = probe.given("mask_grad")
    if mask_grad is not NOT_DECLARED:
        mask_grad = bool(mask_grad)
    elif "additive" not in mask_kinds or not found["autograd"]:
        mask_grad = False
    else:
        if grad_len:
            qg, kg, vg = qkv_for(L=grad_len, S=grad_len)
            said = backward(qg, kg, vg, mask=torch.randn(qg.shape[-2], grad_len, generator=gen))
        else:
            said = backward(q, k, v, mask=torch.randn(L, S0, generator=gen))
        mask_grad = said is None
        if said:
            notes.append(f"mask_grad: a gradient w.r.t. a float mask in {plan.dtype} {said}; declared unsupported")
    causal = probe.given("causal")
    if causal is NOT_DECLARED:
        causal, causal_seen = _probe_causal(probe, fn, q, k, seen_v, notes, equal_lengths, tol)
    else:
        causal_seen = causal or "raised"
    declared_policy = probe.given("fully_masked")
    observed = {
        kind: _probe_fully_masked(probe, fn, q, k, seen_v, kind, as_mask, tol)
        for kind in ("bool", "additive") if kind in mask_kinds and declared_policy is NOT_DECLARED
    }
    caps = Capabilities(
        devices=("cpu",),
        dtypes=dtypes or (plan.dtype,),
        mask_kinds=frozenset(mask_kinds),
        causal=causal,
        different_v_dim=found["different_v_dim"],
        gqa=found["gqa"],
        dropout=_supports(probe, "dropout", "dropout_p=0.5", lambda: fn(q, k, v, dropout_p=0.5), notes,
                          plan.dtype),
        custom_scale=_supports(probe, "custom_scale", "scale=0.5", lambda: fn(q, k, v, scale=0.5), notes,
                               plan.dtype),
        autograd=found["autograd"],
        mask_grad=mask_grad,
        non_contiguous=_supports(probe, "non_contiguous", "a transposed query",
                                 lambda: fn(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v), notes,
                                 plan.dtype),
        self_attention_lengths=equal_lengths,
        shared_kv=False,
        batch_dims=batch_dims,
        by_dtype=by_dtype,
    )
    if causal_seen == "lower_right" and not equal_lengths and declared_policy is NOT_DECLARED:
        # the flag alone empties row 0 at L=3 > S=2
        q3, k2, v2 = qkv(L=3, S=2) if (L0, S0) == (2, 3) else qkv(L=2 * L0, S=L0)
        observed["causal"] = _probe_fully_masked(probe, fn, q3, k2, k2 if seen_v is k else v2, "causal", as_mask,
                                                 tol)
    fully_masked, source = ((declared_policy, "declared") if declared_policy is not NOT_DECLARED
                            else _fully_masked_declaration(observed, notes))
    return caps.replace(fully_masked=fully_masked, probe_notes=tuple(notes),
                        sources={"causal": "contract" if causal else "probed", "shared_kv": "contract",
                                 "fully_masked": source})


#: Absolute tolerance of the probes' comparisons with the float64 oracle, per probe dtype.
_TOLERANCE = {"float16": 2e-2, "bfloat16": 1e-1}


def _sdpa_attempt_runs(probe: _Prober, fn: Callable[..., Any], plan: Any) -> bool:
    """Whether a plain call built by ``plan`` returns the (B, N, L, Ev) output."""
    import torch

    gen = torch.Generator().manual_seed(1)
    t = getattr(torch, plan.dtype)
    q = torch.randn(1, 2, plan.L, plan.E, generator=gen).to(t)
    k, v = (torch.randn(1, 2, plan.S, plan.E, generator=gen).to(t) for _ in range(2))
    kwargs = {"is_causal": True} if plan.causal_only else {}
    try:
        out = probe.call("a call built inside a declaration", lambda: fn(q, k, v, **kwargs))
    except CallRaised:
        return False
    return _is_output(out, (1, 2, plan.L, plan.E))


def _value_ignored(out: Any, q, k, v, notes: list[str], tol: float = 1e-4, causal: str | None = None) -> bool:
    """Whether the plain call's output is attention with the keys as values (``value``
    ignored). The contract uses ``value``: that is not declared (the suite's properties
    fail on it), but noted with the declaration that would express it if intended."""
    q64, k64, v64 = (x.double().numpy() for x in (q, k, v))
    got = out.detach().double().numpy()
    if np.allclose(got, spec.sdpa(q64, k64, v64, causal=causal).output, atol=tol):
        return False
    if np.allclose(got, spec.sdpa(q64, k64, k64, causal=causal).output, atol=tol):
        notes.append(f"shared_kv: the output is attention with the keys as values (value is ignored); "
                     f"the contract ({_SDPA_CONTRACT}) uses value, which is tested; if one memory "
                     "tensor as both key and value is intended, declare --impl-option shared_kv=true")
        return True
    return False


def _probe_causal(probe: _Prober, fn, q, k, v, notes: list[str],
                  equal_lengths: bool = False, tol: float = 1e-4) -> tuple[str | None, str]:
    """(declaration, what was seen). ``is_causal=True`` means the contract's upper-left
    triangle; only a flag that raises is declared unsupported (None). Seen: ``upper_left``,
    ``lower_right``, ``no_effect``, ``neither``, ``raised`` or ``bad_output``; each but the
    first is noted with what the probe saw (and the declaration that expresses it, if any)."""
    shape = (1, 2, q.shape[2], v.shape[-1])
    lengths = f"query length {q.shape[2]}, key length {k.shape[2]}"
    contract = f"the contract ({_SDPA_CONTRACT}) is upper-left, which is tested"
    try:
        got = probe.call("is_causal=True", lambda: fn(q, k, v, is_causal=True))  # L=2, S=3: alignments differ
    except CallRaised as exc:
        notes.append(f"causal: is_causal=True raised {summarise(exc.error)}; declared as no causal flag "
                     "(not supported)")
        return None, "raised"
    if not _is_output(got, shape):
        notes.append(f"causal: is_causal=True returned {_describe_result(got)}, not the {shape} output; "
                     f"{contract}")
        return "upper_left", "bad_output"
    got = got.detach().double().numpy()
    q64, k64, v64 = (x.double().numpy() for x in (q, k, v))

    def close_to(alignment: str | None) -> bool:
        return bool(np.allclose(got, spec.sdpa(q64, k64, v64, causal=alignment).output, atol=tol))

    upper, lower = close_to("upper_left"), close_to("lower_right")
    if upper:
        return "upper_left", "upper_left"
    if lower:
        notes.append(f"causal: is_causal=True behaved as the lower-right triangle ({lengths}); {contract}; "
                     "if lower-right is intended, declare --impl-option causal=lower_right")
        return "upper_left", "lower_right"
    if close_to(None):
        notes.append(f"causal: is_causal=True has no effect (the output equals the non-causal one, {lengths}); "
                     f"{contract} and fails; no declaration expresses a causal flag without effect: apply "
                     "the causal mask, or raise on is_causal=True (then it is declared not supported)")
        return "upper_left", "no_effect"
    notes.append(f"causal: is_causal=True matches neither alignment, upper-left nor lower-right ({lengths}; "
                 f"e.g. a triangle that also blocks the diagonal); {contract} and fails")
    return "upper_left", "neither"


def _probe_fully_masked(probe: _Prober, fn, q, k, v, kind: str, as_mask: Callable[[Any], Any],
                        tol: float = 1e-4) -> str:
    """The policy for a query row whose every key is blocked by ``kind``: a bool mask,
    a -inf additive mask, or (``causal``: L > S) a lower-right causal flag alone;
    ``unspecified`` when the call raises or the row is none of zero, NaN, mean of V."""
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
    if not _is_output(out, (1, 2, L, v.shape[-1])):
        return "unspecified"
    row = out.detach()[0, :, 0]  # (N, Ev)
    if torch.isnan(row).all():
        return "nan"
    if torch.equal(row, torch.zeros_like(row)):
        return "zero"
    if torch.allclose(row.double(), v.double().mean(dim=-2)[0], atol=1e-5 if tol <= 1e-4 else tol):
        return "uniform"
    return "unspecified"
