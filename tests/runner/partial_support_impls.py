"""Small implementations with partial support that a declaration states
(``tests/runner/test_partial_support.py``): each fails its certificate without the
declaration and certifies with it. Each has scaled_dot_product_attention's signature and
is right wherever it claims to be (:func:`_attend`).

* :func:`positive_scale_only`: NaN for an explicit scale <= 0 (ONNX Runtime's
  ``Attention`` op): ``positive_scale=true``;
* :func:`float64_without_float_masks`: ignores a float mask in float64 (an exported graph
  that drops it): ``float64.mask_kinds=none,bool``;
* :func:`head_dims_8_16`: raises unless E and Ev are 8 or 16: ``head_dims=8,16``;
* :func:`causal_only`: raises unless is_causal=True: ``causal_only=true``;
* :func:`blocks_of_4`: raises unless L and S are multiples of 4: ``seq_multiple=4``;
* :func:`up_to_8_or_multiples`: raises unless L and S are at most 8 or multiples of 8
  (JAX's Pallas flash attention with its block of 128): ``seq_block=8``;
* :func:`one_block_past_8`: the same rule, and past one block it drops the last block of
  keys (wrong inside the declaration: the sweeps must catch it);
* :func:`no_bool_masks`: raises on a bool mask (a declaration claiming bool masks is refused);
* :func:`backward_blocks_of_4`: any length forward, but its backward raises unless L and S are
  multiples of 4 (a kernel whose backward tiles need whole blocks): ``backward_seq_multiple=4``;
* :func:`backward_blocks_of_4_doubled`: the same rule, and gradients twice too large (wrong
  inside the declaration).
"""

from __future__ import annotations

import torch



def _attend(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    """Attention written out: upper-left causal flag, bool (True = may attend) or additive
    mask, GQA, a row with every key blocked giving 0."""
    N, K = query.shape[-3], key.shape[-3]
    if N != K and (not enable_gqa or N % K):
        raise ValueError(f"{N} query heads and {K} kv heads: need K == N, or enable_gqa with N % K == 0")
    if enable_gqa and K != N:
        group = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(group, dim=-3), value.repeat_interleave(group, dim=-3)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale
    if is_causal:
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)  # rows attending no key: 0, gradients too
    return torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0) @ value


def positive_scale_only(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False):
    out = _attend(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    if scale is not None and scale <= 0:
        return torch.full_like(out, float("nan"))
    return out


def float64_without_float_masks(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                scale=None, enable_gqa=False):
    if query.dtype == torch.float64 and attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = None  # silently dropped
    return _attend(query, key, value, attn_mask, is_causal, scale, enable_gqa)


def head_dims_8_16(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
    if query.shape[-1] not in (8, 16) or value.shape[-1] not in (8, 16):
        raise ValueError(f"head dims {query.shape[-1]}, {value.shape[-1]}: only 8 and 16 are compiled")
    return _attend(query, key, value, attn_mask, is_causal, scale, enable_gqa)


def causal_only(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
    if not is_causal or attn_mask is not None:
        raise NotImplementedError("only is_causal=True, without a mask")
    return _attend(query, key, value, attn_mask, is_causal, scale, enable_gqa)


def blocks_of_4(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
    if query.shape[-2] % 4 or key.shape[-2] % 4:
        raise ValueError(f"L={query.shape[-2]}, S={key.shape[-2]}: lengths must be multiples of 4")
    return _attend(query, key, value, attn_mask, is_causal, scale, enable_gqa)


def no_bool_masks(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        raise TypeError("bool masks are not supported")
    return _attend(query, key, value, attn_mask, is_causal, scale, enable_gqa)


def _up_to_8_or_multiples(query, key) -> None:
    for name, n in (("L", query.shape[-2]), ("S", key.shape[-2])):
        if n > 8 and n % 8:
            raise ValueError(f"{name}={n}: a length must be at most 8 or a multiple of 8")


def up_to_8_or_multiples(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False):
    _up_to_8_or_multiples(query, key)
    return _attend(query, key, value, attn_mask, is_causal, scale, enable_gqa)


def one_block_past_8(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
    _up_to_8_or_multiples(query, key)
    S = key.shape[-2]
    if S > 8:  # the last block of keys left out (a loop bound off by one block)
        key, value = key[..., :S - 8, :], value[..., :S - 8, :]
        if attn_mask is not None:
            attn_mask = attn_mask[..., :S - 8]
        if is_causal:  # the causal rule of the whole S, kept for the keys still there
            keep = torch.ones(query.shape[-2], S, dtype=torch.bool, device=query.device).tril()[:, :S - 8]
            attn_mask = keep if attn_mask is None else attn_mask & keep if attn_mask.dtype == torch.bool \
                else attn_mask.masked_fill(~keep, float("-inf"))
            is_causal = False
    return _attend(query, key, value, attn_mask, is_causal, scale, enable_gqa)


class _BackwardBlocks(torch.autograd.Function):
    """The identity on the output, whose backward raises unless L and S are multiples of 4
    (and scales the gradient by ``factor``)."""

    @staticmethod
    def forward(ctx, out, L, S, factor):
        ctx.L, ctx.S, ctx.factor = L, S, factor
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        if ctx.L % 4 or ctx.S % 4:
            raise ValueError(f"backward: L={ctx.L}, S={ctx.S}: lengths must be multiples of 4")
        return grad * ctx.factor, None, None, None


def backward_blocks_of_4(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False):
    out = _attend(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    return _BackwardBlocks.apply(out, query.shape[-2], key.shape[-2], 1.0)


def backward_blocks_of_4_doubled(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    out = _attend(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    return _BackwardBlocks.apply(out, query.shape[-2], key.shape[-2], 2.0)
