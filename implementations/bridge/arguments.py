"""How an SDPA-level function of another framework names SDPA's arguments.

Read from the signature, the way :mod:`implementations.registry.recognition` reads a
torch one: the first three parameters are query, key and value, whatever their names
(``query, key, value``; ``q, k, v``; ``self, key, value`` for a method such as
tinygrad's ``Tensor.scaled_dot_product_attention``), and the others are recognised by
name:

=====================  ===============================================================
torch SDPA             the framework function's parameter
=====================  ===============================================================
bool ``attn_mask``     ``attn_mask`` (either kind, torch's meaning), else ``mask`` (bool,
                       True = may attend: JAX's and Keras' polarity)
float ``attn_mask``    ``attn_mask``, else ``bias`` / ``attn_bias`` (added to the logits)
``is_causal``          ``is_causal`` or ``causal``
``scale``              ``scale``, ``softmax_scale`` or ``sm_scale``
``dropout_p``          ``dropout_p``
``enable_gqa``         ``enable_gqa``; without it K < N heads are passed as they are (the
                       probe reads whether the function takes them)
=====================  ===============================================================

A ``mask`` parameter annotated to take a string (MLX's ``mask: None | str | array``) takes
either kind of mask, and ``is_causal=True`` as ``mask="causal"``. A compiled function
whose signature Python cannot read (a nanobind function, MLX's) is read from the
signature text nanobind keeps (:func:`signature_of`).

A parameter the function lacks is refused (NotImplementedError, which probing reads
as "unsupported") unless the call leaves it at its default. A scale parameter whose
default is not None (Pallas' ``sm_scale=1.0``) or that has none is always given: SDPA's
``scale=None`` means 1/sqrt(E), which the function's own default need not be. A further *required*
parameter is an error at recognition; further optional ones keep their defaults.
"""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass
from typing import Any

from implementations.base import ImplementationError

__all__ = ["ArgumentMap", "map_arguments", "signature_of"]

_ALIASES = {
    "mask": ("attn_mask",),
    "bool_mask": ("mask",),
    "bias": ("bias", "attn_bias"),
    "causal": ("is_causal", "causal"),
    "scale": ("scale", "softmax_scale", "sm_scale"),
    "dropout": ("dropout_p",),
    "gqa": ("enable_gqa",),
}


@dataclass(frozen=True)
class ArgumentMap:
    """The framework function's name for each of SDPA's optional arguments (None: it has
    none); ``qkv`` are the names of its first three parameters."""

    qkv: tuple[str, str, str]
    mask: str | None = None
    bool_mask: str | None = None
    bias: str | None = None
    causal: str | None = None
    scale: str | None = None
    dropout: str | None = None
    gqa: str | None = None
    #: Whether SDPA's default scale must be passed explicitly (the function's scale
    #: parameter defaults to something other than None, or is required).
    explicit_scale: bool = False
    #: The value the mask parameter takes for a causal call without a mask (MLX's
    #: ``"causal"``), where the function has no causal flag.
    causal_mask: str | None = None

    def describe(self) -> str:
        scale = f"{self.scale} (always given: its default is not 1/sqrt(E))" if self.explicit_scale else self.scale
        pairs = [("attn_mask", self.mask), ("bool attn_mask", self.bool_mask), ("float attn_mask", self.bias),
                 ("is_causal", self.causal or (f"{self.mask}={self.causal_mask!r}" if self.causal_mask else None)),
                 ("scale", scale), ("dropout_p", self.dropout),
                 ("enable_gqa", self.gqa)]
        return ", ".join(f"{ours} -> {theirs}" for ours, theirs in pairs if theirs) or "none"


def map_arguments(parameters: list[inspect.Parameter], origin: str, given: tuple[str, ...] = ()) -> ArgumentMap:
    """The :class:`ArgumentMap` of a signature; ImplementationError for one that cannot
    take SDPA's calls (fewer than three leading parameters, or an unknown required one).
    ``given``: parameters a declaration fills in every call (``call_kwargs``): each must
    be a parameter SDPA's arguments do not map (or go to ``**kwargs``)."""
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 3:
        raise ImplementationError(
            f"{origin}: a bridged function takes query, key and value as its first three "
            f"parameters; its signature has {[p.name for p in parameters]}"
        )
    names = {p.name: p for p in parameters[3:]}
    found: dict[str, str] = {}
    for field, aliases in _ALIASES.items():
        for alias in aliases:
            if alias in names:
                found[field] = alias
                break
    used = set(found.values())
    every = {p.name for p in parameters}
    var_keyword = any(p.kind == p.VAR_KEYWORD for p in parameters)
    for name in given:
        if name in used or name in [p.name for p in positional[:3]]:
            raise ImplementationError(f"{origin}: call_kwargs gives {name}, which the bridge fills from "
                                      "scaled_dot_product_attention's arguments; leave it out of call_kwargs")
        if name not in every and not var_keyword:
            raise ImplementationError(f"{origin}: call_kwargs gives {name}, which is not a parameter of the "
                                      f"function (its parameters: {sorted(every)})")
    unknown = [p.name for p in parameters[3:] if p.name not in used and p.name not in given
               and p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if unknown:
        raise ImplementationError(
            f"{origin}: the bridged function also requires {unknown}, which it cannot be given from "
            "scaled_dot_product_attention's arguments; give them defaults, or declare their values with "
            f"--impl-option call_kwargs={unknown[0]}=VALUE"
        )
    explicit = "scale" in found and names[found["scale"]].default is not None
    causal_mask = None
    mask = names.get("mask")
    if mask is not None and re.search(r"\bstr\b", str(mask.annotation)) and "causal" not in found:
        # a mask that is an array of either kind, or the string "causal" (MLX)
        found.pop("bool_mask", None)
        found.setdefault("mask", "mask")
        causal_mask = "causal"
    return ArgumentMap(qkv=tuple(p.name for p in positional[:3]), explicit_scale=explicit,
                       causal_mask=causal_mask, **found)


def signature_of(fn: Any) -> inspect.Signature:
    """``inspect.signature(fn)``, or for a nanobind function (MLX's), the signature read
    from the text nanobind keeps (``__nb_signature__``: names, kinds, literal defaults and
    annotations as text); ValueError when neither can be read."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        texts = getattr(fn, "__nb_signature__", None)
        if not texts:
            raise ValueError(str(exc)) from exc
    try:
        tree = ast.parse(texts[0][0].strip() + ": pass").body[0]
    except (SyntaxError, IndexError, TypeError) as exc:
        raise ValueError(f"its nanobind signature cannot be parsed ({exc})") from exc
    args, P = tree.args, inspect.Parameter

    def literal(node: ast.AST | None) -> Any:
        if node is None:
            return P.empty
        try:
            return ast.literal_eval(node)
        except ValueError:
            return ast.unparse(node)  # a default that is not a literal: its text

    def annotation(node: ast.AST | None) -> Any:
        return P.empty if node is None else ast.unparse(node)

    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    parameters = [P(a.arg, P.POSITIONAL_ONLY if i < len(args.posonlyargs) else P.POSITIONAL_OR_KEYWORD,
                    default=literal(d), annotation=annotation(a.annotation))
                  for i, (a, d) in enumerate(zip(positional, defaults, strict=True))]
    if args.vararg is not None:
        parameters.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    parameters += [P(a.arg, P.KEYWORD_ONLY, default=literal(d), annotation=annotation(a.annotation))
                   for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    if args.kwarg is not None:
        parameters.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(parameters)
