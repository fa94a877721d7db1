"""Hypothesis strategies and a brute-force reference, shared by the tests of spec/.

Every case is tiny: the brute force below loops element by element.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from hypothesis import strategies as st

POLICIES = ("zero", "nan", "uniform")


def _broadcast_shape(draw, rng, target: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts to ``target``: some dims kept, some 1, maybe fewer leading dims."""
    keep = [draw(st.booleans()) for _ in target]
    shape = tuple(size if k else 1 for size, k in zip(target, keep, strict=True))
    drop = draw(st.integers(0, len(target) - 2))       # keep (L, S) at least
    return shape[drop:]


@st.composite
def sdpa_cases(draw, *, max_size: int = 4, policies: tuple[str, ...] = POLICIES,
               mask_kinds: tuple[str, ...] = ("none", "bool", "additive", "both"),
               causals: tuple = (None, "upper_left", "lower_right")) -> dict[str, Any]:
    """Tiny SDPA problems: GQA, E != Ev, L != S both ways, every mask kind, fully-masked rows.

    Shrinks towards one head, length 1, no mask, no causal, default scale.
    """
    batch = tuple(draw(st.lists(st.integers(1, 2), max_size=2)))
    K = draw(st.integers(1, 2))
    N = K * draw(st.integers(1, 3))
    L, S = draw(st.integers(1, max_size)), draw(st.integers(1, max_size))
    E, Ev = draw(st.integers(1, max_size)), draw(st.integers(1, max_size))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    magnitude = draw(st.sampled_from([1.0, 0.1, 3.0]))
    case: dict[str, Any] = dict(
        query=rng.normal(0, magnitude, (*batch, N, L, E)),
        key=rng.normal(0, magnitude, (*batch, K, S, E)),
        value=rng.normal(0, 1.0, (*batch, K, S, Ev)),
        attend_mask=None, additive_mask=None,
        causal=draw(st.sampled_from(causals)),
        scale=draw(st.one_of(st.none(), st.sampled_from([0.0, -0.7]),
                             st.floats(-3, 3, allow_nan=False))),
        fully_masked=draw(st.sampled_from(policies)),
    )
    target = (*batch, N, L, S)
    kind = draw(st.sampled_from(mask_kinds))
    if kind in ("bool", "both"):
        keep = draw(st.sampled_from([0.3, 0.7, 1.0]))
        mask = rng.random(_broadcast_shape(draw, rng, target)) < keep
        if draw(st.booleans()):                           # a fully-masked row by construction
            mask[..., rng.integers(mask.shape[-2]), :] = False
        case["attend_mask"] = mask
    if kind in ("additive", "both"):
        shape = _broadcast_shape(draw, rng, target)
        mask = rng.normal(0, 2.0, shape)
        blocked = rng.random(shape) < draw(st.sampled_from([0.0, 0.3]))
        mask[blocked] = -np.inf
        if draw(st.booleans()):
            mask[..., rng.integers(shape[-2]), :] = -np.inf
        case["additive_mask"] = mask
    return case


def brute_force_sdpa(query, key, value, *, attend_mask=None, additive_mask=None, causal=None,
                     scale=None, fully_masked="zero"):
    """SDPA by the definition, one scalar at a time (written independently of spec/)."""
    *batch, N, L, E = query.shape
    K, S, Ev = key.shape[-3], key.shape[-2], value.shape[-1]
    target = (*batch, N, L, S)
    attend = None if attend_mask is None else np.broadcast_to(attend_mask, target)
    additive = None if additive_mask is None else np.broadcast_to(additive_mask, target)
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    output = np.zeros((*batch, N, L, Ev))
    weights = np.zeros(target)
    logits = np.zeros(target)
    for b in np.ndindex(*batch):
        for h in range(N):
            kv_head = h // (N // K)
            for i in range(L):
                scores: list[float | None] = []
                for j in range(S):
                    dot = 0.0
                    for e in range(E):
                        dot += query[b + (h, i, e)] * key[b + (kv_head, j, e)]
                    logit = scale * dot
                    logits[b + (h, i, j)] = logit
                    allowed = True
                    if attend is not None and not attend[b + (h, i, j)]:
                        allowed = False
                    if causal == "upper_left" and j > i:
                        allowed = False
                    if causal == "lower_right" and j > i + (S - L):
                        allowed = False
                    score = logit + (0.0 if additive is None else additive[b + (h, i, j)])
                    if score == -math.inf:
                        allowed = False
                    scores.append(score if allowed else None)
                live = [s for s in scores if s is not None]
                if live:
                    top = max(live)
                    exps = [0.0 if s is None else math.exp(s - top) for s in scores]
                    row = [x / sum(exps) for x in exps]
                elif fully_masked == "zero":
                    row = [0.0] * S
                elif fully_masked == "nan":
                    row = [math.nan] * S
                else:
                    row = [1.0 / S] * S
                for j in range(S):
                    weights[b + (h, i, j)] = row[j]
                for c in range(Ev):
                    total = 0.0
                    for j in range(S):
                        total += row[j] * value[b + (kv_head, j, c)]
                    output[b + (h, i, c)] = total
    return output, weights, logits


def torch_sdpa(case, *, requires_grad: bool = False):
    """Run F.scaled_dot_product_attention on a spec case, translating the masks to torch's one mask.

    With ``requires_grad`` returns ``(output, {name: leaf tensor})`` for autograd.
    """
    import torch
    import torch.nn.functional as F

    def _t(array):
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if requires_grad and tensor.is_floating_point():
            tensor.requires_grad_(True)
            leaves[name_of[id(array)]] = tensor
        return tensor

    leaves: dict = {}
    name_of = {id(case[n]): n for n in ("query", "key", "value", "additive_mask") if case[n] is not None}
    q, k, v = _t(case["query"]), _t(case["key"]), _t(case["value"])
    N, L, S = q.shape[-3], q.shape[-2], k.shape[-2]
    attend, additive, causal = case["attend_mask"], case["additive_mask"], case["causal"]
    kwargs = dict(scale=case["scale"], enable_gqa=k.shape[-3] != N)
    # D8 (spec/README.md): torch's CPU flash kernel gives NaN for is_causal with scale <= 0,
    # so such cases go through an explicit mask; test_difference_D8 pins the bug itself.
    non_positive_scale = case["scale"] is not None and case["scale"] <= 0
    if attend is None and additive is None and causal == "upper_left" and not non_positive_scale:
        output = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
        return (output, leaves) if requires_grad else output
    mask = None
    if attend is not None and additive is None and causal is None:
        mask = torch.from_numpy(attend)                           # torch bool: True = attend
    elif attend is not None or additive is not None or causal is not None:
        mask = torch.zeros(q.shape[:-1] + (S,), dtype=torch.float64)
        if attend is not None:
            mask = mask.masked_fill(~torch.from_numpy(np.ascontiguousarray(attend)), float("-inf"))
        if causal is not None:
            diagonal = 0 if causal == "upper_left" else S - L
            allowed = torch.ones(L, S, dtype=torch.bool).tril(diagonal)
            mask = mask.masked_fill(~allowed, float("-inf"))
        if additive is not None:
            mask = mask + _t(additive)
    output = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
    return (output, leaves) if requires_grad else output


def assert_close(name: str, got, expected, *, atol: float = 1e-12, rtol: float = 1e-12,
                 call: str = "") -> float:
    """Staged comparison (shape, NaN positions, values); returns the worst abs difference."""
    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert got.shape == expected.shape, f"{name}.shape={got.shape}, but should be {expected.shape} {call}"
    nan_got, nan_expected = np.isnan(got), np.isnan(expected)
    assert (nan_got == nan_expected).all(), (
        f"{name} NaN at {np.argwhere(nan_got != nan_expected)[:3].tolist()}: got NaN where "
        f"expected={expected[nan_got != nan_expected][:3]} (or the reverse) {call}")
    finite = ~nan_got
    diff = np.abs(got[finite] - expected[finite])
    allowed = atol + rtol * np.abs(expected[finite])
    if diff.size and (diff > allowed).any():
        worst = int(np.argmax(diff - allowed))
        raise AssertionError(
            f"{name}: {(diff > allowed).sum()} of {diff.size} mismatched; worst abs diff "
            f"{diff[worst]:.3g} (got {got[finite][worst]!r}, should be {expected[finite][worst]!r}), "
            f"allowed {allowed[worst]:.3g} {call}")
    return float(diff.max()) if diff.size else 0.0


def describe_case(case: dict[str, Any]) -> str:
    parts = []
    for name, value in case.items():
        parts.append(f"{name}={value.shape if isinstance(value, np.ndarray) else value!r}")
    return "[" + ", ".join(parts) + "]"
