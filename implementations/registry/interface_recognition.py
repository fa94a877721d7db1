"""transformers' attention interface, certified with no adapter.

Every attention backend of transformers (``eager_attention_forward`` of each model,
``sdpa_attention_forward``, ``flex_attention_forward``) and every kernel registered with
``AttentionInterface.register`` has the signature::

    fn(module, query, key, value, attention_mask, scaling=..., dropout=0.0, **kwargs)
        -> (output, weights)

query ``(B, N, L, E)``, key and value ``(B, K, S, E|Ev)``, GQA through
``module.num_key_value_groups = N // K``, output ``(B, L, N, Ev)``, ``weights`` the
attention probabilities ``(B, N, L, S)`` (eager), the log-sum-exp (flex off the CPU) or None.
:class:`InterfaceSDPA` puts scaled_dot_product_attention's signature in front of it:

=====================  ===================================================================
SDPA                   the interface
=====================  ===================================================================
``query, key, value``  the same tensors (4-D: leading batch dims are flattened); the output
                       ``(B, L, N, Ev)`` is turned back to ``(B, N, L, Ev)``
``enable_gqa``         ``module.num_key_value_groups = N // K`` (1 without GQA)
``scale``              ``scaling=`` (``E ** -0.5`` when None, as every transformers model passes)
``dropout_p``          ``dropout=`` and ``module.training = dropout_p > 0``
``is_causal``          ``module.is_causal``, and the causal constraint in ``attention_mask``
                       where transformers' mask builders put it (below)
``attn_mask``          ``attention_mask`` ``(B, 1, L, S)`` (``(B, N, L, S)`` for a per-head
                       mask), in the mask form of the function (below)
=====================  ===================================================================

Mask forms, as ``transformers.masking_utils`` builds them:

* ``additive`` (``eager_mask``: eager and flex backends, and the default for any other
  function): a float mask in the query's dtype, 0 where a key is attended and
  ``torch.finfo(dtype).min`` where it is blocked; the causal constraint is always in it.
* ``bool`` (``sdpa_mask``: ``sdpa_attention_forward``): True = attend; a purely causal
  call with ``L == 1`` or ``L == S`` gets no mask, and ``module.is_causal`` carries it,
  as ``_ignore_causal_mask_sdpa`` decides.

A float SDPA mask goes over as it is in both forms (added to the scores). The causal
constraint is transformers': query ``i`` sits at position ``S - L + i`` (the keys before it
are the cache), so ``is_causal`` is **lower-right** here. ``--impl-option
interface_mask=additive|bool`` declares the form of a function not named above.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

import torch

from implementations.base import Implementation, ImplementationError
from implementations.registry.expected_failures import LIBRARY_XFAIL_DIR, load_expected_failures

__all__ = ["INTERFACE_PARAMETERS", "MASK_FORMS", "InterfaceSDPA", "interface_mask_form",
           "is_interface_signature", "recognise_interface"]

#: The leading parameters of transformers' attention interface.
INTERFACE_PARAMETERS = ("module", "query", "key", "value", "attention_mask")
#: The mask forms transformers builds (``--impl-option interface_mask=``).
MASK_FORMS = ("additive", "bool")
#: The mask form of transformers' own backends, by function name (every model has its own
#: copy of ``eager_attention_forward``).
KNOWN_FORMS = {"eager_attention_forward": "additive", "sdpa_attention_forward": "bool",
               "flex_attention_forward": "additive"}
#: The expected-failures files (implementations/xfail/libraries/, else a built-in's in
#: implementations/xfail/) of transformers' own backends,
#: attached to those functions only: sdpa_attention_forward calls torch's SDPA, whose
#: deviations it inherits.
KNOWN_DEVIATIONS = {"eager_attention_forward": ("transformers-eager",), "sdpa_attention_forward": ("sdpa",),
                    "flex_attention_forward": ("transformers-flex",)}


def is_interface_signature(parameters: list[inspect.Parameter]) -> bool:
    """Whether the parameters start ``module, query, key, value, attention_mask``."""
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return tuple(positional[:5]) == INTERFACE_PARAMETERS


def interface_mask_form(fn: Any, declared: str | None = None) -> str:
    """The mask form ``fn`` is given: the declared one, its backend's, else ``additive``."""
    if declared:
        return declared
    return KNOWN_FORMS.get(getattr(fn, "__name__", ""), "additive")


class _Module(torch.nn.Module):
    """What an attention-interface function reads of the attention layer calling it."""

    def __init__(self, *, is_causal: bool, groups: int, scaling: float, training: bool, head_dim: int) -> None:
        super().__init__()
        self.is_causal, self.num_key_value_groups, self.scaling = is_causal, groups, scaling
        self.head_dim, self.layer_idx = head_dim, 0
        self.train(training)


class InterfaceSDPA:
    """``fn`` of transformers' attention interface behind scaled_dot_product_attention's
    signature (see the module docstring). ``accepted``: the keyword arguments ``fn`` takes
    (``scaling``, ``dropout``); with ``**kwargs`` it takes both."""

    def __init__(self, fn: Callable[..., Any], mask_form: str, accepted: frozenset[str]) -> None:
        if mask_form not in MASK_FORMS:
            raise ValueError(f"mask_form must be one of {MASK_FORMS}, not {mask_form!r}")
        self.fn, self.mask_form, self.accepted = fn, mask_form, accepted
        self.__name__ = getattr(fn, "__name__", "attention_forward")

    def __repr__(self) -> str:
        return f"InterfaceSDPA({self.__name__}, mask_form={self.mask_form})"

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
        if query.dim() < 3 or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"query/key/value must have the same rank >= 3; got {query.dim()}, "
                             f"{key.dim()}, {value.dim()}")
        lead = query.shape[:-3]
        q, k, v = (x.reshape(-1, *x.shape[-3:]) for x in (query, key, value))
        B, N, L, E = q.shape
        K, S, Ev = k.shape[1], k.shape[2], v.shape[-1]
        if K != N and not enable_gqa:
            raise ValueError(f"key has {K} heads and query {N}; pass enable_gqa=True for grouped-query attention")
        if N % K:
            raise ValueError(f"query heads N={N} must be a multiple of key/value heads K={K}")
        if dropout_p and "dropout" not in self.accepted:
            raise NotImplementedError(f"{self.__name__} has no dropout parameter")
        scaling = float(scale) if scale is not None else E ** -0.5
        if "scaling" not in self.accepted and scale is not None:
            raise NotImplementedError(f"{self.__name__} has no scaling parameter")
        module = _Module(is_causal=bool(is_causal), groups=N // K, scaling=scaling, training=dropout_p > 0,
                         head_dim=E)
        mask = self.attention_mask(attn_mask, bool(is_causal), lead, N, L, S, q.dtype, q.device)
        kwargs: dict[str, Any] = {}
        if "scaling" in self.accepted:
            kwargs["scaling"] = scaling
        if "dropout" in self.accepted:
            kwargs["dropout"] = float(dropout_p)
        result = self.fn(module, q, k, v, mask, **kwargs)
        out, weights = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (B, L, N, Ev):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise TypeError(f"{self.__name__} returned the output {got}; the attention interface returns "
                            f"(output (B, L, N, Ev) = {(B, L, N, Ev)}, weights)")
        if weights is not None and (not isinstance(weights, torch.Tensor) or tuple(weights.shape[:3]) != (B, N, L)):
            got = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
            raise TypeError(f"{self.__name__} returned the weights {got}; the attention interface returns None, "
                            f"the probabilities (B, N, L, S) = {(B, N, L, S)} or the log-sum-exp (B, N, L)")
        return out.transpose(1, 2).reshape(*lead, N, L, Ev)

    def attention_mask(self, attn_mask, is_causal: bool, lead, N: int, L: int, S: int, dtype, device):
        """``attention_mask`` as transformers' mask builders give it (module docstring)."""
        mask = None
        if attn_mask is not None:
            mask = attn_mask.reshape((1,) * (len(lead) + 3 - attn_mask.dim()) + tuple(attn_mask.shape))
            heads = mask.shape[-3]
            if heads not in (1, N):
                raise ValueError(f"attn_mask has {heads} heads; it broadcasts to (B, N, L, S) with N={N}")
            mask = mask.expand(*lead, heads, L, S).reshape(-1, heads, L, S)
        B = int(torch.tensor(lead).prod()) if len(lead) else 1
        keep = None
        if is_causal:  # query i at position S - L + i: the keys before the queries are the cache
            keep = torch.arange(S, device=device)[None, :] <= torch.arange(L, device=device)[:, None] + (S - L)
            keep = keep.expand(B, 1, L, S)
        if self.mask_form == "bool":
            if mask is None:
                # _ignore_causal_mask_sdpa: no mask, module.is_causal carries the constraint
                return None if keep is None or L == 1 or L == S else keep
            if keep is None:
                return mask
            return mask & keep if mask.dtype == torch.bool else mask + _blocked(keep, mask.dtype)
        if mask is None:
            return None if keep is None else _blocked(keep, dtype)
        if mask.dtype == torch.bool:  # combined before the fill, as eager_mask does
            return _blocked(mask if keep is None else mask & keep, dtype)
        return mask if keep is None else mask + _blocked(keep, mask.dtype)


def _blocked(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``keep``, ``torch.finfo(dtype).min`` elsewhere (``masking_utils.eager_mask``)."""
    zero = torch.zeros((), dtype=dtype, device=keep.device)
    return torch.where(keep, zero, torch.finfo(dtype).min)


def _deviations(fn: Any) -> tuple:
    """The measured deviations of transformers' own backend ``fn`` (none for another function)."""
    if not (getattr(fn, "__module__", "") or "").startswith("transformers."):
        return ()
    names = KNOWN_DEVIATIONS.get(getattr(fn, "__name__", ""), ())
    return tuple(entry for name in names
                 for entry in load_expected_failures(name, LIBRARY_XFAIL_DIR) or load_expected_failures(name))


def _accepted(parameters: list[inspect.Parameter]) -> frozenset[str]:
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return frozenset({"scaling", "dropout"})
    return frozenset({"scaling", "dropout"} & {p.name for p in parameters})


def recognise_interface(fn: Callable[..., Any], parameters: list[inspect.Parameter], *, name: str, origin: str,
                        declared: dict[str, str], probe: Callable[..., Any], timeout: float | None,
                        version: str) -> Implementation:
    """The SDPA-level Implementation of an attention-interface function: adapted by
    :class:`InterfaceSDPA`, probed by ``probe`` (``probing.probe_sdpa``); ``is_causal`` is
    lower-right by the interface's contract."""
    refused = sorted(k for k in declared if k not in ("interface_mask", "_used"))
    if refused:
        raise ImplementationError(
            f"--impl-option {', '.join(refused)}: {origin} has transformers' attention-interface signature "
            f"({', '.join(INTERFACE_PARAMETERS)}), recognised from it; of the bridge options it takes "
            "interface_mask=additive|bool only")
    required = [p.name for p in parameters[5:] if p.default is p.empty and p.name != "scaling"
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        raise ImplementationError(
            f"{origin} has transformers' attention-interface signature but also requires {required}, which "
            "transformers does not pass to every backend; give them defaults")
    package = (getattr(fn, "__module__", "") or "").partition(".")[0]
    top = sys.modules.get(package)
    if version in ("", "0") and getattr(top, "__version__", None):  # transformers.models.x has none
        version = f"{package} {top.__version__}"
    form = interface_mask_form(fn, declared.get("interface_mask"))
    adapter = InterfaceSDPA(fn, form, _accepted(parameters))
    caps = probe(adapter, origin=origin, timeout=timeout)
    notes = [n for n in caps.probe_notes if not n.startswith("causal:")]
    notes.insert(0, f"interface: transformers' attention interface, mask form {form} "
                    f"({'declared' if declared.get('interface_mask') else 'of the function'}); module stub "
                    "is_causal, num_key_value_groups, scaling, training; output (B, L, N, Ev) turned back")
    if caps.causal is not None:
        notes.insert(1, "causal: lower-right by the interface's contract (query i at position S - L + i, as "
                        "transformers' mask builders place it)")
        caps = caps.replace(causal="lower_right", sources={**dict(caps.sources), "causal": "contract"})
    caps = caps.replace(probe_notes=tuple(notes))
    return Implementation(
        name=name, capabilities=caps, sdpa=adapter, version=version, expected_failures=_deviations(fn),
        description=f"transformers attention-interface function {origin} (mask form {form}); capabilities "
                    "probed, semantics scaled_dot_product_attention's with lower-right causal",
    )
