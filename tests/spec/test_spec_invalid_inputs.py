"""Every invalid input raises SpecError naming the argument as name=value, the rule and the fix."""

from __future__ import annotations

import numpy as np
import pytest

import spec
from spec import masks

rng = np.random.default_rng(0)
Q = rng.normal(size=(2, 4, 3, 5))        # (B, N, L, E)
K = rng.normal(size=(2, 2, 6, 5))        # (B, K, S, E)
V = rng.normal(size=(2, 2, 6, 7))        # (B, K, S, Ev)
PARAMS = spec.MHAParams.random(rng, 4, 2)
X = rng.normal(size=(3, 2, 4))           # (L, B, D)

# (id, call, text the message must contain besides "name=" and "Fix:")
INVALID_CALLS = [
    ("query rank", lambda: spec.sdpa(Q[0, 0], K[0, 0], V[0, 0]), "query=<array shape=(3, 5)", "rank >= 3"),
    ("E mismatch", lambda: spec.sdpa(Q, K[..., :4], V), "key=", "must equal query's E=5"),
    ("S mismatch", lambda: spec.sdpa(Q, K, V[..., :5, :]), "key=", "must match"),
    ("batch mismatch", lambda: spec.sdpa(Q, K[:1], V[:1]), "key=", "must match"),
    ("heads not divisible", lambda: spec.sdpa(Q[:, :3], K, V), "key=", "multiple of kv heads K=2"),
    ("complex query", lambda: spec.sdpa(Q.astype(complex), K, V), "query=", "real numbers"),
    ("bool value", lambda: spec.sdpa(Q, K, V > 0), "value=", "real numbers"),
    ("mask for other S", lambda: spec.sdpa(Q, K, V, attend_mask=np.ones((3, 5), bool)), "attend_mask=", "must broadcast"),
    ("mask too many dims", lambda: spec.sdpa(Q, K, V, attend_mask=np.ones((1, 2, 4, 3, 6), bool)), "attend_mask=", "must broadcast"),
    ("float attend mask", lambda: spec.sdpa(Q, K, V, attend_mask=np.ones((3, 6))), "attend_mask=", "additive_mask="),
    ("int attend mask", lambda: spec.sdpa(Q, K, V, attend_mask=np.ones((3, 6), int)), "attend_mask=", "from_keep_int"),
    ("bool additive mask", lambda: spec.sdpa(Q, K, V, additive_mask=np.ones((3, 6), bool)), "additive_mask=", "attend_mask"),
    ("additive mask shape", lambda: spec.sdpa(Q, K, V, additive_mask=np.zeros((4, 6))), "additive_mask=", "must broadcast"),
    ("+inf additive", lambda: spec.sdpa(Q, K, V, additive_mask=np.full((3, 6), np.inf)), "additive_mask=", "finite values or -inf"),
    ("NaN additive", lambda: spec.sdpa(Q, K, V, additive_mask=np.full((3, 6), np.nan)), "additive_mask=", "finite values or -inf"),
    ("NaN scale", lambda: spec.sdpa(Q, K, V, scale=float("nan")), "scale=nan", "must not be NaN"),
    ("inf scale", lambda: spec.sdpa(Q, K, V, scale=float("inf")), "scale=inf", "finite"),
    ("string scale", lambda: spec.sdpa(Q, K, V, scale="0.5"), "scale='0.5'", "real number"),
    ("bool causal", lambda: spec.sdpa(Q, K, V, causal=True), "causal=True", "'upper_left'"),
    ("misspelt causal", lambda: spec.sdpa(Q, K, V, causal="upper-left"), "causal='upper-left'", "'lower_right'"),
    ("policy", lambda: spec.sdpa(Q, K, V, fully_masked="ignore"), "fully_masked='ignore'", "'uniform'"),
    ("vjp grad shape", lambda: spec.sdpa_vjp(Q, K, V, np.zeros((2, 4, 3, 6))), "grad_output=", "output's shape"),
    ("vjp heads", lambda: spec.sdpa_vjp(Q[:, :3], K, V, np.zeros((2, 3, 3, 7))), "key=", "multiple of kv heads"),
    ("emulate dtype", lambda: spec.emulate_sdpa(Q, K, V, dtype="int8"), "dtype='int8'", "'bfloat16'"),
    ("emulate NaN scale", lambda: spec.emulate_sdpa(Q, K, V, dtype="float16", scale=float("nan")), "scale=nan", "NaN"),
    ("mha is_causal alone", lambda: spec.mha_forward(PARAMS, X, X, X, is_causal=True), "is_causal=True", "attn_mask"),
    ("mha kpm shape", lambda: spec.mha_forward(PARAMS, X, X, X, key_padding_mask=np.zeros((3, 2), bool)), "key_padding_mask=", "(2, 3)"),
    ("mha attn_mask shape", lambda: spec.mha_forward(PARAMS, X, X, X, attn_mask=np.zeros((3, 4), bool)), "attn_mask=", "(L, S)"),
    ("mha 3-D attn_mask rows", lambda: spec.mha_forward(PARAMS, X, X, X, attn_mask=np.zeros((2, 3, 3), bool)), "attn_mask=", "(B*N, L, S)"),
    ("mha int mask", lambda: spec.mha_forward(PARAMS, X, X, X, attn_mask=np.zeros((3, 3), int)), "attn_mask=", "from_keep_int"),
    ("mha model dim", lambda: spec.mha_forward(PARAMS, X[..., :3], X, X), "query=", "last dim must be 4"),
    ("mha rank", lambda: spec.mha_forward(PARAMS, X[None], X[None], X[None]), "query=", "3-D"),
    ("mha policy", lambda: spec.mha_forward(PARAMS, X, X, X, fully_masked=None), "fully_masked=None", "'zero'"),
    ("params heads", lambda: spec.MHAParams(embed_dim=4, num_heads=3, out_proj_weight=np.eye(4)), "num_heads=3", "divid"),
    ("params shape", lambda: spec.MHAParams(embed_dim=4, num_heads=2, out_proj_weight=np.eye(4), in_proj_weight=np.eye(4)), "in_proj_weight=", "(12, 4)"),
    ("params bias_k alone", lambda: spec.MHAParams(embed_dim=4, num_heads=2, out_proj_weight=np.eye(4), in_proj_weight=np.ones((12, 4)), bias_k=np.ones((1, 1, 4))), "bias_k=", "together"),
    ("causal alignment", lambda: masks.causal_mask(2, 3, "diagonal"), "alignment='diagonal'", "'upper_left'"),
    ("window alignment", lambda: masks.sliding_window_mask(2, 2, 1, None), "alignment=None", "'lower_right'"),
    ("negative length", lambda: masks.causal_mask(-1, 3), "L=-1", ">= 0"),
    ("padding lengths", lambda: masks.padding_mask([4], 3), "lengths=[4]", "[0, S=3]"),
    ("window", lambda: masks.sliding_window_mask(2, 2, 1.5), "window=1.5", "int"),
    ("keep int values", lambda: masks.from_keep_int(np.array([0, 2])), "mask=", "only 0"),
    ("additive bias to bool", lambda: masks.from_additive(np.array([0.5])), "mask=", "other than 0 and -inf"),
    ("convention", lambda: masks.to_canonical(np.ones(2, bool), "sdpa"), "convention='sdpa'", "'mha_bool'"),
    ("fully_masked_rows mask shape", lambda: masks.fully_masked_rows((2, 3, 4), np.ones((3, 5), bool)), "attend_mask=", "must broadcast"),
    ("fully_masked_rows mask dtype", lambda: masks.fully_masked_rows((2, 3, 4), None, np.ones((3, 4), bool)), "additive_mask=", "float"),
    ("merge 3-D rows", lambda: masks.merge_key_padding(None, np.zeros((5, 2, 2)), num_heads=2), "attn_mask=", "num_heads=2"),
]


@pytest.mark.parametrize("call,argument,rule", [c[1:] for c in INVALID_CALLS], ids=[c[0] for c in INVALID_CALLS])
def test_invalid_call_raises_spec_error(call, argument, rule):
    with pytest.raises(spec.SpecError) as info:
        call()
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert argument in message, f"message={message!r}, but should name {argument!r}"
    assert rule in message, f"message={message!r}, but should state the rule {rule!r}"
    assert "Fix: " in message, f"message={message!r}, but should say how to fix the call"


def test_valid_edge_values_do_not_raise():
    """Zero and negative scales, broadcast masks and L = 0 are valid."""
    spec.sdpa(Q, K, V, scale=0.0)
    spec.sdpa(Q, K, V, scale=-2)
    spec.sdpa(Q, K, V, attend_mask=np.ones((6,), bool), additive_mask=np.zeros((1, 1, 3, 1)))
    assert spec.sdpa(Q[:, :, :0], K, V).output.shape == (2, 4, 0, 7)
