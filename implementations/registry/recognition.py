"""Recognition: turn what ``--impl`` found into an Implementation, with no adapter code.

Accepted, in this order:

* an :class:`~implementations.base.Implementation`, or a zero-argument callable
  returning one;
* an SDPA-level function of another array framework (NumPy, JAX, Keras, TensorFlow,
  tinygrad, CuPy, MLX), recognised from its module or declared with
  ``--impl-option framework=NAME``, through the framework bridge (:mod:`implementations.bridge`);
* a function of transformers' attention interface (``module, query, key, value,
  attention_mask`` first: :mod:`.interface_recognition`), at the SDPA level;
* a function with the signature of ``torch.nn.functional.scaled_dot_product_attention``
  (``query, key, value`` first; ``attn_mask, dropout_p, is_causal, scale, enable_gqa``
  optional, a missing one meaning that feature is unsupported);
* FlashAttention's ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k,
  max_seqlen_q, max_seqlen_k, ...)`` (varlen level) or ``flash_attn_with_kvcache(q,
  k_cache, v_cache, ...)`` (kvcache level), called as is, capabilities read from the
  signature;
* a function with FlashAttention's ``flash_attn_func`` signature (``q, k, v`` first;
  :mod:`.flash_recognition`), certified at the flash level;
* a class that is a drop-in for ``torch.nn.MultiheadAttention`` (constructor
  ``embed_dim, num_heads, ...`` and ``forward(query, key, value, key_padding_mask,
  need_weights, attn_mask, average_attn_weights, is_causal)``; weights are loaded by
  nn.MultiheadAttention's parameter names).

For SDPA functions and MHA classes the capabilities are probed (:mod:`.probing`; the
semantics are the signature's contract, probes find only what is accepted); the adapters here
(:class:`_SDPAAdapter`, :class:`_MHAFactory`) fill in a missing optional parameter
while it keeps its default and refuse it otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import inspect
import sys
from collections.abc import Mapping
from typing import Any, Callable

from implementations.base import Capabilities, Implementation, ImplementationError
from implementations.bridge import (
    bridge_declarations,
    bridged_implementation,
    bridged_mha_implementation,
    bridged_module_implementation,
    detect_framework,
    keras_mha_framework,
    module_table,
    signature_of,
)
from implementations.guard import CallRaised, CallTimedOut, guarded_call
from implementations.registry._errors import summarise
from implementations.registry.flash_recognition import (
    FA3_OTHER_PARAMETERS,
    FLASH_PARAMETERS,
    SINK_ALIASES,
    is_flash_signature,
    recognise_flash,
)
from implementations.registry.interface_recognition import is_interface_signature, recognise_interface
from implementations.registry.learner import is_learner_candidate, recognise_learner
from implementations.registry.probe_plan import current_declarations, probe_plan
from implementations.registry.mha_probing import probe_mha
from implementations.registry.prober import DEFAULT_PROBE_TIMEOUT, _Prober, build_limit
from implementations.registry.probing import probe_sdpa

__all__ = [
    "ACCEPTED_OBJECTS",
    "KVCACHE_PARAMETERS",
    "MHA_FORWARD_PARAMETERS",
    "MHA_INIT_PARAMETERS",
    "SDPA_PARAMETERS",
    "VARLEN_PARAMETERS",
    "recognise",
]

SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
MHA_INIT_PARAMETERS = (
    "embed_dim", "num_heads", "dropout", "bias", "add_bias_kv", "add_zero_attn",
    "kdim", "vdim", "batch_first", "device", "dtype",
)
MHA_FORWARD_PARAMETERS = (
    "query", "key", "value", "key_padding_mask", "need_weights", "attn_mask",
    "average_attn_weights", "is_causal",
)
# -- varlen / kv-cache levels: FlashAttention's entry points, recognised by signature --
VARLEN_PARAMETERS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
KVCACHE_PARAMETERS = ("q", "k_cache", "v_cache")
#: What an object found by ``--impl`` may be, for error messages.
ACCEPTED_OBJECTS = (
    "an Implementation (or a zero-argument callable returning one), a function "
    "with torch.nn.functional.scaled_dot_product_attention's or flash_attn_func's signature, or a "
    "drop-in class for torch.nn.MultiheadAttention (or FlashAttention's flash_attn_varlen_func / "
    "flash_attn_with_kvcache)"
)


def recognise(obj: Any, *, name: str, origin: str = "",
              timeout: float | None = DEFAULT_PROBE_TIMEOUT) -> Implementation:
    """An :class:`Implementation` for ``obj`` (see the module docstring for what is
    accepted); each call into ``obj`` (building, probing) is limited to ``timeout`` seconds."""
    origin = origin or name
    if isinstance(obj, Implementation):
        return obj
    if inspect.isclass(obj):
        keras = keras_mha_framework(obj)
        if keras is not None:  # Keras' MultiHeadAttention (or a subclass): the MHA level through the bridge
            return bridged_mha_implementation(obj, keras, name=name, origin=origin, probe=probe_mha,
                                              timeout=timeout)
        if module_table(obj) is not None:  # another framework's multi-head layer: the module bridge
            return bridged_module_implementation(obj, name=name, origin=origin, probe=probe_mha, timeout=timeout)
        return _recognise_class(obj, name=name, origin=origin, timeout=timeout)
    if not callable(obj):
        raise ImplementationError(
            f"{origin} is a {type(obj).__name__}, not callable; expected {ACCEPTED_OBJECTS}"
        )
    if _interface_function(obj):  # transformers' attention interface: (module, query, key, value, mask)
        declared = bridge_declarations()
        declared["_used"] = "yes"
        return recognise_interface(obj, _parameters(obj, origin), name=name, origin=origin, declared=declared,
                                   probe=probe_sdpa, timeout=timeout, version=_version_of(obj))
    framework = detect_framework(obj)
    if framework is not None and (_declared_framework() or _takes_qkv(obj)):
        return bridged_implementation(obj, framework, name=name, origin=origin, probe=probe_sdpa,
                                      timeout=timeout, jit=current_declarations().get("jit"))
    parameters = _parameters(obj, origin)
    names = [p.name for p in parameters]
    varlen_level = _varlen_level(names)
    if varlen_level is not None:
        return _recognise_varlen(obj, varlen_level, names, name=name, origin=origin)
    if names[:3] == ["query", "key", "value"]:
        return _recognise_sdpa(obj, parameters, name=name, origin=origin, timeout=timeout)
    if is_flash_signature(parameters):
        return recognise_flash(obj, parameters, name=name, origin=origin, version=_version_of(obj),
                               timeout=timeout)
    required = [p.name for p in parameters if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not required:
        return _call_builder(obj, origin, timeout)
    raise ImplementationError(_unrecognised_signature(obj, origin, parameters))


def _unrecognised_signature(obj: Any, origin: str, parameters: list[inspect.Parameter]) -> str:
    """Why a function's signature is none the suite recognises, and what would make it one."""
    names = [p.name for p in parameters]
    shown = f"{origin} has the signature {getattr(obj, '__name__', 'f')}({', '.join(names)})"
    alternatives = "; or give a drop-in class for torch.nn.MultiheadAttention, or an Implementation"
    if names[:3] == ["q", "k", "v"]:
        foreign = [n for n in names[3:] if n not in FLASH_PARAMETERS and n not in SINK_ALIASES
                   and n not in FA3_OTHER_PARAMETERS]
        return (f"{shown}: a function whose first parameters are q, k, v is read as flash_attn_func's "
                f"((B, L, N, E) tensors; parameters {', '.join(FLASH_PARAMETERS)}), but "
                f"{', '.join(foreign) or 'none of the others'} {'is' if len(foreign) == 1 else 'are'} not "
                "among them. If it follows torch.nn.functional.scaled_dot_product_attention's convention "
                f"((B, N, L, E) tensors; {', '.join(SDPA_PARAMETERS)}), name its first three parameters "
                "query, key, value (parameters SDPA lacks need defaults), or wrap it in a function of "
                "either signature" + alternatives)
    return (f"{shown}, which is not torch.nn.functional.scaled_dot_product_attention's "
            f"({', '.join(SDPA_PARAMETERS)}): the first three parameters must be named query, key, "
            "value (or q, k, v for flash_attn_func's signature)" + alternatives)


def _declared_framework() -> bool:
    return "framework" in bridge_declarations()


def _interface_function(obj: Any) -> bool:
    try:
        return is_interface_signature(list(inspect.signature(obj).parameters.values()))
    except (TypeError, ValueError):
        return False


def _takes_qkv(obj: Any) -> bool:
    """Whether ``obj`` takes at least three positional arguments (query, key, value)."""
    try:
        parameters = signature_of(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters) >= 3


def _call_builder(builder: Callable[[], Any], origin: str, timeout: float | None) -> Implementation:
    """The Implementation a zero-argument callable returns."""
    try:
        made = guarded_call(builder, timeout=build_limit(timeout), rng=True)
    except CallRaised as exc:
        raise ImplementationError(
            f"{origin} takes no arguments, so it was called to build an Implementation, "
            f"but the call raised {summarise(exc.error)}"
        ) from exc.error
    except CallTimedOut:
        raise ImplementationError(
            f"{origin} takes no arguments, so it was called to build an Implementation, "
            f"but the call did not return within {build_limit(timeout):g}s"
        ) from None
    if isinstance(made, Implementation):
        return made
    raise ImplementationError(
        f"{origin} takes no arguments, so it was called expecting an Implementation, but "
        f"it returned {type(made).__name__}; return implementations.Implementation(...)"
    )


def _parameters(obj: Any, origin: str) -> list[inspect.Parameter]:
    try:
        import torch.nn.functional as F

        if obj is F.scaled_dot_product_attention:  # a builtin without a Python signature
            return [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None if i > 2 else inspect.Parameter.empty)
                    for i, n in enumerate(SDPA_PARAMETERS)]
    except ImportError:
        pass
    try:
        return list(signature_of(obj).parameters.values())
    except (TypeError, ValueError) as exc:
        raise ImplementationError(
            f"{origin} is callable but its signature cannot be read ({exc}); wrap it in a Python "
            "function with scaled_dot_product_attention's signature"
        ) from exc


def _version_of(obj: Any) -> str:
    """The version of the code ``obj`` comes from: its module's ``__version__``, else its
    top-level package's or the installed distribution's that holds it, named
    (``"transformers 5.25.0"``); "0" for a file of the user's own."""
    name = getattr(obj, "__module__", "") or ""
    top = name.split(".")[0]
    version = getattr(sys.modules.get(name), "__version__", None)
    if version:
        return str(version)
    version = getattr(sys.modules.get(top), "__version__", None)
    if not version and _distributions().get(top):
        try:
            version = importlib.metadata.version(_distributions()[top][0])
        except importlib.metadata.PackageNotFoundError:
            version = None
    return f"{top} {version}" if version else "0"


@functools.lru_cache(maxsize=1)
def _distributions() -> Mapping[str, list[str]]:
    """Top-level package -> the installed distributions that hold it (read once)."""
    return importlib.metadata.packages_distributions()


# --------------------------------------------------------------------------- SDPA


def _recognise_sdpa(fn: Callable[..., Any], parameters: list[inspect.Parameter], *, name: str, origin: str,
                    timeout: float | None) -> Implementation:
    names = {p.name for p in parameters}
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in parameters)
    unknown = [p.name for p in parameters[3:] if p.name not in SDPA_PARAMETERS
               and p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if unknown:
        raise ImplementationError(
            f"{origin} looks like an SDPA function (query, key, value) but also requires "
            f"{unknown}, which scaled_dot_product_attention does not have; give them defaults. "
            f"Expected parameters: {', '.join(SDPA_PARAMETERS)}"
        )
    accepted = set(SDPA_PARAMETERS) if has_var_kw else names & set(SDPA_PARAMETERS)
    sink_name = next((n for n in SDPA_SINK_NAMES if n in names), None)
    wrap = accepted != set(SDPA_PARAMETERS) or sink_name not in (None, "sinks")
    sdpa = _SDPAAdapter(fn, accepted, sink_name) if wrap else fn
    caps = probe_sdpa(sdpa, origin=origin, timeout=timeout)
    if sink_name is not None:
        caps = _probe_sinks(sdpa, caps, origin=origin, timeout=timeout)
    return Implementation(
        name=name,
        capabilities=caps,
        sdpa=sdpa,
        version=_version_of(fn),
        description=f"SDPA-signature function {origin}; capabilities probed, semantics "
                    "scaled_dot_product_attention's",
    )


class _SDPAAdapter:
    """Calls a function that lacks some of SDPA's optional parameters: a missing one
    is dropped while it has its default value and refused otherwise. Learned sinks go
    over under the function's own name for them (``sink_name``), only when given."""

    _DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}

    def __init__(self, fn: Callable[..., Any], accepted: set[str], sink_name: str | None = None) -> None:
        self.fn, self.accepted, self.sink_name = fn, accepted, sink_name
        self.__name__ = getattr(fn, "__name__", "sdpa")

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                 sinks=None):
        given = {"attn_mask": attn_mask, "dropout_p": dropout_p, "is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa}
        kwargs = {}
        for key_name, value_given in given.items():
            if key_name in self.accepted:
                kwargs[key_name] = value_given
            elif value_given is not self._DEFAULTS[key_name] and value_given != self._DEFAULTS[key_name]:
                raise NotImplementedError(f"{self.__name__} has no {key_name} parameter")
        if sinks is not None:
            if self.sink_name is None:
                raise NotImplementedError(f"{self.__name__} has no sinks parameter")
            kwargs[self.sink_name] = sinks
        return self.fn(query, key, value, **kwargs)


#: Names an SDPA-signature function may give learned sinks (N,): ``sinks`` (gpt-oss),
#: ``s_aux`` (vLLM), ``learnable_sink`` (FlashAttention-3). The suite passes ``sinks=``.
SDPA_SINK_NAMES = ("sinks", "s_aux", "learnable_sink")


def _probe_sinks(sdpa: Callable[..., Any], caps: Any, *, origin: str, timeout: float | None) -> Any:
    """A function naming a sinks argument: one call with sinks (N=2,) that runs and returns
    the (B, N, L, Ev) output declares ``sdpa_sinks`` (the meaning, ``spec.sdpa(sinks=)``'s, is
    then tested); one that raises is noted and not declared."""
    import torch

    probe = _Prober(origin, timeout)
    plan = probe_plan(level="sdpa")     # inside the declarations in force, as every probe call
    gen = torch.Generator().manual_seed(0)
    L, E = plan.L, plan.E
    q, k, v = (torch.randn(1, 2, L, E, generator=gen).to(getattr(torch, plan.dtype)) for _ in range(3))
    kwargs = {"is_causal": True} if plan.causal_only else {}
    try:
        out = probe.call("sinks", lambda: sdpa(q, k, v, sinks=torch.tensor([1.5, -0.5]), **kwargs))
    except CallRaised as exc:
        note = f"sdpa_sinks: sinks=[1.5, -0.5] raised {summarise(exc.error)}; declared unsupported"
        return caps.replace(probe_notes=(*caps.probe_notes, note))
    if not (isinstance(out, torch.Tensor) and tuple(out.shape) == (1, 2, L, E)):
        note = (f"sdpa_sinks: sinks=[1.5, -0.5] returned {type(out).__name__}, not the (1, 2, {L}, {E}) output; "
                "sdpa_sink_agreement is run and fails")
        return caps.replace(sdpa_sinks=True, probe_notes=(*caps.probe_notes, note))
    return caps.replace(sdpa_sinks=True)


# --------------------------------------------------------------------------- MHA


def _recognise_class(cls: type, *, name: str, origin: str, timeout: float | None) -> Implementation:
    init_parameters = _parameters(cls.__init__, origin)[1:]
    init = [p.name for p in init_parameters]
    forward_fn = getattr(cls, "forward", None)
    forward = [p.name for p in _parameters(forward_fn, origin)][1:] if forward_fn else []
    missing_init = [n for n in ("embed_dim", "num_heads") if n not in init]
    missing_forward = [n for n in MHA_FORWARD_PARAMETERS if n not in forward]
    if missing_init or missing_forward:
        if is_learner_candidate(cls):  # a hand-written module: the learner level reads it
            return dataclasses.replace(recognise_learner(cls, name=name, origin=origin, timeout=timeout),
                                       version=_version_of(cls))
        raise ImplementationError(
            f"{origin} is the class {cls.__name__}({', '.join(init)}) with forward"
            f"({', '.join(forward) or 'missing'}), which is not a drop-in for "
            f"torch.nn.MultiheadAttention: missing constructor parameters {missing_init} and "
            f"forward parameters {missing_forward}. Expected __init__({', '.join(MHA_INIT_PARAMETERS)}) "
            f"and forward({', '.join(MHA_FORWARD_PARAMETERS)}), or an Implementation"
        )
    from implementations.builtins.pytorch._torch_common import load_mha_weights

    accepts_kwargs = any(p.kind is p.VAR_KEYWORD for p in init_parameters)
    factory = _MHAFactory(cls, set(MHA_INIT_PARAMETERS) if accepts_kwargs else set(init))
    return Implementation(
        name=name,
        capabilities=probe_mha(factory, origin=origin, timeout=timeout),
        mha=factory,
        load_weights=load_mha_weights,
        version=_version_of(cls),
        description=f"nn.MultiheadAttention drop-in {origin}; capabilities probed, semantics "
                    "nn.MultiheadAttention's",
    )


class _MHAFactory:
    """Builds ``cls`` with the constructor options it accepts; an option it lacks is
    dropped while it has nn.MultiheadAttention's default and refused otherwise."""

    _DEFAULTS = {"dropout": 0.0, "bias": True, "add_bias_kv": False, "add_zero_attn": False,
                 "kdim": None, "vdim": None, "batch_first": False, "device": None, "dtype": None}

    def __init__(self, cls: type, accepted: set[str]) -> None:
        self.cls, self.accepted = cls, accepted
        self.__name__ = cls.__name__

    def __call__(self, embed_dim: int, num_heads: int, **options: Any) -> Any:
        kwargs = {}
        for key_name, value in options.items():
            if key_name in self.accepted:
                kwargs[key_name] = value
            elif value != self._DEFAULTS.get(key_name, object()):
                raise NotImplementedError(f"{self.cls.__name__} has no constructor option {key_name}")
        module = self.cls(embed_dim, num_heads, **kwargs)
        device, dtype = options.get("device"), options.get("dtype")
        if ("device" not in self.accepted and device is not None) or ("dtype" not in self.accepted and dtype is not None):
            module = module.to(device=device, dtype=dtype)
        return module


# --------------------------------------------------------------------------- varlen / kv-cache


def _varlen_level(names: list[str]) -> str | None:
    """``"varlen"`` for flash_attn_varlen_func's signature, ``"kvcache"`` for
    flash_attn_with_kvcache's, else None."""
    if tuple(names[:7]) == VARLEN_PARAMETERS:
        return "varlen"
    if tuple(names[:3]) == KVCACHE_PARAMETERS:
        return "kvcache"
    return None


#: kvcache-level features read from ``flash_attn_with_kvcache``'s signature: the feature is
#: claimed when every parameter named is there (its meaning is FlashAttention's contract).
KVCACHE_FEATURE_PARAMETERS = {
    "window": ("window_size",), "softcap": ("softcap",), "alibi": ("alibi_slopes",),
    "lse": ("return_softmax_lse",), "rotary": ("rotary_cos", "rotary_sin"),
    "cache_batch_idx": ("cache_batch_idx",), "cache_leftpad": ("cache_leftpad",), "num_splits": ("num_splits",),
    # FlashAttention-3's descales: FP8 q, caches and k/v in float8_e4m3fn, descales None or
    # (B, K), row b for everything sequence b attends
    "fp8": ("q_descale", "k_descale", "v_descale"),
}


#: varlen-level features read from ``flash_attn_varlen_func``'s signature (FlashAttention's
#: contract gives the meaning: ``dropout_p`` drops each sequence's weights after the softmax;
#: FlashAttention-3's descales take FP8 q, k, v in float8_e4m3fn, descales None or (B, K)).
VARLEN_FEATURE_PARAMETERS = {"dropout": ("dropout_p",), "fp8": ("q_descale", "k_descale", "v_descale")}


def _recognise_varlen(fn: Callable[..., Any], level: str, names: list[str], *, name: str,
                      origin: str) -> Implementation:
    """A FlashAttention-signature function, called as is; its capabilities are read from the
    signature (a missing ``causal``, ``softmax_scale``, ``k``/``v`` or ``block_table``
    parameter: that feature is not claimed; at the kvcache level each option of
    :data:`KVCACHE_FEATURE_PARAMETERS`, at the varlen level each of
    :data:`VARLEN_FEATURE_PARAMETERS`, whose parameters are there is claimed), not probed:
    ``--impl-option`` overrides them (FlashAttention itself: ``--device cuda --impl-option
    dtypes=float16,bfloat16``)."""
    has = set(names)
    kvcache_features = frozenset(feature for feature, parameters in KVCACHE_FEATURE_PARAMETERS.items()
                                 if level == "kvcache" and set(parameters) <= has)
    varlen_features = frozenset(feature for feature, parameters in VARLEN_FEATURE_PARAMETERS.items()
                                if level == "varlen" and set(parameters) <= has)
    caps = Capabilities(
        causal="lower_right" if "causal" in has else None,
        custom_scale="softmax_scale" in has,
        different_v_dim=False,           # FlashAttention-2 requires Ev == E
        autograd=False,
        mask_grad=False,
        mask_kinds=frozenset({"none"}),
        kv_paged="block_table" in has,
        kv_append={"k", "v"} <= has,
        kvcache_features=kvcache_features,
        varlen_features=varlen_features,
        **({"fp8_dtypes": ("float8_e4m3fn",), "fp8_descales": ("none", "per_head")}
           if "fp8" in varlen_features | kvcache_features else {}),
        probe_notes=(f"{level}: capabilities read from the signature, not probed",),
        sources={"causal": "contract"},  # flash_attn's causal: bottom-right per sequence
    )
    return Implementation(name=name, capabilities=caps, version=_version_of(fn),
                          description=f"{level}-level function {origin} (FlashAttention's signature)",
                          **{level: fn})
