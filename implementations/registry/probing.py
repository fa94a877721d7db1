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
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

import spec
from implementations.base import ALL_DTYPES, ALL_MASK_KINDS, Capabilities, ImplementationError
from implementations.guard import CallRaised, CallTimedOut, guarded_call
from implementations.registry._errors import summarise
from implementations.registry.probe_plan import first_call_hint, probe_plan

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

    def tried(self, what: str, fn: Callable[[], Any]) -> str | None:
        """None when ``fn()`` returns (and not False), else what it did, for a note
        (``"raised ValueError('...')"``)."""
        try:
            result = self.call(what, fn)
        except CallRaised as exc:
            return f"raised {summarise(exc.error)}"
        return "returned False" if result is False else None

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

#: The contract of scaled_dot_product_attention's signature, as the notes name it.
_SDPA_CONTRACT = "scaled_dot_product_attention's"


def probe_sdpa(fn: Callable[..., Any], *, origin: str,
               timeout: float | None = DEFAULT_PROBE_TIMEOUT) -> Capabilities:
    """Capabilities of an SDPA-signature function, found by tiny calls on CPU
    (each limited to ``timeout`` seconds). Semantics are the signature's contract
    (``is_causal`` upper-left, ``value`` used); probes find what it accepts, per dtype."""
    import torch

    probe = _Prober(origin, timeout)
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

    def capability_probes(dtype: str) -> dict[str, tuple[str, Callable[[], Any]]]:
        """Capability -> (what is tried, the call) of the probes that may differ per dtype."""
        t = getattr(torch, dtype)
        qd, kd, vd = (x.to(t) for x in (q, k, v))
        probes = {
            "mask_kinds:bool": ("a bool mask", lambda: fn(qd, kd, vd, attn_mask=as_mask(bool_mask))),
            "mask_kinds:additive": ("a float mask", lambda: fn(qd, kd, vd, attn_mask=as_mask(float_mask.to(t)))),
            "gqa": ("GQA (N=2, K=1, enable_gqa=True)", lambda: fn(*qkv_for(N=2, K=1, dtype=t), enable_gqa=True)),
            "different_v_dim": (f"Ev={plan.Ev_other} != E={E0}", lambda: fn(*qkv_for(Ev=plan.Ev_other, dtype=t))),
            # backward makes its own guarded calls: it returns None or what happened.
            "autograd": ("backward through query, key, value", lambda: backward(qd, kd, vd), "direct"),
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
    mask_grad = False
    if "additive" in mask_kinds and found["autograd"]:
        said = backward(q, k, v, mask=torch.randn(L, S0, generator=gen))
        mask_grad = said is None
        if said:
            notes.append(f"mask_grad: a gradient w.r.t. a float mask in {plan.dtype} {said}; declared unsupported")
    causal, causal_seen = _probe_causal(probe, fn, q, k, seen_v, notes, equal_lengths, tol)
    observed = {
        kind: _probe_fully_masked(probe, fn, q, k, seen_v, kind, as_mask, tol)
        for kind in ("bool", "additive") if kind in mask_kinds
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
    if causal_seen == "lower_right" and not equal_lengths:  # the flag alone empties row 0 at L=3 > S=2
        q3, k2, v2 = qkv(L=3, S=2) if (L0, S0) == (2, 3) else qkv(L=2 * L0, S=L0)
        observed["causal"] = _probe_fully_masked(probe, fn, q3, k2, k2 if seen_v is k else v2, "causal", as_mask,
                                                 tol)
    fully_masked, source = _fully_masked_declaration(observed, notes)
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


def _try(probe: _Prober, what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``'s result, or None when it raises."""
    try:
        return probe.call(what, fn)
    except CallRaised:
        return None


def _supports(probe: _Prober, name: str, what: str, fn: Callable[[], Any], notes: list[str],
              dtype: str = "float32") -> bool:
    """Whether ``fn()`` runs; when not, a note of what it raised (``name: what in dtype raised ...``)."""
    said = probe.tried(what, fn)
    if said:
        notes.append(f"{name}: {what} in {dtype} {said}; declared unsupported")
    return said is None


def _dtypes_that_run(probe: _Prober, call: Callable[[str], Any], notes: list[str],
                     candidates: tuple[str, ...] = ALL_DTYPES) -> tuple[str, ...]:
    """The dtypes among ``candidates`` (the declared ones, else all) in which a plain call
    runs; a note for each one that does not."""
    dtypes = []
    for dtype in [d for d in ALL_DTYPES if d in candidates]:
        said = probe.tried(f"dtype {dtype}", lambda d=dtype: call(d))
        if said:
            notes.append(f"dtypes: a plain call in {dtype} {said}; {dtype} not declared")
        else:
            dtypes.append(dtype)
    return tuple(dtypes)


def _per_dtype_capabilities(probe: _Prober, probes: Callable[[str], dict[str, tuple]],
                            dtypes: tuple[str, ...], notes: list[str],
                            base_dtype: str = "float32") -> tuple[dict[str, bool], dict[str, dict]]:
    """Each capability of ``probes(dtype)`` (key -> ``(what, call)``, or ``(what, call,
    "direct")`` for a call that makes its own guarded calls and returns None or what
    happened) in float32 (the declaration) and in every other dtype that runs
    (``Capabilities.by_dtype`` where it differs). A guarded call is supported when it
    returns (not False). Every limitation found is a note naming what was tried, in which
    dtype, and what it did."""
    def outcome(what: str, call: Callable[[], Any], *direct: str) -> str | None:
        if direct:
            return call()
        try:
            result = probe.call(what, call)
        except CallRaised as exc:
            return f"raised {summarise(exc.error)}"
        if result is False:
            return "returned False"
        return None

    def field(key: str) -> str:
        return key.split(":", 1)[0]

    base = {}
    for key, (what, *call) in probes(base_dtype).items():
        said = outcome(f"{what} in {base_dtype}", *call)
        base[key] = said is None
        if said:
            notes.append(f"{field(key)}: {what} in {base_dtype} {said}; declared unsupported")
    by_dtype: dict[str, dict] = {}
    for dtype in dtypes:
        if dtype == base_dtype:
            continue
        for key, (what, *call) in probes(dtype).items():
            said = outcome(f"{what} in {dtype}", *call)
            if (said is None) != base[key]:
                by_dtype.setdefault(dtype, {})[key] = said is None
                notes.append(f"{field(key)}: {what} in {dtype} {said}; unsupported in {dtype}" if said else
                             f"{field(key)}: {what} in {dtype} works (not in {base_dtype}); supported in {dtype}")
    return base, by_dtype


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


def _kinds_text(policies: dict[str, str]) -> str:
    """``bool:zero,additive:nan`` (the ``--impl-option fully_masked=`` syntax)."""
    return ",".join(f"{kind}:{policy}" for kind, policy in policies.items())


#: What blocks every key of a probed row, per kind, for the notes.
_BLOCKED_BY = {"bool": "a bool mask", "additive": "a -inf additive mask",
               "causal": "the causal flag alone (query length 3, key length 2)"}


def _fully_masked_declaration(observed: dict[str, str], notes: list[str], level: str = "",
                              blocked_by: dict[str, str] | None = None) -> tuple[str, str]:
    """The declared fully-masked policy and its source, from the policies ``observed`` per
    kind of blocking. The contract leaves the value open, so a probed policy is adopted
    (source ``probed``) when every probed kind gives the same non-attending one (zero or
    nan). A policy that differs between kinds, attends blocked keys (``uniform``) or could
    not be classified (``unspecified``) is not: the declaration stays at the agreeing
    kinds' zero or nan, else the contract default zero (source ``contract``), so the
    fully-masked property fails on the offending rows; the note names what was seen and
    the ``--impl-option`` that would declare it."""
    where = f" at the {level} level" if level else ""
    if not observed:
        return "zero", "contract"
    seen = set(observed.values())
    text = _kinds_text(observed)
    blocked_by = {**_BLOCKED_BY, **(blocked_by or {})}
    said = "; ".join(f"{blocked_by.get(kind, kind)}: {policy}" for kind, policy in observed.items())
    if len(seen) == 1 and seen <= {"zero", "nan"}:
        notes.append(f"fully_masked: a row with every key blocked came out {seen.pop()} ({said}){where}; "
                     "the contract leaves it open, so this probed policy is adopted")
        return observed[next(iter(observed))], "probed"
    why = []
    if len(seen) > 1:
        why.append("it differs between the kinds of blocking")
    if "uniform" in seen:
        why.append("uniform rows attend the keys the mask or causal rule blocks")
    if "unspecified" in seen:
        why.append("the probe could not classify " + ", ".join(
            k for k, p in observed.items() if p == "unspecified") + " rows (neither zero, NaN nor the mean of V, "
            "or the call raised)")
    agreeing = seen & {"zero", "nan"}
    fallback = agreeing.pop() if len(agreeing) == 1 else "zero"
    hint = text if len(seen) > 1 else seen.pop()
    notes.append(f"fully_masked: probed {text}{where} ({said}); not adopted: {'; '.join(why)}; declared "
                 f"{fallback}, so the fully-masked property tests it and fails on those rows; if the "
                 f"probed behaviour is intended, declare --impl-option fully_masked={hint}")
    return fallback, "contract"


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
    mha_features = set()
    notes: list[str] = []
    for feature, run in _mha_feature_probes(factory, call, x, kv).items():
        said = probe.tried(f"feature {feature}", run)
        if said:
            notes.append(f"mha_features: {feature} in float32 {said}; declared unsupported")
        else:
            mha_features.add(feature)
    # Masks are features when their bool form runs; their float form is the mask kind
    # "additive", probed apart (a module with bool masks only is certified with bool masks).
    mask_kinds = set(ALL_MASK_KINDS)
    for feature, run in _mha_float_mask_probes(call, x).items():
        said = probe.tried(f"a float {feature}", run) if feature in mha_features else None
        if said:
            notes.append(f"mask_kinds: a float {feature} in float32 {said}; float masks declared unsupported "
                         "(MHA masks are drawn bool only)")
            mask_kinds.discard("additive")

    def built(d: str) -> Any:
        return call({"dtype": getattr(torch, d)}, *[x.to(getattr(torch, d))] * 3)

    dtypes = _dtypes_that_run(probe, built, notes)
    if "key_padding_mask" in mha_features:
        observed = _probe_mha_fully_masked(probe, factory, x, kinds=mask_kinds)
        fully_masked, source = _fully_masked_declaration(
            observed, notes, level="MHA",
            blocked_by={"bool": "a bool key_padding_mask", "additive": "a -inf float key_padding_mask"})
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
    return Capabilities(
        devices=("cpu",),
        dtypes=dtypes or ("float32",),
        causal="upper_left",
        fully_masked=fully_masked,
        mask_kinds=frozenset(mask_kinds),
        dropout="dropout" in mha_features,
        autograd=found["autograd"],
        mask_grad=False,
        mha_features=frozenset(mha_features),
        by_dtype=by_dtype,
        probe_notes=tuple(notes),
        sources={"causal": "contract", "fully_masked": source},
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
        "key_padding_mask": lambda: call(None, key_padding_mask=kpm),
        "attn_mask": lambda: call(None, attn_mask=causal),
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


def _probe_mha_fully_masked(probe: _Prober, factory, x, kinds=ALL_MASK_KINDS) -> dict[str, str]:
    """Kind -> policy of a query row whose keys a key_padding_mask blocks all of, bool
    (``bool``) and -inf float (``additive``): ``nan``, ``zero`` (module output =
    out_proj.bias), ``uniform`` (out_proj of the mean value projection, read through
    nn.MultiheadAttention's parameter names) or ``unspecified`` (anything else, or the
    call raised)."""
    import torch

    blocked = torch.tensor([[True, True, True], [False, False, False]])
    masks = {"bool": blocked, "additive": torch.zeros(2, 3).masked_fill(blocked, float("-inf"))}

    def policy(mask: Any) -> str:
        def run() -> tuple[Any, Any]:
            m = factory(_D, _N)
            m.eval()
            out = m(x, x, x, key_padding_mask=mask, need_weights=False)[0]
            return out, m

        try:
            out, module = probe.call("a fully-masked row", run)
        except CallRaised:
            return "unspecified"
        if not _is_output(out, (_L, _B, _D)):
            return "unspecified"
        out = out.detach()[:, 0]  # (L, D), batch 0
        if torch.isnan(out).all():
            return "nan"
        out_proj = getattr(module, "out_proj", None)
        bias = getattr(out_proj, "bias", None)
        if isinstance(bias, torch.Tensor) and torch.allclose(out, bias.detach().expand_as(out)):
            return "zero"  # attention output 0, so the module output is out_proj.bias
        uniform = _mha_uniform_row(module, x[:, 0])
        if uniform is not None and torch.allclose(out, uniform.expand_as(out), atol=1e-5):
            return "uniform"
        return "unspecified"

    return {kind: policy(mask) for kind, mask in masks.items() if kind in kinds}


def _mha_uniform_row(module: Any, keys: Any) -> Any:
    """out_proj(mean over keys of the value projection), the output of a row attending
    every key equally, from nn.MultiheadAttention's parameter names; None without them."""
    import torch

    try:
        with torch.no_grad():
            weight, bias = module.in_proj_weight, module.in_proj_bias
            if not isinstance(weight, torch.Tensor):
                return None
            w_v = weight[2 * _D:]
            b_v = bias[2 * _D:] if isinstance(bias, torch.Tensor) else 0.0
            mean_v = (keys @ w_v.T + b_v).mean(dim=0)
            out_bias = module.out_proj.bias if module.out_proj.bias is not None else 0.0
            return mean_v @ module.out_proj.weight.T + out_bias
    except (AttributeError, RuntimeError, TypeError, IndexError):
        return None
