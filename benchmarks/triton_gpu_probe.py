"""The triton kernel on a CUDA device, case by case, each in a process of its own.

    python benchmarks/triton_gpu_probe.py --out probe.md [--jobs 12] [--sanitize]

A CUDA fault (an illegal address, a misaligned access) breaks the process's CUDA
context, so every later call fails too and the first fault cannot be told from its
echoes. Here each case runs in a fresh ``python this.py --child CASE VARIANT``
process with ``CUDA_LAUNCH_BLOCKING=1`` (the fault is reported by the launch that made
it), and prints the forward and gradient errors against a float64 reference on the
CPU. Each case also runs under launch-configuration variants (``native`` as shipped;
``upcast``: 16-bit operands upcast to float32 before the dots; ``stages1``: no
software pipelining; ``small``: 32 x 32 tiles), so a wrong result can be traced to
the configuration that makes it. ``--sanitize`` reruns each faulting case under
``compute-sanitizer --tool memcheck`` and keeps the head of its report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

#: name -> (dtype, B, N, K, L, S, E, Ev, mask, causal)
CASES = {
    "f16 plain": ("float16", 2, 3, 3, 33, 49, 20, 12, None, False),
    "f16 causal": ("float16", 2, 3, 3, 33, 49, 20, 12, None, True),
    "f16 gqa": ("float16", 2, 4, 2, 33, 49, 20, 12, None, False),
    "f16 additive": ("float16", 2, 3, 3, 33, 49, 20, 12, "additive", False),
    "f16 additive -inf": ("float16", 2, 3, 3, 33, 49, 20, 12, "additive_inf", False),
    "f16 bool fully-masked rows": ("float16", 2, 3, 3, 33, 49, 20, 12, "bool", False),
    "f16 gqa causal additive -inf": ("float16", 2, 4, 2, 33, 49, 20, 12, "additive_inf", True),
    "bf16 gqa causal additive -inf": ("bfloat16", 2, 4, 2, 33, 49, 20, 12, "additive_inf", True),
    "f16 E=Ev=64 L=S=256": ("float16", 2, 4, 4, 256, 256, 64, 64, None, False),
    "f16 E=Ev=128 causal L=S=300": ("float16", 1, 2, 2, 300, 300, 128, 128, None, True),
    "f16 tiny L=1 S=2 E=4": ("float16", 1, 1, 1, 1, 2, 4, 4, None, False),
    "f16 tiny bool L=3 S=2": ("float16", 1, 1, 1, 3, 2, 4, 4, "bool", False),
    "f32 gqa causal additive -inf": ("float32", 2, 4, 2, 33, 49, 20, 12, "additive_inf", True),
    "f32 bool fully-masked rows": ("float32", 2, 3, 3, 33, 49, 20, 12, "bool", False),
    "f64 gqa causal additive -inf": ("float64", 2, 4, 2, 33, 49, 20, 12, "additive_inf", True),
}
VARIANTS = ("native", "upcast", "stages1", "small")


def _child(case_name: str, variant: str, device: str) -> dict:
    import torch

    import implementations.builtins.kernels.triton_attention as ta

    if variant != "native":
        def patch(original):
            def config(dtype, E, Ev, *, gpu):
                cfg = original(dtype, E, Ev, gpu=gpu)
                if variant == "upcast":
                    return dataclasses.replace(cfg, native_dot=False)
                if variant == "stages1":
                    return dataclasses.replace(cfg, num_stages=1)
                return dataclasses.replace(cfg, block_m=32, block_n=32, num_stages=1)
            return config
        ta.kernel_config = patch(ta.kernel_config)
        ta.backward_config = patch(ta.backward_config)

    dtype_name, B, N, K, L, S, E, Ev, mask_kind, causal = CASES[case_name]
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    q64, k64, v64 = (torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).double()
                     for shape in ((B, N, L, E), (B, K, S, E), (B, K, S, Ev)))
    do64 = torch.randn(B, N, L, Ev, generator=g, dtype=torch.float64).to(dtype).double()
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(L, S, generator=g) > 0.4
        mask[::4] = False
    elif mask_kind and mask_kind.startswith("additive"):
        mask = torch.randn(B, 1, L, S, generator=g, dtype=torch.float64)
        if mask_kind == "additive_inf":
            mask = mask.masked_fill(torch.rand(B, 1, L, S, generator=g) < 0.2, float("-inf"))
        mask = mask.to(dtype).double()

    def reference():
        q, k, v = (t.clone().requires_grad_() for t in (q64, k64, v64))
        kk, vv = k.repeat_interleave(N // K, -3), v.repeat_interleave(N // K, -3)
        s = (q @ kk.transpose(-2, -1)) / (E ** 0.5)
        visible = torch.ones(L, S, dtype=torch.bool)
        if causal:
            visible = visible.tril()
        if mask is not None and mask.dtype == torch.bool:
            visible = visible & mask
        elif mask is not None:
            s = s + mask
        s = s.masked_fill(~visible, float("-inf"))
        empty = (s == float("-inf")).all(-1, keepdim=True)
        w = torch.softmax(s.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
        out = w @ vv
        out.backward(do64)
        return out.detach(), q.grad, k.grad, v.grad

    want = reference()
    impl = ta.make_implementation()
    q, k, v = (t.to(device, dtype).requires_grad_() for t in (q64, k64, v64))
    m = None if mask is None else (mask.to(device) if mask.dtype == torch.bool else mask.to(device, dtype))
    result = {}
    try:
        out = impl.sdpa(q, k, v, attn_mask=m, is_causal=causal, enable_gqa=N != K)
        if device == "cuda":
            torch.cuda.synchronize()
        result["out"] = (out.double().cpu() - want[0]).abs().max().item()
        grads = torch.autograd.grad(out, (q, k, v), do64.to(device, dtype))
        if device == "cuda":
            torch.cuda.synchronize()
        for name, got, ref in zip(("dq", "dk", "dv"), grads, want[1:], strict=True):
            result[name] = (got.double().cpu() - ref).abs().nan_to_num(nan=float("inf")).max().item()
    except Exception as exc:  # noqa: BLE001 - the fault is the measurement
        result["error"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:160]
    return result


def _run(case_name: str, variant: str, sanitize: bool, device: str) -> dict:
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", TRITON_INTERPRET="0" if device == "cuda" else "1")
    cmd = [sys.executable, __file__, "--child", case_name, variant, "--device", device]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 180 s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(lines[-1][7:]) if lines else {"error": f"exit {proc.returncode}: {proc.stderr[-300:]}"}
    fault = any(word in result.get("error", "") for word in ("illegal", "misaligned", "CUDA error"))
    if fault and sanitize and shutil.which("compute-sanitizer"):
        try:
            san = subprocess.run(["compute-sanitizer", "--tool", "memcheck", *cmd], capture_output=True,
                                 text=True, env=env, timeout=240)
            result["sanitizer"] = "\n".join(san.stdout.splitlines()[:40])
        except subprocess.TimeoutExpired:
            result["sanitizer"] = "compute-sanitizer timed out after 240 s"
    return result


def _cell(result: dict) -> str:
    if "error" in result:
        return "ERR " + result["error"].replace("|", "/")[:90]
    return " ".join(f"{k}={result[k]:.1e}" for k in ("out", "dq", "dk", "dv") if k in result)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=2, metavar=("CASE", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--sanitize", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu: the interpreter (a smoke test of this script)")
    parser.add_argument("--only", help="cases whose name contains this")
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(_child(*args.child, args.device)), flush=True)
        return 0
    jobs = [(c, v) for c in CASES for v in VARIANTS
            if (v == "native" or not c.startswith(("f32", "f64"))) and (not args.only or args.only in c)]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = dict(zip(jobs, pool.map(lambda job: _run(*job, args.sanitize, args.device), jobs), strict=True))
    lines = ["# triton kernel on CUDA, case by case (errors: max abs vs float64 reference)", "",
             "| case | " + " | ".join(VARIANTS) + " |", "| --- |" + " --- |" * len(VARIANTS)]
    for case in CASES:
        lines.append(f"| {case} | " + " | ".join(_cell(results[(case, v)]) if (case, v) in results else ""
                                                  for v in VARIANTS) + " |")
    for (case, variant), result in results.items():
        if "sanitizer" in result:
            lines += ["", f"## compute-sanitizer: {case} / {variant}", "", "```", result["sanitizer"], "```"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
