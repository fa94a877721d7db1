"""Multi-head attention modules of other frameworks at the MHA level, with no adapter: one
generic part (this module) and a small table per framework (:mod:`.module_tables`).

The generic part puts ``torch.nn.MultiheadAttention``'s constructor, ``forward`` and weights
in front of a framework's layer:

* ``forward``'s layouts: (L, B, D) or ``batch_first`` (B, L, D), unbatched (L, D) as B = 1;
  the layer sees (B, L, D);
* its masks (True = blocked; ``key_padding_mask`` (B, S), ``attn_mask`` (L, S) or per head
  (B*N, L, S)) become one bool mask **True = attend**, (B, 1, L, S) or (B, N, L, S), which
  the table hands to the layer in its own form; float masks are refused (declared
  unsupported), as the layers take bool masks only;
* ``is_causal`` goes as the layer's causal flag where it has one (``attn_mask`` is then
  left out), else as that mask;
* the drawn weights (``spec.MHAParams``) are written into the layer's parameters through the
  canonical per-head layout the tables share: query, key and value kernels (D_in, N, hd), their
  biases (N, hd), the output kernel (N, hd, D) and bias (D,); the module shows them back under
  nn.MultiheadAttention's names (``in_proj_weight``, ``out_proj.weight``...), which the
  fully-masked probe reads;
* ``need_weights``: the layer's attention weights (B, N, L, S) where the table can read
  them, averaged over heads when asked; None otherwise (declared unsupported by the probe).

A table entry (:class:`ModuleTable`) says how to build the layer, call it and reach its
parameters. Arrays cross through NumPy: gradients are not taken (autograd declared off).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from implementations.bridge.frameworks import framework_named, torch_to_numpy

__all__ = ["ROLES", "ModuleMHA", "ModuleMHAFactory", "ModuleTable", "load_module_weights"]

#: The parameters a table reaches, in the canonical layout: q/k/v kernels (D_in, N, hd),
#: q/k/v biases (N, hd), the output kernel (N, hd, D) and bias (D,).
ROLES = ("q_kernel", "k_kernel", "v_kernel", "q_bias", "k_bias", "v_bias", "o_kernel", "o_bias")


@dataclass(frozen=True)
class ModuleTable:
    """How one framework's multi-head layer is built, called and reached.

    ``build(cls, embed_dim, num_heads, kdim, vdim, bias, dropout, dtype_name)`` -> the layer;
    ``call(layer, query, key, value, attend, causal, training, need_weights)`` -> (output,
    weights or None), arrays of the framework, ``attend`` bool (B, 1|N, L, S) True = attend or
    None; ``get(layer, role)`` -> that parameter as a NumPy array in the canonical layout,
    ``put(layer, role, array)`` writes one. ``kdim_vdim``: whether key and value may have
    different widths (else ``kdim != vdim`` is refused). ``deviations``: the short name of
    the layer's measured expected-failures file (``implementations/xfail/libraries/``),
    attached when the library's class itself is certified (not a subclass, which may compute
    otherwise)."""

    name: str
    framework: str
    matches: Callable[[type], bool]
    build: Callable[..., Any]
    call: Callable[..., tuple[Any, Any]]
    get: Callable[[Any, str], np.ndarray]
    put: Callable[[Any, str, np.ndarray], None]
    kdim_vdim: bool = True
    causal_flag: bool = True
    deviations: str | None = None


class ModuleMHAFactory:
    """``factory(embed_dim, num_heads, **nn.MultiheadAttention's options)`` -> a built
    :class:`ModuleMHA` around ``cls``."""

    def __init__(self, cls: type, table: ModuleTable) -> None:
        self.cls, self.table = cls, table
        self.framework = framework_named(table.framework)
        self.__name__ = cls.__name__

    def __call__(self, embed_dim: int, num_heads: int, *, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, device: Any = None, dtype: Any = None):
        if add_bias_kv or add_zero_attn:
            raise NotImplementedError(f"{self.table.name} has no add_bias_kv / add_zero_attn")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        if device is not None and torch.device(device).type != "cpu":
            raise NotImplementedError(f"device={device}: the {self.table.name} bridge runs on the CPU")
        kdim, vdim = kdim or embed_dim, vdim or embed_dim
        if kdim != vdim and not self.table.kdim_vdim:
            raise NotImplementedError(f"{self.table.name} takes one width for key and value (kdim={kdim}, "
                                      f"vdim={vdim})")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        with self.framework.dtype_scope(dtype):
            layer = self.table.build(self.cls, embed_dim, num_heads, kdim, vdim, bias, dropout,
                                     str(dtype).removeprefix("torch."))
        return ModuleMHA(layer, self, embed_dim=embed_dim, num_heads=num_heads, kdim=kdim, vdim=vdim,
                         bias=bias, batch_first=batch_first, dtype=dtype)


class ModuleMHA(torch.nn.Module):
    """A built layer behind nn.MultiheadAttention's ``forward`` (module docstring)."""

    def __init__(self, layer: Any, factory: ModuleMHAFactory, *, embed_dim: int, num_heads: int, kdim: int,
                 vdim: int, bias: bool, batch_first: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.__dict__["layer"] = layer  # not a torch module: kept out of torch's registries
        self.factory, self.table = factory, factory.table
        self.embed_dim, self.num_heads, self.kdim, self.vdim = embed_dim, num_heads, kdim, vdim
        self.bias, self.batch_first, self.dtype = bias, batch_first, dtype

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
        causal = bool(is_causal) and self.table.causal_flag
        attend = self._attend(key_padding_mask, None if causal else attn_mask, B, L, S)
        framework = self.factory.framework
        with framework.dtype_scope(self.dtype):
            arrays = [framework.from_torch(t.detach()) for t in (query, key, value)]
            mask = None if attend is None else framework.from_torch(attend)
            out, weights = self.table.call(self.layer, *arrays, mask, causal, self.training, need_weights)
            out = framework.to_torch(out, query)
            if need_weights and weights is not None:
                weights = framework.to_torch(weights, query)
        if need_weights and weights is not None:
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if unbatched:
                weights = weights.squeeze(0)
        else:
            weights = None
        if unbatched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _attend(self, key_padding_mask, attn_mask, B: int, L: int, S: int):
        """One bool mask, True = attend, (B, 1, L, S) or per head (B, N, L, S); None without masks."""
        attend = None
        for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if mask is None:
                continue
            if mask.dtype != torch.bool:
                raise NotImplementedError(f"a float {name}: {self.table.name} takes bool masks only, so no "
                                          "float mask can be handed over")
            if name == "key_padding_mask":
                keep = ~mask.reshape(B, 1, 1, S)
            elif mask.dim() == 3:  # (B*N, L, S), or (N, L, S) unbatched: per head
                keep = ~mask.reshape(B, self.num_heads, L, S)
            else:
                keep = ~mask.reshape(1, 1, L, S)
            attend = keep if attend is None else attend & keep
        if attend is None:
            return None
        return attend.expand(B, attend.shape[1], L, S).contiguous()

    # ------------------------------------------------- nn.MultiheadAttention's names

    def _get(self, role: str) -> torch.Tensor:
        return torch.as_tensor(np.array(self.table.get(self.layer, role), dtype=np.float64)).to(self.dtype)

    @property
    def in_proj_weight(self) -> torch.Tensor | None:
        """(3D, D) as nn.MultiheadAttention holds it (None when kdim or vdim differ)."""
        if self.kdim != self.embed_dim or self.vdim != self.embed_dim:
            return None
        return torch.cat([self._get(r).reshape(self.embed_dim, -1).T for r in ROLES[:3]])

    @property
    def in_proj_bias(self) -> torch.Tensor | None:
        return torch.cat([self._get(r).reshape(-1) for r in ROLES[3:6]]) if self.bias else None

    @property
    def out_proj(self) -> Any:
        weight = self._get("o_kernel").reshape(-1, self.embed_dim).T
        return types.SimpleNamespace(weight=weight, bias=self._get("o_bias") if self.bias else None)


def load_module_weights(module: ModuleMHA, params: Any) -> None:
    """``spec.MHAParams`` (float64 NumPy, nn.MultiheadAttention's names) into the layer's
    parameters, through the canonical layout (rounded to the module's dtype first)."""
    N, D = module.num_heads, module.embed_dim
    head = D // N

    def put(role: str, array: np.ndarray) -> None:
        value = torch.as_tensor(np.asarray(array, dtype=np.float64)).to(module.dtype)
        with module.factory.framework.dtype_scope(module.dtype):
            module.table.put(module.layer, role, torch_to_numpy(value))

    weights, biases = params.projection_weights(), params.projection_biases()
    for index, (weight, bias) in enumerate(zip(weights, biases, strict=True)):
        put(ROLES[index], weight.T.reshape(weight.shape[1], N, head))
        if module.bias:
            put(ROLES[3 + index], np.asarray(bias).reshape(N, head))
    put("o_kernel", params.out_proj_weight.T.reshape(N, head, D))
    if module.bias:
        put("o_bias", params.out_proj_bias)
