"""Cases worked by hand, the arithmetic in the comments (spec sections: SDPA, masks, GQA)."""

from __future__ import annotations

import math

import numpy as np

import spec


def test_worked_example():
    # One batch-free head: N = K = 1, L = 2 queries, S = 3 keys, E = 4, Ev = 2.
    ln3 = math.log(3.0)
    query = np.array([[[2.0, 0.0, 0.0, 0.0],          # q0
                       [1.0, 1.0, 1.0, 1.0]]])        # q1 (fully masked below)
    key = np.array([[[0.0, 0.0, 0.0, 0.0],            # k0
                     [ln3, 0.0, 0.0, 0.0],            # k1
                     [9.0, 9.0, 9.0, 9.0]]])          # k2 (blocked for q0)
    value = np.array([[[4.0, 0.0],                    # v0
                       [0.0, 8.0],                    # v1
                       [100.0, 100.0]]])              # v2
    attend = np.array([[True, True, False],           # q0 may attend k0, k1
                        [False, False, False]])       # q1 may attend nothing
    result = spec.sdpa(query, key, value, attend_mask=attend)
    # scale = 1/sqrt(E) = 1/sqrt(4) = 0.5
    # q0·k0 = 0            -> logit 0.5 * 0        = 0
    # q0·k1 = 2 ln 3       -> logit 0.5 * 2 ln 3   = ln 3
    # q0·k2 = 18           -> logit 9 (blocked by the mask)
    np.testing.assert_allclose(result.logits[0, 0], [0.0, ln3, 9.0], rtol=1e-15)
    # softmax over the attended keys: exp(0) = 1, exp(ln 3) = 3, total 4 -> weights 1/4, 3/4, 0
    np.testing.assert_allclose(result.weights[0, 0], [0.25, 0.75, 0.0], rtol=1e-15)
    # output = 1/4 · (4, 0) + 3/4 · (0, 8) = (1, 0) + (0, 6) = (1, 6)
    np.testing.assert_allclose(result.output[0, 0], [1.0, 6.0], rtol=1e-15)
    # q1 attends nothing: policy 'zero' -> output (0, 0), weights 0
    assert (result.output[0, 1] == 0).all() and (result.weights[0, 1] == 0).all()

    # Adding +ln 3 to k0's score for q0: scores ln 3, ln 3 -> weights 1/2, 1/2
    # output = 1/2 · (4, 0) + 1/2 · (0, 8) = (2, 4)
    bias = np.zeros((2, 3))
    bias[0, 0] = ln3
    biased = spec.sdpa(query, key, value, attend_mask=attend, additive_mask=bias)
    np.testing.assert_allclose(biased.output[0, 0], [2.0, 4.0], rtol=1e-15)

    # Other policies for the fully-masked q1: 'uniform' -> weights 1/3 each,
    # output = ((4 + 0 + 100) / 3, (0 + 8 + 100) / 3) = (104/3, 36); 'nan' -> NaN
    uniform = spec.sdpa(query, key, value, attend_mask=attend, fully_masked="uniform")
    np.testing.assert_allclose(uniform.output[0, 1], [104 / 3, 36.0], rtol=1e-15)
    assert np.isnan(spec.sdpa(query, key, value, attend_mask=attend, fully_masked="nan").output[0, 1]).all()


def test_causal_alignments_and_gqa_by_hand():
    # N = 2 query heads share K = 1 kv head; L = 1 query, S = 2 keys; all logits 0 (q = 0).
    query = np.zeros((2, 1, 1))
    key = np.zeros((1, 2, 1))
    value = np.array([[[2.0], [6.0]]])
    # upper_left: query 0 sees key 0 only -> output 2 in both heads
    np.testing.assert_array_equal(spec.sdpa(query, key, value, causal="upper_left").output, [[[2.0]], [[2.0]]])
    # lower_right: query 0 is aligned with the last key -> sees keys 0, 1 equally -> (2 + 6) / 2 = 4
    np.testing.assert_array_equal(spec.sdpa(query, key, value, causal="lower_right").output, [[[4.0]], [[4.0]]])


def test_explicit_scale_multiplies_as_given():
    # logits = scale · q·k; with scale = -1 the smaller dot product wins.
    query = np.array([[[1.0]]])
    key = np.array([[[0.0], [math.log(2.0)]]])        # q·k = 0, ln 2
    value = np.array([[[3.0], [0.0]]])
    # scores 0, -ln 2 -> exp 1, 1/2 -> weights 2/3, 1/3 -> output 2
    np.testing.assert_allclose(spec.sdpa(query, key, value, scale=-1.0).output, [[[2.0]]], rtol=1e-15)
    # scale 0: uniform weights -> output 1.5
    np.testing.assert_allclose(spec.sdpa(query, key, value, scale=0.0).output, [[[1.5]]], rtol=1e-15)
