"""Multi-head attention modules against spec.mha_forward and the module's own
invariants (need_weights, averaged weights, eval mode, dropout, causal hint, mask
conventions, output contract).

How a module is built, called and compared with the oracle is in
``conformance.calls.mha``; this file holds the properties.
"""

from __future__ import annotations

import numpy as np

from conformance.calls import mha_bounds
from conformance.calls.mha import (
    build,
    check_dropout_mean,
    check_input_derivative,
    check_mha,
    check_parameter_grads,
    fully_masked_policy,
    has_feature,
    oracle,
    output_rows,
    pair_allowed,
    run_mha,
    upstream_gradient,
)
from conformance.calls.sdpa import policy_source
from conformance.core.cases import MHACase
from conformance.core.compare import assert_contract, compare_values, fail
from conformance.core.target import Target
from conformance.core.tensors import dtype_of, mha_inputs
from conformance.directed.helpers import mha_cases_for, mha_directed_for, skip_unless
from conformance.harness.reporting import probe_saw
from conformance.harness.runner import conformance_property


@conformance_property(
    "mha_agreement", level="mha", section="spec.mha_forward",
    cases=lambda t: mha_cases_for(t),
    directed=lambda t: mha_directed_for(t),
)
def test_mha_agreement(target: Target, case: MHACase) -> float:
    """The module's output (and weights, when asked for) equal spec.mha_forward
    with the same weights copied in, over every constructor option and forward
    argument the implementation declares (rows with every key blocked are
    checked by mha_fully_masked_rows)."""
    return check_mha(target, case, run_mha(target, case))


@conformance_property(
    "mha_fully_masked_rows", level="mha", section="spec.mha_forward (fully_masked)",
    cases=lambda t: mha_cases_for(t, fully_masked=True),
    directed=lambda t: mha_directed_for(t, fully_masked=True),
    skip_reason=lambda t: skip_unless(has_feature(t, "key_padding_mask") or has_feature(t, "attn_mask"),
                                   "no masks declared"),
)
def test_mha_fully_masked_rows(target: Target, case: MHACase) -> float:
    """Query rows whose keys are all blocked follow the declared policy (zero:
    attention output 0, so the module output is out_proj.bias; nan; uniform),
    leave the other rows alone, and give finite gradients to every parameter."""
    policy = fully_masked_policy(target, case)
    autograd = target.caps.autograd and target.dtype in ("float32", "float64")
    backward = autograd and policy not in ("nan", "unspecified")
    call = run_mha(target, case, requires_grad=autograd,
                   grad_output=upstream_gradient(case) if backward else None)
    if policy == "unspecified":
        return check_mha(target, case, call)
    with probe_saw(target, "fully_masked"):
        ratio = check_mha(target, case, call, fully_masked=policy, include_dead=True,
                          what=f"module output with fully-masked rows ({policy_source(target)} policy {policy!r})")
    if backward:
        check_parameter_grads(call.module, require_all=False)
    return ratio


@conformance_property(
    "mha_gradients", level="mha", section="spec.mha_forward (derivative)",
    cases=lambda t: mha_cases_for(t, fully_masked=False),
    directed=lambda t: mha_directed_for(t, fully_masked=False),
    requires=("autograd",),
    skip_reason=lambda t: skip_unless(t.dtype in ("float32", "float64"), "checked in float32/float64 (finite differences)"),
    examples_factor=0.5,
)
def test_mha_gradients(target: Target, case: MHACase) -> float:
    """Every parameter receives a finite gradient, and the gradient with
    respect to query, key and value matches the oracle's derivative along a
    random direction (float64 central differences of spec.mha_forward)."""
    g = upstream_gradient(case)
    call = run_mha(target, case, requires_grad=True, grad_output=g)
    check_parameter_grads(call.module)
    return check_input_derivative(target, case, call.inputs, g)


@conformance_property(
    "mha_need_weights_equivalence", level="mha", section="spec.mha_forward (need_weights)",
    cases=lambda t: mha_cases_for(t),
    directed=lambda t: mha_directed_for(t),
    requires=("mha:need_weights",),
)
def test_mha_need_weights_equivalence(target: Target, case: MHACase) -> float:
    """need_weights=True and need_weights=False give the same output (different
    code paths must not change the answer), fully-masked rows included."""
    module = build(target, case)
    with_w = run_mha(target, case, module, need_weights=True)
    without = run_mha(target, case, module, need_weights=False)
    if without.weights is not None:
        fail("weights returned with need_weights=False, but should be None")
    allowed = pair_allowed(target, case)
    return compare_values("output with need_weights=False vs True", without.output, with_w.output,
                          allowed).ratio


@conformance_property(
    "mha_averaged_weights", level="mha", section="spec.mha_forward (average_attn_weights)",
    cases=lambda t: mha_cases_for(t, need_weights=True),
    directed=lambda t: mha_directed_for(t, need_weights=True),
    skip_reason=lambda t: skip_unless(has_feature(t, "need_weights") and has_feature(t, "per_head_weights"),
                                   "per-head weights not declared"),
)
def test_mha_averaged_weights(target: Target, case: MHACase) -> float:
    """average_attn_weights=True returns the mean over heads of the per-head
    weights: shapes (B, L, S) and (B, N, L, S), (L, S) and (N, L, S) unbatched."""
    module = build(target, case)
    avg = run_mha(target, case, module, need_weights=True, average_attn_weights=True)
    per_head = run_mha(target, case, module, need_weights=True, average_attn_weights=False)
    if avg.weights is None or per_head.weights is None:
        fail("weights=None with need_weights=True, but should be returned")
    _, expected = oracle(case, need_weights=True, average_attn_weights=False)
    if per_head.weights.shape != expected.shape:
        fail(f"per-head weights shape={per_head.weights.shape}, but should be {expected.shape}")
    head_axis = 0 if case.unbatched else 1
    mean = per_head.weights.mean(axis=head_axis)
    # A head's fully-masked row holds what the policy gives (uniform: 1/S), and the bound
    # scales with it; under another policy such rows are mha_fully_masked_rows' to check.
    policy = fully_masked_policy(target, case)
    known = policy in ("zero", "uniform")
    allowed = mha_bounds.pair_allowed(case.replace(average_attn_weights=True), tf32=target.tf32,
                                      fully_masked=policy if known else "zero").weights
    where = np.isfinite(mean)
    if not known:
        alive = ~case.blocked_rows().any(axis=1)  # (B, L): no head's row fully masked
        where = where & (alive[0][:, None] if case.unbatched else alive[:, :, None])
    return compare_values("averaged weights vs the mean of per-head weights", avg.weights, mean,
                          allowed, where=where).ratio


@conformance_property(
    "mha_eval_determinism", level="mha", section="spec.mha_forward (eval: no dropout)",
    cases=lambda t: mha_cases_for(t),
    directed=lambda t: mha_directed_for(t),
)
def test_mha_eval_determinism(target: Target, case: MHACase) -> float:
    """In eval mode a module built with dropout=0.5 ignores dropout: two calls
    are equal and equal the oracle; in train mode dropout=0 gives the same."""
    p = 0.5 if has_feature(target, "dropout") else 0.0
    module = build(target, case, dropout=p)
    first = run_mha(target, case, module)
    second = run_mha(target, case, module, seed_salt="|second call")  # another dropout sample
    a, b = np.nan_to_num(first.output, nan=7.0), np.nan_to_num(second.output, nan=7.0)
    if not np.array_equal(a, b):
        fail(f"two calls in eval mode (dropout={p}) differ by up to {np.abs(a - b).max():.3g}, "
             "but should be equal: dropout must be off in eval mode")
    ratio = check_mha(target, case, first, what=f"eval-mode output of a module built with dropout={p}")
    trained = build(target, case, dropout=0.0, training=True)
    train_out = run_mha(target, case, trained)
    allowed = pair_allowed(target, case)
    return max(ratio, compare_values("train-mode output with dropout=0 vs eval", train_out.output,
                                     first.output, allowed).ratio)


@conformance_property(
    "mha_dropout_expectation", level="mha", section="docs/KNOWN_BUGS.md#7-dropout-in-eval (dropout keeps the expectation)",
    cases=lambda t: mha_cases_for(t, max_L=3, max_S=4, max_batch=1, need_weights=False,
                                  features=set(t.caps.mha_features) - {"unbatched", "batch_first"}),
    directed=lambda t: mha_directed_for(t, max_L=3, max_S=4, max_batch=1, need_weights=False,
                                     features=set(t.caps.mha_features) - {"unbatched", "batch_first"}),
    requires=("mha:dropout",),
    skip_reason=lambda t: skip_unless(t.dtype in ("float32", "float64"), "checked in float32/float64 (a statistical bound)"),
    examples_factor=0.2,
)
def test_mha_dropout_expectation(target: Target, case: MHACase) -> float:
    """In train mode with dropout=p, the mean output over M = 2048 samples (the
    case tiled along the batch) is the eval output, their standard deviation is what
    dropping each head's weights independently gives, and no sample is NaN.

    Each sample of an output element is b_o + Σ_j W_o[d, j]·Σ_s w_s m_s v_s[j] / (1 - p)
    with m_s ∈ {0, 1}: it lies in an interval of width 2c, c = Σ_j |W_o[d, j]| Σ_s w_s |v_s[j]| / (1 - p).
    Hoeffding: |mean - expectation| ≤ 2c·sqrt(ln(2/δ) / 2M) with probability 1 - δ,
    δ = 1e-7 / #elements, so a false alarm is below 1e-7 per example
    (``tolerance.mha_dropout_allowed``). A module that never applies its dropout keeps
    that mean: each sample's standard deviation must be sqrt(p/(1-p)·Σ_hs t_hs²), t_hs the
    term key s of head h adds (``tolerance.dropout_spread_allowed``).
    """
    p = 0.5
    M = 2048
    module = build(target, case, dropout=p, training=True)
    out = run_mha(target, case, module, need_weights=False, samples=M).output  # (L, M, D)
    return check_dropout_mean(target, case, out, p, M)


def _causal_hint_missing(target: Target) -> str | None:
    """Why mha_causal_flag_equivalence cannot run: is_causal is only a hint that
    comes with the causal attn_mask, so both features are needed."""
    missing = [f for f in ("is_causal", "attn_mask") if not has_feature(target, f)]
    if not missing:
        return None
    return (f"{' and '.join(missing)} not declared (is_causal is a hint that comes with the causal "
            "attn_mask: both are needed)")


@conformance_property(
    "mha_causal_flag_equivalence", level="mha", section="spec.mha_forward (is_causal)",
    cases=lambda t: mha_cases_for(t, is_causal=True),
    directed=lambda t: mha_directed_for(t, is_causal=True),
    skip_reason=lambda t: _causal_hint_missing(t),
)
def test_mha_causal_flag_equivalence(target: Target, case: MHACase) -> float:
    """is_causal=True with the causal attn_mask equals the attn_mask alone, for
    every need_weights / key_padding_mask combination drawn, and the oracle."""
    module = build(target, case)
    flagged = run_mha(target, case, module)
    plain = run_mha(target, case.replace(is_causal=False), module)
    ratio = check_mha(target, case, flagged, what="output with is_causal=True")
    allowed = pair_allowed(target, case)
    rows = output_rows(case, ~case.blocked_rows().any(axis=1))
    return max(ratio, compare_values("output with is_causal=True vs the causal attn_mask alone",
                                     flagged.output, plain.output, allowed, where=rows).ratio)


def _as_float(mask: np.ndarray | None) -> np.ndarray | None:
    if mask is None or mask.dtype != np.bool_:
        return mask
    return np.where(mask, -np.inf, 0.0)


@conformance_property(
    "mha_mask_conventions", level="mha", section="spec.masks (MHA convention: True = blocked)",
    cases=lambda t: mha_cases_for(t, mask_kinds=("bool",)),
    directed=lambda t: mha_directed_for(t, mask_kinds=("bool",)),
    skip_reason=lambda t: skip_unless(has_feature(t, "key_padding_mask") or has_feature(t, "attn_mask"),
                                   "no masks declared")
    or skip_unless("additive" in t.caps.mask_kinds, "float masks not declared (mask_kinds without additive): "
                   "the float form of a bool mask cannot be compared"),
)
def test_mha_mask_conventions(target: Target, case: MHACase) -> float:
    """Bool masks mean True = blocked (the oracle agrees), and the float form
    0 / -inf of each mask (key_padding_mask and attn_mask) gives the same output."""
    module = build(target, case)
    by_bool = run_mha(target, case, module)
    ratio = check_mha(target, case, by_bool, what="output with bool masks (True = blocked)")
    as_float = case.replace(key_padding_mask=_as_float(case.key_padding_mask), attn_mask=_as_float(case.attn_mask))
    by_float = run_mha(target, as_float, module)
    allowed = pair_allowed(target, case)
    rows = output_rows(case, ~case.blocked_rows().any(axis=1))
    return max(ratio, compare_values("output with float 0/-inf masks vs bool masks", by_float.output,
                                     by_bool.output, allowed, where=rows).ratio)


@conformance_property(
    "mha_output_contract", level="mha", section="docs/DESIGN.md#output-contract (dtype, shapes)",
    cases=lambda t: mha_cases_for(t),
    directed=lambda t: mha_directed_for(t),
)
def test_mha_output_contract(target: Target, case: MHACase) -> None:
    """Output (L, B, D) / (B, L, D) / (L, D) in the input dtype and device;
    weights None without need_weights, else (B, L, S') or (B, N, L, S'); the
    inputs are not modified."""
    import torch

    call = run_mha(target, case)
    inputs = call.inputs
    before = {k: v for k, v in mha_inputs(case).items() if isinstance(v, torch.Tensor)}  # fresh copies
    expected_out, expected_w = oracle(case)
    assert_contract("output", call.out_tensor, shape=expected_out.shape, dtype=dtype_of(case.dtype),
                    device=target.device)
    if case.need_weights and has_feature(target, "need_weights"):
        if call.weights_tensor is None:
            fail("weights=None with need_weights=True, but should be returned")
        assert_contract("weights", call.weights_tensor, shape=expected_w.shape,
                        dtype=dtype_of(case.dtype), device=target.device)
    elif not case.need_weights and call.weights_tensor is not None:
        fail("weights returned with need_weights=False, but should be None")
    for name, old in before.items():
        now = inputs[name].detach()
        same = torch.equal(now, old) if old.dtype == torch.bool else torch.equal(
            torch.nan_to_num(now), torch.nan_to_num(old))
        if not same:
            fail(f"input {name} was modified in place, but should be left unchanged")
