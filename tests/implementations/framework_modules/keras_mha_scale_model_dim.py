"""A Keras MultiHeadAttention whose scores are scaled by 1/sqrt(D), the model dim, instead of
1/sqrt(D / N), the head dim: the classic mistake (bug zoo ``mha_scale_model_dim``). Certified
with no adapter (``--impl=...:ModelDimScaledMHA``, KERAS_BACKEND=torch), it must fail
``mha_agreement``."""

import math

import keras


class ModelDimScaledMHA(keras.layers.MultiHeadAttention):
    def _build_attention(self, rank):
        super()._build_attention(rank)
        self._inverse_sqrt_key_dim = 1.0 / math.sqrt(float(self._key_dim * self._num_heads))
