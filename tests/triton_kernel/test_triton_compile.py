"""Every kernel variant the triton implementation launches on a GPU builds for sm_80 and sm_90.

No GPU is needed: ``triton.compile`` runs the whole NVIDIA pipeline (TTIR -> TTGIR ->
LLIR -> PTX -> cubin, with the ptxas bundled in the triton wheel) for an explicit
``GPUTarget``. So a variant the Hopper or Ampere compiler would reject (a 16-bit dot
with a dim < 16, a non-power-of-2 ``tl.arange``, a type error only the compiler sees)
fails here, even though the CPU tests run the same kernel under the interpreter.

Each variant is built from a real launch: ``plan_launch(..., gpu=True)`` turns CPU
tensors into exactly the arguments, constexprs, num_warps and num_stages a CUDA call
would pass, and Triton's own binder (``create_function_from_signature`` +
``JITFunction._pack_args``, triton 3.9) derives the signature dict (``{"Q": "*fp16",
..., "BLOCK_M": "constexpr"}``), the constexprs (keyed by ``(arg_index,)``) and the
divisibility attrs, as ``JITFunction.run`` would on a device. Then
``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(...))``.

The builds run in one subprocess per target (this file run as a script) with
``TRITON_INTERPRET=0``: a process where the interpreter is on (as it is for the CPU
forward tests, see docs/TRITON.md) cannot compile for a GPU,
because triton.language's helpers were decorated as interpreted functions.

Variants. Full matrix (``ATTN_TRITON_COMPILE_ALL=1``; 65 variants, 187 builds per
target with the two backward kernels): dtype (float64/32/16, bfloat16) x mask kind
(none/bool/additive) x causal at E = Ev = 64; every head-dim block size (16..256, and
E != Ev including the extremes 16/256) with causal + additive mask; a strided/GQA/
lower-right launch (non-unit last stride and a runtime GROUP change the integer
specialisation); the two planted forward bugs; the flash level's window / softcap /
ALiBi switches in FlashAttention's layout and its planted window bug
(``_flash_variants``). Forward, dK/dV and dQ kernels each.
Default: a core subset (31 variants, 73 builds per target) that still reaches every
constexpr branch, every GPU tile family of the forward and backward configs and the
head-dim extremes once per dtype. Beyond "it builds", each kernel must fit the
target's shared memory, float32 must not use TF32, 16-bit dots must reach tensor-core
mma, and the scale and softcap must arrive as f64 (float64 keeps a float64 scale).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch  # noqa: E402

import implementations.builtins.kernels.triton_attention as ta  # noqa: E402
from conformance.core.tensors import dtype_of  # noqa: E402
from implementations.base import ALL_DTYPES  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]')")

#: target name -> (GPUTarget, max dynamic shared memory per block in bytes)
TARGETS = {
    "sm80": (("cuda", 80, 32), 163 * 1024),   # A100
    "sm90": (("cuda", 90, 32), 227 * 1024),   # H100 / H200
}
#: dtype name -> torch dtype (the suite's one map, conformance.core.tensors.dtype_of).
DTYPES = {name: dtype_of(name) for name in ALL_DTYPES}


def _all_variants():
    out = []
    for dtype in ALL_DTYPES:
        for mask_kind in ("none", "bool", "additive"):
            for causal in (False, True):
                out.append(dict(dtype=dtype, E=64, Ev=64, mask=mask_kind, causal=causal, bwd=True))
        for E, Ev in ((16, 16), (32, 32), (128, 128), (256, 256), (40, 72), (16, 256), (256, 16)):
            out.append(dict(dtype=dtype, E=E, Ev=Ev, mask="additive", causal=True, bwd=True))
        out.append(dict(dtype=dtype, E=48, Ev=48, mask="bool", causal=True, layout="strided",
                        alignment="lower_right", bwd=True))
    for bug in ("drop_ragged_block", "no_rescale"):
        out.append(dict(dtype="float16", E=64, Ev=64, mask="none", causal=False, bug=bug))
    return out + _flash_variants()


def _flash_variants():
    """The flash level's switches (WINDOW_LEFT, SOFTCAP with libdevice tanh, ALIBI) all on
    once per dtype with causal, forward and both backward kernels; a right-only window
    with softcap (CAUSAL from the window, no left edge), also backward; a left-only
    window; the planted window bug. FlashAttention's layout (B, L, N, E) with GQA, so
    the strides are those of a real flash call."""
    out = [dict(dtype=dtype, E=64, Ev=64, mask="none", causal=True, bwd=True,
                flash=dict(window=(7, 0), softcap=30.0, alibi=True))
           for dtype in ALL_DTYPES]
    out.append(dict(dtype="bfloat16", E=128, Ev=128, mask="none", causal=False, bwd=True,
                    flash=dict(window=(-1, 5), softcap=1.5)))
    out.append(dict(dtype="float32", E=32, Ev=32, mask="none", causal=False, flash=dict(window=(9, -1))))
    out.append(dict(dtype="float16", E=64, Ev=64, mask="none", causal=False, flash=dict(window=(3, 3)),
                    bug="window_left_off_by_one"))
    return out


def _core_variants():
    """Every constexpr branch, every GPU tile family and head-dim extreme, once per dtype."""
    out = []
    for dtype in ALL_DTYPES:
        out.append(dict(dtype=dtype, E=64, Ev=64, mask="none", causal=False))
        for E, Ev in ((64, 64), (128, 128), (256, 256)):
            out.append(dict(dtype=dtype, E=E, Ev=Ev, mask="additive", causal=True, bwd=True))
        out.append(dict(dtype=dtype, E=48, Ev=48, mask="bool", causal=True, layout="strided",
                        alignment="lower_right", bwd=True))
    for dtype in ("float16", "float32"):
        out.append(dict(dtype=dtype, E=16, Ev=256, mask="additive", causal=True))
    for bug in ("drop_ragged_block", "no_rescale"):
        out.append(dict(dtype="float16", E=64, Ev=64, mask="none", causal=False, bug=bug))
    return out + _flash_variants()


#: ATTN_TRITON_COMPILE_ALL=1 compiles the full matrix (374 builds); the default core
#: set (146 builds) reaches every constexpr branch and tile family.
FULL_MATRIX = os.environ.get("ATTN_TRITON_COMPILE_ALL", "") == "1"

VARIANTS = _all_variants() if FULL_MATRIX else _core_variants()


def _variant_id(v) -> str:
    parts = [v["dtype"], f"E{v['E']}", f"Ev{v['Ev']}", v["mask"], "causal" if v["causal"] else "full"]
    parts += [v[k] for k in ("layout", "alignment", "bug") if k in v]
    if "flash" in v:
        flash = v["flash"]
        parts.append("flash")
        parts += [f"window{flash['window'][0]}_{flash['window'][1]}"] if "window" in flash else []
        parts += [f"softcap{flash['softcap']:g}"] if flash.get("softcap") else []
        parts += ["alibi"] if flash.get("alibi") else []
    return "-".join(parts)


def _plan(v):
    """CPU tensors shaped like a GPU call of this variant -> ta.plan_launch(gpu=True)."""
    dtype = dtype_of(v["dtype"])
    B, N, L, S = 2, 4, 100, 90
    E, Ev = v["E"], v["Ev"]
    if "flash" in v:  # flash_attn_func's (B, L, N, E) layout, GQA, bottom-right alignment
        flash = v["flash"]
        q = torch.randn(B, L, N, E, dtype=dtype).transpose(1, 2)
        k = torch.randn(B, S, 2, E, dtype=dtype).transpose(1, 2)
        v_ = torch.randn(B, S, 2, Ev, dtype=dtype).transpose(1, 2)
        slopes = torch.rand(N) if flash.get("alibi") else None
        return ta.plan_launch(q, k, v_, None, v["causal"], None, causal_alignment="lower_right",
                              planted_bug=v.get("bug"), gpu=True, window=flash.get("window", (-1, -1)),
                              softcap=flash.get("softcap", 0.0), alibi_slopes=slopes)
    if v.get("layout") == "strided":
        K = 2  # GQA: GROUP = 2 is a runtime int, not the constexpr 1
        q = torch.randn(B, N, L, 2 * E, dtype=dtype)[..., ::2]
        k = torch.randn(B, S, K, 2 * E, dtype=dtype).transpose(1, 2)[..., ::2]
        v_ = torch.randn(B, 1, S, Ev, dtype=dtype).expand(B, K, S, Ev)
    else:
        q = torch.randn(B, N, L, E, dtype=dtype)
        k = torch.randn(B, N, S, E, dtype=dtype)
        v_ = torch.randn(B, N, S, Ev, dtype=dtype)
    mask = None
    if v["mask"] == "bool":
        mask = torch.rand(L, S) > 0.2
    elif v["mask"] == "additive":
        mask = torch.randn(B, 1, L, S, dtype=dtype)
    return ta.plan_launch(q, k, v_, mask, v["causal"], None,
                          causal_alignment=v.get("alignment", "upper_left"),
                          planted_bug=v.get("bug"), gpu=True)


def _kernels(v) -> list[str]:
    return ["fwd", "bwd-dkdv", "bwd-dq"] if v.get("bwd") else ["fwd"]


def _launches(v) -> dict[str, tuple]:
    """kernel key -> (kernel attribute of ta, args, constexprs, num_warps, num_stages)."""
    plan = _plan(v)
    out = {"fwd": ("_attn_fwd_kernel", plan.args, plan.constexprs, plan.num_warps, plan.num_stages)}
    if v.get("bwd"):
        grad_out = torch.randn(plan.out_shape, dtype=plan.out_dtype)
        launches, *_ = ta.plan_backward(plan, grad_out, grad_out)
        for launch in launches:
            out[f"bwd-{launch.kernel}"] = (ta._BACKWARD_KERNELS[launch.kernel], launch.args,
                                           launch.constexprs, launch.num_warps, launch.num_stages)
    return out


def _compile_all(target_name: str) -> dict[str, dict]:
    """Worker side (TRITON_INTERPRET=0): build every variant for one target."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target = GPUTarget(*TARGETS[target_name][0])
    backend = make_backend(target)
    binders = {}
    results = {}
    for variant in VARIANTS:
        try:
            launches = _launches(variant)
        except Exception as exc:  # reported per variant by the test
            for key in _kernels(variant):
                results[f"{_variant_id(variant)}:{key}"] = {"ok": False, "error": repr(exc)}
            continue
        for key, (attr, args, constexprs_in, num_warps, num_stages) in launches.items():
            start = time.perf_counter()
            row = {"ok": False}
            try:
                kernel = getattr(ta, attr)
                assert isinstance(kernel, JITFunction), f"worker kernel is {type(kernel).__name__}"
                if attr not in binders:
                    binders[attr] = create_function_from_signature(kernel.signature, kernel.params, backend)
                kwargs = dict(constexprs_in, num_warps=num_warps, num_stages=num_stages)
                bound, specialization, options = binders[attr](*args, **kwargs)
                options, signature, constexprs, attrs = kernel._pack_args(
                    backend, kwargs, bound, specialization, options)
                src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
                built = triton.compile(src, target=target, options=options.__dict__)
                ptx = built.asm["ptx"]
                row.update(ok=True, cubin_bytes=len(built.asm.get("cubin") or b""),
                           shared=built.metadata.shared, tf32="tf32" in ptx, mma="mma" in ptx,
                           scale_type=signature["scale"], softcap_type=signature.get("softcap"),
                           native_dot=constexprs_in["NATIVE_DOT"],
                           config=f"{constexprs_in} warps={num_warps} stages={num_stages}")
            except Exception as exc:  # reported per variant by the test
                row["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
            row["seconds"] = round(time.perf_counter() - start, 2)
            results[f"{_variant_id(variant)}:{key}"] = row
    return results


@pytest.fixture(scope="module")
def builds() -> dict[str, dict[str, dict]]:
    """Compile every variant for every target, one subprocess per target, in parallel."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    procs = {name: subprocess.Popen([sys.executable, __file__, name], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in TARGETS}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=1800)
        assert proc.returncode == 0, f"compile worker for {name} failed:\n{stderr[-4000:]}"
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("target_name", sorted(TARGETS))
@pytest.mark.parametrize("variant,kernel", [(v, k) for v in VARIANTS for k in _kernels(v)],
                         ids=[f"{_variant_id(v)}:{k}" for v in VARIANTS for k in _kernels(v)])
def test_kernel_variant_builds(builds, variant, kernel, target_name):
    row = builds[target_name][f"{_variant_id(variant)}:{kernel}"]
    where = f"[{_variant_id(variant)}:{kernel} on {target_name}]"
    assert row["ok"], f"compile failed {where}: {row.get('error')}"
    assert row["cubin_bytes"] > 0, f"no cubin {where}"
    smem_limit = TARGETS[target_name][1]
    assert row["shared"] <= smem_limit, (
        f"shared memory={row['shared']} bytes, but should be <= {smem_limit} {where} "
        f"[{row['config']}]")
    if variant["dtype"] == "float32":
        assert not row["tf32"], f"float32 dots must be IEEE, not TF32 {where}"
    assert row["scale_type"] == "fp64", f"scale passed as {row['scale_type']} {where}"
    assert row["softcap_type"] == "fp64", f"softcap passed as {row['softcap_type']} {where}"
    if variant["dtype"] in ("float16", "bfloat16"):
        assert row["native_dot"], f"16-bit GPU launches should use native dots {where}"
        assert row["mma"], f"16-bit dots should lower to tensor-core mma {where}"


CONFIGS = {"forward": ta.kernel_config, "backward": ta.backward_config}


@pytest.mark.parametrize("which", sorted(CONFIGS))
@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_every_config_has_legal_dot_shapes(dtype, gpu, which):
    """Powers of 2 (tl.arange) and >= 16 (NVIDIA 16-bit dots) for every head dim."""
    for E in range(0, ta.MAX_HEAD_DIM + 1):
        for Ev in (E, 1, ta.MAX_HEAD_DIM):
            cfg = CONFIGS[which](dtype, E, Ev, gpu=gpu)
            for name in ("block_m", "block_n", "block_e", "block_ev"):
                size = getattr(cfg, name)
                assert size >= 16 and size & (size - 1) == 0, f"{name}={size} for E={E}, Ev={Ev}"
            assert cfg.block_e >= E and cfg.block_ev >= Ev
            assert cfg.block_e in (16, 32, 64, 128, 256) and cfg.block_ev in (16, 32, 64, 128, 256)


def _family(cfg):
    return (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.native_dot)


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_variants_cover_every_gpu_config(which):
    """Every GPU tile family (tiles, warps, stages, dot mode) of every dtype is compiled."""
    compiled = {(v["dtype"], _family(CONFIGS[which](dtype_of(v["dtype"]), v["E"], v["Ev"], gpu=True)))
                for v in VARIANTS if which == "forward" or v.get("bwd")}
    for name, dtype in DTYPES.items():
        for E in range(1, ta.MAX_HEAD_DIM + 1):
            for Ev in (E, 16, ta.MAX_HEAD_DIM):
                cfg = CONFIGS[which](dtype, E, Ev, gpu=True)
                assert (name, _family(cfg)) in compiled, f"{which} {name} E={E} Ev={Ev}: {cfg} never compiled"


if __name__ == "__main__":  # compile worker: python test_triton_compile.py sm80|sm90
    print(json.dumps(_compile_all(sys.argv[1])))
