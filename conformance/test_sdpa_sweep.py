"""Every small size, and the long sizes of real kernels' blocks (spec.sdpa): forward
agreement for each L, S in 1..33, and for L, S around blocks of 64, 128 and 256.

Bugs that live at one size (a ragged last block, an off-by-one tile count) are
found by luck in a random search; ``small_sizes_sweep`` visits every (L, S) up to two
key blocks of 16 and one more, block edges first, with a few head layouts, causal
and not, and Ev != E, in one pytest test per target (no Hypothesis per size).
``long_sizes_sweep`` visits the lengths where a GPU kernel's second and third query or
key block of 64, 128 or 256 begins (129, 257, ...), which no random draw reaches (they
stop at 65), the same way.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

import spec
from conformance.core import tolerance
from conformance.calls.sdpa import allowed_error, logit_scale, magnitude, run_sdpa, valid_rows
from conformance.core.cases import SDPACase
from conformance.core.compare import PropertyFailure, compare_values, fail
from conformance.calls.declarations import fit_head_dims, require_inside
from implementations.capabilities import length_allowed
from conformance.directed.helpers import needs_separate_values, skip_unless
from conformance.core.target import Target, call_guarded
from conformance.harness.sweep import Sweep, sweep_property
from conformance.core.tensors import dtype_of, to_numpy
from spec.emulate import round_to

#: Longest L and S visited: two blocks of 16 and one more.
MAX_LENGTH = 33
#: Lengths at block edges, visited first.
EDGE_LENGTHS = (1, 2, 15, 16, 17, 31, 32, 33)
#: Sizes the sweep visits per target, by Hypothesis profile (``size_order``: block
#: edges first), a count and never a time, so that a certificate does not depend on the
#: machine's speed (a slow machine visits the same sizes, in more time).
SIZES = {"dev": 400, "ci": 361, "thorough": None}
#: q/k head dim, and the value head dim of the Ev != E pass.
HEAD_DIM, OTHER_VALUE_DIM = 4, 2
#: Every key's value in the last value column: the output there is exactly this
#: (``tolerance.constant_column_allowed``); mid-binade, so an ulp is unambiguous.
CONSTANT_VALUE = 1.5
#: Most sizes whose calls share one guarded call (one thread hand-off).
MAX_CHUNK = 16
#: Lengths of ``long_sizes_sweep``, in the order they enter its square: one query (decode),
#: one past a block of 128 and of 256 (the second and third block's first row or key),
#: the block edges themselves, then around 64.
LONG_LENGTHS = (1, 129, 257, 128, 256, 127, 255, 65, 64)
#: Sizes ``long_sizes_sweep`` visits per target, by profile: the squares of its first 4,
#: 5 and all 9 lengths.
LONG_SIZES = {"dev": 25, "ci": 16, "thorough": None}


@dataclass(frozen=True)
class _Layout:
    """One call per size: heads N (query) and K (kv), value head dim, causal alignment."""

    N: int
    K: int
    Ev: int
    causal: str | None

    def describe(self) -> str:
        causal = f", causal={self.causal}" if self.causal else ""
        return f"N={self.N}, K={self.K}, Ev={self.Ev}{causal}"


def length_order(max_length: int) -> list[int]:
    """1..max_length, block edges (EDGE_LENGTHS) first."""
    edges = [n for n in EDGE_LENGTHS if n <= max_length]
    return edges + [n for n in range(1, max_length + 1) if n not in edges]


def size_order(max_length: int) -> list[tuple[int, int]]:
    """Every (L, S) with L, S in 1..max_length, as a growing square over
    :func:`length_order`: all pairs of the first k lengths before any pair with the
    (k+1)-th, so block edges come first and a budget of sizes cuts off the rest."""
    return square_order(length_order(max_length))


def square_order(lengths: list[int]) -> list[tuple[int, int]]:
    """Every (L, S) with L, S in ``lengths``, as a growing square over their order."""
    rank = {n: i for i, n in enumerate(lengths)}
    pairs = [(L, S) for L in rank for S in rank]
    return sorted(pairs, key=lambda p: (max(rank[p[0]], rank[p[1]]), p[0] + p[1], p))


def _layouts(target: Target, E: int) -> list[_Layout]:
    """Three calls per size: N = K = 1 without causal flag; N = 2, K = 1 (N = K = 1
    without GQA) with the declared causal flag (without one when none is declared);
    and, Ev != E declared, N = K = 1 with Ev != E."""
    caps = target.caps
    out = [_Layout(1, 1, E, None)]
    grouped = (2, 1) if caps.gqa else (1, 1)
    if caps.causal or caps.gqa:
        out.append(_Layout(*grouped, E, caps.causal))
    if caps.different_v_dim and not caps.shared_kv:
        # OTHER_VALUE_DIM, or the declared head dim nearest it that differs from E.
        dims = fit_head_dims(caps, E, OTHER_VALUE_DIM)
        if dims is not None and dims[1] != E:
            out.append(_Layout(1, 1, dims[1], None))
    return out


def _head_dim(target: Target) -> int:
    lo = target.caps.min_head_dim or 1
    hi = target.caps.max_head_dim or max(HEAD_DIM, lo)
    if target.caps.head_dims:  # a declared set: its nearest to HEAD_DIM
        return fit_head_dims(target.caps, min(max(HEAD_DIM, lo), hi), min(max(HEAD_DIM, lo), hi))[0]
    return min(max(HEAD_DIM, lo), hi)


class _Pool:
    """q (1, 2, M, E), k (1, 1, M, E) and values (1, 1, M, Ev) for each Ev, exact in
    the dtype, last value column constant; every case is a slice of them."""

    def __init__(self, target: Target, E: int, value_dims: set[int], length: int,
                 name: str = "small_sizes_sweep") -> None:
        import torch

        self.name = name
        rng = np.random.default_rng(zlib.crc32(f"{name}/{target.dtype}".encode()))
        dtype = target.dtype
        self.query = round_to(rng.standard_normal((1, 2, length, E)), dtype)
        self.key = round_to(rng.standard_normal((1, 1, length, E)), dtype)
        self.values = {}
        for Ev in sorted(value_dims):
            value = round_to(rng.standard_normal((1, 1, length, Ev)), dtype)
            value[..., -1] = CONSTANT_VALUE
            self.values[Ev] = value
        torch_dtype = dtype_of(dtype)

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.tensor(a, dtype=torch_dtype, device=target.device)

        self.tensors = (tensor(self.query), tensor(self.key),
                        {Ev: tensor(v) for Ev, v in self.values.items()})

    def case(self, target: Target, layout: _Layout, L: int, S: int) -> SDPACase:
        return SDPACase(query=self.query[:, :layout.N, :L], key=self.key[:, :, :S],
                        value=self.values[layout.Ev][:, :, :S], causal=layout.causal,
                        dtype=target.dtype, device=target.device,
                        notes=(f"{self.name}: {layout.describe()}",))

    def _call(self, target: Target, layout: _Layout, L: int, S: int) -> Any:
        query, key, values = self.tensors
        return target.impl.sdpa(query[:, :layout.N, :L].contiguous(), key[:, :, :S].contiguous(),
                                values[layout.Ev][:, :, :S].contiguous(),
                                is_causal=layout.causal is not None, enable_gqa=layout.N != layout.K)

    def call(self, target: Target, layout: _Layout, L: int, S: int) -> np.ndarray:
        """One guarded call: its output, or the PropertyFailure of what went wrong."""
        out = call_guarded(target, self._call, target, layout, L, S)
        shape = (1, layout.N, L, layout.Ev)
        if tuple(getattr(out, "shape", ())) != shape:
            fail(f"output shape={tuple(getattr(out, 'shape', ()))}, but should be {shape} (B, N, L, Ev)")
        return to_numpy(out)

    def call_many(self, target: Target, layouts: list[_Layout],
                  sizes: list[tuple[int, int]]) -> list[list[Any]]:
        """Every layout at every size in one guarded call (one thread hand-off for
        all of them): per size, per layout, the output tensor or the exception raised."""

        def work() -> list[list[Any]]:
            results: list[list[Any]] = []
            for L, S in sizes:
                row: list[Any] = []
                for layout in layouts:
                    try:
                        row.append(self._call(target, layout, L, S))
                    except Exception as exc:  # noqa: BLE001 - re-raised, guarded, by call()
                        row.append(exc)
                results.append(row)
            return results

        return call_guarded(target, work)


def _constant_column(target: Target, case: SDPACase, out: np.ndarray) -> float:
    """The last value column is CONSTANT_VALUE for every key: so is the output's."""
    allowed = tolerance.constant_column_allowed(case.dtype, CONSTANT_VALUE, case.S, tf32=target.tf32)
    return compare_values(f"output of the value column that is {CONSTANT_VALUE} for every key",
                          out[..., -1:], np.full(out[..., -1:].shape, CONSTANT_VALUE), allowed,
                          where=valid_rows(case)).ratio


def _check_output(target: Target, case: SDPACase, out: np.ndarray) -> float:
    """The tolerance rule (``calls.sdpa.allowed_error``) and the constant column."""
    ref = spec.sdpa(case.query, case.key, case.value, causal=case.causal, fully_masked="zero")
    ratio = compare_values("output", out, ref.output, allowed_error(target, case, ref),
                           where=valid_rows(case)).ratio
    if np.ptp(case.value[..., -1]) == 0 and case.value[0, 0, 0, -1] == CONSTANT_VALUE:
        ratio = max(ratio, _constant_column(target, case, out))
    return ratio


def _check_case(target: Target, case: SDPACase) -> float:
    """One saved case (``--replay``)."""
    return _check_output(target, case, run_sdpa(target, case).output)


def _quick_ratio(target: Target, case: SDPACase, ref: spec.SDPAResult, out: np.ndarray) -> float | None:
    """error / (the tolerance rule's floor) where the output is certainly right, None
    where only the full rule (with the naive same-precision error) can tell."""
    rows = valid_rows(case) if case.causal else np.ones((1, case.N, case.L, 1), bool)
    diff = np.where(rows, np.abs(out - ref.output), 0.0)
    if not np.isfinite(diff).all():
        return None
    floor = tolerance.sdpa_allowed(case.dtype, 0.0, magnitude(case, ref.weights), tf32=target.tf32,
                                   logit_scale=logit_scale(case, ref))
    column = np.where(rows, np.abs(out[..., -1:] - CONSTANT_VALUE), 0.0)
    column_allowed = tolerance.constant_column_allowed(case.dtype, CONSTANT_VALUE, case.S, tf32=target.tf32)
    if (diff > floor).any() or (column > column_allowed).any():
        return None
    return float(max((diff / floor).max(initial=0.0), column.max(initial=0.0) / column_allowed))


def _oracle(pool: _Pool, layouts: list[_Layout], L: int, S: int) -> dict[_Layout, spec.SDPAResult]:
    """The oracle for every layout of one size: one call per causal option (both
    head layouts are its heads; another value head dim reuses its weights)."""
    out = {}
    for causal in {layout.causal for layout in layouts}:
        E = pool.query.shape[-1]
        ref = spec.sdpa(pool.query[:, :, :L], pool.key[:, :, :S], pool.values[E][:, :, :S],
                        causal=causal, fully_masked="zero")
        for layout in layouts:
            if layout.causal != causal:
                continue
            weights, logits = ref.weights[:, :layout.N], ref.logits[:, :layout.N]
            output = weights @ pool.values[layout.Ev][:, :, :S]
            out[layout] = spec.SDPAResult(output, weights, logits)
    return out


@sweep_property(
    "small_sizes_sweep", level="sdpa", section="spec.sdpa (every L, S in 1..33)",
    check=_check_case, sizes=SIZES,
    skip_reason=lambda t: skip_unless("none" in t.caps.mask_kinds, "calls without a mask not declared")
    or needs_separate_values(t),
)
def test_small_sizes_sweep(target: Target, sweep: Sweep) -> None:
    """For every L and S in 1..33 (block edges 1, 2, 15, 16, 17, 31, 32, 33 first),
    the output equals the float64 oracle within the tolerance rule: N = K = 1; N = 2,
    K = 1 (GQA declared) with the declared causal flag; N = K = 1 with Ev != E. A value
    column that is 1.5 for every key comes back as 1.5 to one ulp
    (``tolerance.constant_column_allowed``). The smallest failing (L, S) is reported.
    A sweep visits its profile's count of sizes (``SIZES``); its examples are the sizes visited."""
    import torch

    # Problems this small gain nothing from intra-op threads but pay their
    # synchronization: 10 to 60 times slower per call on a busy 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _sweep(target, sweep)
    finally:
        torch.set_num_threads(threads)


def _long_lengths_skip(target: Target) -> str | None:
    """Why ``long_sizes_sweep`` cannot run: a declared maximum length or block multiple
    leaves none of its lengths."""
    if not _long_lengths(target):
        return (f"no length of the long sweep {LONG_LENGTHS} is inside the declarations "
                f"(max_seq_len={target.caps.max_seq_len}, seq_multiple={target.caps.seq_multiple}, "
                f"seq_block={target.caps.seq_block})")
    return None


def _long_lengths(target: Target) -> list[int]:
    """LONG_LENGTHS inside the declared length rules (maximum, block multiple, block)."""
    return [n for n in LONG_LENGTHS if length_allowed(target.caps, n)]


@sweep_property(
    "long_sizes_sweep", level="sdpa", section="spec.sdpa (long sequences: blocks of 64, 128, 256)",
    check=_check_case, sizes=LONG_SIZES,
    skip_reason=lambda t: skip_unless("none" in t.caps.mask_kinds, "calls without a mask not declared")
    or needs_separate_values(t) or _long_lengths_skip(t),
)
def test_long_sizes_sweep(target: Target, sweep: Sweep) -> None:
    """For L and S in 1, 129, 257, 128, 256, 127, 255, 65, 64 (where a kernel's second or
    third query or key block of 64, 128 or 256 begins or ends; random draws stop at 65),
    the output equals the float64 oracle within the tolerance rule, with the calls of
    small_sizes_sweep (without a mask, with the declared causal flag and GQA, Ev != E).
    The smallest failing (L, S) is reported. Its examples are the sizes visited."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lengths = _long_lengths(target)
        _sweep(target, sweep, square_order(lengths), max(lengths), "long_sizes_sweep",
               f"L, S in {{{', '.join(map(str, sorted(lengths)))}}}")
    finally:
        torch.set_num_threads(threads)


def _sweep(target: Target, sweep: Sweep, order: list[tuple[int, int]] | None = None,
           length: int | None = None, name: str = "small_sizes_sweep", visits: str | None = None) -> None:
    """Visit ``order`` (default: every size in 1..MAX_LENGTH, block edges first) with
    every call layout; the pool holds ``length`` positions."""
    E = _head_dim(target)
    layouts = _layouts(target, E)
    if order is None:
        length = min(MAX_LENGTH, target.caps.max_seq_len or MAX_LENGTH)
        order = size_order(length)
    pool = _Pool(target, E, {layout.Ev for layout in layouts}, length, name)
    top = max((n for n in range(1, length + 1) if length_allowed(target.caps, n)), default=0)
    # (the longest length inside the declarations)
    for layout in layouts:  # the pool's calls go to the implementation directly: inside, checked
        require_inside(target, pool.case(target, layout, top or length, top or length), what=name)
    if target.caps.self_attention_lengths:  # L == S only: the diagonal of the square
        order = [(L, S) for L, S in order if L == S]
    if target.caps.seq_multiple or target.caps.seq_block:  # lengths of a block rule: those sizes only
        order = [(L, S) for L, S in order if length_allowed(target.caps, L) and length_allowed(target.caps, S)]
    total, order = len(order), sweep.budget(order)
    smallest: tuple[tuple[int, int], SDPACase, PropertyFailure] | None = None
    chunk, position = 1, 0
    while position < len(order):
        if sweep.out_of_time():  # the safety limit (a hang guard); the reason says so
            break
        # Sizes still worth a call: only one smaller than the smallest failure can be reported.
        sizes = [(L, S) for L, S in order[position:position + chunk]
                 if smallest is None or (L + S, L) < smallest[0]]
        position += chunk
        started = time.perf_counter()
        # Isolated, each case is checked whole in the worker process (it alone may call
        # the implementation); else the calls of one chunk share one guarded call.
        outputs = (pool.call_many(target, layouts, sizes) if sizes and not sweep.isolated
                   else [None] * len(sizes))
        # Grow the chunk while a chunk is fast.
        chunk = min(chunk * 2, MAX_CHUNK) if time.perf_counter() - started < 0.5 else max(1, chunk // 2)
        for (L, S), row in zip(sizes, outputs, strict=True):
            if sweep.isolated:
                failure = _check_size_isolated(sweep, pool, layouts, L, S)
            else:
                failure = _check_size(target, sweep, pool, layouts, L, S, row)
            if failure is not None:
                smallest = ((L + S, L), *failure)
                break
    lengths = "L = S" if target.caps.self_attention_lengths else "L, S"
    visits = visits or f"{lengths} in 1..{length}"
    sweep.record.reason = sweep.describe(total, f"sizes ({visits}), {len(layouts)} calls each")
    if smallest is not None:
        (_, _), case, exc = smallest
        sweep.failing(case)
        message = (f"{exc}\nsmallest failing size of the sweep: L={case.L}, S={case.S} "
                   f"({case.notes[0].split(': ', 1)[1]})")
        # The failure keeps its ratio: the certificate's FAIL cell shows it.
        raise type(exc)(message, ratio=getattr(exc, "ratio", None)) from exc


def _check_size_isolated(sweep: Sweep, pool: _Pool, layouts: list[_Layout], L: int,
                         S: int) -> tuple[SDPACase, PropertyFailure] | None:
    """:func:`_check_size` for an isolated implementation: each layout's case through
    :func:`_check_case` in the worker (``Sweep.check``)."""
    worst, cases = 0.0, tuple(pool.case(sweep.target, layout, L, S) for layout in layouts)
    for case in cases:
        try:
            ratio = sweep.check(case)
        except PropertyFailure as exc:
            if sweep.expected(case):
                continue
            return case, exc
        worst = max(worst, ratio or 0.0)
    sweep.visited(worst, cases if sweep.entries else ())
    return None


def _check_size(target: Target, sweep: Sweep, pool: _Pool, layouts: list[_Layout], L: int, S: int,
                outputs: list[Any]) -> tuple[SDPACase, PropertyFailure] | None:
    """Check one size's outputs (tensors or exceptions, one per layout): None when it
    passes (and is counted), else the failing case and its failure."""
    refs = _oracle(pool, layouts, L, S)
    worst = 0.0
    for layout, output in zip(layouts, outputs, strict=True):
        case = pool.case(target, layout, L, S)
        try:
            shape = (1, layout.N, L, layout.Ev)
            if isinstance(output, Exception) or tuple(getattr(output, "shape", ())) != shape:
                out = pool.call(target, layout, L, S)  # again, alone: the guarded failure
            else:
                out = to_numpy(output)
            ratio = _quick_ratio(target, case, refs[layout], out)
            if ratio is None:
                ratio = _check_output(target, case, out)
        except PropertyFailure as exc:
            if sweep.expected(case):
                continue
            return case, exc
        worst = max(worst, ratio)
    sweep.visited(worst, tuple(pool.case(target, x, L, S) for x in layouts) if sweep.entries else ())
    return None
