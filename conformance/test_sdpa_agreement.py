"""SDPA agreement with the oracle (spec.sdpa, spec.sdpa_vjp): forward, gradients,
fully-masked rows, the output contract, invalid inputs and large logits."""

from __future__ import annotations

import numpy as np

from conformance.calls.sdpa import (
    assert_output_contract,
    check_against_oracle,
    check_fully_masked_policy,
    check_gradients,
    expect_sdpa_raises,
    uses_causal_flag,
    fully_masked_policy,
    run_sdpa,
)
from conformance.core.cases import SDPACase
from conformance.core.compare import fail
from conformance.directed.helpers import (
    backward_target,
    case_rng,
    cases_for,
    directed_for,
    needs_separate_values,
    skip_unless,
)
from conformance.harness.reporting import probe_saw
from conformance.core.target import Target
from conformance.harness.runner import conformance_property
from conformance.core.tensors import sdpa_inputs
from spec.emulate import round_to


@conformance_property(
    "forward_agreement", level="sdpa", section="spec.sdpa",
    cases=lambda t: cases_for(t, layouts=("contiguous",)),
    directed=lambda t: directed_for(t, layouts=("contiguous",)),
    examples_factor=2.0,
)
def test_forward_agreement(target: Target, case: SDPACase) -> float:
    """The output equals the float64 oracle run on the stored inputs, within
    k × the error of a naive same-precision computation plus a rounding floor
    (rows with every key blocked are checked by fully_masked_rows)."""
    call = run_sdpa(target, case)
    assert_output_contract(target, case, call)
    if not uses_causal_flag(target, case):
        return check_against_oracle(target, case, call.output).ratio
    with probe_saw(target, "causal"):
        return check_against_oracle(target, case, call.output).ratio


@conformance_property(
    "gradient_agreement", level="sdpa", section="spec.sdpa_vjp",
    cases=lambda t: cases_for(backward_target(t), layouts=("contiguous",), fully_masked=False),
    directed=lambda t: directed_for(backward_target(t), layouts=("contiguous",), fully_masked=False),
    requires=("autograd",),
    examples_factor=0.5,
)
def test_gradient_agreement(target: Target, case: SDPACase) -> float:
    """dq, dk, dv (and d-additive-mask, where declared) equal the float64
    closed-form VJP in spec, within the gradient rounding floor."""
    return check_gradients(target, case)


@conformance_property(
    "fully_masked_rows", level="sdpa", section="spec.sdpa (fully_masked policy)",
    cases=lambda t: cases_for(t, layouts=("contiguous",), fully_masked=True, causal_dead_rows=True),
    directed=lambda t: directed_for(t, layouts=("contiguous",), fully_masked=True, causal_dead_rows=True),
    skip_reason=lambda t: skip_unless(
        bool({"bool", "additive"} & set(t.caps.mask_kinds))
        or (t.caps.causal == "lower_right" and not t.caps.self_attention_lengths),
        "no mask declared, and no lower-right causal flag with L > S (self_attention_lengths: "
        "L == S only) to block every key of a row"),
)
def test_fully_masked_rows(target: Target, case: SDPACase) -> float:
    """Rows whose keys are all blocked follow the declared policy (zero: output 0;
    nan: NaN; uniform: mean of V; declared for all rows or per kind of blocking:
    bool mask, additive mask, causal flag), never change any other row, and (with
    autograd, under policy zero) give gradients that match the VJP."""
    call = run_sdpa(target, case)
    policy = fully_masked_policy(target, case)
    with probe_saw(target, "fully_masked"):
        check_fully_masked_policy(target, case, call.output)
    ratio = check_against_oracle(target, case, call.output, what="output of the other rows").ratio
    if policy == "zero" and target.caps.autograd and target.dtype in ("float64", "float32"):
        ratio = max(ratio, check_gradients(target, case))
    return ratio


@conformance_property(
    "output_contract", level="sdpa", section="docs/DESIGN.md#output-contract (dtype, device, shape)",
    cases=lambda t: cases_for(t),
    directed=lambda t: directed_for(t),
)
def test_output_contract(target: Target, case: SDPACase) -> None:
    """The output is a tensor of shape (B, N, L, Ev) with the input dtype and
    device, the inputs are not modified, and a second call gives the same result."""
    import torch

    first = run_sdpa(target, case)
    assert_output_contract(target, case, first)
    tensors = first.inputs
    before = sdpa_inputs(first.spec.passed_case)  # what was handed over, freshly made
    for name, old in before.items():
        if old is None:
            continue
        now = tensors[name]
        same = torch.equal(now.detach(), old) if old.dtype == torch.bool else torch.equal(
            torch.nan_to_num(now.detach()), torch.nan_to_num(old))
        if not same:
            fail(f"input {name} was modified in place by the call, but should be left unchanged")
    second = run_sdpa(target, case, inputs=tensors)
    a, b = first.output, second.output
    if not np.array_equal(np.nan_to_num(a, nan=7.0), np.nan_to_num(b, nan=7.0)):
        diff = np.nanmax(np.abs(a - b))
        fail(f"two identical calls (dropout_p=0) differ by up to {diff:.3g}, but should be equal "
             "(no dropout means a deterministic result)")


@conformance_property(
    "invalid_inputs_raise", level="sdpa", section="spec.sdpa (invalid input)",
    cases=lambda t: cases_for(t, layouts=("contiguous",), mask_kinds=("none",), causal=(None,)),
    directed=lambda t: directed_for(t, layouts=("contiguous",), mask_kinds=("none",), causal=(None,)),
    examples_factor=0.25,
)
def test_invalid_inputs_raise(target: Target, case: SDPACase) -> None:
    """Inputs invalid per the spec raise instead of computing: N % K != 0 with
    enable_gqa, and a mask built for another key length (S + 1)."""
    # N query heads against N + 1 kv heads: N % (N + 1) != 0 for every N >= 1.
    bad_heads = case.replace(key=np.repeat(case.key[:, :1], case.N + 1, axis=1),
                             value=np.repeat(case.value[:, :1], case.N + 1, axis=1))
    expect_sdpa_raises(target, bad_heads,
                       f"query heads N={case.N} with K={case.N + 1} kv heads and enable_gqa=True")
    bad_mask = case.replace(attend_mask=np.ones((case.L, case.S + 1), dtype=bool))
    expect_sdpa_raises(target, bad_mask,
                       f"attn_mask of shape (L, S+1)=({case.L}, {case.S + 1}) for S={case.S} keys")


@conformance_property(
    "large_logits", level="sdpa", section="docs/KNOWN_BUGS.md#8-fp16-overflow",
    cases=lambda t: cases_for(t, layouts=("contiguous",), mask_kinds=("none",), causal=(None,),
                              regimes=("normal",), fully_masked=False),
    directed=lambda t: directed_for(t, layouts=("contiguous",), mask_kinds=("none",), causal=(None,),
                                 regimes=("normal",), fully_masked=False),
    skip_reason=lambda t: skip_unless(t.dtype == "float16", "only float16 has a range that q·kᵀ can "
                                   "overflow while the scaled logits stay representable")
    or skip_unless(t.caps.custom_scale, "needs an explicit scale") or needs_separate_values(t),
    examples_factor=0.5,
)
def test_large_logits(target: Target, case: SDPACase) -> float | None:
    """With |q·kᵀ| beyond float16's 65504 but scale·q·kᵀ well inside it, the
    output is finite and agrees with the oracle (an implementation must not
    form the unscaled product in float16)."""
    rng = case_rng(case, "large")
    q = rng.uniform(0.5, 1.0, case.query.shape) * rng.choice([-1, 1], case.query.shape)
    k = rng.uniform(0.5, 1.0, case.key.shape) * rng.choice([-1, 1], case.key.shape)
    # Every |q·k| is at least E·0.25·c²: choose c so that the largest product overflows.
    c = float(np.sqrt(2 * 65504.0 / (0.25 * case.E)))
    # scale 1/64 keeps every scaled logit at most ~2048, far inside float16.
    big = case.replace(query=round_to(q * c, "float16"), key=round_to(k * c, "float16"), scale=1 / 64)
    raw = np.abs(big.query @ np.swapaxes(np.repeat(big.key, case.N // case.K, axis=1), -1, -2))
    if raw.max() <= 65504.0:
        return None
    call = run_sdpa(target, big)
    if not np.isfinite(call.output).all():
        fail(f"output has non-finite values for |q·kᵀ| up to {raw.max():.3g} (> 65504) with "
             f"scale={big.scale} keeping the scaled logits ≤ {raw.max() * big.scale:.3g}; "
             "the unscaled product overflowed float16")
    return check_against_oracle(target, big, call.output).ratio
