"""The triton backward kernels (dQ, dK, dV) against float64 autograd of a reference.

Runs wherever the implementation runs (Triton interpreter on CPU, compiled on CUDA).
The reference is the spec's SDPA written in float64 torch (fully-masked rows -> 0, so
they contribute no gradient); its gradients come from torch.autograd. Inputs of every
dtype are drawn in float64 and rounded once; the reference sees the stored values.
"""

from __future__ import annotations

import math

import pytest

import implementations.builtins.kernels.triton_attention as ta  # (before triton: see its docstring)

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]')")

import torch  # noqa: E402

IMPL = ta.make_implementation()
if not IMPL.available:
    pytest.skip(f"triton implementation unavailable: {IMPL.unavailable_reason}",
                allow_module_level=True)
DEVICE = IMPL.capabilities.devices[0]
UL, LR = "upper_left", "lower_right"

#: max |got - reference| allowed, relative to max(1, max|reference|), per gradient
TOLERANCE = {torch.float64: 1e-11, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}


def reference(q, k, v, mask=None, causal=None, scale=None):
    N, K = q.shape[-3] if q.dim() >= 3 else 1, k.shape[-3] if k.dim() >= 3 else 1
    if N != K:
        k = k.repeat_interleave(N // K, dim=-3)
        v = v.repeat_interleave(N // K, dim=-3)
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    scores = scale * (q @ k.transpose(-2, -1))
    visible = torch.ones(L, S, dtype=torch.bool, device=q.device)
    if causal is not None:
        visible = torch.ones(L, S, device=q.device).tril(0 if causal == UL else S - L).bool()
    if mask is not None and mask.dtype == torch.bool:
        visible = visible & mask.to(q.device)
    elif mask is not None:
        scores = scores + mask.to(q.device).double()
    scores = scores.masked_fill(~visible.expand_as(scores), float("-inf"))
    fully_masked = (scores == float("-inf")).all(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(fully_masked, 0.0), dim=-1).masked_fill(fully_masked, 0.0)
    return weights @ v


def _case(B=2, N=3, K=None, L=33, S=49, E=20, Ev=12, dtype=torch.float32, mask=None, causal=None,
          scale=None, layout="contiguous", seed=0):
    K = N if K is None else K
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=gen).to(dtype)

    q, k, v = draw(B, N, L, E), draw(B, K, S, E), draw(B, K, S, Ev)
    m = None
    if mask == "bool":
        m = torch.rand(L, S, generator=gen) > 0.4
        m[::4] = False  # fully-masked rows
    elif mask == "additive":
        m = torch.randn(B, 1, L, S, dtype=torch.float64, generator=gen)
        m = m.masked_fill(torch.rand(B, 1, L, S, generator=gen) < 0.2, float("-inf")).to(dtype)
    grad_out = draw(B, N, L, Ev)
    return dict(q=q, k=k, v=v, mask=m, causal=causal, scale=scale, grad_out=grad_out, layout=layout)


def _leaves(case):
    """Leaf tensors on DEVICE and the (possibly re-laid-out) tensors fed to sdpa."""
    leaves = [t.clone().to(DEVICE).requires_grad_(True) for t in (case["q"], case["k"], case["v"])]
    fed = list(leaves)
    if case["layout"] == "transposed":
        fed = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in leaves]
    return leaves, fed


def _check(case, impl=IMPL, what=""):
    leaves, fed = _leaves(case)
    mask = None if case["mask"] is None else case["mask"].to(DEVICE)
    out = impl.sdpa(*fed, attn_mask=mask, is_causal=case["causal"] is not None, scale=case["scale"],
                    enable_gqa=fed[0].shape[-3] != fed[1].shape[-3])
    grads = torch.autograd.grad(out, leaves, case["grad_out"].to(DEVICE))
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (case["q"], case["k"], case["v"])]
    ref_out = reference(*ref_leaves, case["mask"], case["causal"], case["scale"])
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, case["grad_out"].double())
    dtype = case["q"].dtype
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert got.shape == want.shape and got.dtype == dtype, f"{name}: {got.shape} {got.dtype} [{what}]"
        assert torch.isfinite(got).all(), f"{name} has NaN/inf [{what}]"
        err = (got.double().cpu() - want).abs().max().item()
        allowed = TOLERANCE[dtype] * max(1.0, want.abs().max().item())
        assert err <= allowed, f"{name}: max abs error={err:.3g}, but should be <= {allowed:.3g} [{what}]"


CASES = {
    "basic": dict(),
    "E_ne_Ev_ragged": dict(L=17, S=65, E=7, Ev=29),
    "L_gt_S": dict(L=65, S=17),
    "L1_S1": dict(L=1, S=1, E=1, Ev=1),
    "causal_UL_L_lt_S": dict(L=17, S=49, causal=UL),
    "causal_UL_L_gt_S": dict(L=49, S=17, causal=UL),
    "causal_LR_L_lt_S": dict(L=17, S=49, causal=LR),
    "causal_LR_L_gt_S": dict(L=49, S=17, causal=LR),  # fully-masked rows
    "bool_fully_masked_rows": dict(mask="bool"),
    "additive_neg_inf_causal": dict(mask="additive", causal=UL),
    "scale_negative": dict(scale=-0.6),
    "gqa_4_2": dict(N=4, K=2),
    "gqa_6_3_causal_mask": dict(N=6, K=3, L=17, S=33, causal=LR, mask="bool"),
    "transposed": dict(layout="transposed", L=33, S=17),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients_match_reference(name):
    params = dict(CASES[name])
    impl = ta.make_implementation(causal_alignment=LR) if params.get("causal") == LR else IMPL
    _check(_case(**params), impl=impl, what=name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16],
                         ids=["float64", "float32", "float16", "bfloat16"])
def test_gradients_every_dtype(dtype):
    _check(_case(dtype=dtype, N=4, K=2, causal=UL, mask="additive"), what=str(dtype))


def test_gradients_through_stride0_expanded_kv():
    """K/V expanded over batch and heads: autograd sums the dense dK/dV back."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 17, 8, generator=gen).to(DEVICE).requires_grad_(True)
    k0 = torch.randn(1, 1, 33, 8, generator=gen).to(DEVICE).requires_grad_(True)
    v0 = torch.randn(1, 1, 33, 8, generator=gen).to(DEVICE).requires_grad_(True)
    g = torch.randn(2, 4, 17, 8, generator=gen).to(DEVICE)
    out = IMPL.sdpa(q, k0.expand(2, 4, 33, 8), v0.expand(2, 4, 33, 8))
    grads = torch.autograd.grad(out, (q, k0, v0), g)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k0, v0)]
    ref = reference(leaves[0], leaves[1].expand(2, 4, 33, 8), leaves[2].expand(2, 4, 33, 8))
    ref_grads = torch.autograd.grad(ref, leaves, g.double())
    for got, want in zip(grads, ref_grads, strict=True):
        assert (got.double() - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())


def test_gradients_3d_inputs():
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, n, 8, generator=gen).to(DEVICE).requires_grad_(True) for n in (17, 33, 33))
    out = IMPL.sdpa(q, k, v, is_causal=True)
    out.sum().backward()
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    reference(*leaves, causal=UL).sum().backward()
    for got, want in zip((q, k, v), leaves, strict=True):
        assert (got.grad.double() - want.grad).abs().max().item() <= 1e-4 * max(1.0, want.grad.abs().max().item())


@pytest.mark.parametrize("seed", [1, 2])
def test_gradients_with_scores_near_1e9_are_finite_and_agree_with_math(seed, large_logit_heads):
    """|scores| near 1e9 (the wide_range regime): an ulp of 64 in float32, so the backward
    must recompute the forward's scores bit for bit (recomputed by a transposed dot they
    rounded differently and exp(s - lse) overflowed: dK and dV NaN or inf at L = 4,
    S = 12, E = 2 for these seeds). Reference: the MATH backend in float32 (it keeps the
    forward's weights); each head's gradients within 10% of its largest value (+1)."""
    from implementations import registry

    *inputs, grad_out = large_logit_heads(torch.float32, 4, 12, seed=seed)

    def grads(impl):
        leaves = [t.clone().to(DEVICE).requires_grad_(True) for t in inputs]
        out = impl.sdpa(*leaves)
        return [g.double().cpu() for g in torch.autograd.grad(out, leaves, grad_out.to(DEVICE))]

    got, want = grads(IMPL), grads(registry.resolve("sdpa-math"))
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert torch.isfinite(w).all()
        assert torch.isfinite(g).all(), f"{name} has NaN/inf: {int((~torch.isfinite(g)).sum())} elements"
        scale = w.abs().amax(dim=(2, 3), keepdim=True) + 1.0
        worst = ((g - w).abs() / scale).max().item()
        assert worst <= 0.1, f"{name}: max error {worst:.3g} of the head's largest value + 1, but should be <= 0.1"
