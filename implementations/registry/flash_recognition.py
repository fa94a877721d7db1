"""Recognition and probing of a function with FlashAttention's ``flash_attn_func`` signature.

``flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
return_attn_probs=False)``: q (B, L, N, E), k (B, S, K, E), v (B, S, K, Ev), causal
lower-right (``spec.flash``). A function whose first three parameters are named
``q, k, v`` is taken as one; an optional parameter it lacks is dropped while it keeps
its default and refused otherwise (:class:`FlashAdapter`), so that feature probes as
unsupported.

What the parameters *mean* is FlashAttention's contract, never what a probe sees:
``causal`` is lower-right, ``window_size``, ``softcap`` and ``alibi_slopes`` mean what
``flash_attn_func`` says. Probes find capabilities only: a feature whose call raises (a
parameter the function lacks, a NotImplementedError) is declared unsupported with a note;
a feature that runs is declared, and when it behaves otherwise than the contract (no
effect, the other causal alignment) a note says what the probe saw, so the properties
run and fail (``Capabilities.probe_notes``; ``Capabilities.sources`` says ``contract``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

import spec
from implementations.base import (
    Capabilities,
    Implementation,
    ImplementationError,
)
from implementations.guard import CallRaised
from implementations.registry._errors import summarise
from implementations.registry.prober import (
    DEFAULT_PROBE_TIMEOUT,
    _describe_result,
    _dtypes_that_run,
    _fully_masked_declaration,
    _per_dtype_capabilities,
    _Prober,
    _supports,
)
from implementations.registry.probe_plan import NOT_DECLARED, first_call_hint, probe_plan

__all__ = ["FLASH_PARAMETERS", "FlashAdapter", "is_flash_signature", "probe_flash", "recognise_flash"]

FLASH_PARAMETERS = ("q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                    "alibi_slopes", "deterministic", "return_attn_probs", "sinks", "q_descale",
                    "k_descale", "v_descale")
#: FlashAttention-3's descale factors of FP8 q, k, v (``spec.fp8``); a function naming them
#: is probed with FP8 inputs (``Capabilities.fp8_dtypes``).
DESCALE_PARAMETERS = ("q_descale", "k_descale", "v_descale")
#: Other parameters of FlashAttention-3's ``flash_attn_func``: recognised, never passed
#: (left at their defaults): the suite certifies none of them.
FA3_OTHER_PARAMETERS = ("qv", "attention_chunk", "num_splits", "pack_gqa", "sm_margin")
#: Names kernels give the learned-sink argument (N,) besides ``sinks``: FlashAttention-3's
#: ``learnable_sink``, vLLM's ``s_aux``. The suite passes ``sinks=``; the adapter renames it.
SINK_ALIASES = ("learnable_sink", "s_aux")
#: The contract of flash_attn_func's signature, as the notes name it.
_FLASH_CONTRACT = "flash_attn_func's"
_DEFAULTS = {"dropout_p": 0.0, "softmax_scale": None, "causal": False, "window_size": (-1, -1),
             "softcap": 0.0, "alibi_slopes": None, "deterministic": False, "return_attn_probs": False,
             "sinks": None, "q_descale": None, "k_descale": None, "v_descale": None}


def is_flash_signature(parameters: list[inspect.Parameter]) -> bool:
    """Whether ``parameters`` are ``flash_attn_func``'s: q, k, v first, then only names of
    its own (at least one, so that a bare ``f(q, k, v)``, whose layout could be either,
    is not taken for it), ``*args``/``**kwargs`` aside. A function such as
    ``attention(q, k, v, mask=None)`` is not: it has a parameter flash_attn_func lacks."""
    if [p.name for p in parameters[:3]] != ["q", "k", "v"]:
        return False
    rest = [p.name for p in parameters[3:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return bool(rest) and all(name in FLASH_PARAMETERS or name in SINK_ALIASES or name in FA3_OTHER_PARAMETERS
                              for name in rest)


def recognise_flash(fn: Callable[..., Any], parameters: list[inspect.Parameter], *, name: str,
                    origin: str, version: str, timeout: float | None) -> Implementation:
    """A flash-level :class:`Implementation` for ``fn``, capabilities probed."""
    unknown = [p.name for p in parameters[3:] if p.name not in FLASH_PARAMETERS and p.name not in SINK_ALIASES
               and (p.name not in FA3_OTHER_PARAMETERS or p.default is p.empty)
               and p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if unknown:
        raise ImplementationError(
            f"{origin} looks like flash_attn_func (q, k, v) but also requires {unknown}, which "
            f"flash_attn_func does not have; give them defaults. Expected parameters: "
            f"{', '.join(FLASH_PARAMETERS)}"
        )
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in parameters)
    names = {p.name for p in parameters}
    alias = next((a for a in SINK_ALIASES if a in names), None)
    accepted = set(FLASH_PARAMETERS) if has_var_kw else names & set(FLASH_PARAMETERS)
    if alias is not None:
        accepted.add("sinks")
    flash = fn if accepted == set(FLASH_PARAMETERS) and alias is None else FlashAdapter(fn, accepted, alias)
    caps = probe_flash(flash, origin=origin, timeout=timeout)
    return Implementation(name=name, capabilities=caps, flash=flash, version=version,
                          description=f"flash_attn_func-signature function {origin}; capabilities probed, "
                                      "semantics flash_attn_func's")


class FlashAdapter:
    """Calls a function lacking some of flash_attn_func's optional parameters: a missing
    one is dropped while it has its default value and refused otherwise."""

    def __init__(self, fn: Callable[..., Any], accepted: set[str], sink_alias: str | None = None) -> None:
        self.fn, self.accepted, self.sink_alias = fn, accepted, sink_alias
        self.__name__ = getattr(fn, "__name__", "flash_attn_func")

    def __call__(self, q, k, v, **options: Any) -> Any:
        kwargs = {}
        for key_name, given in options.items():
            if key_name == "sinks" and self.sink_alias is not None:
                if given is not None:
                    kwargs[self.sink_alias] = given
            elif key_name in self.accepted:
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
    """Capabilities of a ``flash_attn_func``-signature function, found by tiny CPU calls
    built inside the declarations in force (:mod:`.probe_plan`: dtype, head dims, lengths,
    causal only); without any, float32 with E = 4, L = 2, S = 3."""
    import torch

    probe = _Prober(origin, timeout, "flash")
    gen = torch.Generator().manual_seed(0)
    plan = probe_plan(level="flash")
    L0, S0, E0 = plan.L, plan.S, plan.E
    t0 = getattr(torch, plan.dtype)
    tol = _TOLERANCE.get(plan.dtype, 1e-4)
    user_fn = fn
    if plan.causal_only:  # every call of a causal-only kernel is causal
        def fn(q, k, v, **kw):  # noqa: F811
            return user_fn(q, k, v, **{**kw, "causal": True})

    def qkv(B=1, L=L0, S=S0, N=2, K=2, E=E0, Ev=E0, dtype=t0):
        return (torch.randn(B, L, N, E, generator=gen).to(dtype), torch.randn(B, S, K, E, generator=gen).to(dtype),
                torch.randn(B, S, K, Ev, generator=gen).to(dtype))

    q, k, v = qkv()
    shape = (1, L0, 2, E0)
    plain = (f"the first call, {plan.describe()} (q (1, {L0}, 2, {E0}), k (1, {S0}, 2, {E0}), "
             f"v (1, {S0}, 2, {E0}))")
    try:
        out = probe.call("a plain call", lambda: fn(q, k, v))
    except CallRaised as exc:
        hint = first_call_hint(lambda p: _flash_attempt_runs(probe, user_fn, p), level="flash")
        raise ImplementationError(
            f"{origin} has flash_attn_func's signature but {plain} raised {summarise(exc.error)}{hint}"
        ) from exc.error
    if not _is_tensor(out, shape):
        raise ImplementationError(
            f"{origin} has flash_attn_func's signature but {plain} returned {_describe_result(out)}; it "
            f"must return a torch.Tensor of shape {shape} (B, L, N, Ev)")
    q64, k64, v64 = (x.double().numpy() for x in (q, k, v))
    base = out.detach().double().numpy()
    notes: list[str] = []
    plain_options = {"causal": True} if plan.causal_only else {}

    def feature_runs(feature: str, what: str, call: Callable[[], Any], **options: Any) -> bool:
        """Whether the feature is declared: its call runs (a call that raises: unsupported,
        noted). One that runs but returns no output, or has no effect where the oracle
        changes, stays declared (the contract's meaning is tested) with a note."""
        try:
            got = _output_of(probe.call(feature, call))
        except CallRaised as exc:
            notes.append(f"{feature}: {what} raised {summarise(exc.error)}; declared unsupported")
            return False
        contract = (f"the contract ({_FLASH_CONTRACT}) is tested and fails; if the feature is not "
                    f"meant to be supported, make it raise (or leave it out with --impl-option flash_features=...)")
        if not _is_tensor(got, shape):
            notes.append(f"{feature}: {what} returned {_describe_result(got)}, not the {shape} output; "
                         + contract)
            return True
        got = got.detach().double().numpy()
        want = spec.flash_attention(q64, k64, v64, **plain_options, **options)
        if np.allclose(got, base, atol=tol * 1e-2) and not np.allclose(want, base, atol=tol):
            notes.append(f"{feature}: {what} has no effect (the output equals the plain call's); " + contract)
        return True

    declared_features = probe.given("flash_features")
    slopes, features = torch.tensor([0.5, 0.25]), set(() if declared_features is NOT_DECLARED else declared_features)
    if declared_features is NOT_DECLARED:  # a declared field is not probed (.probe_plan)
        if feature_runs("window", "window_size=(0, 0)", lambda: fn(q, k, v, window_size=(0, 0)), window=(0, 0)):
            features.add("window")
        if feature_runs("softcap", "softcap=0.05", lambda: fn(q, k, v, softcap=0.05), softcap=0.05):
            features.add("softcap")
        if feature_runs("alibi", "alibi_slopes=[0.5, 0.25]", lambda: fn(q, k, v, alibi_slopes=slopes),
                        alibi_slopes=slopes.numpy()):
            features.add("alibi")
        if _probe_lse(probe, fn, q, k, v, notes):
            features.add("lse")
        sinks = torch.tensor([1.5, -0.5])
        if _takes_sinks(fn) and feature_runs("sinks", "sinks=[1.5, -0.5]", lambda: fn(q, k, v, sinks=sinks),
                                             sinks=sinks.numpy()):
            features.add("sinks")
    dropout = probe.given("dropout")
    dropout = _probe_dropout(probe, fn, q, k, v, base, notes) if dropout is NOT_DECLARED else dropout
    if dropout and declared_features is NOT_DECLARED and _probe_dropout_pattern(probe, fn, q, k, v, notes):
        features.add("dropout_pattern")
    fp8_dtypes = _probe_fp8(probe, fn, q, k, v, notes) if _names_any(fn, DESCALE_PARAMETERS) else ()
    fp8_descales = _probe_descale_forms(probe, fn, q, k, v, fp8_dtypes[0], notes) if fp8_dtypes else None
    causal, causal_seen = ((probe.given("causal"), probe.given("causal") or "raised")
                           if probe.given("causal") is not NOT_DECLARED else
                           _probe_causal(probe, fn, q, k, v, q64, k64, v64, None if plan.causal_only else base,
                                         notes, tol))

    def backward(qq, kk, vv) -> str | None:
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (qq, kk, vv))
        try:
            got = _output_of(probe.call("backward", lambda: fn(qq, kk, vv)))
            if not isinstance(got, torch.Tensor):
                return f"returned {_describe_result(got)}"
            probe.call("backward", lambda: got.sum().backward())
        except CallRaised as exc:
            return f"raised {summarise(exc.error)}"
        if qq.grad is None or kk.grad is None or vv.grad is None:
            return "left q, k or v without a gradient"
        return None

    dtypes = _dtypes_that_run(probe, lambda d: fn(*qkv(dtype=getattr(torch, d))), notes, plan.dtypes)

    def capability_probes(dtype: str) -> dict[str, tuple]:
        t = getattr(torch, dtype)
        probes: dict[str, tuple] = {
            "gqa": ("GQA (N=2, K=1)", lambda: fn(*qkv(N=2, K=1, dtype=t))),
            "autograd": ("backward through q, k, v", lambda: backward(*(x.to(t) for x in (q, k, v))), "direct"),
        }
        if plan.Ev_other is not None:
            probes = {"different_v_dim": (f"Ev={plan.Ev_other} != E={E0}",
                                          lambda: fn(*qkv(Ev=plan.Ev_other, dtype=t))), **probes}
        return probes

    found, by_dtype = _per_dtype_capabilities(probe, capability_probes, dtypes, notes, plan.dtype)
    if plan.Ev_other is None:
        found["different_v_dim"] = False
        notes.append(f"different_v_dim: the declarations leave one head dim (E={E0}); Ev != E not tried")
    # Rows attend no key only where causal=True is the lower-right rule it should be.
    fully_masked, source = ((probe.given("fully_masked"), "declared") if probe.given("fully_masked") is not NOT_DECLARED
                            else _probe_fully_masked(probe, fn, qkv, notes, L0, S0) if causal_seen == "lower_right"
                            else ("zero", "contract"))
    return Capabilities(
        devices=("cpu",),
        dtypes=dtypes or (plan.dtype,),
        mask_kinds=frozenset({"none"}),
        causal=causal,
        fully_masked=fully_masked,
        different_v_dim=found["different_v_dim"],
        gqa=found["gqa"],
        dropout=dropout,
        fp8_dtypes=fp8_dtypes,
        **({} if fp8_descales is None else {"fp8_descales": fp8_descales}),
        custom_scale=_supports(probe, "custom_scale", "softmax_scale=0.5",
                               lambda: fn(q, k, v, softmax_scale=0.5), notes, plan.dtype),
        autograd=found["autograd"],
        mask_grad=False,
        non_contiguous=_supports(probe, "non_contiguous", "a transposed q",
                                 lambda: fn(q.transpose(1, 2).contiguous().transpose(1, 2), k, v), notes,
                                 plan.dtype),
        flash_features=frozenset(features),
        by_dtype=by_dtype,
        probe_notes=tuple(notes),
        sources={"causal": "contract" if causal else "probed", "flash_features": "contract",
                 "fully_masked": source},
    )


#: Absolute tolerance of the probes' comparisons with the float64 oracle, per probe dtype.
_TOLERANCE = {"float16": 2e-2, "bfloat16": 1e-1}


def _flash_attempt_runs(probe: _Prober, fn: Callable[..., Any], plan: Any) -> bool:
    """Whether a plain call built by ``plan`` returns the (B, L, N, Ev) output."""
    import torch

    gen = torch.Generator().manual_seed(1)
    t = getattr(torch, plan.dtype)
    q = torch.randn(1, plan.L, 2, plan.E, generator=gen).to(t)
    k, v = (torch.randn(1, plan.S, 2, plan.E, generator=gen).to(t) for _ in range(2))
    kwargs = {"causal": True} if plan.causal_only else {}
    try:
        out = _output_of(probe.call("a call built inside a declaration", lambda: fn(q, k, v, **kwargs)))
    except CallRaised:
        return False
    return _is_tensor(out, (1, plan.L, 2, plan.E))


def _takes_sinks(fn: Any) -> bool:
    """Whether the function names a sinks argument (``sinks`` or an alias): sinks are no
    flash_attn_func argument, so a function without one (``**kwargs`` that may swallow it
    included) is not probed for them and does not claim them."""
    return _names_any(fn, ("sinks", *SINK_ALIASES))


def _names_any(fn: Any, names: tuple[str, ...]) -> bool:
    """Whether the function's own signature names one of ``names`` (``**kwargs`` does not)."""
    try:
        parameters = inspect.signature(fn.fn if isinstance(fn, FlashAdapter) else fn).parameters
    except (TypeError, ValueError):
        return False
    return any(name in parameters for name in names)


def _probe_dropout(probe: _Prober, fn, q, k, v, base: np.ndarray, notes: list[str]) -> bool:
    """``dropout_p=0.5`` runs and returns the output: dropout declared (its meaning,
    FlashAttention's, is tested by the dropout properties; a call without effect is noted);
    a call that raises: unsupported."""
    try:
        got = _output_of(probe.call("dropout", lambda: fn(q, k, v, dropout_p=0.5)))
    except CallRaised as exc:
        notes.append(f"dropout: dropout_p=0.5 raised {summarise(exc.error)}; declared unsupported")
        return False
    contract = (f"the contract ({_FLASH_CONTRACT}) is tested and fails; if dropout is not meant to be "
                "supported, make dropout_p > 0 raise (or declare --impl-option dropout=false)")
    if not _is_tensor(got, tuple(q.shape[:3]) + (v.shape[-1],)):
        notes.append(f"dropout: dropout_p=0.5 returned {_describe_result(got)}, not the output; {contract}")
    elif np.array_equal(got.detach().double().numpy(), base):
        notes.append(f"dropout: dropout_p=0.5 has no effect (the output equals the plain call's); {contract}")
    return True


def _probe_dropout_pattern(probe: _Prober, fn, q, k, v, notes: list[str]) -> bool:
    """``return_attn_probs=True`` with ``dropout_p=0.5`` returns ``(out, lse, S_dmask)`` with
    S_dmask (B, N, >= L, >= S) (FlashAttention-2: negative where dropped): the feature
    ``dropout_pattern``; anything else is noted and the pattern property skips."""
    import torch

    try:
        got = probe.call("dropout_pattern", lambda: fn(q, k, v, dropout_p=0.5, return_attn_probs=True))
    except CallRaised as exc:
        notes.append(f"dropout_pattern: return_attn_probs=True with dropout_p=0.5 raised {summarise(exc.error)}; "
                     "not declared")
        return False
    B, L, N = q.shape[:3]
    S = k.shape[1]
    third = got[2] if isinstance(got, (tuple, list)) and len(got) >= 3 else None
    if not (isinstance(third, torch.Tensor) and third.dim() == 4 and tuple(third.shape[:2]) == (B, N)
            and third.shape[2] >= L and third.shape[3] >= S):
        notes.append(f"dropout_pattern: return_attn_probs=True with dropout_p=0.5 returned no S_dmask "
                     f"(B, N, >= L, >= S) third (got {_describe_result(third)}); not declared, so "
                     "dropout_pattern_agreement skips")
        return False
    return True


def _probe_descale_forms(probe: _Prober, fn, q, k, v, fmt: str, notes: list[str]) -> tuple[str, ...]:
    """The descale forms an FP8 call in ``fmt`` takes besides (B, K) (the form its probe ran
    with): one per tensor, shape (1,), and none at all; a form that raises is left out, noted
    (FlashAttention-3 checks the shape (B, K))."""
    import torch

    t = getattr(torch, fmt)
    forms = ["per_head"]
    for form, descale in (("per_tensor", torch.full((1,), 0.5)), ("none", None)):
        try:
            probe.call(f"fp8 descales {form}", lambda d=descale: fn(q.to(t), k.to(t), v.to(t), q_descale=d,
                                                                   k_descale=d, v_descale=d))
        except CallRaised as exc:
            notes.append(f"fp8_descales: descales {'of shape (1,)' if form == 'per_tensor' else 'left out'} "
                         f"raised {summarise(exc.error)}; not drawn")
            continue
        forms.append(form)
    return tuple(forms)


def _probe_fp8(probe: _Prober, fn, q, k, v, notes: list[str]) -> tuple[str, ...]:
    """The 8-bit formats in which q, k, v with ``q_descale``, ``k_descale``, ``v_descale``
    (float32, one per batch element and kv head) run and return the output (its meaning,
    ``spec.fp8``'s, is tested by ``fp8_agreement``)."""
    import torch

    from implementations.base import FP8_DTYPES

    B, K = q.shape[0], k.shape[2]
    descale = torch.full((B, K), 0.5)
    found = []
    for name in FP8_DTYPES:
        t = getattr(torch, name)
        try:
            got = _output_of(probe.call(f"fp8 {name}", lambda t=t: fn(
                q.to(t), k.to(t), v.to(t), q_descale=descale, k_descale=descale, v_descale=descale)))
        except CallRaised as exc:
            notes.append(f"fp8_dtypes: q, k, v in {name} with descales raised {summarise(exc.error)}; "
                         "not declared")
            continue
        if not _is_tensor(got, tuple(q.shape[:3]) + (v.shape[-1],)):
            notes.append(f"fp8_dtypes: q, k, v in {name} returned {_describe_result(got)}, not the output; "
                         "fp8_agreement is run and fails")
        found.append(name)
    return tuple(found)


def _is_tensor(out: Any, shape: tuple[int, ...]) -> bool:
    import torch

    return isinstance(out, torch.Tensor) and tuple(out.shape) == shape and out.device.type == "cpu"


def _probe_fully_masked(probe: _Prober, fn, qkv, notes: list[str], L0: int = 2, S0: int = 3) -> tuple[str, str]:
    """The declared policy (and its source) for rows attending no key (causal with L > S:
    L = 3, S = 1 empties rows 0 and 1; with lengths a multiple m of a block, L = 2m, S = m
    empties rows 0..m-1): zero or nan adopted as probed; a uniform or unclassified row is
    not adopted (:func:`~implementations.registry.prober._fully_masked_declaration`)."""
    import torch

    L, S = (3, 1) if (L0, S0) == (2, 3) else (2 * L0, L0)
    q, k, v = qkv(L=L, S=S)
    policy = "unspecified"
    try:
        got = _output_of(probe.call("a row attending no key", lambda: fn(q, k, v, causal=True)))
    except CallRaised:
        got = None
    if _is_tensor(got, (1, L, 2, v.shape[-1])):
        rows = got.detach()[:, :L - S].double()
        mean_v = v.double().mean(dim=1, keepdim=True)  # (1, 1, K, Ev): every key equally
        if torch.isnan(rows).all():
            policy = "nan"
        elif torch.equal(rows, torch.zeros_like(rows)):
            policy = "zero"
        elif torch.allclose(rows, mean_v.expand_as(rows), atol=1e-5 if v.dtype in (torch.float32, torch.float64)
                            else 2e-2):
            policy = "uniform"
    return _fully_masked_declaration({"causal": policy}, notes, level="flash",
                                     blocked_by={"causal": f"causal=True alone (query length {L}, key length {S})"})


def _probe_lse(probe: _Prober, fn, q, k, v, notes: list[str]) -> bool:
    """``return_attn_probs=True`` runs (declared: the contract's (output, lse, ...) is tested);
    a note when it raises, or returns no (B, N, L) LSE second."""
    try:
        got = probe.call("lse", lambda: fn(q, k, v, return_attn_probs=True))
    except CallRaised as exc:
        notes.append(f"lse: return_attn_probs=True raised {summarise(exc.error)}; declared unsupported")
        return False
    lse_shape = (1, 2, q.shape[1])
    if not (isinstance(got, (tuple, list)) and len(got) >= 2 and _is_tensor(got[1], lse_shape)):
        notes.append(f"lse: return_attn_probs=True returned {_describe_result(_output_of(got))}"
                     f"{' first' if isinstance(got, (tuple, list)) else ''}, not (output, lse {lse_shape}, ...); "
                     f"the contract ({_FLASH_CONTRACT}) is tested and fails")
    return True


def _probe_causal(probe: _Prober, fn, q, k, v, q64, k64, v64, base,
                  notes: list[str], tol: float = 1e-4) -> tuple[str | None, str]:
    """(declaration, what was seen). ``causal=True`` means FlashAttention-2's lower-right
    rule: declared ``lower_right`` whatever it does (noted when it is upper-left, has no
    effect, or matches neither; L=2 < S=3: the alignments differ); None (no causal flag)
    only when it raises. Seen: lower_right, upper_left, no_effect, neither, raised, bad_output."""
    try:
        got = _output_of(probe.call("causal=True", lambda: fn(q, k, v, causal=True)))
    except CallRaised as exc:
        notes.append(f"causal: causal=True raised {summarise(exc.error)}; declared as no causal flag "
                     "(not supported)")
        return None, "raised"
    contract = f"the contract ({_FLASH_CONTRACT}) is lower-right, which is tested"
    shape = tuple(q.shape[:3]) + (v.shape[-1],)
    if not _is_tensor(got, shape):
        notes.append(f"causal: causal=True returned {_describe_result(got)}, not the {shape} output; "
                     f"{contract}")
        return "lower_right", "bad_output"
    got = got.detach().double().numpy()
    if np.allclose(got, spec.flash_attention(q64, k64, v64, causal=True), atol=tol):
        return "lower_right", "lower_right"
    lengths = f"query length {q.shape[1]}, key length {k.shape[1]}"
    if np.allclose(got, spec.flash_attention(q64, k64, v64, causal=True, alignment="upper_left"), atol=tol):
        notes.append(f"causal: causal=True behaved as the upper-left triangle ({lengths}; flash-attn < 2.1's); "
                     f"{contract} and fails; no flash-level declaration expresses upper-left (the SDPA "
                     "level's is_causal is upper-left)")
        return "lower_right", "upper_left"
    if base is not None and np.allclose(got, base, atol=tol):
        notes.append(f"causal: causal=True has no effect (the output equals the non-causal one, {lengths}); "
                     f"{contract} and fails; no declaration expresses a causal flag without effect")
        return "lower_right", "no_effect"
    notes.append(f"causal: causal=True matches neither alignment ({lengths}); {contract} and fails")
    return "lower_right", "neither"

