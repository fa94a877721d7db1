"""Scaled dot-product attention on TensorFlow tensors (B, N, L, E), with no torch in it:
``pytest conformance --impl=examples/frameworks/tf_attention.py:attention``
(the framework bridge recognises TensorFlow from the function's module; gradients by
``tf.GradientTape``; TensorFlow is not in the project's extras: ``pip install tensorflow-cpu``)."""

import tensorflow as tf


def attention(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """softmax(query key^T * scale + mask) value; a bool mask is True where a query may
    attend, a float one is added to the logits; ``is_causal``: upper-left; a row with
    every key blocked is 0."""
    dtype = query.dtype
    # float16 products overflow and bfloat16 sums lose the small terms: compute in float32
    work = tf.float64 if dtype == tf.float64 else tf.float32
    query, key, value = (tf.cast(x, work) for x in (query, key, value))
    scale = 1.0 / tf.sqrt(tf.cast(tf.shape(query)[-1], work)) if scale is None else tf.constant(scale, work)
    logits = tf.einsum("...le,...se->...ls", query, key) * scale
    length, keys = tf.shape(logits)[-2], tf.shape(logits)[-1]
    visible = tf.ones((length, keys), tf.bool)
    if is_causal:
        visible = tf.linalg.band_part(tf.ones((length, keys)), -1, 0) > 0  # j <= i
    if attn_mask is not None and attn_mask.dtype == tf.bool:
        visible = tf.logical_and(visible, attn_mask)
    elif attn_mask is not None:
        logits = logits + tf.cast(attn_mask, work)
    visible = tf.logical_and(tf.broadcast_to(visible, tf.shape(logits)), logits > -float("inf"))
    # the max over visible keys only; a row with none visible takes 0 (never -inf - -inf)
    peak = tf.reduce_max(tf.where(visible, logits, tf.constant(-float("inf"), work)), -1, keepdims=True)
    peak = tf.where(tf.math.is_finite(peak), peak, tf.zeros_like(peak))
    weights = tf.where(visible, tf.exp(tf.where(visible, logits, peak) - peak), tf.zeros_like(logits))
    total = tf.reduce_sum(weights, -1, keepdims=True)
    weights = weights / tf.where(total > 0, total, tf.ones_like(total))
    return tf.cast(tf.einsum("...ls,...se->...le", weights, value), dtype)
