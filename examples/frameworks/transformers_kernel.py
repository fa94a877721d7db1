"""An attention kernel for transformers' attention interface, certified with no adapter:

    pytest conformance --impl=examples/frameworks/transformers_kernel.py:attention_forward \
        --impl-option fully_masked=bool:uniform,additive:nan,causal:uniform

The signature is the one every transformers backend has; register the same function with
``transformers.AttentionInterface.register("my_attention", attention_forward)`` and a model
loaded with ``attn_implementation="my_attention"`` calls it. It needs torch only. Its mask
form is additive (transformers' eager mask: 0 or torch.finfo(dtype).min); a kernel that takes
transformers' bool sdpa mask declares ``--impl-option interface_mask=bool``. A row whose keys
are all blocked is uniform under that finite fill (a bool mask or the causal rule) and NaN
under a -inf float mask: the declaration above says so.
"""

import torch


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query (B, N, L, E), key/value (B, K, S, E|Ev) -> ((B, L, N, Ev) output, (B, N, L, S) weights)."""
    groups = module.num_key_value_groups  # N // K query heads share each key/value head
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = (query @ key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    upcast = query.dtype in (torch.float16, torch.bfloat16)  # float32 softmax for 16-bit inputs only
    weights = torch.softmax(scores.float() if upcast else scores, dim=-1).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return (weights @ value).transpose(1, 2).contiguous(), weights
