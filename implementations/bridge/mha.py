"""Keras' ``MultiHeadAttention`` layer certified at the MHA level with no adapter: the bridge
puts ``torch.nn.MultiheadAttention``'s constructor, ``forward`` and weights in front of it.

``--impl=keras.layers:MultiHeadAttention`` (Keras 3, the backend ``KERAS_BACKEND`` chose;
``tf.keras.layers.MultiHeadAttention`` too, where TensorFlow is installed), or a subclass of
it: a class whose bases include a Keras layer whose constructor takes ``num_heads`` and
``key_dim`` (:func:`keras_mha_framework`).

What each of nn.MultiheadAttention's arguments becomes, from Keras' documented API
(``keras/src/layers/attention/multi_head_attention.py``, Keras 3.15):

=================================  ===========================================================
nn.MultiheadAttention              Keras MultiHeadAttention
=================================  ===========================================================
``embed_dim, num_heads``           ``num_heads``, ``key_dim = value_dim = embed_dim // num_heads``
                                   (the output dim defaults to the query's, ``embed_dim``)
``bias``, ``dropout``              ``use_bias``, ``dropout`` (on the attention weights, in
                                   training: the module's ``train()`` is ``training=True``)
``kdim``, ``vdim``                 the key and value inputs' last dims (the layer is built on them)
``dtype``                          the layer's ``dtype`` (its variables and computation)
``add_bias_kv``, ``add_zero_attn`` none: refused (NotImplementedError)
(L, B, D) / ``batch_first``        (B, L, D) only: transposed; unbatched (L, D) gets B = 1
``key_padding_mask`` (B, S),       ``attention_mask`` (B, L, S), bool **True = attend**: the
``attn_mask`` (L, S) bool,         masks are inverted (nn.MultiheadAttention's True = blocked)
True = blocked                     and combined; a per-head ``attn_mask`` (B*N, L, S) goes as
                                   (B, N, L, S), which the layer broadcasts against its (B, N,
                                   L, S) scores (beyond the documented (B, L, S))
float masks                        none (``attention_mask`` is cast to bool): refused, so the
                                   probes declare bool masks only
``is_causal`` (a hint that         ``use_causal_mask=True`` (Keras' lower-triangular mask,
``attn_mask`` is the causal mask)  upper-left), ``attn_mask`` then left out
``need_weights``,                  ``return_attention_scores=True`` (per-head (B, N, L, S)
``average_attn_weights``           scores), averaged over heads here when asked
=================================  ===========================================================

Weights: ``spec.MHAParams`` (nn.MultiheadAttention's names) are written into the layer's
variables: the query, key and value kernels ``(D_in, N, D/N)`` are the transposed
projection weights split per head, their biases ``(N, D/N)``; the output kernel ``(N, D/N,
D)`` is the transposed ``out_proj.weight``. The module also shows them under
nn.MultiheadAttention's names (``in_proj_weight``, ``out_proj.weight``...; read-only
copies), which the fully-masked probe reads.

On the torch backend the layer is a torch module: its variables are parameters of this
module and gradients are torch's. On the jax, tensorflow or numpy backend the tensors go
through NumPy and the output has no gradient (autograd declared off).
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import numpy as np
import torch

from implementations.bridge.frameworks import framework_named, numpy_to_torch

__all__ = ["KERAS_PACKAGES", "KerasMHA", "KerasMHAFactory", "keras_mha_framework", "load_keras_weights"]

#: Top-level packages of a Keras layer: Keras 3 itself, Keras 2 (tf_keras), tf.keras.
KERAS_PACKAGES = {"keras": "keras", "tf_keras": "tensorflow", "tensorflow": "tensorflow"}


def keras_mha_framework(cls: type) -> str | None:
    """``"keras"`` (Keras 3) or ``"tensorflow"`` (Keras 2, ``tf_keras``) when ``cls`` is a Keras
    layer class (or a subclass of one) whose constructor takes ``num_heads`` and ``key_dim``,
    as Keras' MultiHeadAttention; else None."""
    if not inspect.isclass(cls):
        return None
    for base in cls.__mro__:
        package = (base.__module__ or "").partition(".")[0]
        if package in KERAS_PACKAGES and base.__name__ == "MultiHeadAttention":
            try:
                names = set(inspect.signature(cls.__init__).parameters)
            except (TypeError, ValueError):
                return None
            if {"num_heads", "key_dim"} <= names:
                return "keras" if package == "keras" else KERAS_PACKAGES[package]
    return None


class KerasMHAFactory:
    """``factory(embed_dim, num_heads, **nn.MultiheadAttention's options)`` -> a
    :class:`KerasMHA` around ``cls(num_heads=..., key_dim=...)``, built."""

    def __init__(self, cls: type, framework: str) -> None:
        self.cls, self.framework = cls, framework_named(framework)
        self.native_torch = bool(getattr(self.framework, "native_torch", False))
        self.__name__ = cls.__name__

    def __call__(self, embed_dim: int, num_heads: int, *, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, device: Any = None, dtype: Any = None):
        if add_bias_kv or add_zero_attn:
            raise NotImplementedError(f"Keras {self.cls.__name__} has no add_bias_kv / add_zero_attn")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        if device is not None and torch.device(device).type != "cpu":
            raise NotImplementedError(f"device={device}: the Keras bridge runs on the CPU")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        name = str(dtype).removeprefix("torch.")
        head = embed_dim // num_heads
        kdim, vdim = kdim or embed_dim, vdim or embed_dim
        with self.framework.dtype_scope(dtype):
            layer = self.cls(num_heads=num_heads, key_dim=head, value_dim=head, dropout=dropout, use_bias=bias,
                             dtype=name)
            layer.build((1, 1, embed_dim), (1, 1, vdim), (1, 1, kdim))
        return KerasMHA(layer, self, embed_dim=embed_dim, num_heads=num_heads, kdim=kdim, vdim=vdim,
                        batch_first=batch_first, dtype=dtype)


class KerasMHA(torch.nn.Module):
    """A built Keras MultiHeadAttention behind nn.MultiheadAttention's ``forward`` (see the
    module docstring)."""

    def __init__(self, layer: Any, factory: KerasMHAFactory, *, embed_dim: int, num_heads: int, kdim: int,
                 vdim: int, batch_first: bool, dtype: torch.dtype) -> None:
        super().__init__()
        if factory.native_torch:
            self.layer = layer  # a torch module: its variables are this module's parameters
        else:
            self.__dict__["layer"] = layer
        self.factory = factory
        self.embed_dim, self.num_heads, self.kdim, self.vdim = embed_dim, num_heads, kdim, vdim
        self.batch_first, self.dtype = batch_first, dtype

    # ----------------------------------------------------------------------- forward

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = (x.unsqueeze(0) for x in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        B, L, S = query.shape[0], query.shape[1], key.shape[1]
        attend = self._attend(key_padding_mask, None if is_causal else attn_mask, B, L, S)
        kwargs = {"training": self.training}
        if attend is not None:
            kwargs["attention_mask"] = attend
        if is_causal:
            kwargs["use_causal_mask"] = True
        if need_weights:
            kwargs["return_attention_scores"] = True
        out = self._call(query, value, key, kwargs)
        weights = None
        if need_weights:
            out, weights = out
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if unbatched:
                weights = weights.squeeze(0)
        if unbatched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _attend(self, key_padding_mask, attn_mask, B: int, L: int, S: int):
        """Keras' bool ``attention_mask`` (True = attend), (B, L, S) or per head (B, N, L, S),
        from nn.MultiheadAttention's masks (True = blocked); None without masks."""
        attend = None
        for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if mask is None:
                continue
            if mask.dtype != torch.bool:
                raise NotImplementedError(
                    f"a float {name}: Keras MultiHeadAttention's attention_mask is boolean (it is cast to bool), "
                    "so no float mask can be handed over")
            if name == "key_padding_mask":
                keep = ~mask.reshape(B, 1, S)
            elif mask.dim() == 3:  # (B*N, L, S) or, unbatched, (N, L, S): per head
                keep = ~mask.reshape(B, self.num_heads, L, S)
                attend = attend.unsqueeze(1) if attend is not None else None
            else:
                keep = ~mask.reshape(1, L, S)
            attend = keep if attend is None else attend & keep
        if attend is None:
            return None
        shape = (B, L, S) if attend.dim() == 3 else (B, self.num_heads, L, S)  # Keras' documented (B, L, S)
        return attend.expand(shape).contiguous()

    def _call(self, query, value, key, kwargs):
        framework = self.factory.framework
        if self.factory.native_torch:
            return self.layer(query, value, key=key, **kwargs)
        with framework.dtype_scope(self.dtype):
            arrays = [framework.from_torch(t.detach()) for t in (query, value, key)]
            if "attention_mask" in kwargs:
                kwargs = dict(kwargs, attention_mask=framework.from_torch(kwargs["attention_mask"]))
            out = self.layer(arrays[0], arrays[1], key=arrays[2], **kwargs)
            if isinstance(out, tuple):  # in the dtype the layer returned: output_contract checks it
                return tuple(framework.to_torch(o, query) for o in out)
            return framework.to_torch(out, query)

    # ------------------------------------------------- nn.MultiheadAttention's names

    def _as_torch(self, variable: Any) -> torch.Tensor:
        """A variable's values as a torch tensor of its dtype (bfloat16 through ml_dtypes')."""
        if isinstance(variable, torch.Tensor):
            return variable
        value = variable.numpy() if hasattr(variable, "numpy") else variable
        if isinstance(value, torch.Tensor):  # a Keras variable on the torch backend
            return value
        return numpy_to_torch(np.asarray(value), torch.device("cpu"))

    @property
    def in_proj_weight(self) -> torch.Tensor | None:
        """(3D, D) as nn.MultiheadAttention holds it (None when kdim or vdim differ)."""
        if self.kdim != self.embed_dim or self.vdim != self.embed_dim:
            return None
        kernels = [self._as_torch(d.kernel).reshape(self.embed_dim, -1).T for d in self._dense()[:3]]
        return torch.cat(kernels).detach()

    @property
    def in_proj_bias(self) -> torch.Tensor | None:
        if not self.layer.use_bias:
            return None
        return torch.cat([self._as_torch(d.bias).reshape(-1) for d in self._dense()[:3]]).detach()

    @property
    def out_proj(self) -> Any:
        dense = self._dense()[3]
        weight = self._as_torch(dense.kernel).reshape(-1, self.embed_dim).T.detach()
        bias = self._as_torch(dense.bias).detach() if self.layer.use_bias else None
        return types.SimpleNamespace(weight=weight, bias=bias)

    def _dense(self) -> tuple[Any, Any, Any, Any]:
        layer = self.layer
        return layer.query_dense, layer.key_dense, layer.value_dense, layer.output_dense


def load_keras_weights(module: KerasMHA, params: Any) -> None:
    """``spec.MHAParams`` (float64 NumPy, nn.MultiheadAttention's names) into the layer's variables."""
    N, D = module.num_heads, module.embed_dim
    head = D // N
    wq, wk, wv = params.projection_weights()
    bq, bk, bv = params.projection_biases()
    dtype = module.dtype
    dense_q, dense_k, dense_v, dense_o = module._dense()

    def put(variable: Any, array: np.ndarray) -> None:
        value = torch.as_tensor(np.asarray(array, dtype=np.float64)).to(dtype)
        with module.factory.framework.dtype_scope(dtype):
            variable.assign(value if module.factory.native_torch else _to_numpy(value))

    for dense, weight, bias in ((dense_q, wq, bq), (dense_k, wk, bk), (dense_v, wv, bv)):
        put(dense.kernel, weight.T.reshape(weight.shape[1], N, head))
        if module.layer.use_bias:
            put(dense.bias, np.asarray(bias).reshape(N, head))
    put(dense_o.kernel, params.out_proj_weight.T.reshape(N, head, D))
    if module.layer.use_bias:
        put(dense_o.bias, params.out_proj_bias)


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    from implementations.bridge.frameworks import torch_to_numpy

    return torch_to_numpy(tensor)
