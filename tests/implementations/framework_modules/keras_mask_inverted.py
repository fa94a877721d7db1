"""A wrong Keras attention in Keras' own layout (B, L, N, E): the bool mask is inverted
before ``keras.ops.dot_product_attention`` sees it. Certified with ``--impl-option
layout=BLNE``; the suite must fail it through the framework bridge."""

import keras


def attention(query, key, value, bias=None, mask=None, scale=None, is_causal=False):
    if mask is not None:
        mask = keras.ops.logical_not(mask)  # the bug: True now means blocked
    return keras.ops.dot_product_attention(query, key, value, bias=bias, mask=mask, scale=scale,
                                           is_causal=is_causal)
