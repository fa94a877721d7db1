"""Small implementations the runner's own tests certify (plugged in as file.py:attr)."""

import time

import torch.nn.functional as F

from implementations.base import Capabilities, ExpectedFailure, Implementation


def correct(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def ignores_scale(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
    """Bug: the explicit scale is dropped (docs/KNOWN_BUGS.md #12)."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, enable_gqa=enable_gqa)


def raises(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    raise RuntimeError("kernel launch failed")


def wrong_shape(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)[..., :1, :]


def hangs(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    time.sleep(30)
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


_caps = Capabilities(dtypes=("float64", "float32"), dropout=True)

#: The scale bug declared as a known deviation: forward_agreement becomes an
#: expected failure; the temperature entry goes stale only if nothing catches it.
known_scale_bug = Implementation(
    name="known-scale-bug",
    capabilities=_caps,
    sdpa=ignores_scale,
    expected_failures=(
        ExpectedFailure("forward_agreement", "drops the explicit scale", {"scale_sign": ["positive", "negative", "zero"]}),
    ),
)

#: A correct implementation with an expected failure that never happens: stale.
stale_entry = Implementation(
    name="stale-entry",
    capabilities=_caps,
    sdpa=correct,
    expected_failures=(ExpectedFailure("output_contract", "was once wrong"),),
)

# Declared explicitly: the registry probes bare functions with a tiny call, and
# these must reach the runner to show that misbehaviour fails properties.
raises_impl = Implementation(name="raises", capabilities=_caps, sdpa=raises)
wrong_shape_impl = Implementation(name="wrong-shape", capabilities=_caps, sdpa=wrong_shape)
ignores_scale_impl = Implementation(name="ignores-scale", capabilities=_caps, sdpa=ignores_scale)
hangs_impl = Implementation(name="hangs", capabilities=_caps, sdpa=hangs)


def _sdpa_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def nan_at_one_size(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """Bug: NaN output only when L = 3 and S = 4 (a size-specific kernel path)."""
    out = _sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if query.shape[-2] == 3 and key.shape[-2] == 4:
        out = out * float("nan")
    return out


def scaled_at_one_size(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False):
    """Bug: the output is 1% too large only when L = 7 and S = 13."""
    out = _sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if query.shape[-2] == 7 and key.shape[-2] == 13:
        out = out * 1.01
    return out


_all_dtypes = Capabilities(dtypes=("float64", "float32", "float16", "bfloat16"))
#: Bugs that live at one size: small_sizes_sweep must find them in every dtype.
nan_at_one_size_impl = Implementation(name="nan-at-3-4", capabilities=_all_dtypes, sdpa=nan_at_one_size)
scaled_at_one_size_impl = Implementation(name="scaled-at-7-13", capabilities=_all_dtypes,
                                         sdpa=scaled_at_one_size)
#: The same computation without the bugs: small_sizes_sweep passes it.
math_impl = Implementation(name="math", capabilities=_all_dtypes, sdpa=_sdpa_math)


def counting(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Correct (the math backend); appends one byte per call to the file
    $CONFORMANCE_TEST_CALLS names (if set)."""
    import os

    path = os.environ.get("CONFORMANCE_TEST_CALLS")
    if path:
        with open(path, "a") as calls:
            calls.write(".")
    return _sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


#: A correct implementation that counts its calls (tests/runner/test_directed_first.py).
counting_impl = Implementation(name="counting", capabilities=_caps, sdpa=counting)


def wrong_at_s33_ev2(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
    """Bug: the output is 1% too large only when S = 33 and Ev = 2 < E (the shape of one
    directed case of forward_agreement, which a short random search does not draw)."""
    out = _sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if key.shape[-2] == 33 and value.shape[-1] == 2 < query.shape[-1]:
        out = out * 1.01
    return out


wrong_at_s33_ev2_impl = Implementation(name="wrong-at-s33-ev2", capabilities=_caps, sdpa=wrong_at_s33_ev2)
