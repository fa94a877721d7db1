"""Wrong conventions of nn.MultiheadAttention, each computed in float64.

One parameterised forward (:func:`_forward`) mirrors :func:`spec.mha_forward` step by
step; :class:`_Steps` says how each step is done, its defaults being the module's own
conventions (a test pins ``_forward(p, _Steps())`` to ``spec.mha_forward``). Each
variant changes one step. Masks are in the module's convention: bool **True = blocked**,
float added.

Dimension letters: B batch, N heads, L query length, S key length, D model dim
(embed_dim), hd = D // N the head dim; S' = S plus the keys bias_k / add_zero_attn append.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from .. import masks
from .._sdpa import sdpa
from ..errors import SpecError
from ..mha import _check_masks, _inputs, _pad_key, mha_forward
from ._core import MHAProblem, Variant, VariantResult

__all__ = ["MHA_VARIANTS", "reference"]


def _policy(p: MHAProblem) -> str:
    return "zero" if p.fully_masked == "unspecified" else p.fully_masked


def reference(p: MHAProblem) -> VariantResult:
    """The correct convention: :func:`spec.mha_forward` (eval) under the declared policy."""
    output, weights = mha_forward(p.params, p.query, p.key, p.value, key_padding_mask=p.key_padding_mask,
                                  attn_mask=p.attn_mask, need_weights=p.need_weights,
                                  average_attn_weights=p.average_attn_weights, is_causal=p.is_causal,
                                  batch_first=p.batch_first, fully_masked=_policy(p))
    return VariantResult(output, weights)


@dataclass(frozen=True)
class _Steps:
    """How each step of the forward is done; the defaults are the module's conventions."""

    batch_first_ignored: bool = False
    projection_order: tuple[int, int, int] = (0, 1, 2)   # in_proj chunk used for W_q, W_k, W_v
    split: str = "transpose"                             # or "view": reshape(B, N, T, hd)
    attn_mask: str = "as_given"                          # "inverted", "nonzero_blocks"
    key_padding_mask: str = "as_given"                   # "inverted", "float_ignored", "on_queries"
    causal_hint_dropped: bool = False
    scale: str = "head_dim"                              # or "embed_dim"
    merge: str = "transpose"                             # or "view": reshape(B, L, D)
    out_proj: bool = True
    heads: str = "mean"                                  # weights averaged with "mean" or "sum"
    softmax_axis: str = "keys"                           # or "queries": normalised over the L axis
    fully_masked: str | None = None                      # None: the declared policy


@dataclass(frozen=True)
class _Heads:
    """The per-head attention problem and what is needed to undo the layout."""

    query: np.ndarray           # (B, N, L, hd)
    key: np.ndarray             # (B, N, S', hd)
    value: np.ndarray           # (B, N, S', hd)
    additive: np.ndarray | None  # broadcastable to (B, N, L, S')
    batched: bool
    batch_first: bool


def _read_masks(p: MHAProblem, steps: _Steps, key_padding_mask: Any, attn_mask: Any,
                L: int) -> tuple[Any, Any, Any, bool]:
    """The masks as the module reads them: ``(key_padding_mask, attn_mask, query_padding,
    causal_flag)``; query_padding is additive (B, 1, L, 1) or None."""
    query_padding, causal_flag = None, False
    if attn_mask is not None and attn_mask.dtype == np.bool_ and steps.attn_mask == "inverted":
        attn_mask = ~attn_mask                                           # read as True = may attend
    if attn_mask is not None and attn_mask.dtype != np.bool_ and steps.attn_mask == "nonzero_blocks":
        attn_mask = attn_mask != 0                                       # .bool(): nonzero blocks
    if key_padding_mask is not None:
        is_bool = key_padding_mask.dtype == np.bool_
        if is_bool and steps.key_padding_mask == "inverted":
            key_padding_mask = ~key_padding_mask
        elif not is_bool and steps.key_padding_mask == "float_ignored":
            key_padding_mask = None
        elif steps.key_padding_mask == "on_queries":
            padding = masks.merge_key_padding(key_padding_mask, None)   # (B, 1, 1, S) with S = L
            query_padding, key_padding_mask = np.swapaxes(padding, -1, -2), None
    if steps.causal_hint_dropped and p.is_causal:
        attn_mask, causal_flag = None, not p.need_weights              # the flag only on that path
    return key_padding_mask, attn_mask, query_padding, causal_flag


def _split(x: np.ndarray, N: int, how: str) -> np.ndarray:
    B, T, D = x.shape
    if how == "view":
        return x.reshape(B, N, T, D // N)                                # heads and positions mixed
    return x.reshape(B, T, N, D // N).transpose(0, 2, 1, 3)               # (B, T, D) -> (B, N, T, hd)


def _merge(x: np.ndarray, how: str) -> np.ndarray:
    B, N, L, hd = x.shape
    if how == "view":
        return x.reshape(B, L, N * hd)                                   # heads and positions mixed
    return x.transpose(0, 2, 1, 3).reshape(B, L, N * hd)                 # (B, N, L, hd) -> (B, L, D)


def _heads(p: MHAProblem, steps: _Steps) -> _Heads:
    """Steps 1-5 of the forward: inputs, masks, projections, heads, one additive mask."""
    params, batch_first = p.params, p.batch_first != steps.batch_first_ignored
    q_in, k_in, v_in, batched = _inputs(params, p.query, p.key, p.value, batch_first)
    B, L, D = q_in.shape
    S, N = k_in.shape[1], params.num_heads
    key_padding_mask, attn_mask = _check_masks(p.key_padding_mask, p.attn_mask, batched, B, N, L, S)
    key_padding_mask, attn_mask, query_padding, causal_flag = _read_masks(p, steps, key_padding_mask, attn_mask, L)
    # 1. input projections                                       (B, L, D), (B, S, D), (B, S, D)
    weights, biases = params.projection_weights(), params.projection_biases()
    order = steps.projection_order if params.packed else (0, 1, 2)    # only a packed weight has chunks
    (w_q, w_k, w_v), (b_q, b_k, b_v) = ([parts[i] for i in order] for parts in (weights, biases))
    q, k, v = q_in @ w_q.T + b_q, k_in @ w_k.T + b_k, v_in @ w_v.T + b_v
    # 2. bias_k / bias_v: one more key and value; masks get an attended column
    if params.bias_k is not None:
        k = np.concatenate([k, np.broadcast_to(params.bias_k[0], (B, 1, D))], axis=1)  # (B, S+1, D)
        v = np.concatenate([v, np.broadcast_to(params.bias_v[0], (B, 1, D))], axis=1)
        attn_mask, key_padding_mask = _pad_key(attn_mask), _pad_key(key_padding_mask)
    # 3. split heads                                             (B, T, D) -> (B, N, T, hd)
    q, k, v = (_split(x, N, steps.split) for x in (q, k, v))
    # 4. add_zero_attn: a zero key and value in head space
    if params.add_zero_attn:
        k = np.concatenate([k, np.zeros((B, N, 1, D // N))], axis=2)  # (B, N, S'+1, hd)
        v = np.concatenate([v, np.zeros((B, N, 1, D // N))], axis=2)
        attn_mask, key_padding_mask = _pad_key(attn_mask), _pad_key(key_padding_mask)
    # 5. one additive mask, broadcastable to (B, N, L, S')
    parts = [masks.merge_key_padding(key_padding_mask, attn_mask, num_heads=N), query_padding]
    if causal_flag:
        parts.append(masks.to_additive(masks.causal_mask(L, k.shape[2], "upper_left")))
    parts = [part for part in parts if part is not None]
    additive = sum(parts[1:], parts[0]) if parts else None
    return _Heads(q, k, v, additive, batched, batch_first)


def _forward(p: MHAProblem, steps: _Steps) -> VariantResult:
    params, heads = p.params, _heads(p, steps)
    D = params.embed_dim
    # 6. attention per head                                      (B, N, L, hd)
    scale = 1.0 / math.sqrt(D) if steps.scale == "embed_dim" else None
    with np.errstate(invalid="ignore"):
        result = sdpa(heads.query, heads.key, heads.value, additive_mask=heads.additive, scale=scale,
                      fully_masked=steps.fully_masked or _policy(p))
    if steps.softmax_axis == "queries":
        result = _softmax_over_queries(heads, scale)
    # 7. merge heads and project out                            (B, N, L, hd) -> (B, L, D)
    output = _merge(result.output, steps.merge)
    if steps.out_proj:
        output = output @ params.out_proj_weight.T
        if params.out_proj_bias is not None:
            output = output + params.out_proj_bias
    # 8. back to the caller's layout (as the module understood it)
    if not heads.batched:
        output = output[0]                                        # (1, L, D) -> (L, D)
    elif not heads.batch_first:
        output = output.transpose(1, 0, 2)                        # (B, L, D) -> (L, B, D)
    if not p.need_weights:
        return VariantResult(output, None)
    weights = result.weights
    if p.average_attn_weights:
        weights = weights.sum(axis=1) if steps.heads == "sum" else weights.mean(axis=1)
    return VariantResult(output, weights if heads.batched else weights[0])


class _Attended(NamedTuple):
    output: np.ndarray
    weights: np.ndarray


def _softmax_over_queries(heads: _Heads, scale: float | None) -> _Attended:
    """Attention whose softmax runs over the query axis: each key's column of weights sums
    to 1 over the queries (a column every query blocks gets weight 0)."""
    E = heads.query.shape[-1]
    scores = heads.query @ np.swapaxes(heads.key, -1, -2) * (1.0 / math.sqrt(E) if scale is None else scale)
    if heads.additive is not None:
        scores = scores + heads.additive
    dead = np.isneginf(scores).all(axis=-2, keepdims=True)
    scores = np.where(dead, 0.0, scores)
    shifted = np.exp(scores - scores.max(axis=-2, keepdims=True))
    weights = np.where(dead, 0.0, shifted / shifted.sum(axis=-2, keepdims=True))
    return _Attended(weights @ heads.value, weights)


def _blocked_rows(p: MHAProblem) -> np.ndarray:
    """Bool (B, N, L): head rows whose keys are all blocked, under the correct reading."""
    heads = _heads(p, _Steps())
    B, N, L, _ = heads.query.shape
    if heads.additive is None:
        return np.zeros((B, N, L), dtype=bool)
    target = (B, N, L, heads.key.shape[2])
    return np.isneginf(np.broadcast_to(heads.additive, target)).all(axis=-1)


def _additive_differs(p: MHAProblem, steps: _Steps) -> bool:
    wrong, right = _heads(p, steps).additive, _heads(p, _Steps()).additive
    if wrong is None or right is None:
        return wrong is not right
    wrong, right = np.broadcast_arrays(wrong, right)
    return not np.array_equal(wrong, right)


def _valid_when_flipped(p: MHAProblem) -> bool:
    try:
        _heads(p, _Steps(batch_first_ignored=True))
    except SpecError:
        return False                                              # the module would raise
    return True


def _batch_first_ignored(p: MHAProblem) -> VariantResult:
    if p.unbatched or not _valid_when_flipped(p):
        return reference(p)                                       # no layout to misread, or it raises
    return _forward(p, _Steps(batch_first_ignored=True))


def _padding_on_queries(p: MHAProblem) -> VariantResult:
    if _length(p, p.query) != _length(p, p.key):
        return reference(p)                                       # the shapes would not broadcast
    return _forward(p, _Steps(key_padding_mask="on_queries"))


def _is_bool(mask: Any) -> bool:
    return mask is not None and np.asarray(mask).dtype == np.bool_


def _is_float(mask: Any) -> bool:
    return mask is not None and np.asarray(mask).dtype != np.bool_


def _any_blocking(mask: Any) -> bool:
    """A key padding mask that does something: a True entry, or a nonzero float entry."""
    return mask is not None and bool(np.asarray(mask).astype(bool).any())


def _table() -> list[Variant]:
    def steps(**changes: Any) -> Callable[[MHAProblem], VariantResult]:
        return lambda p: _forward(p, _Steps(**changes))

    rows = [
        dict(id="mha_scale_model_dim",
             summary="the scores are scaled by 1/sqrt(D), the model dim, instead of 1/sqrt(D / N)",
             models="the head dim confused with embed_dim in a hand-written module (bug zoo: "
                    "mha_scale_sqrt_embed_dim)",
             applies=lambda p: p.params.num_heads > 1, compute=steps(scale="embed_dim")),
        dict(id="mha_heads_split_without_transpose",
             summary="heads are split with reshape(B, N, T, hd) instead of reshape(B, T, N, hd) and a "
                     "transpose, mixing positions and heads",
             models="the wrong view when splitting heads; also a transposed view handed to a kernel "
                    "that assumes dense memory (bug zoo: mha_split_heads_view, mha_missing_contiguous)",
             applies=lambda p: p.params.num_heads > 1 and max(_length(p, p.query), _key_count(p)) > 1,
             compute=steps(split="view")),
        dict(id="mha_heads_merged_without_transpose",
             summary="heads are merged from (B, N, L, hd) straight into (B, L, D) without the transpose",
             models="a reshape where transpose(1, 2).reshape is meant (bug zoo: mha_merge_without_transpose)",
             applies=lambda p: p.params.num_heads > 1 and _length(p, p.query) > 1, compute=steps(merge="view")),
        dict(id="mha_softmax_over_queries",
             summary="the softmax runs over the query axis (dim=-2): each key's weights sum to 1 over the "
                     "queries instead of each query's over the keys",
             models="softmax(scores, dim=-2) in a hand-written module (bug zoo: learner_softmax_over_queries)",
             applies=lambda p: max(_length(p, p.query), _key_count(p)) > 1, compute=steps(softmax_axis="queries")),
        dict(id="mha_no_out_proj", summary="the output projection out_proj is never applied",
             models="a hand-written module returning the merged heads (bug zoo: mha_no_out_proj)",
             applies=lambda p: True, compute=steps(out_proj=False)),
        dict(id="mha_packed_projection_order",
             summary="the packed in_proj_weight is cut in the order k, q, v instead of q, k, v",
             models="loading or splitting a fused qkv projection in another library's chunk order",
             applies=lambda p: p.params.packed, compute=steps(projection_order=(1, 0, 2))),
        dict(id="mha_batch_first_ignored",
             summary="batch_first is ignored: (B, L, D) inputs are read as (L, B, D) or the reverse, so "
                     "attention runs across the batch",
             models="a module that stores batch_first but never transposes for it",
             applies=lambda p: not p.unbatched and (p.query.shape[:2], p.key.shape[:2]) != ((1, 1), (1, 1))
             and _valid_when_flipped(p),
             compute=_batch_first_ignored),
        dict(id="mha_mask_inverted",
             summary="the bool attn_mask is read as True = may attend, so exactly the allowed keys are blocked",
             models="masked_fill(mask == 0, -inf), written for 1 = keep masks, on the module's True = "
                    "blocked mask (bug zoo: mha_mask_eq_zero; pytorch#170400)",
             applies=lambda p: _is_bool(p.attn_mask), compute=steps(attn_mask="inverted")),
        dict(id="mha_padding_mask_inverted",
             summary="the bool key_padding_mask is read as True = keep, so the padding is attended and "
                     "the real keys blocked",
             models="a tokenizer's attention_mask (1 = real token) passed as key_padding_mask unchanged",
             applies=lambda p: _is_bool(p.key_padding_mask), compute=steps(key_padding_mask="inverted")),
        dict(id="mha_float_mask_as_bool",
             summary="the float attn_mask is turned into a bool one: every nonzero bias blocks its key",
             models="nn.MultiheadAttention's fast path turned a float bias into 'mask everything' "
                    "(pytorch#107084; bug zoo: mha_float_mask_as_bool)",
             applies=lambda p: _is_float(p.attn_mask)
             and bool((np.isfinite(p.attn_mask) & (p.attn_mask != 0)).any()),
             compute=steps(attn_mask="nonzero_blocks")),
        dict(id="mha_float_padding_ignored",
             summary="a float key_padding_mask is silently dropped; only a bool one is honoured",
             models="nn.MultiheadAttention ignored -inf in a float key_padding_mask (pytorch#92554; "
                    "bug zoo: mha_float_padding_ignored)",
             applies=lambda p: _is_float(p.key_padding_mask) and _any_blocking(p.key_padding_mask),
             compute=steps(key_padding_mask="float_ignored")),
        dict(id="mha_padding_mask_on_queries",
             summary="the key_padding_mask is applied to query positions (rows) instead of keys "
                     "(columns); padded queries get the fully-masked policy",
             models="a (B, S) padding mask broadcast as (B, 1, S, 1) in self-attention, where L = S "
                    "hides the mistake from shape checks",
             applies=lambda p: _any_blocking(p.key_padding_mask) and _length(p, p.query) == _length(p, p.key),
             compute=_padding_on_queries),
        dict(id="mha_causal_hint_dropped",
             summary="is_causal=True replaces attn_mask by the causal flag, and the need_weights=True path "
                     "never applies the flag",
             models="nn.MultiheadAttention ignored is_causal with need_weights=True (pytorch#99282; "
                    "bug zoo: mha_causal_hint_dropped)",
             applies=lambda p: p.is_causal and _additive_differs(p, _Steps(causal_hint_dropped=True)),
             compute=steps(causal_hint_dropped=True)),
        dict(id="mha_fully_masked_nan",
             summary="a query row whose keys are all blocked comes out NaN (and so does its output row)",
             models="nn.MultiheadAttention with need_weights=True and on its fast path (pytorch#41508, "
                    "#160064; bug zoo: mha_fully_masked_nan)",
             applies=lambda p: p.fully_masked not in ("nan", "unspecified") and bool(_blocked_rows(p).any()),
             compute=steps(fully_masked="nan"), declaration="--impl-option fully_masked={kind}:nan",
             row_policy="nan"),
        dict(id="mha_fully_masked_uniform",
             summary="a query row whose keys are all blocked gets uniform weights over every key, so its "
                     "attention output is the mean of the projected values",
             models="a module filling blocked scores with a finite value (-1e9, finfo.min) instead of "
                    "-inf, so a fully blocked row's scores are all equal",
             applies=lambda p: p.fully_masked not in ("uniform", "unspecified") and bool(_blocked_rows(p).any()),
             compute=steps(fully_masked="uniform"), declaration="--impl-option fully_masked={kind}:uniform",
             row_policy="uniform"),
        dict(id="mha_weights_summed_over_heads",
             summary="average_attn_weights=True sums the per-head weights instead of averaging them",
             models="per-head and averaged weights confused (pytorch#70055; bug zoo: mha_weights_summed)",
             applies=lambda p: p.need_weights and p.average_attn_weights and p.params.num_heads > 1,
             compute=steps(heads="sum")),
        dict(id="mha_dropout_in_eval",
             summary="the module's dropout stays on in eval mode",
             models="dropout_p passed to attention whatever self.training (pytorch#124464), or "
                    "F.dropout without training= (bug zoo: mha_dropout_in_eval, "
                    "mha_dropout_functional_default)",
             applies=lambda p: not p.training and p.dropout > 0, compute=None,
             detect="random, so no single output identifies it (its mean is still the correct output): "
                    "two eval-mode calls on the same inputs differ (property mha_eval_determinism)"),
    ]
    return [Variant(level="mha", **row) for row in rows]


def _length(p: MHAProblem, x: np.ndarray) -> int:
    """The sequence length of a query/key/value array in the problem's layout."""
    if p.unbatched:
        return x.shape[0]
    return x.shape[1] if p.batch_first else x.shape[0]


def _key_count(p: MHAProblem) -> int:
    """S plus the bias_k key (appended before the heads are split)."""
    return _length(p, p.key) + (p.params.bias_k is not None)


#: The MHA variants in their tie-breaking order.
MHA_VARIANTS: tuple[Variant, ...] = tuple(_table())
