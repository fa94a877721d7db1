"""The per-framework tables of the module bridge (:mod:`.modules`): how each framework's
multi-head layer is built, called and reached, from its documented API.

=====================  ================================  ==========================================
Framework              class                             what differs
=====================  ================================  ==========================================
Flax NNX (flax 0.12)   ``flax.nnx.MultiHeadAttention``   ``in_features``, one ``in_kv_features`` for
                                                         key and value (kdim == vdim only);
                                                         ``is_causal`` flag (upper-left tril);
                                                         weights sown with ``sow_weights=True``
Flax Linen             ``flax.linen.                     a pure module: parameters are a dict
                       MultiHeadDotProductAttention``    (``params['query']['kernel']``...); no
                                                         causal flag (the mask carries it);
                                                         weights sown into ``intermediates``
=====================  ================================  ==========================================

Both take a bool mask True = attend broadcastable to (B, N, L, S), their kernels are
``LinearGeneral``/``DenseGeneral`` (D_in, N, hd) and (N, hd, D): the canonical layout as is.
Dropout is on the attention weights with ``deterministic=False``, seeded from torch's global
generator when the layer is built (:func:`_seed`).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import numpy as np

from implementations.bridge.modules import ModuleTable

__all__ = ["MODULE_TABLES", "module_table"]

_PARTS = {"q": "query", "k": "key", "v": "value", "o": "out"}


def _part(role: str) -> tuple[str, str]:
    """``"q_kernel"`` -> ``("query", "kernel")``."""
    short, _, leaf = role.partition("_")
    return _PARTS[short], leaf


def _subclass_of(module: str, name: str):
    def matches(cls: type) -> bool:
        return inspect.isclass(cls) and any(
            base.__name__ == name and (base.__module__ or "").startswith(module) for base in cls.__mro__)
    return matches


# --------------------------------------------------------------------------- Flax NNX


def _seed() -> int:
    """A dropout seed from torch's global generator, which the suite seeds per example: each
    layer built draws its own dropout patterns, as nn.MultiheadAttention's would."""
    import torch

    return int(torch.randint(0, 2**31 - 1, ()))


def _nnx_build(cls, embed_dim, num_heads, kdim, vdim, bias, dropout, dtype):
    from flax import nnx

    return cls(num_heads=num_heads, in_features=embed_dim, qkv_features=embed_dim, out_features=embed_dim,
               in_kv_features=kdim, dtype=dtype, param_dtype=dtype, dropout_rate=dropout, use_bias=bias,
               decode=False, rngs=nnx.Rngs(_seed()))


def _nnx_call(layer, query, key, value, mask, causal, training, need_weights):
    from flax import nnx

    with warnings.catch_warnings():  # flax 0.12: sow outside nnx.capture() is deprecated, still documented
        warnings.simplefilter("ignore", DeprecationWarning)
        out = layer(query, key, value, mask=mask, deterministic=not training, is_causal=causal,
                    sow_weights=need_weights)
    if not need_weights:
        return out, None
    sown = nnx.pop(layer, nnx.Intermediate)  # the weights of this call only
    weights = [leaf for leaf in _leaves(sown)]
    return out, (weights[-1] if weights else None)


def _leaves(tree: Any) -> list[Any]:
    import jax

    return [leaf for leaf in jax.tree_util.tree_leaves(tree) if hasattr(leaf, "shape")]


def _nnx_get(layer, role):
    part, leaf = _part(role)
    return np.asarray(getattr(getattr(layer, part), leaf)[...])


def _nnx_put(layer, role, array):
    import jax.numpy as jnp

    part, leaf = _part(role)
    variable = getattr(getattr(layer, part), leaf)
    variable[...] = jnp.asarray(array).reshape(variable[...].shape)


# --------------------------------------------------------------------------- Flax Linen


class _Linen:
    """A Linen module and its parameters (a pure module holds none itself)."""

    def __init__(self, module: Any, params: Any) -> None:
        self.module, self.params = module, params
        self.seed, self.calls = _seed(), 0  # a new dropout key per call, as a stateful layer's rngs advance


def _linen_build(cls, embed_dim, num_heads, kdim, vdim, bias, dropout, dtype):
    import jax
    import jax.numpy as jnp

    module = cls(num_heads=num_heads, qkv_features=embed_dim, out_features=embed_dim, dtype=dtype,
                 param_dtype=dtype, dropout_rate=dropout, use_bias=bias)
    q = jnp.zeros((1, 1, embed_dim), dtype)
    variables = module.init(jax.random.PRNGKey(0), q, jnp.zeros((1, 1, kdim), dtype), jnp.zeros((1, 1, vdim), dtype),
                            deterministic=True)
    return _Linen(module, jax.tree_util.tree_map(lambda x: x, dict(variables["params"])))


def _linen_call(layer, query, key, value, mask, causal, training, need_weights):
    import jax

    layer.calls += 1
    rngs = {"dropout": jax.random.fold_in(jax.random.PRNGKey(layer.seed), layer.calls)} if training else None
    out, state = layer.module.apply({"params": layer.params}, query, key, value, mask=mask,
                                    deterministic=not training, rngs=rngs, sow_weights=need_weights,
                                    mutable=["intermediates"])
    weights = _leaves(state.get("intermediates", {})) if need_weights else []
    return out, (weights[-1] if weights else None)


def _linen_get(layer, role):
    part, leaf = _part(role)
    return np.asarray(layer.params[part][leaf])


def _linen_put(layer, role, array):
    import jax.numpy as jnp

    part, leaf = _part(role)
    held = dict(layer.params[part])
    held[leaf] = jnp.asarray(array).reshape(held[leaf].shape)
    layer.params = {**layer.params, part: held}


#: The tables, tried in order by :func:`module_table`.
MODULE_TABLES = (
    ModuleTable(name="flax.nnx.MultiHeadAttention", framework="jax",
                matches=_subclass_of("flax.nnx", "MultiHeadAttention"), build=_nnx_build, call=_nnx_call,
                get=_nnx_get, put=_nnx_put, kdim_vdim=False),
    ModuleTable(name="flax.linen.MultiHeadDotProductAttention", framework="jax",
                matches=_subclass_of("flax.linen", "MultiHeadDotProductAttention"), build=_linen_build,
                call=_linen_call, get=_linen_get, put=_linen_put, causal_flag=False),
)


def module_table(cls: Any) -> ModuleTable | None:
    """The table of ``cls`` (a class of one of the frameworks above, or a subclass), or None."""
    return next((table for table in MODULE_TABLES if table.matches(cls)), None)
