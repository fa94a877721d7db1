"""Multi-head attention modules against spec.mha_forward and the module's own
invariants (need_weights, averaged weights, eval mode, dropout, causal hint, mask
conventions, output contract).

The module is built by the implementation's factory with the case's options,
the oracle's weights are copied in with ``load_weights``, and the module is
called with nn.MultiheadAttention's conventions (bool masks True = blocked).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import spec
from conformance import tolerance
from conformance.cases import MHACase
from conformance.compare import assert_contract, compare_values, fail
from conformance.helpers import require
from conformance.runner import Target, call_guarded, conformance_property
from conformance.strategies import mha_cases
from conformance.tensors import dtype_of, mha_inputs, to_numpy


def _cases(target: Target, **kwargs: Any):
    """mha_cases within the target's claims (self-attention only without
    the ``cross_attention`` feature)."""
    if "cross_attention" not in target.caps.mha_features:
        kwargs["self_attention"] = True
        features = set(kwargs.get("features", target.caps.mha_features))
        kwargs["features"] = features - {"kdim_vdim"}
    return mha_cases(dtype=target.dtype, device=target.device, caps=target.caps, **kwargs)


def _has(target: Target, feature: str) -> bool:
    return feature in target.caps.mha_features


def build(target: Target, case: MHACase, *, dropout: float = 0.0, training: bool = False) -> Any:
    """The implementation's module with the case's options and weights."""
    p = case.params

    def make() -> Any:
        module = target.impl.mha(
            p.embed_dim, p.num_heads, dropout=dropout, bias=p.in_proj_bias is not None,
            add_bias_kv=p.bias_k is not None, add_zero_attn=bool(p.add_zero_attn),
            kdim=p.kdim, vdim=p.vdim, batch_first=case.batch_first,
            device=case.device, dtype=dtype_of(case.dtype),
        )
        target.impl.load_weights(module, p)
        module.train(training)
        return module

    return call_guarded(target, make)


@dataclass
class MHACall:
    output: np.ndarray
    weights: np.ndarray | None
    out_tensor: Any
    weights_tensor: Any
    inputs: dict[str, Any]
    module: Any


def run_mha(target: Target, case: MHACase, module: Any = None, *, requires_grad: bool = False,
            inputs: dict[str, Any] | None = None, **overrides: Any) -> MHACall:
    module = module if module is not None else build(target, case)
    kwargs = dict(inputs) if inputs is not None else mha_inputs(case, requires_grad=requires_grad)
    kwargs.update(overrides)
    result = call_guarded(target, module, **kwargs)
    if not isinstance(result, tuple) or len(result) != 2:
        fail(f"forward returned {type(result).__name__}, but should return (output, weights) "
             "as nn.MultiheadAttention does")
    out, weights = result
    return MHACall(to_numpy(out), None if weights is None else to_numpy(weights), out, weights, kwargs, module)


def oracle(case: MHACase, fully_masked: str = "zero", **overrides: Any):
    args = dict(key_padding_mask=case.key_padding_mask, attn_mask=case.attn_mask,
                need_weights=case.need_weights, average_attn_weights=case.average_attn_weights,
                is_causal=case.is_causal, batch_first=case.batch_first, fully_masked=fully_masked)
    args.update(overrides)
    return spec.mha_forward(case.params, case.query, case.key, case.value, **args)


def _to_batch_first(x: np.ndarray, case: MHACase) -> np.ndarray:
    if case.unbatched:
        return x[None]
    return x if case.batch_first else np.swapaxes(x, 0, 1)


def _bounds(case: MHACase) -> tuple[np.ndarray, float]:
    """(output magnitude per feature (D,), largest |scaled logit|): what the module
    output's rounding error scales with."""
    p = case.params
    wq, wk, wv = (np.abs(w) for w in p.projection_weights())
    bq, bk, bv = (np.abs(b) for b in p.projection_biases())
    xq = np.abs(_to_batch_first(case.query, case))  # (B, L, D)
    xk = np.abs(_to_batch_first(case.key, case))  # (B, S, kdim)
    xv = np.abs(_to_batch_first(case.value, case))  # (B, S, vdim)
    q = xq @ wq.T + bq  # (B, L, D)
    k = xk @ wk.T + bk
    v = xv @ wv.T + bv
    E = p.head_dim
    if p.bias_k is not None:
        k = np.concatenate([k, np.abs(p.bias_k).reshape(1, 1, -1).repeat(k.shape[0], 0)], axis=1)
        v = np.concatenate([v, np.abs(p.bias_v).reshape(1, 1, -1).repeat(v.shape[0], 0)], axis=1)
    logit = 0.0
    for h in range(p.num_heads):
        sl = slice(h * E, (h + 1) * E)
        logit = max(logit, float((q[..., sl] @ np.swapaxes(k[..., sl], -1, -2)).max()) / np.sqrt(E))
    vmax = v.max(axis=(0, 1))  # (D,)
    out_bias = np.abs(p.out_proj_bias) if p.out_proj_bias is not None else 0.0
    magnitude = np.abs(p.out_proj_weight) @ vmax + out_bias  # (D,)
    mask_range = 0.0
    for m in (case.attn_mask, case.key_padding_mask):
        if m is not None and m.dtype != np.bool_:
            finite = np.abs(m[np.isfinite(m)])
            mask_range += float(finite.max()) if finite.size else 0.0
    return magnitude, logit + mask_range


def _pair_allowed(target: Target, case: MHACase) -> np.ndarray:
    """Allowed difference between two outputs of the module, each within the bound."""
    magnitude, logit_range = _bounds(case)
    return 2 * tolerance.mha_allowed(case.dtype, magnitude, logit_range, tf32=target.tf32)


def _dead(case: MHACase) -> np.ndarray:
    """Bool (B, N, L): query rows of a head with every key blocked."""
    return case.blocked_rows()


def _out_rows(case: MHACase, rows_bl: np.ndarray) -> np.ndarray:
    """(B, L) row selection laid out like the module output (for broadcasting)."""
    if case.unbatched:
        return rows_bl[0][:, None]
    return rows_bl[:, :, None] if case.batch_first else rows_bl.T[:, :, None]


def _weight_rows(case: MHACase, dead: np.ndarray, averaged: bool) -> np.ndarray:
    rows = ~dead.any(axis=1) if averaged else ~dead  # (B, L) or (B, N, L)
    rows = rows[..., None]
    return rows[0] if case.unbatched else rows


def check_mha(target: Target, case: MHACase, call: MHACall, *, fully_masked: str = "zero",
              include_dead: bool = False, what: str = "module output") -> float:
    expected_out, expected_w = oracle(case, fully_masked=fully_masked)
    magnitude, logit_range = _bounds(case)
    allowed = tolerance.mha_allowed(case.dtype, magnitude, logit_range, tf32=target.tf32)
    dead = _dead(case)
    rows = None if include_dead else _out_rows(case, ~dead.any(axis=1))
    ratio = compare_values(what, call.output, expected_out, allowed, where=rows).ratio
    if case.need_weights and _has(target, "need_weights"):
        if call.weights is None:
            fail("weights=None with need_weights=True, but should be the attention weights")
        w_allowed = tolerance.mha_allowed(case.dtype, np.ones(1), logit_range, tf32=target.tf32)
        w_rows = None if include_dead else _weight_rows(case, dead, case.average_attn_weights)
        ratio = max(ratio, compare_values("attention weights", call.weights, expected_w, w_allowed,
                                          where=w_rows).ratio)
    return ratio


@conformance_property(
    "mha_agreement", level="mha", section="spec.mha_forward",
    cases=lambda t: _cases(t),
)
def test_mha_agreement(target: Target, case: MHACase) -> float:
    """The module's output (and weights, when asked for) equal spec.mha_forward
    with the same weights copied in, over every constructor option and forward
    argument the implementation declares (rows with every key blocked are
    checked by mha_fully_masked_rows)."""
    return check_mha(target, case, run_mha(target, case))


@conformance_property(
    "mha_fully_masked_rows", level="mha", section="spec.mha_forward (fully_masked)",
    cases=lambda t: _cases(t, fully_masked=True),
    requires=lambda t: require(_has(t, "key_padding_mask") or _has(t, "attn_mask"), "no masks declared"),
)
def test_mha_fully_masked_rows(target: Target, case: MHACase) -> float:
    """Query rows whose keys are all blocked follow the declared policy (zero:
    attention output 0, so the module output is out_proj.bias; nan; uniform),
    leave the other rows alone, and give finite gradients to every parameter."""
    policy = target.caps.fully_masked
    call = run_mha(target, case, requires_grad=target.caps.autograd and target.dtype in ("float32", "float64"))
    if policy == "unspecified":
        return check_mha(target, case, call)
    ratio = check_mha(target, case, call, fully_masked=policy, include_dead=True,
                      what=f"module output with fully-masked rows (declared policy {policy!r})")
    if policy != "nan" and target.caps.autograd and target.dtype in ("float32", "float64"):
        _backward(target, case, call)
        _check_parameter_grads(call.module, require_all=False)
    return ratio


def _backward(target: Target, case: MHACase, call: MHACall) -> np.ndarray:
    import torch

    rng = np.random.default_rng(abs(hash(case.describe())) % 2**32)
    g = rng.standard_normal(call.output.shape)
    call_guarded(target, lambda: call.out_tensor.backward(
        torch.from_numpy(g).to(call.out_tensor.dtype).to(call.out_tensor.device)))
    return g


def _check_parameter_grads(module: Any, *, require_all: bool = True) -> None:
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            if require_all:
                fail(f"gradient of parameter {name} is None, but every parameter should get one "
                     "(is it used in forward?)")
            continue
        grad = to_numpy(param.grad)
        if not np.isfinite(grad).all():
            bad = int((~np.isfinite(grad)).sum())
            fail(f"gradient of parameter {name} has {bad} non-finite entries, but should be finite "
                 "(a NaN here poisons every later step)")


def _perturbed(case: MHACase, direction: dict[str, np.ndarray], h: float) -> MHACase:
    q = case.query + h * direction["query"]
    k = q if case.key is case.query else case.key + h * direction["key"]
    if case.value is case.query:
        v = q
    elif case.value is case.key:
        v = k
    else:
        v = case.value + h * direction["value"]
    return case.replace(query=q, key=k, value=v)


@conformance_property(
    "mha_gradients", level="mha", section="spec.mha_forward (derivative)",
    cases=lambda t: _cases(t, fully_masked=False),
    requires=lambda t: require(t.caps.autograd, "autograd not declared")
    or require(t.dtype in ("float32", "float64"), "checked in float32/float64 (finite differences)"),
    examples_factor=0.5,
)
def test_mha_gradients(target: Target, case: MHACase) -> float:
    """Every parameter receives a finite gradient, and the gradient with
    respect to query, key and value matches the oracle's derivative along a
    random direction (float64 central differences of spec.mha_forward)."""
    call = run_mha(target, case, requires_grad=True)
    g = _backward(target, case, call)
    _check_parameter_grads(call.module)
    rng = np.random.default_rng(7)
    direction = {n: rng.standard_normal(getattr(case, n).shape) for n in ("query", "key", "value")}
    analytic = 0.0
    scale = 0.0
    seen = set()
    for name in ("query", "key", "value"):
        t = call.inputs[name]
        if id(t) in seen:
            continue
        seen.add(id(t))
        if t.grad is None:
            fail(f"gradient with respect to {name} is None, but should reach the inputs")
        grad = to_numpy(t.grad)
        analytic += float((grad * direction[name]).sum())
        scale += float((np.abs(grad) * np.abs(direction[name])).sum())
    h = 1e-5
    plus = oracle(_perturbed(case, direction, h), need_weights=False)[0]
    minus = oracle(_perturbed(case, direction, -h), need_weights=False)[0]
    numeric = float((g * (plus - minus)).sum() / (2 * h))
    # Central differences: truncation O(h²) plus float64 cancellation ~ eps·Σ|g·f| / h.
    fd_noise = 64 * 2.0**-52 * float(np.abs(g * plus).sum()) / h + 1e-6 * scale
    _, eps = tolerance.tolerance_for(case.dtype, tf32=target.tf32)
    _, logit_range = _bounds(case)
    allowed = tolerance.TOLERANCES[case.dtype].mha_floor * eps * (1 + logit_range) * (scale + abs(numeric)) + fd_noise
    err = abs(analytic - numeric)
    if not np.isfinite(analytic) or err > allowed:
        fail(f"directional derivative of Σ g·output along a random input direction={analytic!r}, "
             f"but should be {numeric!r} (float64 central differences of the oracle; "
             f"|diff|={err:.3g}, allowed {allowed:.3g})")
    return err / allowed if allowed > 0 else 0.0


@conformance_property(
    "mha_need_weights_equivalence", level="mha", section="spec.mha_forward (need_weights)",
    cases=lambda t: _cases(t),
    requires=lambda t: require(_has(t, "need_weights"), "need_weights not declared"),
)
def test_mha_need_weights_equivalence(target: Target, case: MHACase) -> float:
    """need_weights=True and need_weights=False give the same output (different
    code paths must not change the answer), fully-masked rows included."""
    module = build(target, case)
    with_w = run_mha(target, case, module, need_weights=True)
    without = run_mha(target, case, module, need_weights=False)
    if without.weights is not None:
        fail("weights returned with need_weights=False, but should be None")
    allowed = _pair_allowed(target, case)
    return compare_values("output with need_weights=False vs True", without.output, with_w.output,
                          allowed).ratio


@conformance_property(
    "mha_averaged_weights", level="mha", section="spec.mha_forward (average_attn_weights)",
    cases=lambda t: _cases(t, need_weights=True),
    requires=lambda t: require(_has(t, "need_weights") and _has(t, "average_weights"),
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
    _, logit_range = _bounds(case)
    allowed = 2 * tolerance.mha_allowed(case.dtype, np.ones(1), logit_range, tf32=target.tf32)
    finite = np.isfinite(mean)
    return compare_values("averaged weights vs the mean of per-head weights", avg.weights, mean,
                          allowed, where=finite).ratio


@conformance_property(
    "mha_eval_determinism", level="mha", section="spec.mha_forward (eval: no dropout)",
    cases=lambda t: _cases(t),
)
def test_mha_eval_determinism(target: Target, case: MHACase) -> float:
    """In eval mode a module built with dropout=0.5 ignores dropout: two calls
    are equal and equal the oracle; in train mode dropout=0 gives the same."""
    p = 0.5 if _has(target, "dropout") else 0.0
    module = build(target, case, dropout=p)
    first = run_mha(target, case, module)
    second = run_mha(target, case, module)
    a, b = np.nan_to_num(first.output, nan=7.0), np.nan_to_num(second.output, nan=7.0)
    if not np.array_equal(a, b):
        fail(f"two calls in eval mode (dropout={p}) differ by up to {np.abs(a - b).max():.3g}, "
             "but should be equal: dropout must be off in eval mode")
    ratio = check_mha(target, case, first, what=f"eval-mode output of a module built with dropout={p}")
    trained = build(target, case, dropout=0.0, training=True)
    train_out = run_mha(target, case, trained)
    allowed = _pair_allowed(target, case)
    return max(ratio, compare_values("train-mode output with dropout=0 vs eval", train_out.output,
                                     first.output, allowed).ratio)


@conformance_property(
    "mha_dropout_expectation", level="mha", section="docs/KNOWN_BUGS.md#7-dropout-in-eval (dropout keeps the expectation)",
    cases=lambda t: _cases(t, max_L=3, max_S=4, max_batch=1, need_weights=False,
                           features=set(t.caps.mha_features) - {"unbatched", "batch_first"}),
    requires=lambda t: require(_has(t, "dropout"), "dropout not declared")
    or require(t.dtype in ("float32", "float64"), "checked in float32/float64 (a statistical bound)"),
    examples_factor=0.2,
)
def test_mha_dropout_expectation(target: Target, case: MHACase) -> float:
    """In train mode with dropout=p, the mean output over M = 2048 samples (the
    case tiled along the batch) is the eval output, and no sample is NaN.

    Each sample of an output element is b_o + Σ_j W_o[d, j]·Σ_s w_s m_s v_s[j] / (1 - p)
    with m_s ∈ {0, 1}: it lies in an interval of width 2c, c = Σ_j |W_o[d, j]| Σ_s w_s |v_s[j]| / (1 - p).
    Hoeffding: |mean - expectation| ≤ 2c·sqrt(ln(2/δ) / 2M) with probability 1 - δ,
    δ = 1e-7 / #elements, so a false alarm is below 1e-7 per example.
    """
    p = 0.5
    M = 2048
    tiled = case.replace(
        query=np.tile(case.query, (1, M, 1)),
        key=np.tile(case.key, (1, M, 1)) if case.key is not case.query else None,
        value=np.tile(case.value, (1, M, 1)) if case.value is not case.query else None,
        key_padding_mask=None if case.key_padding_mask is None else np.tile(case.key_padding_mask, (M, 1)),
        attn_mask=case.attn_mask if case.attn_mask is None or case.attn_mask.ndim == 2 else np.tile(case.attn_mask, (M, 1, 1)),
    )
    if tiled.key is None:
        tiled = tiled.replace(key=tiled.query)
    if tiled.value is None:
        tiled = tiled.replace(value=tiled.key if case.value is case.key else tiled.query)
    module = build(target, tiled, dropout=p, training=True)
    out = run_mha(target, tiled, module, need_weights=False).output  # (L, M, D)
    dead = _dead(case).any(axis=1)[0]  # (L,)
    live = out[~dead]
    if np.isnan(live).any():
        fail(f"train-mode output has NaN with dropout={p} in rows that have attendable keys")
    expected, weights = oracle(case, need_weights=True, average_attn_weights=False)
    mean = out.mean(axis=1, keepdims=True)  # (L, 1, D)
    pr = case.params
    _, _, wv = pr.projection_weights()
    _, _, bv = pr.projection_biases()
    v = case.value[:, 0] @ wv.T + bv  # (S, D)
    if pr.bias_v is not None:
        v = np.concatenate([v, pr.bias_v.reshape(1, -1)])
    if pr.add_zero_attn:
        v = np.concatenate([v, np.zeros((1, v.shape[1]))])
    E = pr.head_dim
    attended = np.concatenate([weights[0, h] @ np.abs(v[:, h * E:(h + 1) * E]) for h in range(pr.num_heads)],
                              axis=-1)  # (L, D)
    c = (attended @ np.abs(pr.out_proj_weight).T) / (1 - p)  # (L, D)
    delta = 1e-7 / max(1, mean.size)
    magnitude, logit_range = _bounds(case)
    rounding = tolerance.mha_allowed(case.dtype, magnitude, logit_range, tf32=target.tf32)  # (D,)
    bound = 2 * c * np.sqrt(np.log(2 / delta) / (2 * M)) + 1e-6 * c + rounding
    return compare_values(f"mean of {M} train-mode outputs (dropout={p})", mean[:, 0], expected[:, 0],
                          bound, where=~dead[:, None]).ratio


@conformance_property(
    "mha_causal_flag_equivalence", level="mha", section="spec.mha_forward (is_causal)",
    cases=lambda t: _cases(t, is_causal=True),
    requires=lambda t: require(_has(t, "is_causal") and _has(t, "attn_mask"),
                               "is_causal (a hint that needs the causal attn_mask) not declared"),
)
def test_mha_causal_flag_equivalence(target: Target, case: MHACase) -> float:
    """is_causal=True with the causal attn_mask equals the attn_mask alone, for
    every need_weights / key_padding_mask combination drawn, and the oracle."""
    module = build(target, case)
    flagged = run_mha(target, case, module)
    plain = run_mha(target, case.replace(is_causal=False), module)
    ratio = check_mha(target, case, flagged, what="output with is_causal=True")
    allowed = _pair_allowed(target, case)
    rows = _out_rows(case, ~_dead(case).any(axis=1))
    return max(ratio, compare_values("output with is_causal=True vs the causal attn_mask alone",
                                     flagged.output, plain.output, allowed, where=rows).ratio)


def _as_float(mask: np.ndarray | None) -> np.ndarray | None:
    if mask is None or mask.dtype != np.bool_:
        return mask
    return np.where(mask, -np.inf, 0.0)


@conformance_property(
    "mha_mask_conventions", level="mha", section="spec.masks (MHA convention: True = blocked)",
    cases=lambda t: _cases(t, mask_kinds=("bool",)),
    requires=lambda t: require(_has(t, "key_padding_mask") or _has(t, "attn_mask"), "no masks declared"),
)
def test_mha_mask_conventions(target: Target, case: MHACase) -> float:
    """Bool masks mean True = blocked (the oracle agrees), and the float form
    0 / -inf of each mask (key_padding_mask and attn_mask) gives the same output."""
    module = build(target, case)
    by_bool = run_mha(target, case, module)
    ratio = check_mha(target, case, by_bool, what="output with bool masks (True = blocked)")
    as_float = case.replace(key_padding_mask=_as_float(case.key_padding_mask), attn_mask=_as_float(case.attn_mask))
    by_float = run_mha(target, as_float, module)
    allowed = _pair_allowed(target, case)
    rows = _out_rows(case, ~_dead(case).any(axis=1))
    return max(ratio, compare_values("output with float 0/-inf masks vs bool masks", by_float.output,
                                     by_bool.output, allowed, where=rows).ratio)


@conformance_property(
    "mha_output_contract", level="mha", section="docs/DESIGN.md#output-contract (dtype, shapes)",
    cases=lambda t: _cases(t),
)
def test_mha_output_contract(target: Target, case: MHACase) -> None:
    """Output (L, B, D) / (B, L, D) / (L, D) in the input dtype and device;
    weights None without need_weights, else (B, L, S') or (B, N, L, S'); the
    inputs are not modified."""
    import torch

    inputs = mha_inputs(case)
    before = {k: v.detach().clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    call = run_mha(target, case, inputs=inputs)
    expected_out, expected_w = oracle(case)
    assert_contract("output", call.out_tensor, shape=expected_out.shape, dtype=dtype_of(case.dtype),
                    device=target.device)
    if case.need_weights and _has(target, "need_weights"):
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
