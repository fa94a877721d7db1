"""The learner level: certify a hand-written multi-head attention module with no adapter.

A tutorial's module is never an ``nn.MultiheadAttention`` drop-in: its constructor is
``(d_model, num_heads)`` (or ``(h, d_model)``, with ``dropout=``), its projections are four
``nn.Linear`` (``w_q/w_k/w_v/w_o``, ``q_proj/..``, ``linears``) or one fused ``qkv`` Linear,
its ``forward`` is ``(x, mask=None)``, ``(query, key, value, mask=None)`` or ``(q, kv,
mask=None)`` on batch-first ``(B, L, D)`` inputs, its mask is 1 = keep, True = blocked
or additive in one of several shapes, and it returns the output or ``(output, weights)``.
:func:`recognise_learner` reads such a class and returns an MHA-level
:class:`~implementations.base.Implementation` whose factory wraps the module in
nn.MultiheadAttention's interface (:class:`LearnerMHA`) and whose ``load_weights`` maps
``spec.MHAParams`` onto the module's own Linear layers, so every MHA-level property
runs on it.

What is *read* (signature, parameter names and shapes): the constructor's model-dim and
head-count arguments, which Linear is q, k, v, o (by name; by definition order when the
names do not say, e.g. ``linears``), the forward's inputs and mask argument, dropout.
What is *probed*, each a convention the module may choose and never its behaviour:

* the mask convention (1 = keep, True = blocked, additive) and which shapes it accepts:
  every query row of a batch item is left exactly one key; a convention is accepted when
  that makes the rows of each batch item equal (a single attended key gives every row
  that key's value, whatever the scale, the head layout or the softmax's numerics), a
  property that the classic mistakes (scale by d_model, heads split without a transpose)
  do not change and that a wrong polarity breaks;
* the fused projection's head layout (q, k, v blocks or per-head q, k, v): each candidate
  is accepted only when the module matches ``spec.mha_forward`` exactly with it (float64,
  no mask), else the block layout is assumed and said so;
* whether weights are returned, per head or averaged; whether dropout can be switched on;
  what a row with every key blocked gives (zero, NaN, uniform).

Where a convention cannot be told apart from a bug (a fused projection cut k, q, v; four
anonymous Linear layers in another order) the common one is assumed, the certificate says
so, and ``--impl-option`` overrides it (:data:`LEARNER_OPTIONS`).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping

import numpy as np

import spec
from implementations.base import ALL_DTYPES, Capabilities, Implementation, ImplementationError
from implementations.guard import CallRaised, CallTimedOut, guarded_call
from implementations.registry._errors import summarise
from implementations.registry.learner_terms import layer_at

__all__ = [
    "LEARNER_OPTIONS",
    "LearnerMHA",
    "LearnerPlan",
    "is_learner_candidate",
    "learner_options",
    "recognise_learner",
    "split_learner_options",
]

#: ``--impl-option`` keys of the learner level -> what they take.
LEARNER_OPTIONS = {
    "learner_mask": "keep|blocked|additive (1 = keep / True = blocked / added to the scores)",
    "learner_fused": "qkv|kqv|qkv_per_head (how a fused q, k, v projection is cut)",
    "learner_projections": "Q,K,V,O attribute names of the Linear layers (or QKV,O for a fused one)",
    "learner_init": "DIM,HEADS names of the constructor's model-dim and head-count parameters",
}
MASK_CONVENTIONS = ("keep", "blocked", "additive")
FUSED_LAYOUTS = ("qkv", "kqv", "qkv_per_head")

DIM_NAMES = ("d_model", "embed_dim", "dim", "hidden_size", "n_embd", "d_embed", "model_dim", "emb_dim",
             "embedding_dim", "hidden_dim", "embed_size", "d_hidden", "n_state", "d", "dmodel", "width",
             "input_dim", "in_dim", "num_hiddens", "d_in")
HEAD_NAMES = ("num_heads", "n_heads", "heads", "h", "n_head", "nhead", "nheads", "num_attention_heads",
              "head_count", "n_heads_", "num_head", "head_num", "n_h")
#: forward arguments that give lengths (a prefix of valid keys), not a mask.
LENGTH_NAMES = ("valid_lens", "valid_len", "valid_length", "valid_lengths", "lengths", "lens", "seq_lens",
                "seq_len", "src_lengths", "key_lengths", "kv_lens")
DROPOUT_NAMES = ("dropout", "dropout_p", "attn_dropout", "p_drop", "drop", "p", "dropout_rate", "attn_pdrop",
                 "attention_dropout", "attn_drop", "drop_prob", "dropout_prob")

_OPTIONS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("learner_options", default=None)


# --------------------------------------------------------------------------- options


def split_learner_options(options: Mapping[str, str] | None) -> tuple[dict[str, str], dict[str, str]]:
    """``(learner options, the other options)``; an unknown ``learner_*`` key or a bad
    value raises ImplementationError naming the valid ones."""
    learner, rest = {}, {}
    for key, value in (options or {}).items():
        (learner if key.startswith("learner_") else rest)[key] = str(value)
    for key, value in learner.items():
        if key not in LEARNER_OPTIONS:
            raise ImplementationError(
                f"--impl-option {key}={value}: unknown learner option {key!r}; valid: "
                + "; ".join(f"{k}={v}" for k, v in LEARNER_OPTIONS.items()))
        choices = {"learner_mask": MASK_CONVENTIONS, "learner_fused": FUSED_LAYOUTS}.get(key)
        if choices and value not in choices:
            raise ImplementationError(f"--impl-option {key}={value}: bad value; expected one of {list(choices)}")
        names = [n.strip() for n in value.split(",") if n.strip()]
        if key == "learner_projections" and len(names) not in (2, 4):
            raise ImplementationError(
                f"--impl-option {key}={value}: expected 4 names (q, k, v, o Linear layers) or 2 (the "
                "fused q, k, v Linear and the output Linear), comma-separated")
        if key == "learner_init" and len(names) != 2:
            raise ImplementationError(
                f"--impl-option {key}={value}: expected the names of the model-dim and head-count "
                "constructor parameters, e.g. learner_init=d_model,n_heads")
    return learner, rest


@contextlib.contextmanager
def learner_options(options: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """While open, :func:`recognise_learner` reads ``options`` (the registry opens it
    around resolving ``--impl``); the yielded dict gets ``"_used"`` once they are read."""
    held = dict(options)
    token = _OPTIONS.set(held)
    try:
        yield held
    finally:
        _OPTIONS.reset(token)


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class LearnerPlan:
    """Everything read and probed about one learner class."""

    cls: type
    dim_arg: str                # constructor parameter name of the model dim
    heads_arg: str              # ... of the head count
    dropout_arg: str | None     # constructor parameter taking the dropout probability
    #: role -> Linear attribute path: "q", "k", "v", "o", or "qkv"/"kv" for a fused one.
    projections: tuple[tuple[str, str], ...]
    projections_how: str        # "by name", "in definition order", "--impl-option"
    fused: str = "qkv"          # head layout of a fused projection
    fused_how: str = ""
    inputs: str = "self"        # "self" forward(x), "kv" forward(q, kv), "qkv" forward(q, k, v)
    forward_names: tuple[str, ...] = ()
    mask_arg: str | None = None
    mask: str | None = None     # keep / blocked / additive, None: no mask
    mask_dtype: str = "bool"    # bool / long / float (keep and blocked masks)
    mask_how: str = ""
    #: accepted mask shapes, each a tuple of "B", "H", "L", "S", "1" (e.g. ("B", "1", "1", "S")).
    mask_shapes: tuple[tuple[str, ...], ...] = ()
    returns: str = "output"     # "output", "pair" (output, weights)
    weights: str | None = None  # None, "per_head" (B, H, L, S), "averaged" (B, L, S)
    notes: tuple[str, ...] = field(default=())
    origin: str = ""            # the --impl value that named the class (file.py:Class, module:Class)

    def role(self, name: str) -> str | None:
        return dict(self.projections).get(name)


def _shape_text(shape: tuple[str, ...]) -> str:
    return "(" + ", ".join(shape) + ")"


# --------------------------------------------------------------------------- the wrapper


class _Unsupported(NotImplementedError):
    pass


def _make_learner_mha(plan: LearnerPlan):
    import torch
    from torch import nn

    class _LearnerMHA(nn.Module):
        """nn.MultiheadAttention's constructor and forward around a learner's module."""

        def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                     kdim=None, vdim=None, batch_first=False, device=None, dtype=None):
            super().__init__()
            name = plan.cls.__name__
            if add_bias_kv or add_zero_attn:
                raise _Unsupported(f"{name} has no bias_k/bias_v or zero-attention key (add_bias_kv, add_zero_attn)")
            if kdim not in (None, embed_dim) or vdim not in (None, embed_dim):
                raise _Unsupported(f"{name} projects keys and values from d_model only (kdim/vdim)")
            if dropout and plan.dropout_arg is None:
                raise _Unsupported(f"{name}'s constructor takes no dropout argument")
            kwargs = {plan.dim_arg: embed_dim, plan.heads_arg: num_heads}
            if plan.dropout_arg is not None:
                kwargs[plan.dropout_arg] = float(dropout)
            inner = _materialised(plan.cls(**kwargs), plan.inputs, embed_dim)
            if plan.dropout_arg is None:  # a hard-wired nn.Dropout: off, as dropout=0 asks
                for sub in inner.modules():
                    if isinstance(sub, nn.Dropout):
                        sub.p = 0.0
            self.inner = inner.to(device=device, dtype=dtype)
            self.embed_dim, self.num_heads, self.batch_first = embed_dim, num_heads, batch_first
            with torch.no_grad():
                for _, path in plan.projections:
                    layer = layer_at(self.inner, path)
                    if bias and layer.bias is None:  # nn.Linear adds its bias when it has one
                        layer.bias = nn.Parameter(torch.zeros(layer.out_features, device=layer.weight.device,
                                                              dtype=layer.weight.dtype))
                    elif not bias and layer.bias is not None:
                        layer.bias = None

        def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                    average_attn_weights=True, is_causal=False):
            unbatched = query.dim() == 2
            if unbatched:
                query, key, value = (t.unsqueeze(1) for t in (query, key, value))
                if key_padding_mask is not None:
                    key_padding_mask = key_padding_mask.unsqueeze(0)
            elif self.batch_first:
                query, key, value = (t.transpose(0, 1) for t in (query, key, value))
            q, k, v = (t.transpose(0, 1) for t in (query, key, value))  # (B, T, D)
            B, L, S = q.shape[0], q.shape[1], k.shape[1]
            kwargs = {}
            mask = _merged_mask(key_padding_mask, attn_mask, B, self.num_heads, L, S, q.dtype)
            if mask is not None:
                kwargs[plan.mask_arg] = _render_mask(plan, mask, (B, self.num_heads, L, S))
            if plan.inputs == "self":
                if not (key is query or torch.equal(k, q)) or not (value is query or torch.equal(v, q)):
                    raise _Unsupported(f"{plan.cls.__name__} is self-attention only: forward takes one input")
                out = self.inner(q, **kwargs)
            elif plan.inputs == "kv":
                if not (value is key or torch.equal(k, v)):
                    raise _Unsupported(f"{plan.cls.__name__} takes one key/value input: key must equal value")
                out = self.inner(q, k, **kwargs)
            else:
                out = self.inner(q, k, v, **kwargs)
            weights = None
            if plan.returns == "pair":
                out, weights = out[0], out[1]
            if need_weights and weights is not None:
                if plan.weights == "per_head" and average_attn_weights:
                    weights = weights.mean(dim=1)
                elif plan.weights == "averaged" and not average_attn_weights:
                    raise _Unsupported(f"{plan.cls.__name__} returns weights averaged over heads")
                if unbatched:
                    weights = weights[0]
            else:
                weights = None
            if unbatched:
                return out[0], weights
            out = out if self.batch_first else out.transpose(0, 1)
            return out, weights

    _LearnerMHA.__name__ = _LearnerMHA.__qualname__ = f"{plan.cls.__name__}AsMHA"
    return _LearnerMHA


def _materialised(module: Any, inputs: str, D: int) -> Any:
    """``module`` with its lazy layers (``nn.LazyLinear``, whose in_features are known only
    after a first call) given their shapes by one call on zeros (B=1, L=2, d_model=D)."""
    import torch
    from torch.nn.modules.lazy import LazyModuleMixin

    if not any(isinstance(m, LazyModuleMixin) and m.has_uninitialized_params() for m in module.modules()):
        return module
    x = torch.zeros(1, 2, D)
    training = module.training
    with torch.no_grad():
        module.eval()
        module(*{"self": (x,), "kv": (x, x), "qkv": (x, x, x)}[inputs])
    return module.train(training)


class LearnerMHA:
    """The factory: ``LearnerMHA(plan)(embed_dim, num_heads, **options)`` builds the
    learner's module inside nn.MultiheadAttention's interface."""

    def __init__(self, plan: LearnerPlan) -> None:
        self.plan = plan
        self.module_class = _make_learner_mha(plan)
        self.__name__ = plan.cls.__name__

    def __call__(self, embed_dim: int, num_heads: int, **options: Any) -> Any:
        return self.module_class(embed_dim, num_heads, **options)

    def own_terms(self, case: Any, fully_masked: str) -> str | None:
        """``case``'s call as the module receives it, a torch snippet in its own names
        (:func:`implementations.registry.learner_terms.in_own_terms`)."""
        import torch

        from implementations.registry.learner_terms import in_own_terms

        params = case.params
        if params.in_proj_weight is None or getattr(case, "add_bias_kv", False):
            return None
        module = self(params.embed_dim, params.num_heads, bias=params.in_proj_bias is not None,
                      batch_first=case.batch_first, dtype=getattr(torch, case.dtype))
        module._learner_plan = self.plan
        load_learner_weights(module, params)
        return in_own_terms(module, self.plan, case, fully_masked)


def _merged_mask(key_padding_mask, attn_mask, B, H, L, S, dtype):
    """One additive float mask broadcastable to (B, H, L, S) (-inf blocked), or None."""
    import torch

    parts = []
    for mask, shape in ((key_padding_mask, (B, 1, 1, S)), (attn_mask, None)):
        if mask is None:
            continue
        if shape is None:
            shape = (1, 1, L, S) if mask.dim() == 2 else (B, H, L, S)
        mask = mask.reshape(shape)
        if mask.dtype == torch.bool:
            mask = torch.zeros(shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
        parts.append(mask.to(dtype))
    if not parts:
        return None
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _render_mask(plan: LearnerPlan, additive, sizes_bhls):
    """The merged additive (B|1, H|1, L|1, S) mask in the module's convention and in the
    smallest accepted shape that holds it (``sizes_bhls``: the call's B, H, L, S)."""
    import torch

    B, H, L, S = sizes_bhls
    varies = {"B": B > 1 and not bool((additive == additive[:1]).all()),
              "H": H > 1 and not bool((additive == additive[:, :1]).all()),
              "L": L > 1 and not bool((additive == additive[:, :, :1]).all())}
    if plan.mask != "additive" and not bool((torch.isneginf(additive) | (additive == 0)).all()):
        raise _Unsupported(f"{plan.cls.__name__}'s mask is {plan.mask}: a float bias has no such form")
    # The smallest shape that holds the mask: key padding goes as (B, 1, 1, S) where the
    # module takes it, so a convention the module reads differently there shows.
    for shape in sorted(plan.mask_shapes, key=lambda s: sum(d in s for d in ("B", "H", "L"))):
        if (varies["B"] and "B" not in shape) or (varies["H"] and "H" not in shape) or \
                (varies["L"] and "L" not in shape):
            continue
        full = additive
        if "H" not in shape:
            full = full[:, :1]
        if "L" not in shape:
            full = full[:, :, :1]
        if "B" not in shape:
            full = full[:1]
        sizes = {"B": B, "H": H, "L": L, "S": S}
        target = tuple(sizes[d] if d != "1" else 1 for d in shape)
        kept = [d for d in ("B", "H", "L", "S") if d in shape]
        full = full.expand(B if "B" in shape else 1, H if "H" in shape else 1, L if "L" in shape else 1, S)
        squeezed = full.reshape(tuple(sizes[d] for d in kept))
        mask = squeezed.reshape(target).contiguous()
        if plan.mask == "additive":
            return mask
        blocked = torch.isneginf(mask)
        wanted = ~blocked if plan.mask == "keep" else blocked
        return wanted if plan.mask_dtype == "bool" else wanted.to(getattr(torch, {"long": "int64"}.get(
            plan.mask_dtype, plan.mask_dtype)))
    raise _Unsupported(f"{plan.cls.__name__} takes no mask shape that holds this mask "
                       f"(varies along {[d for d, v in varies.items() if v]})")


def load_learner_weights(module: Any, params: Any) -> None:
    """Copy ``spec.MHAParams`` onto the learner's Linear layers (casting to their dtype)."""
    import torch

    plan = module_plan(module)
    inner = module.inner
    D, H = params.embed_dim, params.num_heads
    if params.in_proj_weight is None:
        raise _Unsupported(f"{plan.cls.__name__} projects keys and values from d_model only (kdim/vdim)")
    w, b = np.asarray(params.in_proj_weight), params.in_proj_bias
    rows = {"q": np.arange(0, D), "k": np.arange(D, 2 * D), "v": np.arange(2 * D, 3 * D)}
    dh = D // H
    if plan.fused == "kqv":
        fused = np.concatenate([rows["k"], rows["q"], rows["v"]])
    elif plan.fused == "qkv_per_head":
        fused = np.concatenate([np.arange(h * dh, (h + 1) * dh) + part * D for h in range(H) for part in range(3)])
    else:
        fused = np.arange(3 * D)
    rows["qkv"] = fused
    rows["kv"] = np.arange(D, 3 * D)
    with torch.no_grad():
        for role, path in plan.projections:
            layer = layer_at(inner, path)
            if role == "o":
                weight, bias = np.asarray(params.out_proj_weight), params.out_proj_bias
            else:
                weight, bias = w[rows[role]], None if b is None else np.asarray(b)[rows[role]]
            if tuple(layer.weight.shape) != weight.shape:
                raise ImplementationError(
                    f"{plan.cls.__name__}.{path}.weight has shape {tuple(layer.weight.shape)}, but the "
                    f"{role} projection of d_model={D} needs {weight.shape}")
            layer.weight.copy_(torch.as_tensor(weight, dtype=torch.float64))
            if layer.bias is not None:
                layer.bias.copy_(torch.as_tensor(np.zeros(weight.shape[0]) if bias is None else np.asarray(bias),
                                                 dtype=torch.float64))


def module_plan(module: Any) -> LearnerPlan:
    return module._learner_plan


# --------------------------------------------------------------------------- reading the class


def is_learner_candidate(cls: type) -> bool:
    """Whether ``cls`` is a torch module class (the learner level's domain)."""
    try:
        from torch import nn
    except ImportError:
        return False
    return isinstance(cls, type) and issubclass(cls, nn.Module)


def _usage(origin: str, what: str, fix: str) -> ImplementationError:
    return ImplementationError(
        f"{origin}: not recognised as a hand-written attention module: {what}; {fix}. It is not a drop-in "
        "for torch.nn.MultiheadAttention either (__init__(embed_dim, num_heads, ...), forward(query, key, "
        "value, key_padding_mask, need_weights, attn_mask, ...)); or write an implementations.Implementation")


def _signature(fn: Any, origin: str) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(fn).parameters.values())[1:]
    except (TypeError, ValueError) as exc:
        raise _usage(origin, f"its signature cannot be read ({exc})",
                     "give the class a Python __init__/forward") from exc


def _constructor(cls: type, origin: str, options: Mapping[str, str]) -> tuple[Any, Any, str | None, list[str]]:
    params = [p for p in _signature(cls.__init__, origin) if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    names = [p.name for p in params]
    notes = []
    if "learner_init" in options:
        dim, heads = (n.strip() for n in options["learner_init"].split(","))
        missing = [n for n in (dim, heads) if n not in names]
        if missing:
            raise _usage(origin, f"learner_init names {missing}, which {cls.__name__}.__init__({', '.join(names)}) "
                         "does not take", "give the names of its model-dim and head-count parameters")
    else:
        dim = next((n for n in names if n.lower() in DIM_NAMES), None)
        heads = next((n for n in names if n.lower() in HEAD_NAMES), None)
        required = [p.name for p in params if p.default is p.empty]
        if dim is None and heads is None and len(required) == 1:
            raise _usage(origin, f"{cls.__name__}.__init__({', '.join(names)}) takes one object ({required[0]}: a "
                         "config, as GPT- and BERT-style modules do), not a model dim and a head count, and "
                         "the learner level cannot know which fields it reads",
                         f"wrap it in a module whose __init__(d_model, n_heads) builds the {required[0]}")
        if dim is None and heads is None and len(required) >= 2:
            dim, heads = required[0], required[1]
        elif (dim is None) != (heads is None):
            rest = [n for n in required if n not in (dim, heads)]
            if not rest:
                raise _usage(origin, f"{cls.__name__}.__init__({', '.join(names)}) has no parameter named like "
                             f"the {'model dim' if dim is None else 'head count'}",
                             "pass --impl-option learner_init=DIM,HEADS naming its two parameters")
            dim, heads = (rest[0], heads) if dim is None else (dim, rest[0])
        elif dim is None:
            raise _usage(origin, f"{cls.__name__}.__init__({', '.join(names)}) takes no model dim and head count "
                         f"(names tried: {', '.join(DIM_NAMES[:5])}...; {', '.join(HEAD_NAMES[:5])}...)",
                         "pass --impl-option learner_init=DIM,HEADS")
    others = [p.name for p in params if p.default is p.empty and p.name not in (dim, heads)]
    if others:
        raise _usage(origin, f"{cls.__name__}.__init__ also requires {others}, which the suite cannot choose",
                     "give them defaults")
    dropout = next((n for n in names if n.lower() in DROPOUT_NAMES and n not in (dim, heads)), None)
    order = "heads first" if names.index(heads) < names.index(dim) else "model dim first"
    notes.append(f"{cls.__name__}({dim}, {heads})" if order == "model dim first" else
                 f"{cls.__name__}({heads}, {dim}), heads first")
    return dim, heads, dropout, notes


_STRIP_PREFIX = ("linear", "proj", "lin", "to", "fc", "w")
_STRIP_SUFFIX = ("projection", "linear", "proj", "layer", "dense", "lin", "fc", "weight", "net")
_ROLE_WORDS = {
    "q": "q", "query": "q", "queries": "q", "k": "k", "key": "k", "keys": "k", "v": "v", "value": "v",
    "values": "v", "o": "o", "out": "o", "output": "o", "c": "o", "": "o", "concat": "o", "final": "o",
    "merge": "o", "outproj": "o", "combine": "o", "qkv": "qkv", "cattn": "qkv", "inproj": "qkv", "attn": "qkv",
    "kv": "kv", "keyvalue": "kv",
}


def _role_of(path: str) -> str | None:
    """q/k/v/o/qkv/kv from a Linear's attribute name, or None (e.g. ``linears.0``)."""
    last = path.rsplit(".", 1)[-1].lower()
    if last.isdigit():
        return None
    compact = re.sub(r"[^a-z]", "", last)
    if "qkv" in compact:
        return "qkv"
    for prefix in _STRIP_PREFIX:
        if compact.startswith(prefix) and compact[len(prefix):] in _ROLE_WORDS:
            compact = compact[len(prefix):]
            break
    for suffix in _STRIP_SUFFIX:
        if compact.endswith(suffix) and compact[:-len(suffix)] in _ROLE_WORDS:
            compact = compact[:-len(suffix)]
            break
    return _ROLE_WORDS.get(compact)


def _linears(module: Any, D: int) -> list[tuple[str, Any]]:
    from torch import nn

    return [(name, sub) for name, sub in module.named_modules()
            if isinstance(sub, nn.Linear) and name and sub.in_features == D
            and sub.out_features in (D, 2 * D, 3 * D)]


def _projections(module: Any, D: int, cls: type, origin: str,
                 options: Mapping[str, str]) -> tuple[tuple[tuple[str, str], ...], str]:
    found = _linears(module, D)
    shapes = {name: sub.out_features // D for name, sub in found}
    listing = ", ".join(f"{name} ({sub.out_features}x{sub.in_features})" for name, sub in found) or "none"
    if "learner_projections" in options:
        names = [n.strip() for n in options["learner_projections"].split(",")]
        bad = [n for n in names if n not in shapes]
        if bad:
            raise _usage(origin, f"learner_projections names {bad}, not Linear layers of in_features d_model "
                         f"(found: {listing})", "name its q, k, v, o Linear layers")
        roles = ("q", "k", "v", "o") if len(names) == 4 else ("qkv", "o")
        return tuple(zip(roles, names, strict=True)), "as --impl-option learner_projections says"
    fix = ("pass --impl-option learner_projections=Q,K,V,O (or QKV,O) naming its Linear layers in_features "
           "= d_model")
    fused3 = [n for n, k in shapes.items() if k == 3]
    fused2 = [n for n, k in shapes.items() if k == 2]
    square = [n for n, k in shapes.items() if k == 1]
    by_role = {}
    for name in square + fused2 + fused3:
        by_role.setdefault(_role_of(name), []).append(name)
    if len(fused3) == 1 and len(square) == 1:
        return (("qkv", fused3[0]), ("o", square[0])), "by shape (one fused q, k, v Linear of 3·d_model)"
    if len(fused2) == 1 and len(square) == 2:
        q = by_role.get("q", [None])[0] or square[0]
        o = next(n for n in square if n != q)
        return (("q", q), ("kv", fused2[0]), ("o", o)), "by name and shape (one fused k, v Linear of 2·d_model)"
    if len(square) == 4 and not fused2 and not fused3:
        roles = {r: names[0] for r, names in by_role.items() if r in ("q", "k", "v", "o") and len(names) == 1}
        if set(roles) == {"q", "k", "v", "o"}:
            return tuple((r, roles[r]) for r in "qkvo"), "by name"
        return tuple(zip("qkvo", square, strict=True)), "in definition order, assumed q, k, v, o"
    raise _usage(origin, f"{cls.__name__}'s Linear layers of in_features d_model are {listing}: expected four "
                 "(q, k, v, output), or a fused q, k, v one (3·d_model) and an output one", fix)


def _forward(cls: type, origin: str) -> tuple[str, tuple[str, ...], str | None]:
    forward = getattr(cls, "forward", None)
    if forward is None:
        raise _usage(origin, f"{cls.__name__} has no forward", "define forward(x, mask=None)")
    params = _signature(forward, origin)
    mask = next((p.name for p in params if "mask" in p.name.lower()), None)
    inputs = [p for p in params if p.name != mask and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
              and p.default is p.empty]
    extra = [p.name for p in params if p.name != mask and p.default is p.empty and p.kind is p.KEYWORD_ONLY]
    names = tuple(p.name for p in inputs)
    if extra or not 1 <= len(inputs) <= 3:
        raise _usage(origin, f"{cls.__name__}.forward({', '.join(p.name for p in params)}) takes "
                     f"{len(inputs)} required inputs{f' and requires {extra}' if extra else ''}",
                     "expected forward(x, mask=None), forward(q, kv, mask=None) or forward(query, key, value, "
                     "mask=None) on (B, L, D) inputs")
    return {1: "self", 2: "kv", 3: "qkv"}[len(inputs)], names, mask


# --------------------------------------------------------------------------- probing

# B != H, so that a (B, L, S) mask broadcast as (H, L, S) against the scores is not taken
# for one read per batch item.
_D, _H, _B, _L = 8, 2, 3, 4


class _Probe:
    def __init__(self, origin: str, timeout: float | None) -> None:
        self.origin, self.timeout = origin, timeout

    def call(self, what: str, fn: Any) -> Any:
        try:
            return guarded_call(fn, timeout=self.timeout, rng=True)
        except CallTimedOut:
            raise ImplementationError(f"{self.origin}: probing {what} did not return within {self.timeout:g}s "
                                      "(--example-timeout); fix the hang") from None

    def value(self, what: str, fn: Any) -> Any:
        """``fn()``, or None when it raises."""
        try:
            return self.call(what, fn)
        except CallRaised:
            return None


def _build(plan: LearnerPlan, params: Any, **options: Any) -> Any:
    import torch

    module = _PlannedFactory(plan)(params.embed_dim, params.num_heads, dtype=torch.float64, **options)
    load_learner_weights(module, params)
    return module.eval()


def _raw(module: Any, plan: LearnerPlan, x: Any, mask: Any = None) -> Any:
    """The learner module called on batch-first ``x`` (self-attention), output only."""
    kwargs = {} if mask is None else {plan.mask_arg: mask}
    args = {"self": (x,), "kv": (x, x), "qkv": (x, x, x)}[plan.inputs]
    out = module.inner(*args, **kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


def _probe_output(probe: _Probe, plan: LearnerPlan, params: Any, x: Any) -> LearnerPlan:
    import torch

    def plain() -> Any:
        module = _build(plan, params)
        args = {"self": (x,), "kv": (x, x), "qkv": (x, x, x)}[plan.inputs]
        return module.inner(*args)

    try:
        out = probe.call("a plain call", plain)
    except CallRaised as exc:
        raise _usage(probe.origin, f"building {plan.cls.__name__} with d_model={_D}, heads={_H} and calling it on "
                     f"x of shape ({_B}, {_L}, {_D}) raised {summarise(exc.error)}",
                     "it must at least run that (batch-first (B, L, D) inputs)") from exc.error
    shape = (_B, _L, _D)
    if isinstance(out, torch.Tensor) and tuple(out.shape) == shape:
        return replace(plan, returns="output")
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) and tuple(out[0].shape) == shape:
        w = out[1] if len(out) > 1 else None
        kind = None
        if isinstance(w, torch.Tensor) and tuple(w.shape) == (_B, _H, _L, _L):
            kind = "per_head"
        elif isinstance(w, torch.Tensor) and tuple(w.shape) == (_B, _L, _L):
            kind = "averaged"
        return replace(plan, returns="pair", weights=kind)
    got = (f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__)
    raise _usage(probe.origin, f"{plan.cls.__name__} on x ({_B}, {_L}, {_D}) returned {got}",
                 f"it must return the output ({_B}, {_L}, {_D}) or (output, weights)")


def _exact(got: Any, want: np.ndarray) -> bool:
    got = got.detach().double().numpy()
    return got.shape == want.shape and bool(np.allclose(got, want, rtol=1e-9, atol=1e-9))


def _probe_fused(probe: _Probe, plan: LearnerPlan, params: Any, x: Any, options: Mapping[str, str]) -> LearnerPlan:
    if "qkv" not in dict(plan.projections):
        return plan
    if "learner_fused" in options:
        return replace(plan, fused=options["learner_fused"], fused_how="as --impl-option learner_fused says")
    xs = x.double().numpy()
    want, _ = spec.mha_forward(params, xs, xs, xs, batch_first=True, need_weights=False)
    for layout in ("qkv", "qkv_per_head"):
        candidate = replace(plan, fused=layout)
        got = probe.value(f"fused layout {layout}", lambda c=candidate: _raw(_build(c, params), c, x))
        if got is not None and _exact(got, want):
            how = ("q, k, v blocks of d_model rows each" if layout == "qkv" else
                   "per head: q, k, v rows of each head together")
            return replace(plan, fused=layout, fused_how=f"cut as {how} (the module matches the oracle exactly "
                           "with it); the order q, k, v is assumed, --impl-option learner_fused=kqv if yours "
                           "differs")
    return replace(plan, fused="qkv", fused_how="assumed cut as q, k, v blocks of d_model rows (no layout "
                   "matched the oracle exactly on a probe; --impl-option learner_fused=qkv|kqv|qkv_per_head "
                   "overrides)")


#: Mask shapes tried, most specific convention first: full (B, 1, L, S) masks decide the
#: polarity; key-padding shapes after them; the per-head (B, H, L, S) last.
_SHAPES = (("B", "1", "L", "S"), ("B", "L", "S"), ("B", "1", "1", "S"), ("B", "1", "S"), ("B", "S"), ("L", "S"),
           ("B", "H", "L", "S"))


def _keep_pattern(shape: tuple[str, ...], per_row: bool) -> np.ndarray:
    """A keep (True = attend) mask of ``shape`` leaving each query row one key: key 0, S-1,
    1 for batch items 0, 1, 2; with ``per_row`` (shapes with L) row L-1 of each item keeps
    another one; per head (H) head 1 keeps that other one on every row."""
    full = np.zeros((_B, _H, _L, _L), dtype=bool)
    for b in range(_B):
        key = (0, _L - 1, 1)[b % 3]
        other = (key + 2) % _L
        full[b, :, :, key] = True
        if per_row and "L" in shape:
            full[b, :, -1, :] = False
            full[b, :, -1, other] = True
        if "H" in shape:
            full[b, 1] = False
            full[b, 1, :, other] = True
    index = tuple(slice(None) if d in shape else slice(0, 1) for d in ("B", "H", "L", "S"))
    sizes = {"B": _B, "H": _H, "L": _L, "S": _L, "1": 1}
    return full[index].reshape(tuple(sizes[d] for d in shape))


def _as_full(shape: tuple[str, ...], mask: np.ndarray) -> np.ndarray:
    """The (B, H, L, S) keep pattern a mask of ``shape`` means (missing dims broadcast)."""
    sizes = {"B": _B, "H": _H, "L": _L, "S": _L}
    return np.broadcast_to(mask.reshape(tuple(sizes[d] if d in shape else 1 for d in ("B", "H", "L", "S"))),
                           (_B, _H, _L, _L))


def _rows_follow(out: Any, full_keep: np.ndarray) -> bool:
    """Rows of each batch item that attend the same keys are equal, and rows attending
    different ones differ (``full_keep`` (B, H, L, S), True = attend)."""
    got = out.detach().double().numpy()
    if not np.isfinite(got).all():
        return False
    for b in range(got.shape[0]):
        pattern = [full_keep[b, :, row].tobytes() for row in range(got.shape[1])]
        for i in range(got.shape[1]):
            for j in range(i + 1, got.shape[1]):
                same = np.allclose(got[b, i], got[b, j], rtol=1e-9, atol=1e-9)
                if same != (pattern[i] == pattern[j]):
                    return False
    return True


def _convention_tensor(keep: np.ndarray, convention: str, dtype: str) -> Any:
    import torch

    if convention == "additive":
        return torch.from_numpy(np.where(keep, 0.0, -np.inf))
    value = keep if convention == "keep" else ~keep
    tensor = torch.from_numpy(np.ascontiguousarray(value))
    return tensor if dtype == "bool" else tensor.to(torch.int64)


def _probe_mask(probe: _Probe, plan: LearnerPlan, params: Any, x: Any, options: Mapping[str, str]) -> LearnerPlan:
    if plan.mask_arg is None:
        forward = [p.name for p in inspect.signature(plan.cls.forward).parameters.values()]
        lengths = next((n for n in forward if n.lower() in LENGTH_NAMES), None)
        if lengths is not None:
            return replace(plan, mask=None, mask_how=(
                f"{plan.cls.__name__}.forward's {lengths} is read as valid lengths, which the learner level "
                "does not translate yet: masked cases skipped (a mask argument, e.g. mask of shape (B, 1, S) "
                "with 1 = keep, would enable them)"))
        return replace(plan, mask=None, mask_how=f"{plan.cls.__name__}.forward takes no mask argument")
    module = probe.value("a plain call", lambda: _build(plan, params))
    plain = probe.value("a plain call", lambda: _raw(module, plan, x))
    if plain is None or _rows_follow(plain, np.ones((_B, _H, _L, _L), dtype=bool)):
        return replace(plan, mask=None, mask_how="rows of a plain call are already equal; the mask cannot be probed")
    conventions = [options["learner_mask"]] if "learner_mask" in options else list(MASK_CONVENTIONS)
    found: dict[tuple[str, ...], tuple[str, str]] = {}
    for shape in _SHAPES:
        for convention in conventions:
            dtypes = ("float",) if convention == "additive" else ("bool", "long")
            for dtype in dtypes:
                ok = True
                for per_row in ((False, True) if "L" in shape else (False,)):
                    keep = _keep_pattern(shape, per_row)
                    full = _as_full(shape, keep)
                    tensor = _convention_tensor(keep, convention, dtype)
                    got = probe.value(f"mask {convention} {_shape_text(shape)}",
                                      lambda t=tensor: _raw(module, plan, x, t))
                    if got is None or tuple(got.shape) != (_B, _L, _D) or not _rows_follow(got, full):
                        ok = False
                        break
                if ok:
                    found[shape] = (convention, dtype)
                    break
            if shape in found:
                break
    if not found:
        return _assumed_mask(probe, plan, module, x, options)
    first = next(iter(found))
    convention, dtype = found[first]
    disagree = [s for s, (c, _) in found.items() if c != convention]
    words = {"keep": "1/True = keep, 0/False = blocked", "blocked": "True = blocked",
             "additive": "additive (0 = keep, -inf = blocked)"}[convention]
    how = f"{words}{' as ' + dtype if dtype == 'long' else ''} ({'--impl-option learner_mask' if 'learner_mask' in options else 'probed'})"
    if disagree:
        how += (f"; but shapes {', '.join(_shape_text(s) for s in disagree)} read the other way (inconsistent): "
                "the suite hands them over in this convention too, so the inconsistency fails")
    return replace(plan, mask=convention, mask_dtype=dtype, mask_shapes=tuple(found), mask_how=how)


def _assumed_mask(probe: _Probe, plan: LearnerPlan, module: Any, x: Any, options: Mapping[str, str]) -> LearnerPlan:
    """No convention passed the probe (the module may have a mistake that breaks it):
    assume the most common one (1 = keep, or ``learner_mask``) in the shapes where a mask
    of it runs and changes the output, and say so; none: masks are not certified."""
    convention = options.get("learner_mask", "keep")
    dtype = "float" if convention == "additive" else "bool"
    plain = probe.value("a plain call", lambda: _raw(module, plan, x))
    shapes = []
    for shape in _SHAPES:
        keep = _keep_pattern(shape, per_row=True)
        tensor = _convention_tensor(keep, convention, dtype)
        got = probe.value(f"mask {convention} {_shape_text(shape)}", lambda t=tensor: _raw(module, plan, x, t))
        if got is not None and tuple(got.shape) == (_B, _L, _D) and plain is not None and \
                not bool(torch_allclose(got, plain)):
            shapes.append(shape)
    tried = "keep, blocked, additive" if "learner_mask" not in options else options["learner_mask"]
    if not shapes:
        return replace(plan, mask=None, mask_how=(
            f"no convention ({tried}) in any shape made a query row that is left one key attend only it, "
            f"and no {convention} mask changed the output (shapes tried: "
            f"{', '.join(_shape_text(s) for s in _SHAPES)}); masks are not certified "
            "(--impl-option learner_mask=keep|blocked|additive sets the convention)"))
    words = {"keep": "1/True = keep", "blocked": "True = blocked", "additive": "additive"}[convention]
    return replace(plan, mask=convention, mask_dtype=dtype, mask_shapes=tuple(shapes), mask_how=(
        f"{words} ASSUMED: no convention ({tried}) made a query row that is left one key attend only it, "
        "which a correct module does whatever its convention, so the module's attention itself is "
        "suspect (see the failures); --impl-option learner_mask=keep|blocked|additive sets it"))


def torch_allclose(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.allclose(a.double(), b.double(), rtol=1e-9, atol=1e-9, equal_nan=True))


def _probe_fully_masked(probe: _Probe, plan: LearnerPlan, params: Any, x: Any) -> tuple[str, str]:
    import torch

    if plan.mask is None:
        return "unspecified", "nothing certified (no mask is certified)"
    blocked = torch.zeros(_B, _L, dtype=torch.bool)
    blocked[0] = True
    xs = x.double().numpy()
    # Probed in the shape that fixed the convention (the first one found), so that a
    # shape the module reads the other way does not change the declaration.
    plan = replace(plan, mask_shapes=plan.mask_shapes[:1])
    got = probe.value("a fully-masked row", lambda: _build(plan, params, batch_first=True)(
        x, x, x, key_padding_mask=blocked, need_weights=False)[0])
    # A row the probe cannot classify is not a convention: the contract's zero is tested
    # (mha_fully_masked_rows fails on it), never "unspecified", which would check nothing.
    if got is None:
        return "zero", ("an error (a row with every key blocked raised); zero is tested, "
                        "declare --impl-option fully_masked=... if another policy is intended")
    row = got.detach().double().numpy()[0]
    if np.isnan(row).all():
        return "nan", "NaN"
    # Zero: the attention output of every row of batch item 0 is 0, so the module outputs
    # its output bias there, whatever its other steps do.
    zero, _ = spec.mha_forward(params, xs, xs, xs, key_padding_mask=blocked.numpy(), batch_first=True,
                               need_weights=False, fully_masked="zero")
    if np.allclose(row, zero[0], rtol=1e-7, atol=1e-7):
        return "zero", "zero (attention output 0, module output = the output bias)"
    # Uniform: with the query projection zeroed every score is 0, so every row of the
    # module's own unmasked call is uniform over the keys; a blocked row is uniform when it
    # equals it. The module's own call is the reference, not the spec's, so that a mistake
    # in another step (the scale, the head split) does not hide the convention.
    D = params.embed_dim
    flat = replace(params, in_proj_weight=np.concatenate([np.zeros((D, D)), params.in_proj_weight[D:]]),
                   in_proj_bias=None if params.in_proj_bias is None else
                   np.concatenate([np.zeros(D), params.in_proj_bias[D:]]))
    pair = probe.value("a fully-masked row against uniform weights", lambda: (
        _build(plan, flat, batch_first=True)(x, x, x, key_padding_mask=blocked, need_weights=False)[0],
        _build(plan, flat, batch_first=True)(x, x, x, need_weights=False)[0]))
    if pair is not None:
        masked, uniform = (t.detach().double().numpy()[0] for t in pair)
        if np.isfinite(uniform).all() and np.allclose(masked, uniform, rtol=1e-7, atol=1e-7):
            return "uniform", "uniform over all keys (a finite fill such as -1e9)"
    return "zero", ("neither zero, NaN nor uniform; zero is tested, declare "
                    "--impl-option fully_masked=... if another policy is intended")


def _probe_dropout(probe: _Probe, plan: LearnerPlan, params: Any, x: Any) -> bool:
    if plan.dropout_arg is None:
        return False

    def differs() -> bool:
        module = _build(plan, params, dropout=0.5).train()
        a, b = _raw(module, plan, x), _raw(module, plan, x)
        return not bool((a == b).all())

    return bool(probe.value("dropout", differs))


def _probe_dtypes(probe: _Probe, plan: LearnerPlan, params: Any, notes: list[str]) -> tuple[str, ...]:
    """The dtypes the module runs in: a plain call and, when a mask is certified, a masked
    one (a fill such as -1e9 raises in float16); a dtype left out for its mask is a note."""
    import torch

    def run(dtype: str, masked: bool = False) -> bool:
        module = LearnerMHA(plan)(_D, _H, dtype=getattr(torch, dtype), batch_first=True)
        module._learner_plan = plan
        x = torch.randn(_B, _L, _D).to(getattr(torch, dtype))
        blocked = torch.zeros(_B, _L, dtype=torch.bool)
        blocked[:, -1] = True
        out = module(x, x, x, need_weights=False, key_padding_mask=blocked if masked else None)[0]
        return out.dtype == x.dtype

    dtypes = []
    for d in ALL_DTYPES:
        if not probe.value(f"dtype {d}", lambda d=d: run(d)):
            continue
        if plan.mask is not None and not probe.value(f"a mask in {d}", lambda d=d: run(d, masked=True)):
            notes.append(f"dtypes: {d} runs without a mask but a masked call raised (a mask fill "
                         f"such as -1e9 does not fit {d}: torch.finfo(scores.dtype).min does); "
                         f"{d} is not certified")
            continue
        dtypes.append(d)
    return tuple(dtypes)


def _probe_backward(probe: _Probe, plan: LearnerPlan) -> bool:
    import torch

    def run() -> bool:
        module = LearnerMHA(plan)(_D, _H, batch_first=True)
        x = torch.randn(_B, _L, _D, requires_grad=True)
        module(x, x, x, need_weights=False)[0].sum().backward()
        return x.grad is not None

    return bool(probe.value("backward", run))


def recognise_learner(cls: type, *, name: str, origin: str, timeout: float | None) -> Implementation:
    """An MHA-level Implementation for a hand-written attention module class (see the module
    docstring); a class too unusual to read raises ImplementationError saying what was not
    understood and which ``--impl-option`` settles it."""
    import torch

    held = _OPTIONS.get()
    options = held or {}
    if held is not None:
        held["_used"] = "yes"
    probe = _Probe(origin, timeout)
    dim, heads, dropout, init_notes = _constructor(cls, origin, options)
    inputs, forward_names, mask_arg = _forward(cls, origin)
    plan = LearnerPlan(cls=cls, dim_arg=dim, heads_arg=heads, dropout_arg=dropout, projections=(),
                       projections_how="", inputs=inputs, forward_names=forward_names, mask_arg=mask_arg,
                       origin=origin)
    try:
        module = probe.call("building it", lambda: _materialised(cls(**{dim: _D, heads: _H}), inputs, _D))
    except CallRaised as exc:
        raise _usage(origin, f"{cls.__name__}({dim}={_D}, {heads}={_H}) raised {summarise(exc.error)}",
                     "pass --impl-option learner_init=DIM,HEADS if those are not its model dim and head "
                     "count") from exc.error
    projections, how = _projections(module, _D, cls, origin, options)
    plan = replace(plan, projections=projections, projections_how=how)
    gen = np.random.default_rng(0)
    params = spec.MHAParams.random(gen, _D, _H)
    x = torch.from_numpy(gen.standard_normal((_B, _L, _D)))
    plan = _probe_output(probe, plan, params, x)
    plan = _probe_fused(probe, plan, params, x, options)
    plan = _probe_mask(probe, plan, params, x, options)
    fully_masked, fm_text = _probe_fully_masked(probe, plan, params, x)
    dropout_on = _probe_dropout(probe, plan, params, x)
    features = {"batch_first", "unbatched", "no_bias"}
    if plan.mask is not None and any("B" in s for s in plan.mask_shapes):
        features.add("key_padding_mask")
    if plan.mask == "additive" and any("H" in s for s in plan.mask_shapes):
        features |= {"attn_mask", "is_causal"}
    if plan.weights is not None:
        features.add("need_weights")
    if plan.weights == "per_head":
        features.add("per_head_weights")
    if dropout_on:
        features.add("dropout")
    if plan.inputs == "qkv":
        features.add("cross_attention")
    notes = list(_notes(plan, init_notes, fm_text, dropout_on, features))
    caps = Capabilities(
        devices=("cpu",), dtypes=_probe_dtypes(probe, plan, params, notes) or ("float32",), causal="upper_left",
        fully_masked=fully_masked, dropout=dropout_on, autograd=_probe_backward(probe, plan), mask_grad=False,
        gqa=False, different_v_dim=False, mha_features=frozenset(features), probe_notes=tuple(notes),
        # The module's own conventions, as the probes found them (its fully-masked rows
        # among them: a learner's -1e9 fill is its convention), shown as probed.
        sources={"causal": "contract", "fully_masked": "probed" if plan.mask is not None and
                 not fm_text.startswith(("an error", "neither")) else "contract"})
    factory = _PlannedFactory(plan)
    return Implementation(name=name, capabilities=caps, mha=factory, load_weights=load_learner_weights,
                          description=f"learner module {origin}: " + "; ".join(n.split(": ", 1)[-1] for n in notes[:1]))


class _PlannedFactory(LearnerMHA):
    def __call__(self, embed_dim: int, num_heads: int, **options: Any) -> Any:
        module = super().__call__(embed_dim, num_heads, **options)
        module._learner_plan = self.plan
        return module


def _notes(plan: LearnerPlan, init_notes: list[str], fm_text: str, dropout_on: bool,
           features: set[str]) -> tuple[str, ...]:
    proj = ", ".join(f"{path}" for _, path in plan.projections)
    fused = f", fused one {plan.fused_how}" if plan.fused_how else ""
    forward = f"forward({', '.join(plan.forward_names + ((plan.mask_arg,) if plan.mask_arg else ()))})"
    inputs = {"self": "self-attention only (one input; cross-attention cases skipped: forward(query, key, value) "
                      "would enable them)",
              "kv": "one key/value input (key = value; cross-attention cases, which draw key != value, skipped)",
              "qkv": "query, key, value"}[plan.inputs]
    notes = [f"learner module: {init_notes[0]}, projections {proj} ({plan.projections_how}{fused}); {forward}: "
             f"{inputs}"]
    if plan.mask is None:
        notes.append(f"learner mask: none certified ({plan.mask_how})")
    else:
        shapes = ", ".join(_shape_text(s) for s in plan.mask_shapes)
        attn = ("attn_mask and causal cases run as one additive mask" if "attn_mask" in features else
                "read as key padding only: attn_mask cases (float biases, per-head masks) skipped, an additive "
                "mask taking (B, H, L, S) would enable them")
        notes.append(f"learner mask: {plan.mask_arg} {plan.mask_how}; shapes {shapes}; {attn}")
    notes.append(f"fully_masked: a row with every key blocked gives {fm_text}")
    weights = {None: "returns the output only: need_weights cases skipped (returning (output, weights) would "
                     "enable them)",
               "per_head": "returns (output, weights per head (B, H, L, S))",
               "averaged": "returns (output, weights averaged over heads): per-head weight cases skipped"}
    notes.append(f"learner output: {weights[plan.weights]}; dropout "
                 + ("switchable" if dropout_on else "not switchable (no dropout constructor argument that works): "
                    "dropout cases skipped"))
    return tuple(notes)
