"""Find the implementation that ``--impl`` names, and describe what it claims.

``resolve(spec)`` tries, in this order:

1. a registered built-in name (``handwritten``, ``torch-mha``, ``sdpa``, ``spec`` ...,
   see :func:`registered`);
2. an installed entry point in the group ``attention_conformance.implementations``;
3. ``mutant:NAME``, a deliberately broken implementation from the bug zoo
   (``implementations.mutants.MUTANTS``);
4. ``package.module:attr``;
5. ``path/to/file.py:attr``.

What ``attr`` (or an entry point) may be, recognised with no adapter code:

* an :class:`~implementations.base.Implementation`, or a zero-argument callable
  returning one;
* a function with the signature of ``torch.nn.functional.scaled_dot_product_attention``
  (``query, key, value`` first; ``attn_mask, dropout_p, is_causal, scale, enable_gqa``
  optional, a missing one meaning that feature is unsupported);
* a class that is a drop-in for ``torch.nn.MultiheadAttention`` (constructor
  ``embed_dim, num_heads, ...`` and ``forward(query, key, value, key_padding_mask,
  need_weights, attn_mask, average_attn_weights, is_causal)``; weights are loaded by
  nn.MultiheadAttention's parameter names).

For the last two the capabilities are *probed*: each optional feature is tried on
a tiny input and recorded as unsupported when the call raises. ``options``
(``--impl-option key=value``) then override any capability, e.g.
``causal=lower_right``, ``fully_masked=nan``, ``dtypes=float32,float16``, ``gqa=false``.

Every failure is an :class:`~implementations.base.ImplementationError` whose message
is one paragraph naming what was found and what was expected.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
import tomllib
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping

from implementations.base import (
    ALL_DTYPES,
    ALL_MASK_KINDS,
    ALL_MHA_FEATURES,
    CAUSAL_ALIGNMENTS,
    FULLY_MASKED_POLICIES,
    Capabilities,
    ExpectedFailure,
    Implementation,
    ImplementationError,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "describe",
    "listing",
    "load_expected_failures",
    "recognise",
    "registered",
    "resolve",
]

ENTRY_POINT_GROUP = "attention_conformance.implementations"
XFAIL_DIR = Path(__file__).resolve().parent / "xfail"

SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
MHA_INIT_PARAMETERS = (
    "embed_dim", "num_heads", "dropout", "bias", "add_bias_kv", "add_zero_attn",
    "kdim", "vdim", "batch_first", "device", "dtype",
)
MHA_FORWARD_PARAMETERS = (
    "query", "key", "value", "key_padding_mask", "need_weights", "attn_mask",
    "average_attn_weights", "is_causal",
)
_ACCEPTED = (
    "a registered name, an entry point of group "
    f"{ENTRY_POINT_GROUP!r}, 'mutant:NAME', 'package.module:attr' or 'path/to/file.py:attr' "
    "where attr is an Implementation (or a zero-argument callable returning one), a function "
    "with torch.nn.functional.scaled_dot_product_attention's signature, or a drop-in class for "
    "torch.nn.MultiheadAttention"
)


# --------------------------------------------------------------------------- registry


@functools.cache
def _build_builtin(name: str) -> Implementation:
    from implementations.builtins import BUILTINS

    target = BUILTINS[name]
    module_name, _, attr = target.partition(":")
    try:
        maker = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        return Implementation(
            name=name, unavailable_reason=f"{target} cannot be loaded: {type(exc).__name__}: {exc}"
        )
    parameters = inspect.signature(maker).parameters.values()
    takes_name = any(p.name == "name" or p.kind is p.VAR_KEYWORD for p in parameters)
    return maker(name=name) if takes_name else maker()


def registered() -> dict[str, Callable[[], Implementation]]:
    """Listed built-ins, name -> zero-argument builder (each built once, on first call)."""
    from implementations.builtins import BUILTINS

    return {name: functools.partial(_build_builtin, name) for name in BUILTINS}


def resolve(spec: str, options: Mapping[str, str] | None = None) -> Implementation:
    """The implementation ``spec`` names (see the module docstring), with ``options``
    overriding its capabilities."""
    if not isinstance(spec, str) or not spec.strip():
        raise ImplementationError(f"--impl={spec!r} is empty; give {_ACCEPTED}")
    spec = spec.strip()
    impl = _resolve(spec)
    return apply_options(impl, options) if options else impl


def _resolve(spec: str) -> Implementation:
    builtins = registered()
    if spec in builtins:
        return builtins[spec]()
    entry_point = _find_entry_point(spec)
    if entry_point is not None:
        try:
            obj = entry_point.load()
        except Exception as exc:  # the user's package raised while importing
            raise ImplementationError(
                f"--impl={spec!r} is the entry point {entry_point.value!r} (group "
                f"{ENTRY_POINT_GROUP!r}) but loading it raised {_summary(exc)}; fix that "
                "package or reinstall it"
            ) from exc
        return recognise(obj, name=spec, origin=f"entry point {entry_point.value!r}")
    if spec.startswith("mutant:"):
        return _resolve_mutant(spec.removeprefix("mutant:"))
    if ":" in spec:
        location, _, attr = spec.rpartition(":")
        if location.endswith(".py") or "/" in location or "\\" in location:
            module = _import_file(spec, location)
        else:
            module = _import_module(spec, location)
        if not attr.isidentifier():
            raise ImplementationError(
                f"--impl={spec!r}: {attr!r} after the colon is not an attribute name; "
                f"write {location}:NAME where NAME is defined in it"
            )
        if not hasattr(module, attr):
            public = sorted(n for n in vars(module) if not n.startswith("_"))[:20]
            raise ImplementationError(
                f"--impl={spec!r}: {location} has no attribute {attr!r}; it defines {public}. "
                f"Expected {attr!r} to be {_ACCEPTED.split(' where attr is ')[1]}"
            )
        return recognise(getattr(module, attr), name=spec, origin=spec)
    raise ImplementationError(
        f"--impl={spec!r} is not a registered implementation (registered: "
        f"{', '.join(sorted(builtins))}), not an installed entry point of group "
        f"{ENTRY_POINT_GROUP!r} (installed: {', '.join(_entry_point_names()) or 'none'}), "
        f"and has no ':' for module:attr or file.py:attr; give {_ACCEPTED}"
    )


def _find_entry_point(name: str) -> importlib.metadata.EntryPoint | None:
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.name == name:
            return entry_point
    return None


def _entry_point_names() -> list[str]:
    return sorted({ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)})


def _resolve_mutant(name: str) -> Implementation:
    try:
        from implementations.mutants import MUTANTS
    except ImportError as exc:
        raise ImplementationError(
            f"--impl='mutant:{name}' needs the bug zoo implementations.mutants (a MUTANTS dict), "
            f"which does not import here: {_summary(exc)}"
        ) from exc
    if name not in MUTANTS:
        raise ImplementationError(
            f"--impl='mutant:{name}': no mutant named {name!r}; the bug zoo has "
            f"{', '.join(sorted(MUTANTS)) or 'none'}"
        )
    impl = MUTANTS[name].build()
    if not isinstance(impl, Implementation):
        raise ImplementationError(
            f"mutant {name!r}'s build() returned {type(impl).__name__}, expected an Implementation"
        )
    return impl


def _summary(exc: BaseException) -> str:
    """``Type: message (at file:line)`` for the innermost frame, on one line."""
    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})"
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}{where}"


def _import_module(spec: str, module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise ImplementationError(
                f"--impl={spec!r}: no module named {module_name!r} is importable from "
                f"sys.path (looked for {exc.name!r}); install it, run from its directory, or "
                "give a file path as path/to/file.py:attr"
            ) from exc
        raise ImplementationError(
            f"--impl={spec!r}: importing module {module_name!r} raised {_summary(exc)}; "
            "the module itself imports something that is missing"
        ) from exc
    except Exception as exc:
        raise ImplementationError(
            f"--impl={spec!r}: importing module {module_name!r} raised {_summary(exc)}; "
            "fix the error in that module"
        ) from exc


def _import_file(spec: str, location: str) -> Any:
    path = Path(location).expanduser()
    if not path.is_file():
        raise ImplementationError(
            f"--impl={spec!r}: no file {location!r} (looked for {path.resolve()}); "
            "give an existing path/to/file.py:attr"
        )
    module_name = f"_attention_conformance_user_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImplementationError(f"--impl={spec!r}: {location!r} is not a loadable Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ImplementationError(
            f"--impl={spec!r}: running {location!r} raised {_summary(exc)}; fix the error in "
            "that file"
        ) from exc
    return module


# --------------------------------------------------------------------------- recognition


def recognise(obj: Any, *, name: str, origin: str = "") -> Implementation:
    """An :class:`Implementation` for ``obj`` (see the module docstring for what is accepted)."""
    origin = origin or name
    if isinstance(obj, Implementation):
        return obj
    if inspect.isclass(obj):
        return _recognise_class(obj, name=name, origin=origin)
    if not callable(obj):
        raise ImplementationError(
            f"{origin} is a {type(obj).__name__}, not callable; expected "
            f"{_ACCEPTED.split(' where attr is ')[1]}"
        )
    parameters = _parameters(obj, origin)
    names = [p.name for p in parameters]
    if names[:3] == ["query", "key", "value"]:
        return _recognise_sdpa(obj, parameters, name=name, origin=origin)
    required = [p.name for p in parameters if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not required:
        try:
            made = obj()
        except Exception as exc:
            raise ImplementationError(
                f"{origin} takes no arguments, so it was called to build an Implementation, "
                f"but the call raised {_summary(exc)}"
            ) from exc
        if isinstance(made, Implementation):
            return made
        raise ImplementationError(
            f"{origin} takes no arguments, so it was called expecting an Implementation, but "
            f"it returned {type(made).__name__}; return implementations.Implementation(...)"
        )
    raise ImplementationError(
        f"{origin} has the signature {getattr(obj, '__name__', 'f')}({', '.join(names)}), which "
        "is not torch.nn.functional.scaled_dot_product_attention's "
        f"({', '.join(SDPA_PARAMETERS)}): the first three parameters must be named query, key, "
        "value; or give a drop-in class for torch.nn.MultiheadAttention, or an Implementation"
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
        return list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError) as exc:
        raise ImplementationError(
            f"{origin} is callable but its signature cannot be read ({exc}); wrap it in a Python "
            "function with scaled_dot_product_attention's signature"
        ) from exc


def _recognise_sdpa(fn: Callable[..., Any], parameters: list[inspect.Parameter], *, name: str, origin: str) -> Implementation:
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
    sdpa = _SDPAAdapter(fn, accepted) if accepted != set(SDPA_PARAMETERS) else fn
    caps = probe_sdpa(sdpa, origin=origin)
    return Implementation(
        name=name,
        capabilities=caps,
        sdpa=sdpa,
        version=_version_of(fn),
        description=f"SDPA-signature function {origin}; capabilities probed",
    )


class _SDPAAdapter:
    """Calls a function that lacks some of SDPA's optional parameters: a missing one
    is dropped while it has its default value and refused otherwise."""

    _DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}

    def __init__(self, fn: Callable[..., Any], accepted: set[str]) -> None:
        self.fn, self.accepted = fn, accepted
        self.__name__ = getattr(fn, "__name__", "sdpa")

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        given = {"attn_mask": attn_mask, "dropout_p": dropout_p, "is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa}
        kwargs = {}
        for key_name, value_given in given.items():
            if key_name in self.accepted:
                kwargs[key_name] = value_given
            elif value_given is not self._DEFAULTS[key_name] and value_given != self._DEFAULTS[key_name]:
                raise NotImplementedError(f"{self.__name__} has no {key_name} parameter")
        return self.fn(query, key, value, **kwargs)


def _recognise_class(cls: type, *, name: str, origin: str) -> Implementation:
    init = [p.name for p in _parameters(cls.__init__, origin)][1:]
    forward_fn = getattr(cls, "forward", None)
    forward = [p.name for p in _parameters(forward_fn, origin)][1:] if forward_fn else []
    missing_init = [n for n in ("embed_dim", "num_heads") if n not in init]
    missing_forward = [n for n in MHA_FORWARD_PARAMETERS if n not in forward]
    if missing_init or missing_forward:
        raise ImplementationError(
            f"{origin} is the class {cls.__name__}({', '.join(init)}) with forward"
            f"({', '.join(forward) or 'missing'}), which is not a drop-in for "
            f"torch.nn.MultiheadAttention: missing constructor parameters {missing_init} and "
            f"forward parameters {missing_forward}. Expected __init__({', '.join(MHA_INIT_PARAMETERS)}) "
            f"and forward({', '.join(MHA_FORWARD_PARAMETERS)}), or an Implementation"
        )
    accepts_kwargs = any(p.kind is p.VAR_KEYWORD for p in _parameters(cls.__init__, origin))
    factory = _MHAFactory(cls, set(MHA_INIT_PARAMETERS) if accepts_kwargs else set(init))
    from implementations.builtins._torch_common import load_mha_weights

    caps = probe_mha(factory, origin=origin)
    return Implementation(
        name=name,
        capabilities=caps,
        mha=factory,
        load_weights=load_mha_weights,
        version=_version_of(cls),
        description=f"nn.MultiheadAttention drop-in {origin}; capabilities probed",
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


def _version_of(obj: Any) -> str:
    module = sys.modules.get(getattr(obj, "__module__", "") or "")
    return str(getattr(module, "__version__", "0"))


# --------------------------------------------------------------------------- probing


def _raises(call: Callable[[], Any]) -> bool:
    try:
        call()
        return False
    except Exception:
        return True


def probe_sdpa(fn: Callable[..., Any], *, origin: str) -> Capabilities:
    """Capabilities of an SDPA-signature function, found by tiny calls on CPU."""
    import torch

    from implementations.builtins.handwritten import scaled_dot_product_attention as reference

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
            f"(1, 2, 3, 4), value (1, 2, 3, 4) raised {_summary(exc)}; it must at least run that"
        ) from exc
    dtypes = tuple(d for d in ALL_DTYPES if not _raises(lambda d=d: fn(*qkv(dtype=getattr(torch, d)))))
    bool_mask = torch.tensor([[True, False, True], [True, True, False]])
    mask_kinds = {"none"}
    if not _raises(lambda: fn(q, k, v, attn_mask=bool_mask)):
        mask_kinds.add("bool")
    if not _raises(lambda: fn(q, k, v, attn_mask=torch.randn(2, 3, generator=gen))):
        mask_kinds.add("additive")
    causal = _probe_causal(fn, q, k, v, reference)
    fully_masked = _probe_fully_masked(fn, q, k, v) if "bool" in mask_kinds else "unspecified"

    def backward(mask_grad: bool = False) -> bool:
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        mask = torch.randn(2, 3, generator=gen).requires_grad_() if mask_grad else None
        fn(qq, kk, vv, attn_mask=mask).sum().backward()
        return qq.grad is not None and (mask is None or mask.grad is not None)

    def ok(call: Callable[[], Any]) -> bool:
        try:
            return call() is not False
        except Exception:
            return False

    return Capabilities(
        devices=("cpu",),
        dtypes=dtypes or ("float32",),
        mask_kinds=frozenset(mask_kinds),
        causal=causal,
        fully_masked=fully_masked,
        different_v_dim=ok(lambda: fn(*qkv(Ev=3))),
        gqa=ok(lambda: fn(*qkv(N=2, K=1), enable_gqa=True)),
        dropout=ok(lambda: fn(q, k, v, dropout_p=0.5)),
        custom_scale=ok(lambda: fn(q, k, v, scale=0.5)),
        autograd=ok(backward),
        mask_grad="additive" in mask_kinds and ok(lambda: backward(mask_grad=True)),
        non_contiguous=ok(lambda: fn(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v)),
    )


def _probe_causal(fn, q, k, v, reference) -> str | None:
    import torch

    try:
        got = fn(q, k, v, is_causal=True)  # L=2, S=3: the two alignments differ
    except Exception:
        return None
    lower_right = torch.ones(2, 3, dtype=torch.bool).tril(diagonal=1)
    lr = reference(q.double(), k.double(), v.double(), attn_mask=lower_right)
    if torch.allclose(got.double(), lr, atol=1e-4) and not torch.allclose(
        got.double(), reference(q.double(), k.double(), v.double(), is_causal=True), atol=1e-4
    ):
        return "lower_right"
    return "upper_left"


def _probe_fully_masked(fn, q, k, v) -> str:
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


def probe_mha(factory: Callable[..., Any], *, origin: str) -> Capabilities:
    """Capabilities of an nn.MultiheadAttention drop-in, found by tiny calls on CPU."""
    import torch

    # L == S and query = key = value unless a feature needs otherwise, so that a
    # self-attention-only module is probed feature by feature too.
    D, N, L, S, B = 4, 2, 3, 3, 2
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(L, B, D, generator=gen)
    kv = torch.randn(S, B, D, generator=gen)
    try:
        module = factory(D, N)
        module.eval()
        module(x, x, x)
    except Exception as exc:
        raise ImplementationError(
            f"{origin} has nn.MultiheadAttention's signature but building it with (embed_dim=4, "
            f"num_heads=2) and calling it on query = key = value of shape (3, 2, 4) raised "
            f"{_summary(exc)}; it must at least run that"
        ) from exc

    def runs(call: Callable[[], Any]) -> bool:
        try:
            return call() is not False
        except Exception:
            return False

    def call(build: dict | None = None, *args, **forward) -> Any:
        m = factory(D, N, **(build or {}))
        m.eval()
        q_, k_, v_ = args or (x, x, x)
        return m(q_, k_, v_, **forward)

    kpm = torch.tensor([[False, False, True], [False, True, False]])
    causal = torch.ones(L, S, dtype=torch.bool).tril().logical_not()
    features = {
        "cross_attention": lambda: call(None, x, kv, kv),
        "bias": lambda: call({"bias": False}),
        "kdim_vdim": lambda: call({"kdim": 3, "vdim": 5}, x, torch.randn(S, B, 3), torch.randn(S, B, 5)),
        "bias_kv": lambda: call({"add_bias_kv": True}),
        "zero_attn": lambda: call({"add_zero_attn": True}),
        "batch_first": lambda: call({"batch_first": True}, *[x.transpose(0, 1)] * 3),
        "unbatched": lambda: call(None, *[x[:, 0]] * 3),
        "key_padding_mask": lambda: (call(None, key_padding_mask=kpm),
                                     call(None, key_padding_mask=torch.zeros(B, S).masked_fill(kpm, float("-inf")))),
        "attn_mask": lambda: (call(None, attn_mask=causal), call(None, attn_mask=torch.randn(L, S))),
        "is_causal": lambda: call(None, attn_mask=causal, is_causal=True),
        "need_weights": lambda: call(None, need_weights=True)[1] is not None,
        "average_weights": lambda: call(None, need_weights=True, average_attn_weights=False)[1].dim() == 4,
        "dropout": lambda: factory(D, N, dropout=0.5).train()(x, x, x),
    }
    mha_features = frozenset(f for f, probe in features.items() if runs(probe))
    dtypes = tuple(
        d for d in ALL_DTYPES
        if runs(lambda d=d: call({"dtype": getattr(torch, d)}, *[x.to(getattr(torch, d))] * 3))
    )

    def backward() -> bool:
        m = factory(D, N)
        xx = x.clone().requires_grad_()
        m(xx, xx, xx)[0].sum().backward()
        return xx.grad is not None

    fully_masked = "unspecified"
    if "key_padding_mask" in mha_features:
        blocked = torch.tensor([[True, True, True], [False, False, False]])
        m = factory(D, N)
        m.eval()
        out = m(x, x, x, key_padding_mask=blocked, need_weights=False)[0][:, 0]  # (L, D), batch 0
        bias = getattr(getattr(m, "out_proj", None), "bias", None)
        if torch.isnan(out).all():
            fully_masked = "nan"
        elif bias is not None and torch.allclose(out, bias.detach().expand_as(out)):
            fully_masked = "zero"  # attention output 0, so the module output is out_proj.bias
    return Capabilities(
        devices=("cpu",),
        dtypes=dtypes or ("float32",),
        causal="upper_left",
        fully_masked=fully_masked,
        returns_weights="need_weights" in mha_features,
        dropout="dropout" in mha_features,
        autograd=runs(backward),
        mask_grad=False,
        mha_features=mha_features,
    )


# --------------------------------------------------------------------------- options


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError("use true or false")


def _parse_list(choices: tuple[str, ...] | frozenset[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(item.strip() for item in text.split(",") if item.strip())
        bad = [item for item in items if item not in choices]
        if bad or not items:
            raise ValueError(f"a comma-separated list of {sorted(choices)}; {bad or text!r} is not")
        return items
    return parse


def _parse_choice(choices: tuple[str, ...], allow_none: bool = False) -> Callable[[str], str | None]:
    def parse(text: str) -> str | None:
        if allow_none and text.strip().lower() in ("none", "false", "no"):
            return None
        if text.strip() not in choices:
            raise ValueError(f"one of {list(choices) + (['none'] if allow_none else [])}")
        return text.strip()
    return parse


def _parse_optional_int(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    value = int(text)
    if value < 1:
        raise ValueError("a positive integer or none")
    return value


_OPTION_PARSERS: dict[str, Callable[[str], Any]] = {
    "devices": _parse_list(("cpu", "cuda", "mps", "xpu")),
    "dtypes": _parse_list(ALL_DTYPES),
    "mask_kinds": lambda text: frozenset(_parse_list(ALL_MASK_KINDS)(text)),
    "causal": _parse_choice(CAUSAL_ALIGNMENTS, allow_none=True),
    "fully_masked": _parse_choice(FULLY_MASKED_POLICIES),
    "mha_features": lambda text: frozenset(() if text.strip().lower() == "none" else _parse_list(ALL_MHA_FEATURES)(text)),
    "max_head_dim": _parse_optional_int,
    "max_seq_len": _parse_optional_int,
    "min_head_dim": _parse_optional_int,
}
for _field in dataclasses.fields(Capabilities):
    if _field.type in ("bool", bool):
        _OPTION_PARSERS[_field.name] = _parse_bool


def apply_options(impl: Implementation, options: Mapping[str, str]) -> Implementation:
    """``impl`` with capabilities overridden by ``--impl-option key=value`` pairs
    (applied at both levels)."""
    changes: dict[str, Any] = {}
    for key_name, text in options.items():
        parser = _OPTION_PARSERS.get(key_name)
        if parser is None:
            raise ImplementationError(
                f"--impl-option {key_name}={text}: unknown option {key_name!r}; valid options are "
                f"{', '.join(sorted(_OPTION_PARSERS))}"
            )
        try:
            changes[key_name] = parser(str(text))
        except ValueError as exc:
            raise ImplementationError(
                f"--impl-option {key_name}={text}: bad value for {key_name!r}; expected {exc}"
            ) from exc
    try:
        caps = impl.capabilities.replace(**changes)
        mha_caps = impl.mha_capabilities.replace(**changes) if impl.mha_capabilities else None
    except ImplementationError as exc:
        raise ImplementationError(f"--impl-option values {dict(options)} are inconsistent: {exc}") from exc
    return dataclasses.replace(impl, capabilities=caps, mha_capabilities=mha_caps)


# --------------------------------------------------------------------------- expected failures


def load_expected_failures(name: str, directory: Path | None = None) -> tuple[ExpectedFailure, ...]:
    """Entries of ``implementations/xfail/<name>.toml`` (none when the file is absent).

    Each ``[[xfail]]`` has ``property`` (or ``"*"``), ``reason``, optional ``match`` and
    ``reference`` (CONTRACTS.md); ``match`` values are matched by
    :meth:`ExpectedFailure.applies` (plain value, list = any of, ``"none"`` = None, or a
    table of comparisons ``lt/le/gt/ge/ne/in``, validated here).
    """
    path = (directory or XFAIL_DIR) / f"{name}.toml"
    if not path.is_file():
        return ()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ImplementationError(f"{path} is not valid TOML: {exc}") from exc
    entries = []
    for index, entry in enumerate(data.get("xfail", [])):
        unknown = set(entry) - {"property", "match", "reason", "reference"}
        if unknown or "property" not in entry or "reason" not in entry:
            raise ImplementationError(
                f"{path} entry {index}: needs property and reason (optional match, reference); "
                f"got keys {sorted(entry)}"
            )
        match = dict(entry.get("match", {}))
        for key_name, wanted in match.items():
            if isinstance(wanted, dict) and (not wanted or set(wanted) - set(_COMPARISONS)):
                raise ImplementationError(
                    f"{path} entry {index}: match.{key_name}={wanted!r}; a table value must use "
                    f"only {sorted(_COMPARISONS)} (e.g. {{ le = 0.0 }})"
                )
        entries.append(ExpectedFailure(
            property=entry["property"], reason=entry["reason"],
            match=match, reference=entry.get("reference", ""),
        ))
    return tuple(entries)


_COMPARISONS = ("lt", "le", "gt", "ge", "ne", "in")


# --------------------------------------------------------------------------- describing


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _caps_line(c: Capabilities, level: str) -> str:
    parts = [
        f"devices={','.join(c.devices)}",
        f"dtypes={','.join(c.dtypes)}",
        f"masks={','.join(sorted(c.mask_kinds))}",
        f"causal={c.causal or 'no'}",
        f"fully_masked={c.fully_masked}",
    ]
    if level == "sdpa":
        parts += [f"Ev!=E={_yes(c.different_v_dim)}", f"gqa={_yes(c.gqa)}"]
    else:
        parts += [f"weights={_yes(c.returns_weights)}"]
    parts += [
        f"dropout={_yes(c.dropout)}", f"scale={_yes(c.custom_scale)}",
        f"autograd={_yes(c.autograd)}", f"mask_grad={_yes(c.mask_grad)}",
        f"non_contiguous={_yes(c.non_contiguous)}",
    ]
    for bound in ("min_head_dim", "max_head_dim", "max_seq_len"):
        if getattr(c, bound) is not None:
            parts.append(f"{bound}={getattr(c, bound)}")
    if level == "mha":
        missing = sorted(ALL_MHA_FEATURES - set(c.mha_features))
        parts.append(f"mha_features=all but {missing}" if missing else "mha_features=all")
    return " ".join(parts)


def describe(impl: Implementation) -> str:
    """Several lines: name, version, availability, description, capabilities per level,
    expected failures."""
    status = "available" if impl.available else f"UNAVAILABLE: {impl.unavailable_reason}"
    lines = [f"{impl.name} ({impl.version}) - {status}"]
    if impl.description:
        lines.append(f"  {impl.description}")
    if impl.sdpa is not None:
        lines.append(f"  SDPA level: {_caps_line(impl.caps('sdpa'), 'sdpa')}")
    if impl.mha is not None:
        lines.append(f"  MHA level: {_caps_line(impl.caps('mha'), 'mha')}")
    for entry in impl.expected_failures:
        match = f" {dict(entry.match)}" if entry.match else ""
        ref = f" [{entry.reference}]" if entry.reference else ""
        lines.append(f"  expected failure: {entry.property}{match}: {entry.reason}{ref}")
    return "\n".join(lines)


def listing() -> str:
    """A table of every listed built-in (for ``--impl=list``), unavailable ones with why."""
    header = ("name", "available", "levels", "devices", "dtypes", "masks", "causal",
              "fully-masked", "gqa", "Ev!=E", "dropout", "grad", "xfails")
    rows, notes = [], []
    for name, build in registered().items():
        impl = build()
        if not impl.listed:
            continue
        levels = "+".join(lvl for lvl, fn in (("sdpa", impl.sdpa), ("mha", impl.mha)) if fn is not None)
        c = impl.caps("sdpa" if impl.sdpa is not None else "mha")
        short = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}
        rows.append((
            name, _yes(impl.available), levels or "-", ",".join(c.devices),
            ",".join(short[d] for d in c.dtypes), ",".join(sorted(c.mask_kinds - {"none"})) or "-",
            c.causal or "-", c.fully_masked,
            _yes(c.gqa) if impl.sdpa is not None else "-",
            _yes(c.different_v_dim) if impl.sdpa is not None else "-",
            _yes(c.dropout), _yes(c.autograd), str(len(impl.expected_failures)),
        ))
        if not impl.available:
            notes.append(f"  {name}: {impl.unavailable_reason}")
        elif impl.description:
            notes.append(f"  {name}: {impl.description}")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*row) for row in rows]
    return "\n".join(lines + ["", "notes:", *notes])
