"""Headroom and discrimination of the MHA tolerance rule, old and new, per dtype.

Draws MHA cases with ``conformance.strategies.mha_cases`` (every feature, fixed
Hypothesis seeds), runs each module below on them on the CPU, and prints per dtype the
worst and median of error/allowed (the larger of the output's and, with need_weights,
the weights'), and how many cases fail (ratio > 1), under two bounds:

* old: ``mha_floor × eps × (1 + logit range) × magnitude`` with one magnitude per
  feature (``|W_o| @ max|v| + |b_o|``) and one logit range per case (the rule of
  conformance/test_mha.py as of this benchmark);
* new: ``conformance.calls.mha_bounds.allowed_error`` (k × the naive same-precision module
  call's error + a floor at a per-element magnitude).

Modules: the correct built-ins torch-mha (as the suite calls it, grad enabled: the
slow path; and under no_grad, where the fast path may run), handwritten and spec, and
three wrong ones: ``halved`` (attention output halved before out_proj), ``5%-off``
(output × 1.05) and ``zero-keys`` (keys padded with zero input rows up to the next
multiple of 16, never masked).

    python benchmarks/mha_tolerance.py                    # 200 cases per dtype
    python benchmarks/mha_tolerance.py --cases 50 --dtype bfloat16
    python benchmarks/mha_tolerance.py --device cuda --tf32 --dtype float32

Exit status 1 when a correct built-in exceeds the new bound.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

import spec  # noqa: E402
from conformance.core.cases import MHACase  # noqa: E402
from conformance.strategies import mha_cases  # noqa: E402
from conformance.core.tensors import dtype_of, mha_inputs, to_numpy  # noqa: E402
from conformance.core.tolerance import EPS  # noqa: E402
from conformance.calls.mha_bounds import allowed_error as mha_allowed  # noqa: E402
from implementations.base import Implementation  # noqa: E402
from implementations.builtins.pytorch._torch_common import load_mha_weights  # noqa: E402
from implementations.mutants._base import HandwrittenMHA  # noqa: E402
from implementations.registry import resolve  # noqa: E402

DTYPES = ("float64", "float32", "float16", "bfloat16")


# --------------------------------------------------------------------------- wrong modules


class Halved(HandwrittenMHA):
    """The attention output is halved before out_proj."""

    def project_output(self, x):
        return self.out_proj(x * 0.5)


class FivePercentOff(HandwrittenMHA):
    """The module output is 5 % too large."""

    def forward(self, *args: Any, **kwargs: Any):
        out, weights = super().forward(*args, **kwargs)
        return out * 1.05, weights


class ZeroPaddingKeys(HandwrittenMHA):
    """Keys padded with zero input rows (projected: the in_proj biases) up to the next
    multiple of 16, 1 to 16 of them, and attended: nothing masks the padding."""

    def attention(self, q, k, v, bias, dropout_p):
        B, N, S, E = k.shape
        pad = 16 - S % 16
        if self.in_proj_bias is not None:
            D = self.embed_dim
            b_k = self.in_proj_bias[D:2 * D].reshape(1, N, 1, E)
            b_v = self.in_proj_bias[2 * D:].reshape(1, N, 1, E)
        else:
            b_k = b_v = torch.zeros(1, N, 1, E, dtype=k.dtype, device=k.device)
        k = torch.cat([k, b_k.expand(B, N, pad, E)], dim=2)
        v = torch.cat([v, b_v.expand(B, N, pad, E)], dim=2)
        bias = F.pad(bias, (0, pad))
        attended, weights = super().attention(q, k, v, bias, dropout_p)
        return attended, weights[..., :S]


@dataclass
class Module:
    factory: Callable[..., Any]
    load_weights: Callable[[Any, Any], None]
    no_grad: bool = False
    #: a registered built-in: its expected failures of mha_agreement are left out
    impl: Implementation | None = None


#: The old rule's ulps at the module output's magnitude (256 for every dtype on the CPU).
OLD_MHA_FLOOR = 256.0

def _modules() -> dict[str, Module]:
    torch_mha, handwritten, oracle = (resolve(n) for n in ("torch-mha", "handwritten", "spec"))
    return {
        "torch-mha": Module(torch_mha.mha, torch_mha.load_weights, impl=torch_mha),
        "torch-mha no_grad": Module(torch_mha.mha, torch_mha.load_weights, True, impl=torch_mha),
        "handwritten": Module(handwritten.mha, handwritten.load_weights, impl=handwritten),
        "spec": Module(oracle.mha, oracle.load_weights, impl=oracle),
        "halved": Module(Halved, load_mha_weights),
        "5%-off": Module(FivePercentOff, load_mha_weights),
        "zero-keys": Module(ZeroPaddingKeys, load_mha_weights),
    }


CORRECT = ("torch-mha", "torch-mha no_grad", "handwritten", "spec")


# --------------------------------------------------------------------------- cases, calls


def draw_cases(dtype: str, count: int, first_seed: int, device: str = "cpu") -> list[MHACase]:
    """``count`` cases from mha_cases (all features, fully-masked rows allowed), seeded."""
    cases: list[MHACase] = []

    @seed(first_seed)
    @settings(max_examples=count, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(mha_cases(dtype=dtype, device=device))
    def collect(case: MHACase) -> None:
        cases.append(case)

    collect()
    return cases


def run_module(entry: Module, case: MHACase) -> tuple[np.ndarray, np.ndarray | None]:
    p = case.params
    module = entry.factory(p.embed_dim, p.num_heads, dropout=0.0, bias=p.in_proj_bias is not None,
                     add_bias_kv=p.bias_k is not None, add_zero_attn=bool(p.add_zero_attn),
                     kdim=p.kdim, vdim=p.vdim, batch_first=case.batch_first, device=case.device,
                     dtype=dtype_of(case.dtype))
    entry.load_weights(module, p)
    module.eval()
    if entry.no_grad:
        with torch.no_grad():
            out, weights = module(**mha_inputs(case))
    else:
        out, weights = module(**mha_inputs(case))
    return to_numpy(out), None if weights is None else to_numpy(weights)


def _to_batch_first(x: np.ndarray, case: MHACase) -> np.ndarray:
    if case.unbatched:
        return x[None]
    return x if case.batch_first else np.swapaxes(x, 0, 1)


def old_allowed(case: MHACase) -> tuple[np.ndarray, np.ndarray]:
    """The previous rule of conformance/test_mha.py: (output (D,), weights (1,))."""
    p = case.params
    wq, wk, wv = (np.abs(w) for w in p.projection_weights())
    bq, bk, bv = (np.abs(b) for b in p.projection_biases())
    q = np.abs(_to_batch_first(case.query, case)) @ wq.T + bq
    k = np.abs(_to_batch_first(case.key, case)) @ wk.T + bk
    v = np.abs(_to_batch_first(case.value, case)) @ wv.T + bv
    E = p.head_dim
    if p.bias_k is not None:
        k = np.concatenate([k, np.abs(p.bias_k).reshape(1, 1, -1).repeat(k.shape[0], 0)], axis=1)
        v = np.concatenate([v, np.abs(p.bias_v).reshape(1, 1, -1).repeat(v.shape[0], 0)], axis=1)
    logit = 0.0
    for h in range(p.num_heads):
        sl = slice(h * E, (h + 1) * E)
        logit = max(logit, float((q[..., sl] @ np.swapaxes(k[..., sl], -1, -2)).max()) / np.sqrt(E))
    out_bias = np.abs(p.out_proj_bias) if p.out_proj_bias is not None else 0.0
    magnitude = np.abs(p.out_proj_weight) @ v.max(axis=(0, 1)) + out_bias
    for m in (case.attn_mask, case.key_padding_mask):
        if m is not None and m.dtype != np.bool_:
            finite = np.abs(m[np.isfinite(m)])
            logit += float(finite.max()) if finite.size else 0.0
    factor = OLD_MHA_FLOOR * EPS[case.dtype] * (1.0 + logit)
    return factor * magnitude, factor * np.ones(1)


def _ratio(got: np.ndarray, want: np.ndarray, allowed: np.ndarray, rows: np.ndarray) -> float:
    rows = np.broadcast_to(rows, got.shape)
    if not rows.any():
        return 0.0
    err = np.abs(got - want)
    if not np.isfinite(err[rows]).all():
        return float("inf")
    allowed = np.broadcast_to(allowed, got.shape)
    return float((err[rows] / allowed[rows]).max())


def _rows(case: MHACase) -> tuple[np.ndarray, np.ndarray]:
    """(output rows, weights rows) with an attendable key in every head, laid out like
    the module's output and returned weights (as conformance/test_mha.py selects them)."""
    dead = case.blocked_rows()                          # (B, N, L)
    live = ~dead.any(axis=1)                            # (B, L)
    if case.unbatched:
        out_rows = live[0][:, None]
    else:
        out_rows = live[:, :, None] if case.batch_first else live.T[:, :, None]
    w_rows = (live if case.average_attn_weights else ~dead)[..., None]
    return out_rows, (w_rows[0] if case.unbatched else w_rows)


def expected(case: MHACase) -> tuple[np.ndarray, np.ndarray | None]:
    return spec.mha_forward(
        case.params, case.query, case.key, case.value, key_padding_mask=case.key_padding_mask,
        attn_mask=case.attn_mask, need_weights=case.need_weights,
        average_attn_weights=case.average_attn_weights, is_causal=case.is_causal,
        batch_first=case.batch_first)


def ratios(case: MHACase, call: tuple[np.ndarray, np.ndarray | None],
           want: tuple[np.ndarray, np.ndarray | None],
           bounds: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
    (out, weights), (want_out, want_w) = call, want
    out_rows, w_rows = _rows(case)
    result = {}
    for rule, (allowed_out, allowed_w) in bounds.items():
        r = _ratio(out, want_out, allowed_out, out_rows)
        if case.need_weights and weights is not None:
            r = max(r, _ratio(weights, want_w, allowed_w, w_rows))
        result[rule] = r
    return result


def relative_deviation(case: MHACase, out: np.ndarray, want_out: np.ndarray) -> float:
    """max |output - expected| / max |expected| over the valid rows."""
    rows = np.broadcast_to(_rows(case)[0], out.shape)
    size = np.abs(want_out[rows]).max(initial=0.0)
    return float(np.abs(out - want_out)[rows].max(initial=0.0) / size) if size else 0.0


# --------------------------------------------------------------------------- report


def measure(dtype: str, count: int, first_seed: int, device: str = "cpu",
            tf32: bool = False) -> tuple[dict[str, dict[str, list[float]]], list[str], int]:
    """Ratios per module and rule, one line per distinct case a wrong module passes, and
    how many cases had no row to compare (every query row has a head with no key)."""
    modules = _modules()
    table: dict[str, dict[str, list[float]]] = {name: {"old": [], "new": []} for name in modules}
    misses: list[str] = []
    empty = 0
    for case in draw_cases(dtype, count, first_seed, device):
        if not _rows(case)[0].any():
            empty += 1
            continue
        bounds = {"old": old_allowed(case), "new": tuple(mha_allowed(case, tf32=tf32))}
        want = expected(case)
        for name, module in modules.items():
            if module.impl is not None and module.impl.expected_failure("mha_agreement", case.attrs()):
                continue
            call = run_module(module, case)
            for rule, r in ratios(case, call, want, bounds).items():
                table[name][rule].append(r)
            ratio = table[name]["new"][-1]
            miss = (f"{name} passes (ratio {ratio:.3g}) a case where it is off by "
                    f"{relative_deviation(case, call[0], want[0]):.2%} of the largest output: "
                    f"N={case.N} L={case.L} S={case.S} D={case.D}")
            if module.impl is None and ratio <= 1 and miss not in misses:
                misses.append(miss)
    return table, misses, empty


def _fmt(x: float) -> str:
    return "inf" if x == float("inf") else f"{x:.3g}"


def report(dtype: str, table: dict[str, dict[str, list[float]]], empty: int) -> list[str]:
    lines = [(f"{dtype}: {len(table['halved']['new'])} cases ({empty} more had no row to compare; "
              "fewer for a built-in: its expected failures of mha_agreement are left out)"),
             (f"  {'module':<18} {'old worst':>10} {'old median':>11} {'old fail':>9}   "
              f"{'new worst':>10} {'new median':>11} {'new min':>9} {'new fail':>9}")]
    for name, by_rule in table.items():
        old, new = by_rule["old"], by_rule["new"]
        lines.append(
            f"  {name:<18} {_fmt(max(old)):>10} {_fmt(statistics.median(old)):>11} "
            f"{sum(r > 1 for r in old):>4}/{len(old):<4}   {_fmt(max(new)):>10} "
            f"{_fmt(statistics.median(new)):>11} {_fmt(min(new)):>9} "
            f"{sum(r > 1 for r in new):>4}/{len(new):<4}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=200, help="cases per dtype")
    parser.add_argument("--dtype", action="append", choices=DTYPES, help="repeatable; default all")
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed of the draws")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--tf32", action="store_true",
                        help="CUDA float32 matmuls on TF32 (bounded with tf32=True)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    print(f"torch {torch.__version__}, {args.device}{' TF32' if args.tf32 else ''}, {args.cases} "
          f"cases per dtype, seed {args.seed}; ratio = error/allowed (> 1 fails)")
    ok = True
    for dtype in args.dtype or DTYPES:
        start = time.perf_counter()
        table, misses, empty = measure(dtype, args.cases, args.seed, args.device, args.tf32)
        for line in report(dtype, table, empty) + [f"  {m}" for m in misses]:
            print(line)
        print(f"  ({time.perf_counter() - start:.0f}s)", flush=True)
        ok &= all(max(table[name]["new"]) <= 1 for name in CORRECT)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
