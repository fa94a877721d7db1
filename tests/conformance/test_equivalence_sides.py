"""An equivalence failure names the side that is wrong (conformance.calls.equivalence): each of
the two calls is judged against the spec, so a wrong reference call is not blamed on the
right one."""

from __future__ import annotations

import numpy as np
import pytest
import torch.nn.functional as F

from conformance.calls.equivalence import Side, verdict
from conformance.calls.replay import CallLog
from conformance.core.cases import SDPACase
from conformance.core.compare import PropertyFailure
from conformance.core.registry import registered_checks
from conformance.core.target import Target
from implementations.base import Capabilities, Implementation


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                          scale=scale, enable_gqa=enable_gqa)


def mask_path_wrong(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """Right with the causal flag, NaN whenever a mask is given."""
    out = _sdpa(query, key, value, attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return out * float("nan") if attn_mask is not None else out


def flag_wrong(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Right with masks; the causal flag is ignored."""
    return _sdpa(query, key, value, attn_mask, scale=scale, enable_gqa=enable_gqa)


def gqa_wrong(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Grouped heads read kv head h % K instead of h // (N / K); right without grouping."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key, value = key.repeat(1, group, 1, 1), value.repeat(1, group, 1, 1)
    return _sdpa(query, key, value, attn_mask, is_causal=is_causal, scale=scale)


def _target(fn) -> Target:
    impl = Implementation(name=fn.__name__, sdpa=fn, capabilities=Capabilities(causal="upper_left"))
    return Target(impl, "sdpa", "float64", "cpu", log=CallLog())


def _case(N=1, K=1, L=3, S=3, **kw) -> SDPACase:
    rng = np.random.default_rng(3)
    return SDPACase(rng.standard_normal((1, N, L, 4)), rng.standard_normal((1, K, S, 4)),
                    rng.standard_normal((1, K, S, 4)), **kw)


def _message(property_id: str, fn, case: SDPACase) -> str:
    with pytest.raises(PropertyFailure) as caught:
        registered_checks()[property_id](_target(fn), case)
    return str(caught.value)


def test_a_wrong_masked_path_is_named_not_the_causal_flag():
    message = _message("causal_flag_equivalence", mask_path_wrong, _case(causal="upper_left"))
    first = message.splitlines()[0]
    assert "the explicit-mask call (reference side) disagrees with the spec" in first
    assert "the is_causal=True call agrees with it" in first
    assert "the implementation's masked path is wrong, not its causal flag" in first


def test_a_wrong_causal_flag_is_named_as_the_flag():
    message = _message("causal_flag_equivalence", flag_wrong, _case(causal="upper_left"))
    assert message.startswith("output with is_causal=True")  # the flag call against the oracle
    assert "masked path is wrong" not in message


def test_a_wrong_grouped_path_is_named_against_the_repeated_heads():
    message = _message("gqa_equivalence", gqa_wrong, _case(N=4, K=2))
    first = message.splitlines()[0]
    assert "the grouped call (K=2, enable_gqa=True) disagrees with the spec" in first
    assert "(reference side) agrees with it" in first
    assert "grouped-query path is wrong, not its path without grouping" in first


def test_the_verdict_for_one_both_or_neither_side():
    right, expected = np.ones(3), np.ones(3)
    wrong = np.array([1.0, np.nan, 1.0])
    a = lambda out: Side("the first call", out, expected, 1e-9, path="fast path")  # noqa: E731
    b = lambda out: Side("the second call", out, expected, 1e-9, path="slow path")  # noqa: E731
    assert verdict(a(right), b(wrong)).startswith("the second call (reference side) disagrees with the spec: "
                                                   "its output has NaN")
    assert "the implementation's fast path is wrong, not its slow path" in verdict(a(wrong), b(right))
    assert verdict(a(wrong), b(wrong)).startswith("both calls disagree with the spec")
    assert verdict(a(right), b(right)).startswith("each call alone agrees with the spec")


def test_varlen_pair_names_the_wrong_call():
    from conformance.calls.varlen import compare_pair

    impl = Implementation(name="v", varlen=lambda *a, **k: None, capabilities=Capabilities())
    target = Target(impl, "varlen", "float64", "cpu")
    expected = np.zeros((2, 1, 3))
    wrong = expected.copy()
    wrong[1] = 5.0
    live = np.ones((2, 1, 1), dtype=bool)
    with pytest.raises(PropertyFailure, match=r"the call of sequence 0 alone \(reference side\) disagrees with the "
                                              r"spec.*the packed call agrees with it: the implementation's "
                                              r"single-sequence call is wrong, not its packing"):
        compare_pair(target, "sequence 0 packed vs alone", expected, wrong, np.full(expected.shape, 1e-9), live,
                     expected=expected, names=("the packed call", "the call of sequence 0 alone"),
                     paths=("packing", "single-sequence call"))


def test_the_correct_implementation_passes_the_equivalences():
    target = _target(_sdpa)
    checks = registered_checks()
    for property_id, case in (("causal_flag_equivalence", _case(causal="upper_left")),
                              ("gqa_equivalence", _case(N=4, K=2)),
                              ("bool_additive_equivalence", _case(attend_mask=np.tril(np.ones((3, 3), bool))))):
        checks[property_id](target, case)
