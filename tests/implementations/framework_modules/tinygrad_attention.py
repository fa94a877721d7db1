"""A user's tinygrad SDPA: tinygrad's own ``scaled_dot_product_attention`` (which has no
``scale`` argument: an explicit scale is folded into the query). The body makes method
calls only, so the bridge recognises tinygrad from what the module imports."""

import math

from tinygrad import Tensor  # noqa: F401  (what tells the bridge this is tinygrad code)


def attention(query, key, value, attn_mask=None, is_causal=False, scale=None):
    if scale is not None:
        query = query * (scale * math.sqrt(query.shape[-1]))
    return query.scaled_dot_product_attention(key, value, attn_mask=attn_mask, is_causal=is_causal)
