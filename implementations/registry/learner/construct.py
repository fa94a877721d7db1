"""How a learner's module is built: ``(d_model, n_heads, dropout)`` arguments, or one
config object (nanoGPT's ``GPTConfig``, transformers' ``BertConfig``), read through the
base class's signature where the class forwards ``*args, **kwargs``.

A config is the one the code names (the parameter's annotation, else a class named
``...Config`` in the module's namespace), else a namespace answering the usual names; the
attributes the constructor reads are recorded (shown on the certificate), and a length
limit it carries (``block_size``) bounds the sequence lengths drawn.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing
from collections.abc import Mapping
from typing import Any

from implementations.registry.learner.options import (
    DIM_NAMES,
    DROPOUT_NAMES,
    HEAD_NAMES,
)
from implementations.registry.learner.reading import _usage

__all__ = ["Construction", "init_parameters", "read_constructor", "uninitialised"]

#: Config attributes that bound the sequence length (the module's buffers are that long).
LENGTH_LIMIT_NAMES = ("block_size", "max_position_embeddings", "n_positions", "n_ctx", "max_len",
                     "max_seq_len", "context_length", "max_length", "seq_len")
#: Config attributes for the bias of the projections.
BIAS_NAMES = ("bias", "qkv_bias", "use_bias", "attention_bias")
#: Constructor parameters giving the head dim (d_model = heads * it).
HEAD_SIZE_NAMES = ("head_size", "head_dim", "d_head", "dim_head", "d_k", "dk", "head_dims", "size_per_head")
#: The length a config gets where the suite chooses it (no default of its own).
DEFAULT_LIMIT = 64


def _is_dropout(name: str) -> bool:
    low = name.lower()
    return low in DROPOUT_NAMES or low.endswith(("dropout", "pdrop", "dropout_prob", "dropout_rate"))


#: Words of a config's dropout that acts after attention (on the projected output or the
#: residual), not on the attention weights: minGPT's and GPT-2's ``resid_pdrop``, BERT's
#: ``hidden_dropout_prob``. Set to 0, so the attention dropout alone is switched.
_OUTPUT_DROPOUT_WORDS = ("resid", "hidden", "output", "proj", "embd", "embed", "ffn", "mlp")


def _is_output_dropout(name: str) -> bool:
    low = name.lower()
    return any(word in low for word in _OUTPUT_DROPOUT_WORDS) and "attn" not in low and "attention" not in low


def init_parameters(cls: type, origin: str) -> tuple[type, list[inspect.Parameter]]:
    """``(the base whose signature was read through a forwarding ``__init__(*args,
    **kwargs)``, else ``cls``; the parameters after self)``."""
    forwarded = False
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = list(inspect.signature(inspect.unwrap(init)).parameters.values())[1:]
        except (TypeError, ValueError) as exc:
            raise _usage(origin, f"{klass.__name__}.__init__'s signature cannot be read ({exc})",
                         "give the class a Python __init__") from exc
        if any(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            return (klass if forwarded else cls), params
        forwarded = True
    return cls, []


class _Recording:
    """Mixed into a config class: records which attributes the constructor reads."""

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_"):
            object.__getattribute__(self, "__dict__").setdefault("_read_", []).append(name)
        return super().__getattribute__(name)  # the config's own (transformers maps aliases)


class _Namespace:
    """A config where the module's file names none: answers the usual names."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self.__dict__.update(values)
        self.__dict__["_read_"] = []

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_"):
            object.__getattribute__(self, "__dict__")["_read_"].append(name)
        return object.__getattribute__(self, name)


@dataclasses.dataclass(frozen=True)
class Construction:
    """How to build the module for (D, H, dropout)."""

    kind: str                    # "args" or "config"
    dim: str                     # parameter (args) or config attribute (config) of the model dim
    heads: str
    dropout: str | None          # parameter taking the dropout; config: the first dropout attribute
    config_arg: str | None = None
    config_type: Any = None      # the config class; None: a namespace
    #: args: an optional config parameter the code annotates (transformers' BartAttention):
    #: given one of that class, so the module finds its settings (its attention path).
    side_config: tuple[str, Any] | None = None
    dropouts: tuple[str, ...] = ()   # config: every dropout attribute (set together)
    values: tuple[tuple[str, Any], ...] = ()  # config: other attributes set (bias, limits, learner_config)
    read: tuple[str, ...] = ()   # config: the attributes the constructor read
    max_len: int | None = None
    limit_name: str | None = None
    heads_first: bool = False
    via: str | None = None       # the base class whose signature was read
    per_head: bool = False       # args: ``dim`` takes the head dim (d_model / heads)
    user: tuple[str, ...] = ()   # config attributes set by --impl-option learner_config

    def config(self, D: int, H: int, dropout: float = 0.0) -> Any:
        values = dict(self.values)
        values.update({self.dim: D, self.heads: H})
        # The attention dropout takes the case's p; one after attention stays 0; a value
        # --impl-option learner_config sets is kept.
        values.update({name: 0.0 if _is_output_dropout(name) else float(dropout)
                       for name in self.dropouts if name not in self.user})
        if self.config_type is None:  # every model-dim and head-count name answers D and H
            return _Namespace({**{n: D for n in DIM_NAMES}, **{n: H for n in HEAD_NAMES}, **values})
        recording = type(self.config_type.__name__, (_Recording, self.config_type), {})
        try:
            config = recording()
        except TypeError:  # required fields: give the known ones
            fields = _field_names(self.config_type)
            config = recording(**{k: v for k, v in values.items() if k in fields})
        for key, value in values.items():
            try:
                setattr(config, key, value)
            except (AttributeError, TypeError, ValueError):  # a frozen or validating config
                object.__setattr__(config, key, value)
        object.__getattribute__(config, "__dict__")["_read_"] = []
        return config

    def build(self, cls: type, D: int, H: int, dropout: float = 0.0, seen: list | None = None) -> Any:
        """The module, built from a fixed seed; ``seen`` gets the config it was built from.

        A parameter the constructor leaves uninitialised (``torch.nn.utils.skip_init`` or
        ``torch.empty``, as OpenNMT-py's projections are: its model initialises them
        later) holds whatever memory it was given, and a probe on it reads garbage (NaN,
        1e30) differently in every process. Such a parameter is found as one that differs
        between two builds from the same seed, and drawn here (``_UNSET`` keeps them per class and sizes)."""
        import torch

        def one(seen: list | None) -> Any:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                return self._construct(cls, D, H, dropout, seen)

        module = one(seen)
        key = (cls, self.kind, self.dim, self.heads, D, H, bool(dropout))
        if key not in _UNSET:
            again = one(None)
            theirs = dict(again.named_parameters())
            lazy = torch.nn.parameter.UninitializedParameter  # a lazy layer's: shaped at its first call
            _UNSET[key] = tuple(name for name, p in module.named_parameters()
                                if name in theirs and not isinstance(p, lazy) and not isinstance(theirs[name], lazy)
                                and p.shape == theirs[name].shape and not _same_bits(p, theirs[name]))
        if _UNSET[key]:
            _draw(module, _UNSET[key])
        return module

    def _construct(self, cls: type, D: int, H: int, dropout: float, seen: list | None) -> Any:
        if self.kind == "config":
            config = self.config(D, H, dropout)
            if seen is not None:
                seen.append(config)
            return cls(**{self.config_arg: config})
        kwargs = {self.dim: D // H if self.per_head else D, self.heads: H}
        if self.dropout is not None:
            kwargs[self.dropout] = float(dropout)
        if self.side_config is not None:
            name, config_type = self.side_config
            kwargs[name] = config = config_type()
            for key, value in self.values:
                setattr(config, key, value)
        return cls(**kwargs)

    def text(self, name: str) -> str:
        """The constructor in the module's terms, for the certificate."""
        via = f" (read through {self.via}'s signature)" if self.via else ""
        if self.kind == "args":
            dim = f"{self.dim} = d_model / {self.heads}" if self.per_head else self.dim
            args = f"{self.heads}, {dim}), heads first" if self.heads_first else f"{dim}, {self.heads})"
            return f"{name}({args}{via}"
        typed = self.config_type.__name__ if self.config_type is not None else "a namespace"
        read = list(dict.fromkeys(self.read))
        limit = (f"; {self.limit_name} {self.max_len} → L ≤ {self.max_len}" if self.limit_name else "")
        values = dict(self.values)
        user = "".join(f"; {n}={values[n]!r} (learner_config)" for n in self.user)
        return f"{name}({self.config_arg}: {typed}({', '.join(read) or 'nothing read'}{limit}{user})){via}"

    def snippet(self, name: str, D: int, H: int) -> list[str]:
        """Lines that build the module in a torch-only snippet."""
        if self.kind == "args":
            drop = f", {self.dropout}=0.0" if self.dropout else ""
            return [f"module = {name}({self.dim}={D // H if self.per_head else D}, {self.heads}={H}{drop})"]
        values = dict(self.values)
        values.update({self.dim: D, self.heads: H})
        values.update({n: 0.0 for n in self.dropouts if n not in self.user})
        fields = ", ".join(f"{k}={v!r}" for k, v in values.items())
        typed = self.config_type
        if typed is not None and not typed.__module__.startswith("_attention_conformance_user_"):
            # an importable config class (a library's): built as the module expects it
            return [f"from {typed.__module__} import {typed.__name__}", f"config = {typed.__name__}()",
                    *(f"config.{k} = {v!r}" for k, v in values.items()), f"module = {name}({self.config_arg}=config)"]
        return ["from types import SimpleNamespace", f"config = SimpleNamespace({fields})",
                f"module = {name}({self.config_arg}=config)"]


#: (class, how it is built, D, H, dropout on) -> the parameters its constructor leaves
#: uninitialised (they differ between two builds from one seed).
_UNSET: dict[tuple, tuple[str, ...]] = {}


def _same_bits(a: Any, b: Any) -> bool:
    import torch

    a, b = a.detach(), b.detach()
    if a.dtype.is_floating_point:
        return bool(torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))
                    and torch.equal(a.isnan(), b.isnan()))
    return bool(torch.equal(a, b))


def _draw(module: Any, names: tuple[str, ...]) -> None:
    """Give the uninitialised parameters ``names`` what ``nn.Linear`` gives its own: a
    matrix uniform in ±1/√fan_in, a vector zeros (ones for a norm's scale), from a fixed seed."""
    import torch

    params = dict(module.named_parameters())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name in names:
            p = params[name]
            if p.dim() >= 2:
                bound = 1.0 / max(1, p[0].numel()) ** 0.5
                value = (torch.rand(p.shape, generator=gen, dtype=torch.float64) * 2 - 1) * bound
            else:
                leaf = name.rsplit(".", 1)[-1]
                scale = leaf in ("gamma", "scale") or (leaf == "weight" and "norm" in name.lower())
                value = torch.ones(p.shape) if scale else torch.zeros(p.shape)
            p.copy_(value.to(p.dtype))


def uninitialised(cls: type, D: int, H: int) -> tuple[str, ...]:
    """The parameters of ``cls`` built with (D, H) that its constructor leaves
    uninitialised and the suite draws (known once the module has been built)."""
    return next((names for (c, *_, d, h, _), names in _UNSET.items() if c is cls and (d, h) == (D, H)), ())


def _field_names(config_type: Any) -> set[str]:
    if dataclasses.is_dataclass(config_type):
        return {f.name for f in dataclasses.fields(config_type)}
    try:
        return {p for p in inspect.signature(config_type).parameters if p not in ("args", "kwargs")}
    except (TypeError, ValueError):
        return set()


def _attributes(config_type: Any) -> dict[str, Any]:
    """The config's attributes and defaults (an instance built with no arguments, else the
    dataclass fields' defaults)."""
    try:
        return dict(vars(config_type()))
    except Exception:  # noqa: BLE001 - required fields: the defaults that exist
        if dataclasses.is_dataclass(config_type):
            return {f.name: (None if f.default is dataclasses.MISSING else f.default)
                    for f in dataclasses.fields(config_type)}
        return {}


def _config_type(cls: type, param: inspect.Parameter, fallback: bool = True) -> Any:
    """The config class the code names: the annotation, else a ``...Config`` class of the
    module's namespace that has a model-dim attribute; None: none named."""
    namespace = vars(sys.modules.get(cls.__module__)) if cls.__module__ in sys.modules else {}
    annotation = param.annotation
    if isinstance(annotation, str):
        annotation = namespace.get(annotation.split("|")[0].split("[")[0].strip().strip("'\""))
    for candidate in (annotation, *typing.get_args(annotation)):  # ``BartConfig | None`` too
        if isinstance(candidate, type) and _dim_name(_attributes(candidate)):
            return candidate
    for value in namespace.values() if fallback else ():
        if isinstance(value, type) and value.__name__.lower().endswith("config") and \
                _dim_name(_attributes(value)):
            return value
    return None


def _dim_name(attributes: Mapping[str, Any]) -> str | None:
    return next((n for n in DIM_NAMES if n in attributes), None)


def _parse(value: str) -> Any:
    low = value.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def learner_config_values(text: str | None) -> dict[str, Any]:
    """``--impl-option learner_config=name=value,name=value`` as a dict."""
    values = {}
    for item in (text or "").split(","):
        if item.strip():
            key, _, value = item.partition("=")
            values[key.strip()] = _parse(value)
    return values


def _read_config(cls: type, param: inspect.Parameter, origin: str, options: Mapping[str, str],
                 owner: type | None = None) -> Construction:
    # The class whose __init__ was read names its config in its own module (a subclass
    # forwarding *args to GPT2Attention lives in a file that never imports GPT2Config).
    config_type = (_config_type(owner, param) if owner not in (None, cls) else None) or _config_type(cls, param)
    user = learner_config_values(options.get("learner_config"))
    if config_type is not None:
        attributes = _attributes(config_type)
        dim = _dim_name(attributes)
        heads = next((n for n in HEAD_NAMES if n in attributes), None)
        dropouts = tuple(n for n in attributes if _is_dropout(n))
        values = {n: True for n in BIAS_NAMES if n in attributes and isinstance(attributes[n], bool)}
        limit_name = next((n for n in LENGTH_LIMIT_NAMES if isinstance(attributes.get(n), int)), None)
        max_len = attributes.get(limit_name) if limit_name else None
        if heads is None:
            raise _usage(origin, f"{cls.__name__}.__init__ takes a {config_type.__name__}, which has no head "
                         f"count attribute (names tried: {', '.join(HEAD_NAMES[:6])}...)",
                         "pass --impl-option learner_config=NAME=VALUE for the attributes it lacks")
    else:  # a namespace answering every usual name
        dim, heads = "n_embd", "n_head"
        dropouts = tuple(n for n in DROPOUT_NAMES) + ("attn_pdrop", "resid_pdrop", "attention_probs_dropout_prob")
        values = {"bias": True, "block_size": DEFAULT_LIMIT}
        limit_name, max_len = "block_size", DEFAULT_LIMIT
    values.update(user)
    if limit_name in user:
        max_len = user[limit_name]
    attention_dropouts = [n for n in dropouts if not _is_output_dropout(n)]
    return Construction(kind="config", dim=dim, heads=heads, dropout=next(iter(attention_dropouts), None),
                        config_arg=param.name, config_type=config_type, dropouts=dropouts,
                        values=tuple(values.items()), max_len=max_len, limit_name=limit_name,
                        user=tuple(user))


def read_constructor(cls: type, origin: str, options: Mapping[str, str]) -> Construction:
    """How ``cls`` is built (see the module docstring); a usage error naming what is not
    understood and the option that settles it."""
    owner, all_params = init_parameters(cls, origin)
    via = owner.__name__ if owner is not cls else None
    params = [p for p in all_params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    names = [p.name for p in params]
    if "learner_init" in options:
        dim, heads = (n.strip() for n in options["learner_init"].split(","))
        missing = [n for n in (dim, heads) if n not in names]
        if missing:
            raise _usage(origin, f"learner_init names {missing}, which {owner.__name__}.__init__({', '.join(names)}) "
                         "does not take", "give the names of its model-dim and head-count parameters")
    else:
        dim = next((n for n in names if n.lower() in DIM_NAMES), None)
        heads = next((n for n in names if n.lower() in HEAD_NAMES), None)
        size = next((n for n in names if n.lower() in HEAD_SIZE_NAMES), None)
        if dim is None and heads is not None and size is not None:
            dropout = next((n for n in names if _is_dropout(n)), None)
            return Construction(kind="args", dim=size, heads=heads, dropout=dropout, per_head=True, via=via,
                                heads_first=names.index(heads) < names.index(size))
        required = [p.name for p in params if p.default is p.empty and not _is_dropout(p.name)]
        if dim is None and heads is None and len(required) == 1:
            construction = _read_config(cls, params[names.index(required[0])], origin, options, owner)
            return dataclasses.replace(construction, via=via)
        if dim is None and heads is None and len(required) >= 2:
            dim, heads = required[0], required[1]
        elif (dim is None) != (heads is None):
            rest = [n for n in required if n not in (dim, heads)]
            if not rest:
                raise _usage(origin, f"{owner.__name__}.__init__({', '.join(names)}) has no parameter named like "
                             f"the {'model dim' if dim is None else 'head count'}",
                             "pass --impl-option learner_init=DIM,HEADS naming its two parameters")
            dim, heads = (rest[0], heads) if dim is None else (dim, rest[0])
        elif dim is None and not names:  # a decorator hid the signature and no base says more
            raise _usage(origin, f"{cls.__name__}.__init__ takes only *args, **kwargs (a decorator hides its "
                         "signature) and no base class says more, so the learner level cannot know what to pass",
                         "certify a three-line subclass whose __init__(self, d_model, n_heads) (or (self, config)) "
                         "calls super().__init__ with what the class needs")
        elif dim is None:
            raise _usage(origin, f"{owner.__name__}.__init__({', '.join(names)}) takes no model dim and head count "
                         f"(names tried: {', '.join(DIM_NAMES[:5])}...; {', '.join(HEAD_NAMES[:5])}...)",
                         "pass --impl-option learner_init=DIM,HEADS")
    dropout = next((n for n in names if _is_dropout(n) and n not in (dim, heads)), None)
    others = [p.name for p in params if p.default is p.empty and p.name not in (dim, heads, dropout)]
    if others:
        raise _usage(origin, f"{owner.__name__}.__init__ also requires {others}, which the suite cannot choose",
                     "give them defaults")
    side = next(((p.name, t) for p in params if p.default is None and p.name not in (dim, heads, dropout)
                 and (t := _config_type(owner, p, fallback=False)) is not None), None)
    return Construction(kind="args", dim=dim, heads=heads, dropout=dropout,
                        heads_first=names.index(heads) < names.index(dim), via=via, side_config=side,
                        values=tuple(learner_config_values(options.get("learner_config")).items()))

