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
Equinox                ``equinox.nn.MultiheadAttention`` unbatched (vmapped); ``nn.Linear``
                                                         weights (out, in); one (L, S) mask for
                                                         every head
Haiku                  ``haiku.MultiHeadAttention``      pure (``hk.transform``); no dropout
PaddlePaddle           ``paddle.nn.MultiHeadAttention``  a stateful layer built in the default
                                                         dtype; ``Linear`` weights (in, out);
                                                         weights returned (``need_weights=True``)
=====================  ================================  ==========================================

Each takes a bool mask True = attend broadcastable to (B, N, L, S); Flax's kernels are
``LinearGeneral``/``DenseGeneral`` (D_in, N, hd) and (N, hd, D): the canonical layout as is.
Dropout is on the attention weights in training (Flax: ``deterministic=False``), seeded from
torch's global generator when the layer is built (:func:`_seed`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from typing import Any, Iterator

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


@functools.cache
def _linen_apply() -> Any:
    """``module.apply`` compiled by ``jax.jit``, the module static: a Linen module is
    hashable by its configuration, so every layer built alike shares one compilation per
    shape (about 0.15 s, where ``apply`` op by op takes 0.5 s for each new shape)."""
    import jax

    def apply(module, variables, *args, **kwargs):
        return module.apply(variables, *args, **kwargs)

    return jax.jit(apply, static_argnames=("module", "deterministic", "sow_weights", "mutable"))


@contextlib.contextmanager
def _linen_quiet() -> Iterator[None]:
    """Linen warns whenever a value's last two sizes are equal (S == vdim), guessing that a
    mask was passed as ``inputs_v``; the bridge passes the mask by keyword."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "You are passing an array of shape", DeprecationWarning)
        yield


def _linen_build(cls, embed_dim, num_heads, kdim, vdim, bias, dropout, dtype):
    import jax
    import jax.numpy as jnp

    module = cls(num_heads=num_heads, qkv_features=embed_dim, out_features=embed_dim, dtype=dtype,
                 param_dtype=dtype, dropout_rate=dropout, use_bias=bias)
    q = jnp.zeros((1, 1, embed_dim), dtype)
    with _linen_quiet():
        variables = module.init(jax.random.PRNGKey(0), q, jnp.zeros((1, 1, kdim), dtype),
                                jnp.zeros((1, 1, vdim), dtype), deterministic=True)
    return _Linen(module, jax.tree_util.tree_map(lambda x: x, dict(variables["params"])))


def _linen_call(layer, query, key, value, mask, causal, training, need_weights):
    import jax

    layer.calls += 1
    rngs = {"dropout": jax.random.fold_in(jax.random.PRNGKey(layer.seed), layer.calls)} if training else None
    with _linen_quiet():
        out, state = _linen_apply()(layer.module, {"params": layer.params}, query, key, value, mask=mask,
                                    deterministic=not training, rngs=rngs, sow_weights=need_weights,
                                    mutable=("intermediates",))
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


# --------------------------------------------------------------------------- Equinox


class _Held:
    """An immutable layer (an Equinox module, a Haiku parameter dict) held where ``put``
    can replace it, with its compiled call and a dropout seed advanced per call."""

    def __init__(self, layer: Any, call: Any, num_heads: int) -> None:
        self.layer, self.call, self.num_heads = layer, call, num_heads
        self.seed, self.calls = _seed(), 0

    def dropout_key(self) -> Any:
        import jax

        self.calls += 1
        return jax.random.fold_in(jax.random.PRNGKey(self.seed), self.calls)


def _eqx_build(cls, embed_dim, num_heads, kdim, vdim, bias, dropout, dtype):
    import jax
    import jax.numpy as jnp

    layer = cls(num_heads=num_heads, query_size=embed_dim, key_size=kdim, value_size=vdim, output_size=embed_dim,
                use_query_bias=bias, use_key_bias=bias, use_value_bias=bias, use_output_bias=bias,
                dropout_p=dropout, dtype=jnp.dtype(dtype), key=jax.random.PRNGKey(0))
    return _Held(layer, _eqx_batched(), num_heads)


@functools.cache
def _eqx_batched() -> Any:
    """The layer over a batch, compiled by ``equinox.filter_jit`` (the layer an argument:
    layers built alike share one compilation per shape). The layer is unbatched: each batch
    row gets its (L, S) or (N, L, S) mask and its own dropout key."""
    import equinox as eqx
    import jax

    @eqx.filter_jit
    def call(layer, query, key, value, mask, dropout_key, inference):
        one = lambda q, k, v, m, r: layer(q, k, v, mask=m, key=r, inference=inference)  # noqa: E731
        keys = jax.random.split(dropout_key, query.shape[0])
        return jax.vmap(one)(query, key, value, mask, keys)

    return call


def _eqx_call(held, query, key, value, mask, causal, training, need_weights):
    if mask is not None and mask.shape[1] == 1:
        mask = mask[:, 0]  # (B, L, S): the layer takes one mask for every head as (L, S)
    return held.call(held.layer, query, key, value, mask, held.dropout_key(), not training), None


def _eqx_linear(layer, role):
    """The ``eqx.nn.Linear`` of ``role`` and its leaf's name."""
    part = {"q": "query_proj", "k": "key_proj", "v": "value_proj", "o": "output_proj"}[role[0]]
    return getattr(layer, part), ("bias" if role.endswith("bias") else "weight")


def _eqx_get(held, role):
    linear, leaf = _eqx_linear(held.layer, role)
    array = np.asarray(getattr(linear, leaf))  # weight (out, in), bias (out,)
    if leaf == "bias":
        return array if role == "o_bias" else array.reshape(held.num_heads, -1)
    if role == "o_kernel":
        return array.T.reshape(held.num_heads, -1, array.shape[0])
    return array.T.reshape(array.shape[1], held.num_heads, -1)


def _eqx_put(held, role, array):
    import equinox as eqx
    import jax.numpy as jnp

    linear, leaf = _eqx_linear(held.layer, role)
    old = getattr(linear, leaf)
    if leaf == "weight":  # canonical (D_in, N, hd) or (N, hd, D) -> (out, in)
        array = array.reshape(-1, array.shape[-1]).T if role == "o_kernel" else array.reshape(array.shape[0], -1).T
    new = jnp.asarray(array, dtype=old.dtype).reshape(old.shape)
    held.layer = eqx.tree_at(lambda layer: getattr(_eqx_linear(layer, role)[0], leaf), held.layer, new)


# --------------------------------------------------------------------------- Haiku


def _hk_build(cls, embed_dim, num_heads, kdim, vdim, bias, dropout, dtype):
    import jax
    import jax.numpy as jnp

    if dropout:
        raise NotImplementedError(f"{cls.__name__} has no dropout")
    init, apply = _hk_transformed(cls, embed_dim, num_heads, bias)
    zeros = [jnp.zeros((1, 1, width), dtype) for width in (embed_dim, kdim, vdim)]
    return _Held(init(jax.random.PRNGKey(0), *zeros, None), apply, num_heads)


@functools.cache
def _hk_transformed(cls, embed_dim, num_heads, bias) -> tuple[Any, Any]:
    """The layer's ``hk.transform``: its ``init``, and its ``apply`` compiled by ``jax.jit``
    (one per configuration, so layers built alike share a compilation per shape)."""
    import haiku as hk
    import jax

    head = embed_dim // num_heads

    def forward(query, key, value, mask):
        layer = cls(num_heads=num_heads, key_size=head, value_size=head, model_size=embed_dim, with_bias=bias,
                    w_init=hk.initializers.VarianceScaling(1.0))
        return layer(query, key, value, mask=mask)

    pure = hk.without_apply_rng(hk.transform(forward))
    return pure.init, jax.jit(pure.apply)


def _hk_call(held, query, key, value, mask, causal, training, need_weights):
    return held.call(held.layer, query, key, value, mask), None


def _hk_part(held, role):
    """The parameter dict's module name of ``role`` (``multi_head_attention/query``...) and leaf."""
    part = {"q": "query", "k": "key", "v": "value", "o": "linear"}[role[0]]
    return next(name for name in held.layer if name.split("/")[-1] == part), ("b" if role.endswith("bias") else "w")


def _from_in_out(array: np.ndarray, role: str, num_heads: int) -> np.ndarray:
    """A dense layer's weight (in, out) or bias (out,) -- Haiku's and Paddle's layout -- in
    the canonical per-head layout of ``role`` (:data:`.modules.ROLES`)."""
    if role == "o_bias":
        return array
    if role.endswith("bias"):
        return array.reshape(num_heads, -1)
    if role == "o_kernel":
        return array.reshape(num_heads, -1, array.shape[1])
    return array.reshape(array.shape[0], num_heads, -1)


def _hk_get(held, role):
    part, leaf = _hk_part(held, role)
    return _from_in_out(np.asarray(held.layer[part][leaf]), role, held.num_heads)  # w (in, out), b (out,)


def _hk_put(held, role, array):
    import jax.numpy as jnp

    part, leaf = _hk_part(held, role)
    old = held.layer[part][leaf]
    new = jnp.asarray(np.asarray(array).reshape(old.shape), dtype=old.dtype)
    held.layer = {**held.layer, part: {**held.layer[part], leaf: new}}


# --------------------------------------------------------------------------- PaddlePaddle


@contextlib.contextmanager
def _paddle_dtype(dtype: str) -> Iterator[None]:
    """Paddle builds a layer's parameters in its default dtype: ``dtype`` while open."""
    import paddle

    before = paddle.get_default_dtype()
    paddle.set_default_dtype(dtype)
    try:
        yield
    finally:
        paddle.set_default_dtype(before)


def _pd_build(cls, embed_dim, num_heads, kdim, vdim, bias, dropout, dtype):
    import paddle

    paddle.seed(_seed())  # dropout patterns drawn from the suite's seed
    with _paddle_dtype(dtype):
        return cls(embed_dim, num_heads, dropout=dropout, kdim=kdim, vdim=vdim, need_weights=True,
                   bias_attr=None if bias else False)


def _pd_call(layer, query, key, value, mask, causal, training, need_weights):
    layer.train() if training else layer.eval()
    out, weights = layer(query, key, value, attn_mask=mask)
    return out, (weights if need_weights else None)


def _pd_linear(layer, role):
    """The ``paddle.nn.Linear`` of ``role`` (weight (in, out), bias (out,)) and its leaf."""
    part = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "out_proj"}[role[0]]
    return getattr(layer, part), ("bias" if role.endswith("bias") else "weight")


def _pd_get(layer, role):
    linear, leaf = _pd_linear(layer, role)
    return _from_in_out(getattr(linear, leaf).astype("float64").numpy(), role, layer.num_heads)


def _pd_put(layer, role, array):
    import paddle

    linear, leaf = _pd_linear(layer, role)
    param = getattr(linear, leaf)
    value = np.asarray(array, dtype=np.float64).reshape(param.shape)
    param.set_value(paddle.to_tensor(value).astype(param.dtype))


#: The tables, tried in order by :func:`module_table`.
MODULE_TABLES = (
    ModuleTable(name="flax.nnx.MultiHeadAttention", framework="jax",
                matches=_subclass_of("flax.nnx", "MultiHeadAttention"), build=_nnx_build, call=_nnx_call,
                get=_nnx_get, put=_nnx_put, kdim_vdim=False, deviations="flax-nnx-mha"),
    ModuleTable(name="flax.linen.MultiHeadDotProductAttention", framework="jax",
                matches=_subclass_of("flax.linen", "MultiHeadDotProductAttention"), build=_linen_build,
                call=_linen_call, get=_linen_get, put=_linen_put, causal_flag=False, deviations="flax-linen-mha"),
    ModuleTable(name="equinox.nn.MultiheadAttention", framework="jax",
                matches=_subclass_of("equinox.nn", "MultiheadAttention"), build=_eqx_build, call=_eqx_call,
                get=_eqx_get, put=_eqx_put, causal_flag=False, deviations="equinox-mha"),
    ModuleTable(name="haiku.MultiHeadAttention", framework="jax",
                matches=_subclass_of("haiku", "MultiHeadAttention"), build=_hk_build, call=_hk_call,
                get=_hk_get, put=_hk_put, causal_flag=False, deviations="haiku-mha"),
    ModuleTable(name="paddle.nn.MultiHeadAttention", framework="paddle",
                matches=_subclass_of("paddle.nn", "MultiHeadAttention"), build=_pd_build, call=_pd_call,
                get=_pd_get, put=_pd_put, causal_flag=False, deviations="paddle-mha"),
)


def module_table(cls: Any) -> ModuleTable | None:
    """The table of ``cls`` (a class of one of the frameworks above, or a subclass), or None."""
    return next((table for table in MODULE_TABLES if table.matches(cls)), None)
