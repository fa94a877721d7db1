"""An attention kernel for transformers' attention interface, certified with no adapter:

    pytest conformance --impl=examples/frameworks/transformers_kernel.py:attention_forward

The signature is the one every transformers backend has; register the same function with
``transformers.AttentionInterface.register("my_attention", attention_forward)`` and a model
loaded with ``attn_implementation="my_attention"`` calls it. It needs torch only. Its mask
form is additive (transformers' eager mask: 0, or torch.finfo(dtype).min for a blocked key);
a kernel that takes transformers' bool sdpa mask declares ``--impl-option interface_mask=bool``.
"""

import torch


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query (B, N, L, E), key/value (B, K, S, E|Ev) -> ((B, L, N, Ev) output, (B, N, L, S) weights)."""
    groups = module.num_key_value_groups  # N // K query heads share each key/value head
    # 16-bit inputs are computed in float32: q·kᵀ beyond 65504 does not overflow before the
    # scale, and the products with the values avoid torch's bfloat16 batched matmul
    upcast = query.dtype in (torch.float16, torch.bfloat16)
    q, k, v = (x.float() if upcast else x for x in (query, key, value))
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = (q @ k.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        # transformers fills a blocked key with the finite finfo(dtype).min: blocked is -inf
        # here, so a row with no key left is NaN whatever its scores, like a -inf float mask's
        blocked = attention_mask <= torch.finfo(attention_mask.dtype).min
        scores = (scores + attention_mask.to(scores.dtype)).masked_fill(blocked, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    out = (weights @ v).to(query.dtype)
    return out.transpose(1, 2).contiguous(), weights.to(query.dtype)
