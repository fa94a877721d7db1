"""torch.nn.MultiheadAttention's semantics in float64 NumPy (eval mode).

Dimension letters: B batch, N heads, L query length, S key length, D model dim
(``embed_dim``), hd = D // N the head dim, kdim/vdim the key/value feature dims.

Masks here are in **nn.MultiheadAttention's convention**: a bool mask is **True =
blocked** (not allowed to attend), a float mask is **added** to the scaled scores.
``key_padding_mask`` and ``attn_mask`` are merged by adding their additive forms
(:func:`spec.masks.merge_key_padding`), as PyTorch does.

Dropout: the spec is eval mode, so there is no dropout at all (PyTorch's module skips
dropout when ``training`` is False). Training-mode dropout is random and is checked by the
suite through its expectation, not against this function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _checks, masks
from ._sdpa import sdpa
from .errors import fail

__all__ = ["MHAParams", "mha_forward"]


@dataclass
class MHAParams:
    """The parameters of one ``nn.MultiheadAttention``, under its own names, as float64.

    Packed (``kdim == vdim == embed_dim``, as PyTorch decides): ``in_proj_weight`` (3D, D)
    holds W_q; W_k; W_v stacked. Otherwise ``q_proj_weight`` (D, D), ``k_proj_weight``
    (D, kdim), ``v_proj_weight`` (D, vdim). ``in_proj_bias`` (3D,) and ``out_proj_bias``
    (D,) are None without bias; ``bias_k``/``bias_v`` (1, 1, D) only with ``add_bias_kv``.
    """

    embed_dim: int
    num_heads: int
    out_proj_weight: np.ndarray
    in_proj_weight: np.ndarray | None = None
    q_proj_weight: np.ndarray | None = None
    k_proj_weight: np.ndarray | None = None
    v_proj_weight: np.ndarray | None = None
    in_proj_bias: np.ndarray | None = None
    out_proj_bias: np.ndarray | None = None
    bias_k: np.ndarray | None = None
    bias_v: np.ndarray | None = None
    kdim: int | None = None
    vdim: int | None = None
    add_zero_attn: bool = False

    def __post_init__(self) -> None:
        D, N = self.embed_dim, self.num_heads
        if not isinstance(N, (int, np.integer)) or N < 1 or not isinstance(D, (int, np.integer)) or D % N:
            fail("num_heads", N, f"must be an int >= 1 dividing embed_dim={D}",
                 "choose embed_dim = num_heads * head_dim")
        self.kdim = D if self.kdim is None else self.kdim
        self.vdim = D if self.vdim is None else self.vdim
        expected = {"out_proj_weight": (D, D), "in_proj_bias": (3 * D,), "out_proj_bias": (D,),
                    "bias_k": (1, 1, D), "bias_v": (1, 1, D)}
        if self.packed:
            expected["in_proj_weight"] = (3 * D, D)
        else:
            expected.update(q_proj_weight=(D, D), k_proj_weight=(D, self.kdim),
                            v_proj_weight=(D, self.vdim))
        for name, shape in expected.items():
            value = getattr(self, name)
            if value is None and name in ("in_proj_bias", "out_proj_bias", "bias_k", "bias_v"):
                continue
            if value is None or np.shape(value) != shape:
                fail(name, value, f"must have shape {shape} for embed_dim={D}, kdim={self.kdim}, "
                     f"vdim={self.vdim}", "copy the weights of a module built with the same options")
            setattr(self, name, _checks.as_float64(name, value))
        if (self.bias_k is None) != (self.bias_v is None):
            fail("bias_k", self.bias_k, "bias_k and bias_v must be given together (add_bias_kv)",
                 "set both or neither")

    @property
    def packed(self) -> bool:
        """PyTorch's ``_qkv_same_embed_dim``: one packed in_proj_weight."""
        return self.kdim == self.embed_dim and self.vdim == self.embed_dim

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    def projection_weights(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(W_q (D, D), W_k (D, kdim), W_v (D, vdim))."""
        if self.packed:
            return tuple(np.split(self.in_proj_weight, 3))  # (3D, D) -> 3 × (D, D)
        return self.q_proj_weight, self.k_proj_weight, self.v_proj_weight

    def projection_biases(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.in_proj_bias is None:
            return (np.zeros(self.embed_dim),) * 3
        return tuple(np.split(self.in_proj_bias, 3))        # (3D,) -> 3 × (D,)

    @classmethod
    def random(cls, rng: np.random.Generator, embed_dim: int, num_heads: int, *, bias: bool = True,
               add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
               vdim: int | None = None) -> "MHAParams":
        """Random parameters (every entry, biases included, drawn N(0, 1/D) so nothing is 0)."""
        D = embed_dim
        kdim, vdim = kdim or D, vdim or D
        draw = lambda *shape: rng.normal(0.0, 1.0 / math.sqrt(D), size=shape)  # noqa: E731
        fields: dict[str, Any] = dict(embed_dim=D, num_heads=num_heads, kdim=kdim, vdim=vdim,
                                      add_zero_attn=add_zero_attn, out_proj_weight=draw(D, D))
        if kdim == D and vdim == D:
            fields["in_proj_weight"] = draw(3 * D, D)
        else:
            fields.update(q_proj_weight=draw(D, D), k_proj_weight=draw(D, kdim), v_proj_weight=draw(D, vdim))
        if bias:
            fields.update(in_proj_bias=draw(3 * D), out_proj_bias=draw(D))
        if add_bias_kv:
            fields.update(bias_k=draw(1, 1, D), bias_v=draw(1, 1, D))
        return cls(**fields)


def _inputs(params: MHAParams, query: Any, key: Any, value: Any,
            batch_first: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """Validate the inputs and bring them to (B, L, D), (B, S, kdim), (B, S, vdim)."""
    q = _checks.as_float64("query", query)
    k = _checks.as_float64("key", key)
    v = _checks.as_float64("value", value)
    batched = q.ndim == 3
    if q.ndim not in (2, 3) or k.ndim != q.ndim or v.ndim != q.ndim:
        fail("query", q, "query, key and value must all be 3-D (batched) or all 2-D (unbatched)",
             "pass (L, B, D) / (B, L, D) with batch_first, or (L, D) unbatched")
    if not batched:
        q, k, v = q[:, None], k[:, None], v[:, None]                  # (L, D) -> (L, 1, D)
    elif batch_first:
        q, k, v = (np.swapaxes(x, 0, 1) for x in (q, k, v))           # (B, L, D) -> (L, B, D)
    for name, array, dim in (("query", q, params.embed_dim), ("key", k, params.kdim),
                             ("value", v, params.vdim)):
        if array.shape[-1] != dim:
            fail(name, array, f"last dim must be {dim} (embed_dim/kdim/vdim of the params)",
                 "project the input to the module's feature size")
    if k.shape[:2] != v.shape[:2] or q.shape[1] != k.shape[1]:
        fail("key", k, "key and value must share (S, B), and B must match the query's",
             "pass key/value with the same length and batch as each other and the query")
    # (L, B, D) -> (B, L, D)
    return np.swapaxes(q, 0, 1), np.swapaxes(k, 0, 1), np.swapaxes(v, 0, 1), batched


def _check_masks(key_padding_mask: Any, attn_mask: Any, batched: bool, B: int, N: int,
                 L: int, S: int) -> tuple[Any, Any]:
    """Check MHA's mask shapes against PyTorch's rules; return them batched."""
    for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
        if mask is not None and not (np.asarray(mask).dtype == np.bool_ or _checks.is_real_float(np.asarray(mask).dtype)):
            fail(name, np.asarray(mask), "must be bool (True = blocked) or float (added)",
                 "convert a 1 = keep int mask with spec.masks.to_mha_bool(spec.masks.from_keep_int(m))")
    if key_padding_mask is not None:
        key_padding_mask = np.asarray(key_padding_mask)
        want = (B, S) if batched else (S,)
        if key_padding_mask.shape != want:
            fail("key_padding_mask", key_padding_mask, f"must have shape {want} (B, S)",
                 "give one entry per key and batch element")
        key_padding_mask = key_padding_mask.reshape(B, S)
    if attn_mask is not None:
        attn_mask = np.asarray(attn_mask)
        if attn_mask.shape not in ((L, S), (B * N, L, S)):
            fail("attn_mask", attn_mask, f"must have shape (L, S) = {(L, S)} or (B*N, L, S) = {(B * N, L, S)}",
                 "build the mask for these lengths; per-head masks stack batch-major (row b*N + n)")
    return key_padding_mask, attn_mask


def _pad_key(mask: np.ndarray | None) -> np.ndarray | None:
    """Append one always-attended key column (False if bool = not blocked, 0 if float)."""
    if mask is None:
        return None
    return np.concatenate([mask, np.zeros_like(mask[..., :1])], axis=-1)


def mha_forward(params: MHAParams, query: Any, key: Any, value: Any, *,
                key_padding_mask: Any = None, attn_mask: Any = None, need_weights: bool = True,
                average_attn_weights: bool = True, is_causal: bool = False,
                batch_first: bool = False,
                fully_masked: str = "zero") -> tuple[np.ndarray, np.ndarray | None]:
    """``nn.MultiheadAttention.forward`` in eval mode, float64.

    Shapes: ``query`` (L, B, D), ``key`` (S, B, kdim), ``value`` (S, B, vdim); (B, L, D) etc.
    with ``batch_first``; (L, D), (S, kdim), (S, vdim) unbatched. ``key_padding_mask``
    (B, S) or (S,), ``attn_mask`` (L, S) or (B*N, L, S): bool **True = blocked**, float added.

    ``is_causal`` is PyTorch's hint that ``attn_mask`` is the causal mask: it needs
    ``attn_mask`` (as PyTorch does) and the result is computed from ``attn_mask``.
    Fully-masked query rows follow ``fully_masked`` (spec default: attention output 0,
    so the module output is ``out_proj_bias``).

    Returns ``(output, weights)``: output (L, B, D) / (B, L, D) / (L, D); weights None unless
    ``need_weights``, then (B, L, S') averaged over heads or (B, N, L, S') per head
    (unbatched: no B), where S' = S + 1 with bias_k/bias_v, + 1 more with add_zero_attn.
    """
    _checks.check_policy(fully_masked)
    q_in, k_in, v_in, batched = _inputs(params, query, key, value, batch_first)
    B, L, D = q_in.shape
    S, N, hd = k_in.shape[1], params.num_heads, params.head_dim
    key_padding_mask, attn_mask = _check_masks(key_padding_mask, attn_mask, batched, B, N, L, S)
    if is_causal and attn_mask is None:
        fail("is_causal", is_causal, "nn.MultiheadAttention treats is_causal as a hint and needs attn_mask",
             "also pass attn_mask=spec.masks.to_mha_bool(spec.masks.causal_mask(L, S, 'upper_left'))")
    # 1. input projections                                       (B, L, D), (B, S, D), (B, S, D)
    (w_q, w_k, w_v), (b_q, b_k, b_v) = params.projection_weights(), params.projection_biases()
    q, k, v = q_in @ w_q.T + b_q, k_in @ w_k.T + b_k, v_in @ w_v.T + b_v
    # 2. bias_k / bias_v: one more key and value; masks get an attended column
    if params.bias_k is not None:
        k = np.concatenate([k, np.broadcast_to(params.bias_k[0], (B, 1, D))], axis=1)  # (B, S+1, D)
        v = np.concatenate([v, np.broadcast_to(params.bias_v[0], (B, 1, D))], axis=1)  # (B, S+1, D)
        attn_mask, key_padding_mask = _pad_key(attn_mask), _pad_key(key_padding_mask)
    # 3. split heads                                             (B, L, D) -> (B, N, L, hd)
    q = q.reshape(B, L, N, hd).transpose(0, 2, 1, 3)
    k = k.reshape(B, -1, N, hd).transpose(0, 2, 1, 3)             # (B, N, S', hd)
    v = v.reshape(B, -1, N, hd).transpose(0, 2, 1, 3)             # (B, N, S', hd)
    # 4. add_zero_attn: a zero key and value after everything else (in head space)
    if params.add_zero_attn:
        k = np.concatenate([k, np.zeros((B, N, 1, hd))], axis=2)  # (B, N, S'+1, hd)
        v = np.concatenate([v, np.zeros((B, N, 1, hd))], axis=2)
        attn_mask, key_padding_mask = _pad_key(attn_mask), _pad_key(key_padding_mask)
    # 5. one additive mask, broadcastable to (B, N, L, S')
    additive = masks.merge_key_padding(key_padding_mask, attn_mask, num_heads=N)
    # 6. attention per head, scale 1/sqrt(hd)                    (B, N, L, hd)
    result = sdpa(q, k, v, additive_mask=additive, fully_masked=fully_masked)
    # 7. merge heads and project out                            (B, N, L, hd) -> (B, L, D)
    merged = result.output.transpose(0, 2, 1, 3).reshape(B, L, D)
    output = merged @ params.out_proj_weight.T
    if params.out_proj_bias is not None:
        output = output + params.out_proj_bias
    # 8. back to the caller's layout
    if not batched:
        output = output[0]                                        # (1, L, D) -> (L, D)
    elif not batch_first:
        output = output.transpose(1, 0, 2)                        # (B, L, D) -> (L, B, D)
    if not need_weights:
        return output, None
    weights = result.weights.mean(axis=1) if average_attn_weights else result.weights
    return output, (weights if batched else weights[0])           # (B, L, S') / (B, N, L, S')
