"""Which inputs each forced SDPA backend accepts on a device, measured call by call.

    python benchmarks/sdpa_backend_caps.py --device cuda --out caps.md --json caps.json
    python benchmarks/sdpa_backend_caps.py --device cpu --out caps-cpu.md   # CPU backends

The capabilities ``implementations/builtins/pytorch/torch_sdpa.py`` declares for the backend
built-ins (``sdpa-flash-cuda``, ``sdpa-efficient``, ``sdpa-cudnn``, ``sdpa-flash``) are
what a certificate trusts; this script measures them. Each probe is one call of
``torch.nn.functional.scaled_dot_product_attention`` under ``sdpa_kernel(backend)``
with everything at a known-good base case (B=2, N=4, L=S=64, E=Ev=64, no mask) except
the one feature probed, in each dtype. A cell is ``ok <err>`` (the call ran; ``err`` is
the largest absolute difference from the float64 MATH result on the CPU, or ``-`` where
no reference applies, e.g. dropout), ``NaN`` (ran, non-finite where the reference is
finite) or ``no: <first words of the error>`` (refused). The causal probes also say
which alignment the result matches (``ul`` top-left, ``lr`` bottom-right), and the
fully-masked-row probe says what such a row holds (``zero``, ``nan``, ``uniform``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

DTYPES = ("float64", "float32", "float16", "bfloat16")
HEAD_DIMS = (1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 64, 80, 96, 128, 160, 192, 256, 320, 512)


def _inputs(dtype, *, B=2, N=4, K=None, L=64, S=64, E=64, Ev=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    K = N if K is None else K
    Ev = E if Ev is None else Ev
    q = torch.randn(B, N, L, E, generator=g, dtype=torch.float64)
    k = torch.randn(B, K, S, E, generator=g, dtype=torch.float64)
    v = torch.randn(B, K, S, Ev, generator=g, dtype=torch.float64)
    # Round through the probed dtype so the reference sees the same inputs.
    q, k, v = (t.to(dtype).to(torch.float64) for t in (q, k, v))
    return q, k, v


def _reference(q, k, v, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _first_words(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:90]


def _bottom_right(L, S, device):
    return torch.ones(L, S, dtype=torch.bool, device=device).tril(diagonal=S - L)


def probe(backend, device: str, dtype_name: str, kw: dict) -> str:
    """One call; the cell text (see the module docstring)."""
    dtype = getattr(torch, dtype_name)
    shape = kw.get("shape", {})
    q64, k64, v64 = _inputs(dtype, **shape)
    call = dict(kw.get("call", {}))
    ref_call = dict(call)
    mask = kw.get("mask")
    if mask is not None:
        m64 = mask(q64.shape[-2], k64.shape[-2])
        call["attn_mask"] = m64.to(device) if m64.dtype == torch.bool else m64.to(device, dtype)
        ref_call["attn_mask"] = m64 if m64.dtype == torch.bool else m64.to(dtype).to(torch.float64)
    q, k, v = (t.to(device, dtype) for t in (q64, k64, v64))
    if kw.get("transpose"):
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    grad = kw.get("grad", False)
    if grad:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if kw.get("mask_grad"):
        call["attn_mask"] = call["attn_mask"].detach().requires_grad_()
    try:
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, **call)
            if grad or kw.get("mask_grad"):
                out.float().sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a refusal is the measurement
        return f"no: {_first_words(exc)}"
    if kw.get("no_reference"):
        return "ok -"
    got = out.detach().to("cpu", torch.float64)
    if kw.get("causal_alignment"):
        L, S = q64.shape[-2], k64.shape[-2]
        ul = _reference(q64, k64, v64, attn_mask=torch.ones(L, S, dtype=torch.bool).tril())
        lr = _reference(q64, k64, v64, attn_mask=_bottom_right(L, S, "cpu"))
        e_ul = (got - ul).abs().nan_to_num(nan=math.inf).max().item()
        e_lr = (got - lr).abs().nan_to_num(nan=math.inf).max().item()
        which = "ul" if e_ul <= e_lr else "lr"
        return f"ok {which} {min(e_ul, e_lr):.1e}" if e_ul != e_lr else f"ok both {e_ul:.1e}"
    if kw.get("fully_masked"):
        row = got[..., 0, :]
        if torch.isnan(row).all():
            return "ok nan"
        if (row == 0).all():
            return "ok zero"
        uniform = v64.mean(dim=-2)
        if (row - uniform).abs().max().item() < 0.05:
            return "ok uniform"
        return f"ok other {row.abs().max().item():.2g}"
    ref = _reference(q64, k64, v64, **ref_call)
    if not torch.isfinite(got).all() and torch.isfinite(ref).all():
        return "NaN"
    err = (got - ref).abs().max().item()
    return f"ok {err:.1e}"


def probes() -> dict[str, dict]:
    full_row_blocked = lambda L, S: torch.ones(L, S, dtype=torch.bool).index_fill_(0, torch.tensor([0]), False)  # noqa: E731
    table: dict[str, dict] = {
        "base (no mask)": {},
        "bool mask (L,S)": {"mask": lambda L, S: torch.rand(L, S, generator=torch.Generator().manual_seed(1)) > 0.3},
        "bool mask (B,N,L,S)": {"mask": lambda L, S: torch.rand(2, 4, L, S, generator=torch.Generator().manual_seed(2)) > 0.3},
        "additive mask (L,S)": {"mask": lambda L, S: torch.randn(L, S, generator=torch.Generator().manual_seed(3))},
        "additive mask requires grad": {"mask": lambda L, S: torch.randn(L, S, generator=torch.Generator().manual_seed(3)),
                                        "mask_grad": True, "no_reference": True},
        "is_causal L=S": {"call": {"is_causal": True}, "causal_alignment": True},
        "is_causal L=32 < S=64": {"call": {"is_causal": True}, "shape": {"L": 32}, "causal_alignment": True},
        "is_causal L=64 > S=32": {"call": {"is_causal": True}, "shape": {"S": 32}, "causal_alignment": True},
        "fully masked row (bool)": {"mask": full_row_blocked, "fully_masked": True},
        "GQA N=8 K=2 enable_gqa": {"call": {"enable_gqa": True}, "shape": {"N": 8, "K": 2}},
        "Ev=32 != E=64": {"shape": {"Ev": 32}},
        "Ev=2 != E=4": {"shape": {"E": 4, "Ev": 2}},
        "Ev=8 != E=16": {"shape": {"E": 16, "Ev": 8}},
        "L=S=1": {"shape": {"L": 1, "S": 1}},
        "L=1 S=64": {"shape": {"L": 1}},
        "L=64 S=1": {"shape": {"S": 1}},
        "L=S=2": {"shape": {"L": 2, "S": 2}},
        "L=S=2 E=Ev=8": {"shape": {"L": 2, "S": 2, "E": 8}},
        "L=7 S=13": {"shape": {"L": 7, "S": 13}},
        "L=S=2048": {"shape": {"L": 2048, "S": 2048, "B": 1, "N": 2}},
        "scale=0.3": {"call": {"scale": 0.3}},
        "scale=-0.5": {"call": {"scale": -0.5}},
        "scale=-0.5 is_causal": {"call": {"scale": -0.5, "is_causal": True}},
        "dropout 0.1": {"call": {"dropout_p": 0.1}, "no_reference": True},
        "backward": {"grad": True, "no_reference": True},
        "backward is_causal": {"grad": True, "call": {"is_causal": True}, "no_reference": True},
        "backward bool mask": {"grad": True, "no_reference": True,
                               "mask": lambda L, S: torch.rand(L, S, generator=torch.Generator().manual_seed(1)) > 0.3},
        "non-contiguous (BLNE view)": {"transpose": True},
    }
    for e in HEAD_DIMS:
        table[f"E=Ev={e}"] = {"shape": {"E": e}}
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, required=True, help="markdown table")
    parser.add_argument("--json", type=Path, help="every cell as JSON")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                    "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
        where = torch.cuda.get_device_name()
    else:
        backends = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
        where = "cpu"
    cells: dict[str, dict[str, dict[str, str]]] = {}
    lines = [f"# SDPA backends on {where}: torch {torch.__version__}", ""]
    for bname, backend in backends.items():
        cells[bname] = {}
        lines += [f"## {bname}", "", "| probe | " + " | ".join(DTYPES) + " |",
                  "| --- |" + " --- |" * len(DTYPES)]
        for pname, kw in probes().items():
            row = {d: probe(backend, args.device, d, kw) for d in DTYPES}
            cells[bname][pname] = row
            lines.append(f"| {pname} | " + " | ".join(row[d].replace("|", "/") for d in DTYPES) + " |")
            print(bname, pname, row, flush=True)
        lines.append("")
    args.out.write_text("\n".join(lines) + "\n")
    if args.json:
        args.json.write_text(json.dumps({"device": where, "torch": torch.__version__, "cells": cells}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
