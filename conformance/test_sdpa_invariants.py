"""Oracle-free invariants of scaled-dot-product attention (docs/DESIGN.md#properties).

Each property compares the implementation with itself under a transformation
whose effect the math fixes. The allowed error is the tolerance rule's bound of
each call (``calls.sdpa.allowed_for``) summed, plus a bound on any rounding the
transformation itself introduces in low precision.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from conformance.calls.equivalence import compare_equivalent, sdpa_side
from conformance.calls.sdpa import allowed_for, run_sdpa, valid_rows
from conformance.core import tolerance
from conformance.core.cases import SDPACase
from conformance.core.compare import compare_values, fail
from conformance.core.target import Target
from conformance.directed.helpers import (
    attend_matrix,
    case_rng,
    cases_for,
    directed_for,
    identity_probe,
    needs_separate_values,
    skip_unless,
)
from conformance.harness.runner import conformance_property
from implementations.capabilities import length_allowed
from spec.emulate import round_to


def _probe_ok(t: Target) -> str | None:
    """The V = identity probe needs Ev = S != E, and a value apart from the key."""
    return skip_unless(t.caps.different_v_dim, "the V = identity weights probe needs Ev != E") \
        or needs_separate_values(t)


def _probe_max_S(t: Target) -> int:
    """The longest S whose V = I fits a declared head dim."""
    largest = max(t.caps.head_dims) if t.caps.head_dims else t.caps.max_head_dim or 64
    return min(largest, 64)


def _probe_cases(t: Target, **kw):
    return cases_for(t, layouts=("contiguous",), max_S=_probe_max_S(t), **kw)


def _probe_directed(t: Target, **kw):
    return directed_for(t, layouts=("contiguous",), max_S=_probe_max_S(t), **kw)


@conformance_property(
    "weights_are_distributions", level="sdpa", section="spec.sdpa (weights)",
    cases=lambda t: _probe_cases(t), directed=lambda t: _probe_directed(t), skip_reason=_probe_ok,
)
def test_weights_are_distributions(target: Target, case: SDPACase) -> float:
    """Weights (observed with V = identity) are non-negative and each row sums to 1."""
    probe = identity_probe(case, target.caps)
    weights = run_sdpa(target, probe).output[..., :case.S]  # (B, N, L, S)
    rows = valid_rows(probe)
    allowed, ref = allowed_for(target, probe)
    allowed = allowed[..., :case.S]
    negative = rows & (weights < -allowed)
    if negative.any():
        i = tuple(int(x) for x in np.argwhere(negative)[0])
        fail(f"weight at {i}={weights[i]!r}, but should be >= 0")
    sums = weights.sum(-1, keepdims=True)
    return compare_values("row sum of weights", sums, np.ones_like(sums),
                          allowed.sum(-1, keepdims=True), where=rows).ratio


def _padded(case: SDPACase, rng: np.random.Generator, target: Target) -> SDPACase:
    """``case`` with a key-padding mask: batch item b attends its first lengths[b] keys."""
    lengths = rng.integers(1, case.S, size=case.B)  # at least one key padded, one kept
    attend = np.arange(case.S)[None, :] < lengths[:, None]  # (B, S)
    attend = attend[:, None, None, :]  # (B, 1, 1, S)
    if "bool" in target.caps.mask_kinds and (rng.random() < 0.5 or "additive" not in target.caps.mask_kinds):
        return case.replace(attend_mask=attend, additive_mask=None, causal=None)
    return case.replace(attend_mask=None, additive_mask=np.where(attend, 0.0, -np.inf), causal=None)


@conformance_property(
    "masked_keys_ignored", level="sdpa", section="spec.masks (padding)",
    cases=lambda t: cases_for(t, layouts=("contiguous",), mask_kinds=("none",), causal=(None,),
                              min_S=2, max_S=min(t.caps.max_head_dim or 64, 64)),
    directed=lambda t: directed_for(t, layouts=("contiguous",), mask_kinds=("none",), causal=(None,),
                                 min_S=2, max_S=min(t.caps.max_head_dim or 64, 64)),
    skip_reason=lambda t: skip_unless(bool({"bool", "additive"} & set(t.caps.mask_kinds)), "no masks declared")
    or needs_separate_values(t),
)
def test_masked_keys_ignored(target: Target, case: SDPACase) -> float:
    """Blocked keys get weight exactly 0, and giving them any other finite key
    and value changes nothing."""
    rng = case_rng(case, "padding")
    padded = _padded(case, rng, target)
    blocked = ~attend_matrix(padded)  # (B, N, L, S)
    if target.caps.different_v_dim and (not target.caps.head_dims or max(target.caps.head_dims) >= padded.S):
        weights = run_sdpa(target, identity_probe(padded, target.caps)).output[..., :case.S]
        leak = blocked & (weights != 0)
        if leak.any():
            i = tuple(int(x) for x in np.argwhere(leak)[0])
            fail(f"weight of a blocked key at {i}={weights[i]!r}, but should be exactly 0")
    first = run_sdpa(target, padded).output
    key_blocked = blocked.all(axis=(1, 2))  # (B, S): blocked for every head and query
    junk_k = round_to(rng.standard_normal(padded.key.shape) * 8, case.dtype)
    junk_v = round_to(rng.standard_normal(padded.value.shape) * 8, case.dtype)
    sel = key_blocked[:, None, :, None]
    changed = padded.replace(key=np.where(sel, junk_k, padded.key), value=np.where(sel, junk_v, padded.value))
    second = run_sdpa(target, changed).output
    allowed, _ = allowed_for(target, padded)
    return compare_equivalent(
        "output after changing blocked keys/values",
        sdpa_side(target, "the call with other blocked keys and values", changed, second,
                  path="masking of blocked keys"),
        sdpa_side(target, "the padded call", padded, first, path="padded call"),
        2 * allowed, where=valid_rows(padded)).ratio


def _permute(mask: np.ndarray | None, axis: int, perm: np.ndarray) -> np.ndarray | None:
    if mask is None or mask.ndim < -axis or mask.shape[axis] == 1:
        return mask
    return np.take(mask, perm, axis=axis)


@conformance_property(
    "query_permutation", level="sdpa", section="spec.sdpa (rows are independent)",
    cases=lambda t: cases_for(t, layouts=("contiguous",), causal=(None,)),
    directed=lambda t: directed_for(t, layouts=("contiguous",), causal=(None,)),
)
def test_query_permutation(target: Target, case: SDPACase) -> float:
    """Permuting the queries (and the mask's rows) permutes the output rows."""
    perm = case_rng(case, "qperm").permutation(case.L)
    permuted = case.replace(
        query=case.query[:, :, perm],
        attend_mask=_permute(case.attend_mask, -2, perm),
        additive_mask=_permute(case.additive_mask, -2, perm),
    )
    first = run_sdpa(target, case).output
    second = run_sdpa(target, permuted).output
    allowed, _ = allowed_for(target, case)
    return compare_equivalent(
        "output with permuted queries",
        sdpa_side(target, "the call with permuted queries", permuted, second, path="handling of the permuted rows"),
        sdpa_side(target, "the call in the original order", case, first[:, :, perm], path="original order",
                  view=lambda a: a[:, :, perm]),
        2 * allowed[:, :, perm], where=valid_rows(permuted)).ratio


@conformance_property(
    "key_permutation", level="sdpa", section="spec.sdpa (keys form a set)",
    cases=lambda t: cases_for(t, layouts=("contiguous",), causal=(None,)),
    directed=lambda t: directed_for(t, layouts=("contiguous",), causal=(None,)),
)
def test_key_permutation(target: Target, case: SDPACase) -> float:
    """Permuting keys, values and the mask's columns together changes nothing."""
    perm = case_rng(case, "kperm").permutation(case.S)
    permuted = case.replace(
        key=case.key[:, :, perm],
        value=case.value[:, :, perm],
        attend_mask=_permute(case.attend_mask, -1, perm),
        additive_mask=_permute(case.additive_mask, -1, perm),
    )
    first = run_sdpa(target, case).output
    second = run_sdpa(target, permuted).output
    allowed, _ = allowed_for(target, case)
    return compare_equivalent(
        "output with permuted keys",
        sdpa_side(target, "the call with permuted keys", permuted, second, path="handling of the permuted keys"),
        sdpa_side(target, "the call in the original order", case, first, path="original order"),
        2 * allowed, where=valid_rows(case)).ratio


@conformance_property(
    "shift_invariance", level="sdpa", section="spec.sdpa (softmax shift)",
    cases=lambda t: cases_for(t, layouts=("contiguous",), regimes=("normal", "near_ties", "tiny")),
    directed=lambda t: directed_for(t, layouts=("contiguous",), regimes=("normal", "near_ties", "tiny")),
    skip_reason=needs_separate_values,
)
def test_shift_invariance(target: Target, case: SDPACase) -> float:
    """Adding a vector to every key, or a constant to a row of an additive mask,
    leaves the output unchanged (softmax is shift-invariant per row)."""
    rng = case_rng(case, "shift")
    scale = case.scale if case.scale is not None else 1 / np.sqrt(case.E)
    shift = rng.standard_normal((case.B, case.K, 1, case.E))
    key2 = round_to(case.key + shift, case.dtype)
    # Rounding k + u moves each logit by scale·q·(key2 - key - u): bound it.
    residual = np.repeat(key2 - case.key - shift, case.N // case.K, axis=1)
    delta = scale * (case.query @ np.swapaxes(residual, -1, -2))
    shifted = case.replace(key=key2)
    value_max = np.abs(case.value).max()
    extra = tolerance.logit_shift_allowed(delta, value_max)
    if case.additive_mask is not None:
        row_shift = rng.standard_normal(case.additive_mask.shape[:-1] + (1,)) * 4
        mask2 = round_to(case.additive_mask + row_shift, case.dtype)
        with np.errstate(invalid="ignore"):  # -inf - -inf: blocked stays blocked
            moved = mask2 - case.additive_mask - row_shift
        moved = np.broadcast_to(moved, (case.B, case.N, case.L, case.S))
        extra = extra + tolerance.logit_shift_allowed(moved, value_max)
        shifted = shifted.replace(additive_mask=mask2)
    first = run_sdpa(target, case).output
    second = run_sdpa(target, shifted).output
    allowed, _ = allowed_for(target, case)
    allowed2, _ = allowed_for(target, shifted)
    return compare_equivalent(
        "output after a softmax-invariant shift",
        sdpa_side(target, "the shifted call", shifted, second, path="handling of the shifted logits"),
        sdpa_side(target, "the unshifted call", case, first, path="unshifted call"),
        allowed + allowed2 + extra, where=valid_rows(case)).ratio


@conformance_property(
    "temperature", level="sdpa", section="spec.sdpa (scale)",
    cases=lambda t: cases_for(t, layouts=("contiguous",), regimes=("normal", "near_ties", "wide_range"),
                              scale_kinds=("positive", "tiny", "negative", "zero")),
    directed=lambda t: directed_for(t, layouts=("contiguous",), regimes=("normal", "near_ties", "wide_range"),
                                 scale_kinds=("positive", "tiny", "negative", "zero")),
    requires=("custom_scale",),
)
def test_temperature(target: Target, case: SDPACase) -> float:
    """c·q with scale s gives the same output as q with scale c·s (c a power of
    two, so c·q is exact in every dtype)."""
    c = float(case_rng(case, "temperature").choice([0.5, 2.0, 4.0]))
    s = case.scale if case.scale is not None else 1 / np.sqrt(case.E)
    scaled_q, scaled_s = case.replace(query=case.query * c, scale=s), case.replace(scale=c * s)
    first = run_sdpa(target, scaled_q).output
    second = run_sdpa(target, scaled_s).output
    allowed, _ = allowed_for(target, scaled_s)
    return compare_equivalent(
        f"output for ({c}·q, scale={s:.4g}) vs (q, scale={c * s:.4g})",
        sdpa_side(target, f"the ({c}·q, scale={s:.4g}) call", scaled_q, first, path="larger-logit path"),
        sdpa_side(target, f"the (q, scale={c * s:.4g}) call", scaled_s, second, path="scale argument"),
        2 * allowed, where=valid_rows(case)).ratio


@conformance_property(
    "value_linearity", level="sdpa", section="spec.sdpa (linear in V)",
    cases=lambda t: cases_for(t, layouts=("contiguous",)),
    directed=lambda t: directed_for(t, layouts=("contiguous",)),
    skip_reason=needs_separate_values,
)
def test_value_linearity(target: Target, case: SDPACase) -> float:
    """The output is linear in V: out(2V) = 2·out(V) and out(V1 + V2) = out(V1) + out(V2)."""
    rng = case_rng(case, "linearity")
    v2 = round_to(rng.standard_normal(case.value.shape), case.dtype)
    v12 = round_to(case.value + v2, case.dtype)
    rows = valid_rows(case)
    out1 = run_sdpa(target, case).output
    out_twice = run_sdpa(target, case.replace(value=case.value * 2)).output
    a1, ref = allowed_for(target, case)
    ratio = compare_values("out(2V)", out_twice, 2 * out1, 3 * a1, where=rows).ratio
    out2 = run_sdpa(target, case.replace(value=v2)).output
    out12 = run_sdpa(target, case.replace(value=v12)).output
    a2, _ = allowed_for(target, case.replace(value=v2))
    a12, _ = allowed_for(target, case.replace(value=v12))
    residual = np.abs(v12 - case.value - v2).max()  # rounding of V1 + V2 itself
    return max(ratio, compare_values("out(V1 + V2)", out12, out1 + out2, a1 + a2 + a12 + residual,
                                     where=rows).ratio)


@conformance_property(
    "convex_hull", level="sdpa", section="spec.sdpa (convex combination)",
    cases=lambda t: cases_for(t, layouts=("contiguous",)),
    directed=lambda t: directed_for(t, layouts=("contiguous",)),
)
def test_convex_hull(target: Target, case: SDPACase) -> float:
    """Each output element lies between the smallest and largest value of the
    keys its query may attend (an attention output is a convex combination)."""
    out = run_sdpa(target, case).output  # (B, N, L, Ev)
    attend = attend_matrix(case)[..., None]  # (B, N, L, S, 1)
    v = np.repeat(case.value, case.N // case.K, axis=1)[:, :, None]  # (B, N, 1, S, Ev)
    lo = np.where(attend, v, np.inf).min(-2)
    hi = np.where(attend, v, -np.inf).max(-2)
    rows = valid_rows(case)
    allowed, _ = allowed_for(target, case)
    below = np.where(rows, lo - out, -np.inf)
    above = np.where(rows, out - hi, -np.inf)
    excess = np.maximum(below, above)
    bad = excess > allowed
    if bad.any():
        i = tuple(int(x) for x in np.argwhere(bad)[0])
        fail(f"output at {i}={out[i]!r}, but should lie within the attended values "
             f"[{lo[i]!r}, {hi[i]!r}] (allowed excess {allowed[i]:.3g})")
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(rows & (excess > 0), excess / allowed, 0.0)
    return float(np.nanmax(ratio)) if ratio.size else 0.0


def _stack(a: np.ndarray | None, b: np.ndarray | None, axis: int, full_ndim: int = 4):
    """Concatenate masks along batch (0) or head (1) of the (B, N, L, S) view."""
    if a is None:
        return None
    a4 = a.reshape((1,) * (full_ndim - a.ndim) + a.shape)
    b4 = b.reshape((1,) * (full_ndim - b.ndim) + b.shape)
    if a4.shape[axis] == 1 and np.array_equal(a4, b4):
        return a4
    return np.concatenate([a4, b4], axis=axis)


@conformance_property(
    "batch_independence", level="sdpa", section="spec.sdpa (batch items are independent)",
    cases=lambda t: cases_for(t, layouts=("contiguous",)),
    directed=lambda t: directed_for(t, layouts=("contiguous",)),
    skip_reason=needs_separate_values,
)
def test_batch_independence(target: Target, case: SDPACase) -> float:
    """Each batch item's output is what that item alone gives (with a second,
    different item placed before and after it, so that B >= 2)."""
    rng = case_rng(case, "batch")
    other = case.replace(
        query=round_to(rng.standard_normal(case.query.shape) * 2, case.dtype),
        key=round_to(rng.standard_normal(case.key.shape) * 2, case.dtype),
        value=round_to(rng.standard_normal(case.value.shape) * 2, case.dtype),
    )
    alone = run_sdpa(target, case).output
    allowed, _ = allowed_for(target, case)
    ratio = 0.0
    # The case first and then second: a kernel that reads item 0's keys for
    # every item passes the first order and fails the second.
    for first, second, mine in ((case, other, slice(0, case.B)), (other, case, slice(case.B, 2 * case.B))):
        both = case.replace(
            query=np.concatenate([first.query, second.query]),
            key=np.concatenate([first.key, second.key]),
            value=np.concatenate([first.value, second.value]),
            attend_mask=_stack(first.attend_mask, second.attend_mask, 0),
            additive_mask=_stack(first.additive_mask, second.additive_mask, 0),
        )
        together = run_sdpa(target, both).output[mine]
        ratio = max(ratio, compare_equivalent(
            "batch item computed with another item beside it",
            sdpa_side(target, f"the call with B={both.B} (the item at {mine.start})", both, together,
                      path="batched path", view=lambda a, mine=mine: a[mine]),
            sdpa_side(target, "the call of the item alone", case, alone, path="single-item call"),
            2 * allowed, where=valid_rows(case)).ratio)
    return ratio


@conformance_property(
    "head_independence", level="sdpa", section="spec.sdpa (heads are independent)",
    cases=lambda t: cases_for(t, layouts=("contiguous",)),
    directed=lambda t: directed_for(t, layouts=("contiguous",)),
    skip_reason=needs_separate_values,
)
def test_head_independence(target: Target, case: SDPACase) -> float:
    """Each head's output is what that head alone gives (with a second group of
    heads appended so that there are at least two)."""
    rng = case_rng(case, "heads")
    q2 = round_to(rng.standard_normal(case.query.shape) * 2, case.dtype)
    k2 = round_to(rng.standard_normal(case.key.shape) * 2, case.dtype)
    v2 = round_to(rng.standard_normal(case.value.shape) * 2, case.dtype)

    def head_stack(m):
        if m is None:
            return None
        m4 = m.reshape((1,) * (4 - m.ndim) + m.shape)
        return m4 if m4.shape[1] == 1 else np.concatenate([m4, m4], axis=1)

    both = case.replace(
        query=np.concatenate([case.query, q2], axis=1),
        key=np.concatenate([case.key, k2], axis=1),
        value=np.concatenate([case.value, v2], axis=1),
        attend_mask=head_stack(case.attend_mask),
        additive_mask=head_stack(case.additive_mask),
    )
    alone = run_sdpa(target, case).output
    together = run_sdpa(target, both).output[:, : case.N]
    allowed, _ = allowed_for(target, case)
    return compare_equivalent(
        "heads computed with other heads beside them",
        sdpa_side(target, f"the call with N={both.N} heads", both, together, path="multi-head path",
                  view=lambda a: a[:, : case.N]),
        sdpa_side(target, f"the call with the N={case.N} heads alone", case, alone, path="call with fewer heads"),
        2 * allowed, where=valid_rows(case)).ratio


def _variance_case(target: Target, seed: int) -> SDPACase:
    """q, k iid N(0, 1), V = identity: B·N·L = 64 query rows over S = 64 keys; E = 16
    (Ev = 64: a scale of 1/sqrt(Ev) shows), or the declared head dims' nearest to it
    (V padded with zero columns to Ev = min_head_dim above 64)."""
    rng = np.random.default_rng(seed)
    S = 64
    lo, hi = target.caps.min_head_dim or 1, target.caps.max_head_dim or 64
    Ev = max(S, lo)
    E = min(max(16, lo), hi) if target.caps.different_v_dim else Ev
    dims = target.caps.head_dims
    if dims:  # a declared set: Ev its smallest >= S (skip_reason: there is one), E the nearest to 16
        Ev = next(d for d in dims if d >= S)
        E = min(dims, key=lambda d: abs(d - 16)) if target.caps.different_v_dim else Ev
    q = round_to(rng.standard_normal((1, 1, 64, E)), target.dtype)
    k = round_to(rng.standard_normal((1, 1, S, E)), target.dtype)
    base = SDPACase(q, k, np.zeros((1, 1, S, S)), dtype=target.dtype, device=target.device)
    return identity_probe(base, Ev)


@conformance_property(
    "scaling_variance", level="sdpa", section="spec.sdpa (default scale 1/sqrt(E))",
    cases=lambda t: st.integers(0, 2**32 - 1).map(lambda seed: _variance_case(t, seed)),
    skip_reason=lambda t: skip_unless((t.caps.max_head_dim or 64) >= 64 and length_allowed(t.caps, 64)
                                   and (not t.caps.head_dims or max(t.caps.head_dims) >= 64),
                                   "needs E or Ev = 64 and S = 64") or needs_separate_values(t)
    or skip_unless(not t.caps.causal_only, "needs non-causal calls, but causal_only declares causal calls only"),
    examples_factor=0.25,
)
def test_scaling_variance(target: Target, case: SDPACase) -> float:
    """With q, k iid N(0, 1) and the default scale, the scaled logits seen in the
    weights (log w up to a row constant) have variance ≈ 1 (unscaled: ≈ E).

    Statistic: the mean over 64 rows of the variance of log w across 64 keys,
    accepted in [0.5, 2]. Its expectation is 63/64·E[|q|²]/E = 0.98 and its
    standard deviation under the null ≤ 0.06 (E = 16: Var |q|²/E = 2/E, plus the
    sampling variance of 64 keys), so a false alarm needs an 8-sigma deviation of
    a sum of 64 independent terms: below 1e-12 per example by Bernstein's
    inequality. A scale of 1/sqrt(Ev), 1/sqrt(D) or 1 moves it to 0.25, ≤ 1/N or E.
    """
    weights = run_sdpa(target, case).output[0, 0, :, :case.S]  # (L, S)
    if (weights <= 0).any() or not np.isfinite(weights).all():
        fail("some weights are 0, negative or non-finite for unit-normal q and k with the default "
             "scale, but all should be positive (logits of variance ~1 cannot underflow)")
    logw = np.log(weights)
    stat = float(logw.var(axis=-1, ddof=1).mean())
    if not tolerance.scaling_variance_accepted(stat):
        fail(f"variance of the scaled logits={stat:.3g}, but should be ≈ 1 (accepted [0.5, 2]) "
             f"for E={case.E}: the default scale must be 1/sqrt(E)")
    return tolerance.scaling_variance_ratio(stat)
