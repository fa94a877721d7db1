"""The triton kernels at the flash level: window, softcap, ALiBi and the LSE, forward and backward.

Runs wherever the implementation runs (Triton interpreter on CPU, compiled on CUDA).
The reference is ``flash-ref`` (implementations/builtins/references/flash_reference.py, plain
float64 PyTorch with autograd) on the same stored inputs. Sizes cross the kernel's
block edges (16-key blocks on the CPU) so a window's first and last key blocks are
partial and some blocks are skipped whole.
"""

from __future__ import annotations

import math

import pytest

import implementations.builtins.kernels.triton_attention as ta  # (before triton: see its docstring)

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]')")

import numpy as np
import torch

from implementations.builtins.references.flash_reference import flash_attn_func as reference

IMPL = ta.make_implementation()
if not IMPL.available:
    pytest.skip(f"triton implementation unavailable: {IMPL.unavailable_reason}",
                allow_module_level=True)
DEVICE = IMPL.capabilities.devices[0]
FLASH = IMPL.flash

#: max |got - reference| allowed, relative to max(1, max|reference|) (output, LSE, gradients)
TOLERANCE = {torch.float64: 1e-11, torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}

OPTIONS = {
    "plain": {},
    "causal_L_gt_S": {"causal": True},  # rows before the diagonal attend no key
    "window_both": {"window_size": (19, 5)},
    "window_left_only": {"window_size": (21, -1)},
    "window_right_only": {"window_size": (-1, 0)},
    "window_zero_causal": {"window_size": (0, 0), "causal": True},
    "softcap_below_logits": {"softcap": 0.3},
    "softcap_far_above": {"softcap": 1e4},
    "alibi_heads": {"alibi_slopes": [0.5, -0.25, 1.0, 0.125]},
    "everything": {"alibi_slopes": "batch", "causal": True, "softcap": 2.0, "window_size": (20, 3)},
}


def _inputs(dtype, *, B=2, L=37, S=53, N=4, K=2, E=12, Ev=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, dtype=torch.float64, generator=gen).to(dtype).to(DEVICE)
            for shape in ((B, L, N, E), (B, S, K, E), (B, S, K, Ev))]


def _kwargs(options, B=2, N=4):
    kwargs = dict(options)
    if kwargs.get("alibi_slopes") == "batch":
        kwargs["alibi_slopes"] = torch.linspace(-0.5, 1.0, B * N).reshape(B, N)
    elif "alibi_slopes" in kwargs:
        kwargs["alibi_slopes"] = torch.tensor(kwargs["alibi_slopes"], dtype=torch.float32)
    if "alibi_slopes" in kwargs:
        kwargs["alibi_slopes"] = kwargs["alibi_slopes"].to(DEVICE)
    return kwargs


def assert_close(got, want, dtype, what):
    __tracebackhide__ = True
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, f"{what}: shape={tuple(got.shape)}, but should be {tuple(want.shape)}"
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), f"{what}: non-finite entries differ"
    scale = max(1.0, want[finite].abs().max().item()) if finite.any() else 1.0
    err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    assert err <= TOLERANCE[dtype] * scale, (
        f"{what}: max |error|={err:.3g}, but should be <= {TOLERANCE[dtype] * scale:.3g}")


def _lse_minus_inf(lse):
    return torch.where(torch.isposinf(lse), torch.full_like(lse, -math.inf), lse)


@pytest.mark.parametrize("name", sorted(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_forward_and_lse_match_flash_ref(name, dtype):
    L = 53 if name == "causal_L_gt_S" else 37
    S = 30 if name == "causal_L_gt_S" else 53
    q, k, v = _inputs(dtype, L=L, S=S)
    kwargs = _kwargs(OPTIONS[name])
    out, lse, probs = FLASH(q, k, v, return_attn_probs=True, **kwargs)
    want_out, want_lse, _ = reference(q.cpu().double(), k.cpu().double(), v.cpu().double(),
                                      return_attn_probs=True, **{key: (val.cpu() if torch.is_tensor(val) else val)
                                                                 for key, val in kwargs.items()})
    assert probs is None and out.dtype == dtype and out.is_contiguous()
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close(out, want_out, dtype, f"output [{name}]")
    assert_close(_lse_minus_inf(lse), want_lse, dtype, f"softmax_lse [{name}]")
    assert torch.equal(FLASH(q, k, v, **kwargs), out), "the output must not depend on return_attn_probs"


@pytest.mark.parametrize("name", sorted(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=lambda d: str(d).removeprefix("torch."))
def test_gradients_match_flash_ref(name, dtype):
    L = 53 if name == "causal_L_gt_S" else 37
    S = 30 if name == "causal_L_gt_S" else 53
    inputs = _inputs(dtype, L=L, S=S, seed=1)
    kwargs = _kwargs(OPTIONS[name])
    results = []
    for fn, device in ((FLASH, DEVICE), (reference, "cpu")):
        leaves = [t.detach().to(device).double().to(dtype if fn is FLASH else torch.float64).requires_grad_(True)
                  for t in inputs]
        out = fn(*leaves, **{key: (val.to(device) if torch.is_tensor(val) else val) for key, val in kwargs.items()})
        upstream = torch.linspace(-1.0, 1.0, out.numel(), dtype=torch.float64).reshape(out.shape)
        results.append(torch.autograd.grad(out, leaves, upstream.to(out.dtype).to(device)))
    for got, want, what in zip(*results, ("dq", "dk", "dv"), strict=True):
        assert_close(got, want, dtype, f"{what} [{name}]")


def test_window_sides_at_least_L_plus_S_are_unbounded():
    q, k, v = _inputs(torch.float64)
    L, S = q.shape[1], k.shape[1]
    for wide, unbounded in (((L + S, 4), (-1, 4)), ((3, 10**12), (3, -1))):
        assert torch.equal(FLASH(q, k, v, window_size=wide), FLASH(q, k, v, window_size=unbounded)), wide


def test_tanh_keeps_precision_near_zero_and_saturates():
    """The interpreter's tanh (expm1 by Kahan's ratio): relative error of a few ulps at
    |x| = 1e-30 .. 1e3, exactly +-1 far out, odd; a naive 1 - 2/(e^2x + 1) fails near 0."""
    x = np.concatenate([-np.logspace(-30, 3, 400), np.logspace(-30, 3, 400), [0.0]])
    for dtype, ulps in ((torch.float64, 4), (torch.float32, 4)):
        q = torch.tensor(x, dtype=dtype, device=DEVICE).reshape(-1, 1, 1, 1)  # L = len(x) rows
        eps = torch.finfo(dtype).eps
        # softcap c = 1, scale 1, E = 1, one key of value 1: the output is v = 1 and the
        # LSE is the capped score tanh(x), so the LSE reads the kernel's tanh back
        k = torch.ones(1, 1, 1, 1, dtype=dtype, device=DEVICE)
        _, lse, _ = FLASH(q.transpose(0, 1), k, k, softmax_scale=1.0, softcap=1.0, return_attn_probs=True)
        got = lse.reshape(-1).double().cpu()
        want = torch.tanh(torch.tensor(x, dtype=dtype).double())
        rel = ((got - want).abs() / want.abs().clamp_min(1e-300)).max().item()
        assert rel <= ulps * eps, f"{dtype}: tanh relative error={rel:.3g}, but should be <= {ulps * eps:.3g}"


def test_planted_window_bug_is_wrong_on_the_left_edge_only():
    mutant = ta.make_implementation(planted_bug="window_left_off_by_one")
    q, k, v = _inputs(torch.float64)
    want = FLASH(q, k, v, window_size=(4, 0))
    assert not torch.allclose(mutant.flash(q, k, v, window_size=(4, 0)), want)
    assert torch.equal(mutant.flash(q, k, v, window_size=(-1, 0)), FLASH(q, k, v, window_size=(-1, 0)))


@pytest.mark.parametrize("call,match", [
    (lambda q, k, v: FLASH(q, k, v, window_size=(-2, 0)), "window_size"),
    (lambda q, k, v: FLASH(q, k, v, softcap=-1.0), "softcap"),
    (lambda q, k, v: FLASH(q, k, v, softcap=math.inf), "softcap"),
    (lambda q, k, v: FLASH(q, k, v, dropout_p=0.1), "dropout"),
    (lambda q, k, v: FLASH(q, k, v, alibi_slopes=torch.ones(3)), "alibi_slopes"),
    (lambda q, k, v: FLASH(q[0], k[0], v[0]), "4-D"),
    (lambda q, k, v: FLASH(q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1)), "GQA"),
], ids=["window", "softcap_negative", "softcap_inf", "dropout", "alibi_shape", "rank", "gqa"])
def test_invalid_calls_raise(call, match):
    q, k, v = _inputs(torch.float32)
    with pytest.raises(ValueError, match=match):
        call(q, k, v)


def test_flash_capabilities_are_declared():
    caps = IMPL.caps("flash")
    assert caps.causal == "lower_right" and caps.mask_kinds == frozenset({"none"})
    assert caps.flash_features == frozenset({"window", "softcap", "alibi", "lse"})
    assert caps.autograd and caps.gqa and caps.different_v_dim and not caps.dropout
    assert IMPL.capabilities.causal == "upper_left" and IMPL.sdpa is not None  # the SDPA level as before
