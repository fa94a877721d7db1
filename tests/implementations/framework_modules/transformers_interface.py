"""Attention kernels in transformers' attention-interface signature, as a kernel author
writes them for ``AttentionInterface.register``: one correct kernel (``attention_forward``)
and mutants of it, each with one bug class of the zoo. Certified with no adapter
(``--impl=PATH:NAME``); :data:`MUTANTS` gives each one's expected property and the
``spec.variants`` cause the diagnosis should name first. Needs torch only."""

from __future__ import annotations

import torch


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    """The softmax in float32 for 16-bit inputs, in the input's dtype otherwise."""
    upcast = scores.dtype in (torch.float16, torch.bfloat16)
    return torch.softmax(scores.float() if upcast else scores, dim=-1).to(scores.dtype)


def _kernel(module, query, key, value, attention_mask, scaling, dropout, *, tile=False, mask_after=False):
    groups = module.num_key_value_groups
    if tile:  # the bug of gqa_tiled: query head h reads kv head h % K
        key, value = key.repeat(1, groups, 1, 1), value.repeat(1, groups, 1, 1)
    else:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = (query @ key.transpose(-1, -2)) * scaling
    if attention_mask is not None and not mask_after:
        scores = scores + attention_mask
    weights = _softmax(scores)
    if attention_mask is not None and mask_after:  # the bug: blocked weights zeroed, not renormalised
        weights = weights * (attention_mask == 0)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The correct kernel: eager attention with its softmax in the input's dtype."""
    return _kernel(module, query, key, value, attention_mask, scaling, dropout)


def gqa_tiled(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``repeat_kv`` written with ``repeat`` (tile) where ``repeat_interleave`` is meant."""
    return _kernel(module, query, key, value, attention_mask, scaling, dropout, tile=True)


def scaling_ignored(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The module's ``scaling`` is never read: ``head_dim ** -0.5`` always."""
    return _kernel(module, query, key, value, attention_mask, None, dropout)


def mask_after_softmax(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The additive mask zeroes the blocked weights after the softmax, without renormalising."""
    return _kernel(module, query, key, value, attention_mask, scaling, dropout, mask_after=True)


def float_mask_as_bool(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The additive mask turned into a bool one for SDPA by ``logical_not(mask.bool())`` (the
    Ascend NPU branch of transformers' sdpa_attention_forward): right for 0 / finfo.min
    masks, but every nonzero bias blocks its key."""
    mask = None if attention_mask is None else torch.logical_not(attention_mask.bool())
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
        enable_gqa=module.num_key_value_groups > 1)
    return out.transpose(1, 2).contiguous(), None


#: name -> (expected property, expected cause (``spec.variants`` id), the bug).
MUTANTS = {
    "gqa_tiled": ("gqa_equivalence", "gqa_tiled", "kv heads tiled, not grouped"),
    "scaling_ignored": ("temperature", "scale_arg_ignored", "scaling= ignored, head_dim ** -0.5 used"),
    "mask_after_softmax": ("weights_are_distributions", "mask_after_softmax",
                           "blocked weights zeroed after the softmax"),
    "float_mask_as_bool": ("forward_agreement", "float_mask_as_bool",
                           "the additive mask read as bool by logical_not(mask.bool())"),
}
