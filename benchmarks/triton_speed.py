"""Forward speed of the triton kernel against torch SDPA's flash and efficient backends.

    python benchmarks/triton_speed.py                 # CUDA: L=S in {512, 2048, 8192}, fp16
    python benchmarks/triton_speed.py --smoke         # CPU: tiny sizes, Triton interpreter

Each row times one (L = S, E, causal) problem with B * L = 16384 tokens and
N = 2048 // E heads (so every row moves the same activations), float16. Timing: CUDA
events around each call, median of ``--reps`` calls after ``--warmup`` calls (CPU:
``time.perf_counter``). TFLOP/s counts the two matmuls, 4 * B * N * L * S * E
(E = Ev), halved for causal. ``ratio`` = SDPA time / triton time (> 1: triton faster).
``max abs diff`` is triton's largest absolute difference from the flash (else efficient,
else math) output on the same inputs. A backend that refuses a problem shows its error.
Writes a markdown table to ``--out`` and prints it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# Before torch/triton: on a CPU-only machine this sets TRITON_INTERPRET=1 first.
import implementations.builtins.kernels.triton_attention as ta
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}


def _time(fn, *, reps: int, warmup: int, cuda: bool) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _sdpa_call(backend, q, k, v, causal):
    def call():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return call


def run(sizes, head_dims, *, tokens: int, dtype, device: str, reps: int, warmup: int,
        sdpa_backends) -> list[dict]:
    impl = ta.make_implementation()
    if not impl.available:
        raise SystemExit(f"triton implementation unavailable: {impl.unavailable_reason}")
    cuda = device == "cuda"
    rows = []
    for L in sizes:
        for E in head_dims:
            for causal in (False, True):
                B, N = max(1, tokens // L), max(1, 2048 // E)
                if not cuda:
                    N = max(1, min(N, 2))
                gen = torch.Generator(device=device).manual_seed(0)
                q, k, v = (torch.randn(B, N, L, E, dtype=dtype, device=device, generator=gen)
                           for _ in range(3))
                flops = 4 * B * N * L * L * E * (0.5 if causal else 1.0)
                row = {"L": L, "E": E, "causal": causal, "B": B, "N": N}
                with torch.no_grad():
                    out_triton = impl.sdpa(q, k, v, is_causal=causal)
                    # Defaults bind this iteration's tensors (the lambda is timed at once anyway).
                    row["triton_s"] = _time(lambda q=q, k=k, v=v, causal=causal: impl.sdpa(q, k, v, is_causal=causal),
                                            reps=reps, warmup=warmup, cuda=cuda)
                    baseline = None
                    for name in sdpa_backends:
                        call = _sdpa_call(BACKENDS[name], q, k, v, causal)
                        try:
                            out = call()
                            row[f"{name}_s"] = _time(call, reps=reps, warmup=warmup, cuda=cuda)
                            baseline = out if baseline is None else baseline
                        except RuntimeError as exc:  # backend refuses this problem
                            row[f"{name}_s"] = None
                            row[f"{name}_error"] = str(exc).splitlines()[0][:60]
                    if baseline is not None:
                        row["max_diff"] = (out_triton.float() - baseline.float()).abs().max().item()
                row["flops"] = flops
                rows.append(row)
                print(_row_line(row, sdpa_backends), file=sys.stderr, flush=True)
    return rows


def _tflops(row, key):
    t = row.get(key)
    return f"{row['flops'] / t / 1e12:.3g}" if t else "-"


def _row_line(row, sdpa_backends):
    parts = [f"L={row['L']}", f"E={row['E']}", f"causal={row['causal']}",
             f"triton={row['triton_s'] * 1e3:.3f}ms"]
    for name in sdpa_backends:
        t = row.get(f"{name}_s")
        parts.append(f"{name}={t * 1e3:.3f}ms" if t else f"{name}=n/a")
    return " ".join(parts)


def markdown(rows, sdpa_backends, *, title: str) -> str:
    head = ["L=S", "E", "causal", "B x N", "triton ms", "triton TFLOP/s"]
    for name in sdpa_backends:
        head += [f"{name} ms", f"{name} TFLOP/s", f"ratio {name}/triton"]
    head.append("max abs diff")
    lines = [f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["L"]), str(r["E"]), "yes" if r["causal"] else "no", f"{r['B']} x {r['N']}",
                 f"{r['triton_s'] * 1e3:.3f}", _tflops(r, "triton_s")]
        for name in sdpa_backends:
            t = r.get(f"{name}_s")
            if t:
                cells += [f"{t * 1e3:.3f}", _tflops(r, f"{name}_s"), f"{t / r['triton_s']:.2f}"]
            else:
                cells += [f"n/a ({r.get(f'{name}_error', '')})", "-", "-"]
        cells.append(f"{r['max_diff']:.2e}" if "max_diff" in r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on CPU under the Triton interpreter (tests this script)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per row (median)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls per row")
    parser.add_argument("--out", type=Path, default=None, help="markdown output file")
    args = parser.parse_args(argv)

    if args.smoke:
        device, sizes, head_dims, tokens = "cpu", (17, 33), (16,), 34
        sdpa_backends = ("flash", "math")  # CPU has no efficient backend
        reps, warmup = args.reps or 2, args.warmup or 1
        title = "triton vs SDPA, float16, CPU smoke run (Triton interpreter: not a speed measurement)"
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device; use --smoke for the CPU check")
        device, sizes, head_dims, tokens = "cuda", (512, 2048, 8192), (64, 128), 16384
        sdpa_backends = ("flash", "efficient")
        reps, warmup = args.reps or 10, args.warmup or 3
        title = f"triton vs SDPA, float16, {torch.cuda.get_device_name()}"
    rows = run(sizes, head_dims, tokens=tokens, dtype=torch.float16, device=device, reps=reps,
               warmup=warmup, sdpa_backends=sdpa_backends)
    table = markdown(rows, sdpa_backends, title=title)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
