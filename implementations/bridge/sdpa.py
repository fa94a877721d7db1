"""The bridged call: torch SDPA's calling convention in front of another framework's
SDPA-level function.

``BridgedSDPA(fn, framework, arguments, layout)(query, key, value, attn_mask=None,
dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)``:

1. leading batch dims are flattened to one (any rank in, 4-D to ``fn``) and a mask is
   expanded to the full ``(B, N, L, S)`` (the mask layout of JAX, Keras and torch alike);
2. for ``layout="BLNE"`` query, key and value are transposed to ``(B, L, N, E)``
   (Keras, JAX's ``dot_product_attention``, FlashAttention) and the output back;
3. the tensors become the framework's arrays (:mod:`.frameworks`), ``fn`` runs with the
   arguments named as its signature names them (:mod:`.arguments`), and the output comes
   back as a torch tensor on the query's device;
4. gradients: a ``torch.autograd.Function`` whose backward is the framework's vjp of the
   same call w.r.t. query, key, value and a float mask; a framework without autodiff
   returns an output that does not require grad (the bridge declares autograd off).

The output must have the query's dtype: a framework that silently computes in another
dtype (JAX without x64 returns float32 for float64 inputs) raises TypeError, so that dtype
is not declared rather than certified with another dtype's results.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping

import torch

from implementations.bridge.arguments import ArgumentMap
from implementations.bridge.frameworks import Framework

__all__ = ["LAYOUTS", "BridgedSDPA"]

#: Layouts of query, key, value and the output a bridged function may take.
LAYOUTS = ("BNLE", "BLNE")


class BridgedSDPA:
    """``fn`` of ``framework`` behind scaled_dot_product_attention's signature.

    ``jit``: whether the framework compiles the call (``Framework.jit``), or a predicate
    of the query's torch dtype; each new configuration (shape, dtype, which arguments,
    flags) is one compilation, the scale is traced. ``"fallback"`` (as the value or the
    predicate's answer): compiled, and a shape whose compiled call raises runs eagerly
    from then on (:class:`_JitOrEager`), for a framework whose eager call retries what its
    compiler refuses. ``"default-precision"``: as ``"fallback"``, compiled with each matmul
    precision the backend refuses computed at the default precision
    (``Framework.with_default_precision``), for a function whose eager code itself retries
    that way (JAX's ``dot_product_attention`` in float16 on a CPU). ``native_gqa``: the function is
    documented to take K < N key/value heads without an ``enable_gqa`` parameter (JAX's and
    Keras' own ``dot_product_attention``: query head h reads key/value head h // (N / K)). Any
    function without ``enable_gqa`` gets K < N heads as they are: whether it takes them is read
    from what it does (the probe's call with N = 4, K = 2), not from a parameter's name."""

    def __init__(self, fn: Callable[..., Any], framework: Framework, arguments: ArgumentMap,
                 layout: str = "BNLE", jit: bool | str | Callable[[torch.dtype], bool | str] = False,
                 native_gqa: bool = False, call_kwargs: Mapping[str, Any] | None = None) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
        self.fn, self.framework, self.arguments, self.layout, self.jit = fn, framework, arguments, layout, jit
        self.native_gqa = native_gqa
        #: Keyword arguments given to every call (``--impl-option call_kwargs=``).
        self.call_kwargs = dict(call_kwargs or {})
        #: Whether K < N heads go to the function as they are (no ``enable_gqa`` parameter,
        #: not documented GQA): the probe then reads GQA from what it computes, and once
        #: it has (``gqa_taken``) a function that does not compute GQA gets no K < N heads.
        self.gqa_by_behaviour = arguments.gqa is None and not native_gqa
        self.gqa_taken: bool | None = None
        self.__name__ = getattr(fn, "__name__", "sdpa")
        self._functions = functools.lru_cache(maxsize=256)(self._build)
        #: The compiled functions with an eager fallback made so far (``jit="fallback"``).
        self.fallbacks: list[_JitOrEager] = []

    def eager(self) -> BridgedSDPA:
        """The same function bridged alike, every call made eagerly (``jit=False``)."""
        copy = BridgedSDPA(self.fn, self.framework, self.arguments, self.layout, jit=False,
                           native_gqa=self.native_gqa, call_kwargs=self.call_kwargs)
        copy.gqa_taken = self.gqa_taken
        return copy

    def __repr__(self) -> str:
        return f"BridgedSDPA({self.__name__}, framework={self.framework.name}, layout={self.layout})"

    # ----------------------------------------------------------------------- the call

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
        args = self.arguments
        if query.dim() < 3 or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"query/key/value must have the same rank >= 3; got {query.dim()}, "
                             f"{key.dim()}, {value.dim()}")
        lead = query.shape[:-3]
        q, k, v = (x.reshape(-1, *x.shape[-3:]) for x in (query, key, value))
        statics: dict[str, Any] = dict(self.call_kwargs)
        extra: dict[str, torch.Tensor] = {}
        if attn_mask is not None:
            full = (*lead, query.shape[-3], query.shape[-2], key.shape[-2])
            mask = attn_mask.expand(full).reshape(-1, *full[-3:])
            is_bool = mask.dtype == torch.bool
            target = args.mask or (args.bool_mask if is_bool else args.bias)
            if target is None:
                raise NotImplementedError(
                    f"{self.__name__} has no parameter for a {'bool' if is_bool else 'float'} mask "
                    f"({'attn_mask or mask' if is_bool else 'attn_mask or bias'})")
            extra[target] = mask
        if is_causal and args.causal is None and args.causal_mask is not None:
            if attn_mask is not None:  # one parameter for both: the suite folds causal into the mask
                raise NotImplementedError(f"{self.__name__} takes a mask or {args.mask}={args.causal_mask!r}, "
                                          "not both")
            statics[args.mask] = args.causal_mask
            is_causal = False
        for flag, given, default, ours in ((args.causal, is_causal, False, "is_causal"),
                                           (args.dropout, dropout_p, 0.0, "dropout_p"),
                                           (args.gqa, enable_gqa, False, "enable_gqa")):
            if flag is not None:
                statics[flag] = type(default)(given)
            elif given != default and (ours != "enable_gqa" or self.gqa_taken is False):
                raise NotImplementedError(f"{self.__name__} has no {ours} parameter" + (
                    " and does not compute GQA (the probe's call with N = 4, K = 2)" if ours == "enable_gqa" else ""))
            # without an enable_gqa parameter, K < N heads go as they are: whether the function
            # takes them is read from what it does (the probe's GQA call, gqa_equivalence)
        if scale is not None and args.scale is None:
            raise NotImplementedError(f"{self.__name__} has no scale parameter")
        if scale is None and args.explicit_scale:
            scale = 1.0 / math.sqrt(query.shape[-1])   # SDPA's default, not the function's own
        if self.layout == "BLNE":
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        tensors = (q, k, v, *extra.values())
        config = (tuple(extra), tuple(sorted(statics.items())),
                  tuple(i for i, t in enumerate(tensors) if t.is_floating_point()))
        if self.framework.native_torch:
            out = self.framework.to_torch(self._call(tensors, config, scale), query)
            _check_dtype(self, out, query)
        else:
            out = _Bridged.apply(self, config, None if scale is None else float(scale), *tensors)
        if self.layout == "BLNE":
            out = out.transpose(1, 2)
        if args.gqa is None and key.shape[-3] != query.shape[-3] and out.shape[-3] != query.shape[-3]:
            # K != N heads passed as they are (no enable_gqa parameter) and broadcast by the
            # function into an output that is not the query's heads: not an SDPA result
            raise ValueError(f"{self.__name__} returned {out.shape[-3]} heads for a query of "
                             f"{query.shape[-3]} heads and {key.shape[-3]} key/value heads")
        return out.reshape(*lead, *out.shape[-3:])

    def _call(self, arrays, config, scale):
        names, statics, _ = config
        kwargs = dict(zip(names, arrays[3:], strict=True))
        kwargs.update(statics)
        if scale is not None:
            kwargs[self.arguments.scale] = scale
        return self.fn(arrays[0], arrays[1], arrays[2], **kwargs)

    def _build(self, config, jitted: bool | str) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """(forward(*arrays, scale), backward(*arrays, cotangent, scale)) of one configuration."""
        _, _, differentiable = config
        framework = self.framework

        def forward(*arrays, scale=None):
            return self._call(arrays, config, scale)

        def backward_of(call):
            def backward(*arrays, cotangent, scale=None):
                def of_differentiable(*chosen):
                    full = list(arrays)
                    for index, array in zip(differentiable, chosen, strict=True):
                        full[index] = array
                    return call(*full, scale=scale)

                return framework.vjp(of_differentiable, [arrays[i] for i in differentiable], cotangent)

            return backward

        backward = backward_of(forward)
        if jitted in ("fallback", "default-precision"):
            compiled = framework.with_default_precision(forward) if jitted == "default-precision" else forward
            made = (_JitOrEager(framework.jit(compiled), forward),
                    _JitOrEager(framework.jit(backward_of(compiled)), backward))
            self.fallbacks.extend(made)
            return made
        if jitted:
            return framework.jit(forward), framework.jit(backward)
        return forward, backward

    def functions(self, config, dtype: torch.dtype):
        jitted = self.jit(dtype) if callable(self.jit) else self.jit
        return self._functions(config, jitted if jitted in ("fallback", "default-precision") else bool(jitted))


class _JitOrEager:
    """A compiled function with an eager fallback per shape: a shape (with its dtypes) whose
    first compiled call raises and whose eager call runs is eager from then on (an error of
    the eager call is the call's error, and nothing is recorded); a shape that compiled once
    stays compiled."""

    def __init__(self, jitted: Callable[..., Any], eager: Callable[..., Any]) -> None:
        self.jitted, self.eager = jitted, eager
        self.compiles: dict[tuple, bool] = {}

    def __call__(self, *arrays, **kwargs):
        key = tuple((tuple(getattr(a, "shape", ())), str(getattr(a, "dtype", type(a)))) for a in
                    (*arrays, *kwargs.values()))
        if self.compiles.get(key) is False:
            return self.eager(*arrays, **kwargs)
        if self.compiles.get(key):
            return self.jitted(*arrays, **kwargs)
        try:
            out = self.jitted(*arrays, **kwargs)
        except Exception:  # the compiler refused this shape: what the eager call does instead
            out = self.eager(*arrays, **kwargs)  # raising too: the call's own error, nothing recorded
            self.compiles[key] = False
            return out
        self.compiles[key] = True
        return out


def _check_dtype(bridge: BridgedSDPA, out: torch.Tensor, query: torch.Tensor) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{bridge.__name__} ({bridge.framework.name}) returned {type(out).__name__}, not an array")
    if out.dtype != query.dtype:
        raise TypeError(f"{bridge.__name__} ({bridge.framework.name}) returned {out.dtype} for {query.dtype} "
                        "inputs; the bridge does not certify one dtype with another's results")


class _Bridged(torch.autograd.Function):
    """The framework's forward; its vjp as the backward (the floating inputs)."""

    @staticmethod
    def forward(ctx, bridge: BridgedSDPA, config, scale, *tensors):
        framework = bridge.framework
        query = tensors[0]
        with framework.dtype_scope(query.dtype):
            arrays = [framework.from_torch(t) for t in tensors]
            forward, _ = bridge.functions(config, query.dtype)
            out = framework.to_torch(forward(*arrays, scale=scale), query)
        _check_dtype(bridge, out, query)
        ctx.bridge, ctx.config, ctx.scale, ctx.arrays = bridge, config, scale, arrays
        ctx.likes = tensors
        if not framework.autodiff:
            ctx.mark_non_differentiable(out)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        bridge, likes = ctx.bridge, ctx.likes
        framework = bridge.framework
        _, backward = bridge.functions(ctx.config, likes[0].dtype)
        out: list[torch.Tensor | None] = [None] * len(likes)
        with framework.dtype_scope(likes[0].dtype):
            cotangent = framework.from_torch(grad_output.to(likes[0].dtype).contiguous())
            grads = backward(*ctx.arrays, cotangent=cotangent, scale=ctx.scale)
            for index, grad in zip(ctx.config[2], grads, strict=True):
                if grad is not None:
                    out[index] = framework.to_torch(grad, likes[index]).to(likes[index].dtype)
        return (None, None, None, *out)
