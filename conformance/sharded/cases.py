"""Sharded (context-parallel) cases and calls: the level's entry of ``conformance.core.levels``.

A :class:`ShardedCase` is one sequence, given whole: query (B, N, L, E), key (B, K, L, E),
value (B, K, L, Ev), heads-first as at the SDPA level, with the world size, the layout
(``spec.sharding``), ``causal`` (over global positions; L == S), the scale, and the
declared features' arguments: ``window`` (left, right) over global positions, and
padding (L not a multiple of the layout's divisor: the ranks get the sequence padded at
the end, and ``seq_len=L``). A call
(:class:`ShardedCallSpec`) hands the full arrays to ranks ``0..W-1`` of the worker group
(``conformance.sharded.group``: one group per world size, whose default process group
is exactly those ranks); each rank takes its shard, calls ``impl.sharded`` and
sends back its output, LSE and gradient shards, which :func:`run_sharded` puts back in
global order (:class:`ShardedResult`). A hang, a crash or an exception in any rank is a
property failure (``ImplementationHung`` / ``ImplementationCrashed`` /
``ImplementationRaised``), after which the group is restarted.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from conformance.core.cases import _scale_sign
from conformance.core.compare import fail
from conformance.core.observe import observe_sharded
from conformance.core.target import (
    ImplementationCrashed,
    ImplementationHung,
    ImplementationRaised,
    Target,
)
from conformance.sharded.backends import backend_for
from spec import sharding

__all__ = ["ATTRIBUTES", "ShardedCallSpec", "ShardedCase", "ShardedResult", "backend_for", "call_options",
           "case_from_meta", "case_meta", "run_call", "run_sharded", "validate"]

#: Attributes of a sharded-level call (the keys an expected failure's ``match`` may use).
ATTRIBUTES = frozenset({"level", "device", "dtype", "world_size", "sharding", "sharded_causal", "scale", "scale_sign",
                        "B", "N", "K", "L", "E", "Ev", "gqa", "grad", "window", "window_left", "window_right",
                        "padded", "sharded_features", "backend", "shard_length"})


@dataclass(frozen=True, eq=False, repr=False)
class ShardedCase:
    """One sequence to shard over ``world_size`` ranks (module docstring). ``notes``: labels
    that change no call (a directed case's ``directed: NAME``, which the report names it by)."""

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    world_size: int = 1
    layout: str = "contiguous"
    causal: bool = False
    scale: float | None = None
    dtype: str = "float64"
    device: str = "cpu"
    regime: str = "normal"
    window: tuple[int, int] = (-1, -1)
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "window", (int(self.window[0]), int(self.window[1])))

    @property
    def level(self) -> str:
        return "sharded"

    B = property(lambda self: int(self.query.shape[0]))
    N = property(lambda self: int(self.query.shape[1]))
    K = property(lambda self: int(self.key.shape[1]))
    L = property(lambda self: int(self.query.shape[2]))
    E = property(lambda self: int(self.query.shape[3]))
    Ev = property(lambda self: int(self.value.shape[3]))

    @property
    def padded_length(self) -> int:
        """The length the ranks shard: L, or L padded up to the layout's divisor."""
        return sharding.padded_length(self.L, self.world_size, self.layout)

    @property
    def padded(self) -> bool:
        return self.padded_length != self.L

    @property
    def shard_length(self) -> int:
        return self.padded_length // self.world_size

    def features(self) -> set[str]:
        """The ``Capabilities.sharded_features`` this case uses."""
        return ({"window"} if self.window != (-1, -1) else set()) | ({"padding"} if self.padded else set())

    def attrs(self, **extra: Any) -> dict[str, Any]:
        out = {"level": "sharded", "device": self.device, "dtype": self.dtype, "world_size": self.world_size,
               "sharding": self.layout, "sharded_causal": bool(self.causal), "scale": self.scale,
               "scale_sign": _scale_sign(self.scale), "B": self.B, "N": self.N, "K": self.K, "L": self.L, "S": self.L, "E": self.E, "Ev": self.Ev,
               "gqa": self.K != self.N, "window": self.window != (-1, -1), "window_left": self.window[0],
               "window_right": self.window[1], "padded": self.padded, "sharded_features": self.features(),
               "backend": backend_for(self.device), "shard_length": self.shard_length}
        out.update(extra)
        return out

    def replace(self, **changes: Any) -> ShardedCase:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return ShardedCase(**values)

    def describe(self) -> str:
        padded = f", padded to {self.padded_length}" if self.padded else ""
        window = f" window={self.window}" if self.window != (-1, -1) else ""
        return (f"sharded world_size={self.world_size} layout={self.layout} B={self.B} N={self.N} K={self.K} "
                f"L={self.L} (shard {self.shard_length}{padded}) E={self.E} Ev={self.Ev} causal={self.causal}"
                f"{window} scale={self.scale} dtype={self.dtype} device={self.device} regime={self.regime}")

    def __repr__(self) -> str:
        return f"ShardedCase({self.describe()})"


@dataclass(frozen=True)
class ShardedResult:
    """What the ranks returned, unsharded: output (B, N, L, Ev), lse (B, N, L) or None,
    grads (dq, dk, dv) in the inputs' shapes or None (not asked, or one was None)."""

    output: np.ndarray
    lse: np.ndarray | None
    grads: tuple[np.ndarray | None, ...] | None


@dataclass(frozen=True, eq=False)
class ShardedCallSpec:
    """One sharded call exactly as made: the case and the upstream gradient (None: forward only)."""

    case: ShardedCase
    grad_output: np.ndarray | None = None

    @property
    def level(self) -> str:
        return "sharded"

    def attrs(self) -> dict[str, Any]:
        return self.case.attrs(grad=self.grad_output is not None)

    def arguments(self) -> str:
        c = self.case
        extra = "".join(f", {k}={v!r}" for k, v in call_options(c).items())
        return (f"group=<the default group: ranks 0..{c.world_size - 1}>, world_size={c.world_size}, causal={c.causal!r}, "
                f"softmax_scale={c.scale!r}, layout={c.layout!r}{extra}")

    def describe(self) -> str:
        grad = "; backward with a random grad_output" if self.grad_output is not None else ""
        return f"{self.case.describe()}; {self.arguments()}{grad}"

    def same_as(self, case: Any) -> bool:
        return self.case is case

    def ran(self) -> dict[str, set[Any]]:
        """How the call ran, for the certificate: the backend and the world size."""
        return {"backend": {backend_for(self.case.device)}, "world_sizes": {self.case.world_size}}


def call_options(case: ShardedCase) -> dict[str, Any]:
    """The keyword arguments of a declared feature that ``case`` uses, as passed to every
    rank: ``window_size`` only for a window, ``seq_len`` (the unpadded L) only for a
    padded sequence (an implementation declaring neither never receives them)."""
    options: dict[str, Any] = {}
    if case.window != (-1, -1):
        options["window_size"] = case.window
    if case.padded:
        options["seq_len"] = case.L
    return options


def validate(case: ShardedCase) -> None:
    """ValueError when the spec calls ``case`` invalid (shapes, GQA, window)."""
    for name in ("query", "key", "value"):
        if np.ndim(getattr(case, name)) != 4:
            raise ValueError(f"{name} has shape {np.shape(getattr(case, name))}, but should be 4-D (B, heads, L, dim)")
    if case.key.shape[2] != case.L or case.value.shape[2] != case.L:
        raise ValueError("key and value must have the query's length L (self-attention over one sequence)")
    if case.N % case.K:
        raise ValueError(f"K={case.K} kv heads must divide N={case.N} query heads (GQA)")
    sharding.positions(case.padded_length, case.world_size, 0, case.layout)  # SpecError (a ValueError)
    sharding.allowed([0], [0], window=case.window)  # SpecError for a window side below -1


def _shapes(case: ShardedCase) -> dict[str, tuple[int, ...]]:
    Ls = case.shard_length
    return {"output": (case.B, case.N, Ls, case.Ev), "lse": (case.B, case.N, Ls),
            "dquery": (case.B, case.N, Ls, case.E), "dkey": (case.B, case.K, Ls, case.E),
            "dvalue": (case.B, case.K, Ls, case.Ev)}


def _unshard(case: ShardedCase, replies: list[dict[str, Any]], lse_declared: bool,
             with_grad: bool) -> ShardedResult:
    __tracebackhide__ = True
    shapes = _shapes(case)
    for rank, reply in enumerate(replies):
        if "contract" in reply:
            fail(f"rank {rank}: impl.sharded {reply['contract']}")
        if reply["output"].shape != shapes["output"]:
            fail(f"rank {rank}: output shard has shape {reply['output'].shape}, but should be (B, N, L_shard, Ev) "
                 f"= {shapes['output']}")
        if reply["out_dtype"] != case.dtype:
            fail(f"rank {rank}: output dtype={reply['out_dtype']}, but should be {case.dtype} (the input dtype)")
        if lse_declared and reply["lse"] is None:
            fail(f"rank {rank}: no LSE tensor returned, but sharded_lse is declared (return (output, lse))")
        if lse_declared and reply["lse"].shape != shapes["lse"]:
            fail(f"rank {rank}: LSE shard has shape {reply['lse'].shape}, but should be (B, N, L_shard) = "
                 f"{shapes['lse']}")
    L = case.L
    output = sharding.unshard([r["output"] for r in replies], case.layout, length=L)
    lse = sharding.unshard([r["lse"][..., None] for r in replies], case.layout, length=L)[..., 0] \
        if lse_declared else None
    grads = None
    if with_grad:
        grads = []
        for i, name in enumerate(("dquery", "dkey", "dvalue")):
            parts = [r["grads"][i] for r in replies]
            missing = [rank for rank, p in enumerate(parts) if p is None]
            if missing:
                fail(f"{name} is None on rank(s) {missing}, but should be a gradient (autograd is declared)")
            bad = [rank for rank, p in enumerate(parts) if p.shape != shapes[name]]
            if bad:
                fail(f"rank {bad[0]}: {name} shard has shape {parts[bad[0]].shape}, should be {shapes[name]}")
            grads.append(sharding.unshard(parts, case.layout, length=L))
        grads = tuple(grads)
    return ShardedResult(output, lse, grads)


def run_call(impl: Any, call: ShardedCallSpec, *, timeout: float, lse_declared: bool) -> ShardedResult:
    """Make ``call`` on the worker group of ``impl``; the unsharded result. A hang, crash or
    exception of a rank raises ``ImplementationHung`` / ``Crashed`` / ``Raised``."""
    __tracebackhide__ = True
    from conformance.sharded import group as groups

    case = call.case
    request = {"query": case.query, "key": case.key, "value": case.value, "layout": case.layout,
               "causal": bool(case.causal), "scale": case.scale, "dtype": case.dtype, "device": case.device,
               "options": call_options(case), "grad_output": call.grad_output}
    group = groups.group_for(impl, case.device, case.world_size)
    name = getattr(impl, "name", "the implementation")
    W = case.world_size
    try:
        replies = group.call(request, W, timeout)
    except groups.GroupHung as exc:
        raise ImplementationHung(f"{name} hung (per-example timeout, --example-timeout): {exc}. Every rank of "
                                 f"the group of world size {W} was killed; it is restarted") from None
    except groups.GroupCrashed as exc:
        raise ImplementationCrashed(f"{name} crashed: {exc}; every rank of the group of world size {W} was "
                                    "killed; it is restarted") from None
    except groups.GroupRaised as exc:
        raise ImplementationRaised(f"{name} raised on a case it claims to support: {exc}") from None
    except groups.GroupStartFailed as exc:
        raise ImplementationRaised(str(exc)) from None
    return _unshard(case, replies, lse_declared, call.grad_output is not None)


def run_sharded(target: Target, case: ShardedCase, grad_output: np.ndarray | None = None) -> ShardedResult:
    """``target.impl.sharded`` on ``case`` in the worker group, the call logged."""
    __tracebackhide__ = True
    call = ShardedCallSpec(case, grad_output)
    if target.log is not None:
        target.log.calls.append(call)
    result = run_call(target.impl, call, timeout=target.timeout, lse_declared=target.caps.sharded_lse)
    observe_sharded(case, result.output)
    return result


# -- saving and reproducing ------------------------------------------------------------------

_ARRAYS = ("query", "key", "value")


def case_meta(case: ShardedCase) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    meta = {"kind": "sharded", "world_size": int(case.world_size), "layout": case.layout,
            "causal": bool(case.causal), "scale": case.scale, "dtype": case.dtype, "device": case.device,
            "regime": case.regime, "window": [int(x) for x in case.window], "notes": list(case.notes)}
    return meta, {n: np.asarray(getattr(case, n)) for n in _ARRAYS}


def case_from_meta(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> ShardedCase:
    return ShardedCase(**{n: arrays[n] for n in _ARRAYS}, world_size=int(meta["world_size"]),
                       layout=meta["layout"], causal=bool(meta["causal"]), scale=meta["scale"],
                       dtype=meta["dtype"], device=meta["device"], regime=meta.get("regime", "normal"),
                       window=tuple(meta.get("window", (-1, -1))),
                       notes=tuple(meta.get("notes", ())))  # absent in older files
