"""Declarations first: the user's ``--impl-option`` values in force while probing.

The registry parses ``--impl-option`` values *before* it recognises and probes an
implementation (:func:`declared_for_probes`, set by ``resolution.resolve``), and every
probe call is built inside them (:class:`ProbePlan`): the first dtype declared (float32
when it is among them), a head dim inside ``min_head_dim`` / ``max_head_dim`` /
``head_dims``, lengths that are multiples of ``seq_multiple``, and ``causal=True`` on every
call of a ``causal_only`` kernel. A real kernel with tile limits is then probed on calls it
can run, with no adapter.

When the first call raises, :func:`first_call_hint` tries a few calls that a declaration
would allow (a 16-bit dtype, a larger head dim, block-multiple lengths, causal only), each
on its own and then together, and names the ``--impl-option`` values under which one ran.
What the probes find is still only capabilities; semantics stay the signature's contract.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from implementations.base import ALL_DTYPES

__all__ = ["ProbePlan", "current_declarations", "declared_for_probes", "first_call_hint", "probe_plan",
           "unprobed_value"]

_DECLARED: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar("declared_for_probes",
                                                                                     default=None)
#: scope ("" every level, a level, a dtype) -> field -> value: what a declaration gives, not probed.
_UNPROBED: contextvars.ContextVar[Mapping[str, Mapping[str, Any]] | None] = contextvars.ContextVar(
    "unprobed", default=None)

#: The declarations a probe call is built inside (parsed ``--impl-option`` values).
PROBE_FIELDS = ("dtypes", "min_head_dim", "max_head_dim", "head_dims", "seq_multiple", "seq_block", "causal_only",
                "max_seq_len", "self_attention_lengths", "jit", "backward_seq_multiple")


@contextlib.contextmanager
def declared_for_probes(values: Any, unprobed: tuple[str, ...] = ()) -> Iterator[None]:
    """Probe calls made inside this block are built inside ``values`` (parsed options:
    a mapping, or ``options.ParsedOptions``, whose options for every level count). The
    fields of the option keys ``unprobed`` (a declaration's, ``flash.head_dims`` scoped) are
    not probed: a probe reads their value (:func:`unprobed_value`) instead of calling."""
    scoped = {"": dict(getattr(values, "common", values))}
    scoped.update(getattr(values, "per_level", {}))
    skipped: dict[str, dict[str, Any]] = {}
    for key in unprobed:
        scope, dot, name = key.rpartition(".")
        held = {**scoped, **getattr(values, "per_dtype", {})}.get(scope, {})
        if name in held:  # absent: moved by the options (8-bit dtypes go to fp8_dtypes)
            skipped.setdefault(scope, {})[name] = held[name]
    token = _DECLARED.set({scope: {k: v for k, v in vals.items() if k in PROBE_FIELDS}
                           for scope, vals in scoped.items()})
    unprobed_token = _UNPROBED.set(skipped)
    try:
        yield
    finally:
        _UNPROBED.reset(unprobed_token)
        _DECLARED.reset(token)


_MISSING = object()


def unprobed_value(field: str, level: str, dtype: str | None = None) -> Any:
    """The declared value of ``field`` (``mask_kinds:bool``: whether ``bool`` is among the
    declared mask kinds) at ``level`` in ``dtype`` when a declaration gives it, so that no
    probe call finds it; else :data:`NOT_DECLARED`."""
    name, _, part = field.partition(":")
    scoped = _UNPROBED.get() or {}
    value = _MISSING
    for scope in ("", level, dtype or ""):  # the narrower scope wins
        value = scoped.get(scope, {}).get(name, value)
    if value is _MISSING:
        return NOT_DECLARED
    return part in value if part else value


#: What :func:`unprobed_value` returns for a field that is probed.
NOT_DECLARED = _MISSING


def current_declarations(level: str = "") -> Mapping[str, Any]:
    """The declarations in force for the probe calls of ``level`` (every level's, then its own)."""
    scoped = _DECLARED.get() or {}
    return {**scoped.get("", {}), **(scoped.get(level, {}) if level else {})}


@dataclass(frozen=True)
class ProbePlan:
    """The sizes, dtype and causal flag probe calls are built with."""

    dtype: str
    #: The dtypes a plain call is tried in (the declared ones, else every dtype).
    dtypes: tuple[str, ...]
    E: int
    #: A second head dim for the Ev != E probe (None: the declarations leave only one).
    Ev_other: int | None
    L: int
    S: int
    causal_only: bool
    #: Declared (not the defaults): the notes then say so.
    declared: tuple[str, ...] = ()

    def describe(self) -> str:
        causal = " causal" if self.causal_only else ""
        return f"a plain {self.dtype}{causal} call with E={self.E}, L={self.L}, S={self.S}"


def _head_dim_ok(E: int, declared: Mapping[str, Any]) -> bool:
    dims = declared.get("head_dims")
    lo, hi = declared.get("min_head_dim") or 1, declared.get("max_head_dim")
    return (dims is None or E in dims) and E >= lo and (hi is None or E <= hi)


def probe_plan(default_L: int = 2, default_S: int = 3, default_E: int = 4,
               declared: Mapping[str, Any] | None = None, level: str = "") -> ProbePlan:
    """The plan under ``declared`` (default: the declarations in force); with none, the
    historical tiny probe: float32, E = 4, L = 2, S = 3, non-causal."""
    declared = current_declarations(level) if declared is None else declared
    dtypes = tuple(declared.get("dtypes") or ALL_DTYPES)
    dtype = "float32" if "float32" in dtypes else dtypes[0]
    dims = declared.get("head_dims")
    lo, hi = declared.get("min_head_dim") or 1, declared.get("max_head_dim")
    if dims:
        inside = [d for d in sorted(dims) if _head_dim_ok(d, declared)] or sorted(dims)
        E, others = inside[0], inside[1:]
        Ev_other = others[0] if others else None
    else:
        E = max(default_E, lo)
        if hi is not None:
            E = max(min(E, hi), lo)
        Ev_other = E - 1 if E - 1 >= lo else (E + 1 if hi is None or E + 1 <= hi else None)
    m = declared.get("seq_multiple") or 0
    L, S = (m, 2 * m) if m else (default_L, default_S)
    block = declared.get("seq_block")
    if block and not m:  # inside one block (any length up to it is taken)
        L, S = min(L, block), min(S, block)
    if declared.get("self_attention_lengths"):
        L = S
    return ProbePlan(dtype=dtype, dtypes=dtypes, E=E, Ev_other=Ev_other, L=L, S=S,
                     causal_only=bool(declared.get("causal_only")),
                     declared=tuple(k for k in PROBE_FIELDS if k in declared))


#: Per kind of kernel limit, the declarations tried when the first call raises.
_CANDIDATES: tuple[tuple[tuple[str, dict[str, Any]], ...], ...] = (
    (("dtypes=float16,bfloat16", {"dtypes": ("float16", "bfloat16")}),),
    (("min_head_dim=16", {"min_head_dim": 16}), ("min_head_dim=64", {"min_head_dim": 64})),
    (("seq_multiple=16", {"seq_multiple": 16}), ("seq_multiple=64", {"seq_multiple": 64})),
    (("causal_only=true", {"causal_only": True}),),
)


def _combinations(declared: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """Combinations of candidate declarations not given yet, fewest first."""
    import itertools

    kinds = [[None, *options] for options in _CANDIDATES
             if not any(key in declared for _, change in options for key in change)]
    combos = [tuple(c for c in combo if c is not None) for combo in itertools.product(*kinds)]
    return sorted((c for c in combos if c), key=len)


def first_call_hint(attempt: Callable[[ProbePlan], bool], declared: Mapping[str, Any] | None = None,
                    level: str = "", **defaults: int) -> str:
    """``; a call built inside ... runs: ... declare --impl-option ...``: the fewest
    declarations (not given yet) under which ``attempt(plan)`` (a plain call built by the
    plan; True when it ran) ran; when none did, the declarations that exist for such limits."""
    declared = dict(current_declarations(level) if declared is None else declared)
    for combo in _combinations(declared):
        change: dict[str, Any] = {}
        for _, values in combo:
            change.update(values)
        plan = probe_plan(declared={**declared, **change}, **defaults)
        if attempt(plan):
            texts = [text for text, _ in combo]
            options = " ".join(f"--impl-option {t}" for t in texts)
            also = (f" (or head_dims=... listing the head dims it runs, e.g. head_dims={plan.E},{2 * plan.E}, "
                    "if only some run)" if any(t.startswith("min_head_dim") for t in texts) else "")
            return (f"; a call built inside {', '.join(texts)} ({plan.describe()}) runs: if the kernel "
                    f"needs that, declare {options}{also}")
    return ("; no call built inside the usual kernel limits ran either (16-bit dtypes, head dims "
            "of at least 16 or 64, lengths multiples of 16 or 64, causal only, alone and together); "
            "declare the limits with --impl-option dtypes=, min_head_dim=, max_head_dim=, head_dims=, "
            "seq_multiple=, causal_only=true, or declare the capabilities yourself with an Implementation")
