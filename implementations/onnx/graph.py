"""An existing ONNX attention graph (``--impl=path/model.onnx``), run in ONNX Runtime behind
scaled_dot_product_attention's signature.

What the graph is comes from its own signature (the session's inputs) and the user's
declarations, never from what a call returned:

* its query, key, value (and optional mask) inputs: ``--impl-option onnx_inputs=q,k,v[,mask]``,
  else the graph's inputs named ``query, key, value`` or ``q, k, v`` (and ``attn_mask``,
  ``mask`` or ``attention_mask``);
* the dtype: the query input's element type (declared ``dtypes``);
* rank 4, (B, N, L, E) (``--impl-option onnx_layout=BLNE``: (B, L, N, E)): declared
  ``batch_dims=1``, the suite reshapes other ranks and masks to 4-D;
* every dim but the head dims must be dynamic (a symbolic or unknown size); fixed head
  dims are declared ``head_dims``; any other fixed dim is a usage error (export with
  dynamic axes);
* a mask input takes the full (B, N, L, S) mask: bool (True = may attend) or float (added
  to the scaled scores), by its element type; a call without a mask feeds a mask that
  blocks nothing (all True, or zeros), the meaning of no mask;
* the scale is the graph's own, taken as the default 1/sqrt(E): an explicit ``scale``
  is refused (custom_scale is probed unsupported), and so is ``enable_gqa=True`` (K < N heads: the
  signature does not say whether the graph groups heads);
* a causal graph is declared with ``--impl-option onnx_causal=upper_left|lower_right``
  (then every call is causal: declared ``causal_only``); without it ``is_causal=True``
  is refused; ``dropout_p > 0`` is refused; no gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
import torch

from implementations.base import ImplementationError
from implementations.onnx.runtime import open_session, run_session, to_feed, to_torch

__all__ = ["GRAPH_DTYPES", "GraphInfo", "GraphSDPA", "graph_options", "read_graph"]

#: ONNX Runtime's input type names -> the suite's dtypes.
GRAPH_DTYPES = {"tensor(double)": "float64", "tensor(float)": "float32", "tensor(float16)": "float16",
                "tensor(bfloat16)": "bfloat16"}
_DEFAULT_NAMES = (("query", "key", "value"), ("q", "k", "v"))
_MASK_NAMES = ("attn_mask", "mask", "attention_mask")


@dataclass(frozen=True)
class GraphInfo:
    """What the graph's signature says: input names, dtype, mask kind, fixed head dims."""

    path: str
    names: tuple[str, str, str]
    mask: str | None          # the mask input's name
    mask_kind: str | None     # "bool" or "additive"
    mask_dtype: str | None    # the mask input's dtype (float masks are cast to it)
    dtype: str
    head_dims: tuple[int, ...]
    layout: str

    def describe(self) -> str:
        mask = f", mask {self.mask} ({self.mask_kind}, full (B, N, L, S))" if self.mask else ", no mask input"
        dims = f", fixed head dims {list(self.head_dims)}" if self.head_dims else ""
        return (f"graph {self.path}: inputs query={self.names[0]}, key={self.names[1]}, value={self.names[2]}"
                f"{mask}; {self.dtype}, layout {self.layout}{dims}")


def read_graph(path: str, inputs: str | None, layout: str) -> GraphInfo:
    """The :class:`GraphInfo` of the model at ``path`` (ImplementationError naming what
    does not fit, and the fix)."""
    where = f"--impl={path}"
    try:
        session = open_session(str(Path(path).expanduser()))
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ImplementationError(f"{where}: ONNX Runtime cannot load the graph: {type(exc).__name__}: "
                                  f"{str(exc)[:300]}") from exc
    graph_inputs = {i.name: i for i in session.get_inputs()}
    listed = ", ".join(f"{n} {i.type} {list(i.shape)}" for n, i in graph_inputs.items())
    if inputs:
        names = [n.strip() for n in inputs.split(",") if n.strip()]
        if len(names) not in (3, 4) or any(n not in graph_inputs for n in names):
            raise ImplementationError(
                f"--impl-option onnx_inputs={inputs}: give the graph's query, key, value (and mask) input "
                f"names, 3 or 4 of them; the graph's inputs are {listed}")
    else:
        names = next((list(d) for d in _DEFAULT_NAMES if set(d) <= set(graph_inputs)), None)
        if names is None:
            raise ImplementationError(
                f"{where}: the graph's inputs are {listed}; none is named query, key, value (or q, k, v): "
                "declare them with --impl-option onnx_inputs=QUERY,KEY,VALUE[,MASK]")
        names += [m for m in _MASK_NAMES if m in graph_inputs][:1]
    others = sorted(set(graph_inputs) - set(names))
    if others:
        raise ImplementationError(
            f"{where}: the graph also takes {others}, which scaled_dot_product_attention's arguments cannot "
            f"give (its inputs: {listed}); certify a graph of query, key, value and an optional mask, or name "
            "the mask among --impl-option onnx_inputs=QUERY,KEY,VALUE,MASK")
    q, k, v = (graph_inputs[n] for n in names[:3])
    dtype = GRAPH_DTYPES.get(q.type)
    if dtype is None or k.type != q.type or v.type != q.type:
        raise ImplementationError(
            f"{where}: query, key and value must share one floating type of {sorted(GRAPH_DTYPES)}; the graph "
            f"has {q.type}, {k.type}, {v.type}")
    for info in (q, k, v):
        if len(info.shape) != 4:
            raise ImplementationError(
                f"{where}: input {info.name} has shape {list(info.shape)}; the graph must take 4-D (B, N, L, E) "
                "query, key and value (or (B, L, N, E) with --impl-option onnx_layout=BLNE)")
    head = 3
    fixed = [(info.name, axis, size) for info in (q, k, v) for axis, size in enumerate(info.shape)
             if isinstance(size, int) and axis != head]
    if fixed:
        shown = ", ".join(f"{name} axis {axis} = {size}" for name, axis, size in fixed)
        raise ImplementationError(
            f"{where}: the graph fixes {shown}; the suite draws many batch sizes, head counts and lengths, "
            "so every axis but the head dim must be dynamic: export it with dynamic axes (torch.onnx.export's "
            "dynamic_axes or dynamic_shapes) for B, N, L and S")
    head_dims = tuple(sorted({s for s in (q.shape[head], k.shape[head], v.shape[head]) if isinstance(s, int)}))
    mask = mask_kind = mask_dtype = None
    if len(names) == 4:
        m = graph_inputs[names[3]]
        mask, mask_kind = m.name, ("bool" if m.type == "tensor(bool)" else "additive")
        mask_dtype = "bool" if mask_kind == "bool" else GRAPH_DTYPES.get(m.type)
        if mask_dtype is None or len(m.shape) != 4:
            raise ImplementationError(
                f"{where}: the mask input {m.name} is {m.type} {list(m.shape)}; it must be a bool or floating "
                "(B, N, L, S) mask")
    return GraphInfo(path=str(path), names=tuple(names[:3]), mask=mask, mask_kind=mask_kind, mask_dtype=mask_dtype,
                     dtype=dtype, head_dims=head_dims, layout=layout)


class GraphSDPA:
    """The graph behind scaled_dot_product_attention's signature (see the module docstring);
    ``causal``: the alignment of a causal graph (None: not causal)."""

    def __init__(self, info: GraphInfo, causal: str | None = None) -> None:
        self.info, self.causal = info, causal
        self.session = open_session(str(Path(info.path).expanduser()))
        self.__name__ = Path(info.path).name

    def __repr__(self) -> str:
        return f"GraphSDPA({self.info.path})"

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
        info = self.info
        if dropout_p:
            raise NotImplementedError(f"dropout_p={dropout_p}: an ONNX graph has no dropout")
        if scale is not None:
            raise NotImplementedError(f"scale={scale}: the graph's scale is its own (taken as 1/sqrt(E))")
        if bool(is_causal) != (self.causal is not None):
            raise NotImplementedError(
                f"is_causal={bool(is_causal)}: " + ("the graph is declared causal (onnx_causal): every call is causal"
                                                    if self.causal else "the graph has no causal flag (declare "
                                                    "--impl-option onnx_causal=ALIGNMENT for a causal graph)"))
        if enable_gqa:
            raise NotImplementedError("enable_gqa=True: an ONNX graph has no such input, and whether its MatMul "
                                      "broadcasting groups heads as GQA does is not part of its signature")
        if query.dim() != 4:
            raise ValueError(f"the graph takes 4-D query, key, value; got rank {query.dim()}")
        B, N, L, _ = query.shape
        S = key.shape[-2]
        feeds = {}
        if attn_mask is not None or info.mask is not None:
            if info.mask is None:
                raise NotImplementedError("the graph has no mask input")
            kind = None if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "additive")
            if kind is not None and kind != info.mask_kind:
                words = {"bool": "bool", "additive": "float (additive)"}
                raise NotImplementedError(f"a {words[kind]} mask: the graph's mask input {info.mask} is "
                                          f"{words[info.mask_kind]}")
            mask_dtype = getattr(torch, info.mask_dtype)
            if attn_mask is None:  # no mask: one that blocks nothing
                attn_mask = torch.ones((), dtype=mask_dtype) if info.mask_kind == "bool" \
                    else torch.zeros((), dtype=mask_dtype)
            feeds[info.mask] = to_feed(attn_mask.to(mask_dtype).expand(B, N, L, S))
        if info.layout == "BLNE":
            query, key, value = (x.transpose(1, 2) for x in (query, key, value))
        feeds.update({name: to_feed(t) for name, t in zip(info.names, (query, key, value), strict=True)})
        out = to_torch(run_session(self.session, feeds), query)
        if out.dtype != query.dtype:
            raise TypeError(f"the graph returned {out.dtype} for {query.dtype} inputs")
        return out.transpose(1, 2) if info.layout == "BLNE" else out


def graph_options(info: GraphInfo, causal: str | None) -> dict[str, str]:
    """The capability declarations the graph's signature makes (``--impl-option`` syntax)."""
    options = {"dtypes": info.dtype, "batch_dims": "1"}
    if info.head_dims:
        options["head_dims"] = ",".join(str(d) for d in info.head_dims)
    if causal:
        options.update(causal=causal, causal_only="true")
    return options


