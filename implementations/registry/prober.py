"""Making probe calls and reading what they did, for every probe of the registry (SDPA,
MHA, flash): each call guarded (:func:`implementations.guard.guarded_call`: a timeout, every
exception captured, global state restored), a capability found by whether a call runs in
each dtype, and the one semantic value a probe may adopt, the fully-masked row's policy
(:func:`_fully_masked_declaration`), adopted only when the kinds of blocking agree."""

from __future__ import annotations

from typing import Any, Callable

from implementations.base import ALL_DTYPES, ImplementationError
from implementations.guard import CallRaised, CallTimedOut, guarded_call
from implementations.registry._errors import summarise
from implementations.registry.probe_plan import NOT_DECLARED, unprobed_value

__all__ = ["BUILD_TIMEOUT", "DEFAULT_PROBE_TIMEOUT", "build_limit"]

#: Seconds a probe call may take when the caller gives no timeout.
DEFAULT_PROBE_TIMEOUT = 60.0
#: Seconds an import or a zero-argument builder may take at least: importing torch or
#: compiling kernels is slow (a longer call timeout applies when one is given).
BUILD_TIMEOUT = 300.0


def build_limit(timeout: float | None) -> float | None:
    """The limit for importing or building an implementation under call timeout ``timeout``."""
    return max(timeout, BUILD_TIMEOUT) if timeout else None


class _Prober:
    """Makes the probe calls of one implementation: ``call`` returns the result or
    raises the implementation's exception as :class:`CallRaised`; a probe that does
    not return within ``timeout`` is an ImplementationError."""

    def __init__(self, origin: str, timeout: float | None, level: str = "") -> None:
        self.origin, self.timeout, self.level = origin, timeout, level

    def given(self, field: str, dtype: str | None = None) -> Any:
        """A declaration's value of ``field`` at this prober's level (in ``dtype``), which
        is then not probed; :data:`NOT_DECLARED` when it is probed (``probe_plan.unprobed_value``)."""
        return unprobed_value(field, self.level, dtype)

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        # The first probe call is the first call into the implementation: it may compile
        # (guard.COMPILE_FACTOR x the timeout); a slow one is noted in ``slow_first_call``.
        import time

        from implementations.guard import COMPILE_FACTOR

        started = time.monotonic()
        try:
            return guarded_call(fn, timeout=self.timeout, rng=True, warm_key=self.__dict__.setdefault("_warm_key", ("probe", self.origin, object())))
        except CallTimedOut as exc:
            raise ImplementationError(
                f"{self.origin}: probing {what} {exc} (--example-timeout); fix the hang, or "
                "skip probing by declaring the capabilities yourself with "
                "implementations.Implementation(..., capabilities=Capabilities(...))"
            ) from None
        finally:
            seconds = time.monotonic() - started
            if self.timeout and not getattr(self, "slow_first_call", "") and seconds > self.timeout:
                self.slow_first_call = (f"first call took {seconds:.0f} s: compile time allowed "
                                        f"(up to {COMPILE_FACTOR:g} x --example-timeout)")

    def tried(self, what: str, fn: Callable[[], Any]) -> str | None:
        """None when ``fn()`` returns (and not False), else what it did, for a note
        (``"raised ValueError('...')"``)."""
        try:
            result = self.call(what, fn)
        except CallRaised as exc:
            return f"raised {summarise(exc.error)}"
        return "returned False" if result is False else None

    def runs(self, what: str, fn: Callable[[], Any]) -> bool:
        """Whether ``fn()`` returns without raising (and does not return False)."""
        try:
            return self.call(what, fn) is not False
        except CallRaised:
            return False


def _describe_result(out: Any) -> str:
    import torch

    if isinstance(out, torch.Tensor):
        return f"a {out.device.type} tensor of shape {tuple(out.shape)} and dtype {out.dtype}"
    return "None" if out is None else f"a {type(out).__module__}.{type(out).__qualname__}"


def _is_output(out: Any, shape: tuple[int, ...]) -> bool:
    import torch

    return isinstance(out, torch.Tensor) and tuple(out.shape) == shape and out.device.type == "cpu"


def _try(probe: _Prober, what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``'s result, or None when it raises."""
    try:
        return probe.call(what, fn)
    except CallRaised:
        return None


def _supports(probe: _Prober, name: str, what: str, fn: Callable[[], Any], notes: list[str],
              dtype: str = "float32") -> bool:
    """Whether ``fn()`` runs; when not, a note of what it raised (``name: what in dtype raised ...``)."""
    if (value := probe.given(name)) is not NOT_DECLARED:
        return bool(value)
    said = probe.tried(what, fn)
    if said:
        notes.append(f"{name}: {what} in {dtype} {said}; declared unsupported")
    return said is None


def _dtypes_that_run(probe: _Prober, call: Callable[[str], Any], notes: list[str],
                     candidates: tuple[str, ...] = ALL_DTYPES) -> tuple[str, ...]:
    """The dtypes among ``candidates`` (the declared ones, else all) in which a plain call
    runs; a note for each one that does not (declared: the declared ones, no call)."""
    if (declared := probe.given("dtypes")) is not NOT_DECLARED:
        return tuple(d for d in ALL_DTYPES if d in declared)
    dtypes = []
    for dtype in [d for d in ALL_DTYPES if d in candidates]:
        said = probe.tried(f"dtype {dtype}", lambda d=dtype: call(d))
        if said:
            notes.append(f"dtypes: a plain call in {dtype} {said}; {dtype} not declared")
        else:
            dtypes.append(dtype)
    return tuple(dtypes)


def _per_dtype_capabilities(probe: _Prober, probes: Callable[[str], dict[str, tuple]],
                            dtypes: tuple[str, ...], notes: list[str],
                            base_dtype: str = "float32") -> tuple[dict[str, bool], dict[str, dict]]:
    """Each capability of ``probes(dtype)`` (key -> ``(what, call)``, or ``(what, call,
    "direct")`` for a call that makes its own guarded calls and returns None or what
    happened) in float32 (the declaration) and in every other dtype that runs
    (``Capabilities.by_dtype`` where it differs). A guarded call is supported when it
    returns (not False). Every limitation found is a note naming what was tried, in which
    dtype, and what it did."""
    def outcome(what: str, call: Callable[[], Any], *direct: str) -> str | None:
        if direct:
            return call()
        try:
            result = probe.call(what, call)
        except CallRaised as exc:
            return f"raised {summarise(exc.error)}"
        if result is False:
            return "returned False"
        return None

    def field(key: str) -> str:
        return key.split(":", 1)[0]

    base = {}
    for key, (what, *call) in probes(base_dtype).items():
        if (value := probe.given(key, base_dtype)) is not NOT_DECLARED:  # declared: not probed
            base[key] = bool(value)
            continue
        said = outcome(f"{what} in {base_dtype}", *call)
        base[key] = said is None
        if said:
            notes.append(f"{field(key)}: {what} in {base_dtype} {said}; declared unsupported")
    by_dtype: dict[str, dict] = {}
    for dtype in dtypes:
        if dtype == base_dtype:
            continue
        for key, (what, *call) in probes(dtype).items():
            if probe.given(key, dtype) is not NOT_DECLARED:  # the declaration holds in this dtype
                continue
            said = outcome(f"{what} in {dtype}", *call)
            if (said is None) != base[key]:
                by_dtype.setdefault(dtype, {})[key] = said is None
                notes.append(f"{field(key)}: {what} in {dtype} {said}; unsupported in {dtype}" if said else
                             f"{field(key)}: {what} in {dtype} works (not in {base_dtype}); supported in {dtype}")
    return base, by_dtype


# --------------------------------------------------------------------------- the fully-masked row


def _kinds_text(policies: dict[str, str]) -> str:
    """``bool:zero,additive:nan`` (the ``--impl-option fully_masked=`` syntax)."""
    return ",".join(f"{kind}:{policy}" for kind, policy in policies.items())


#: What blocks every key of a probed row, per kind, for the notes.
_BLOCKED_BY = {"bool": "a bool mask", "additive": "a -inf additive mask",
               "causal": "the causal flag alone (query length 3, key length 2)"}


def _fully_masked_declaration(observed: dict[str, str], notes: list[str], level: str = "",
                              blocked_by: dict[str, str] | None = None,
                              dtype: str | None = None) -> tuple[str, str]:
    """The declared fully-masked policy and its source, from the policies ``observed`` per
    kind of blocking. The contract leaves the value open, so a probed policy is adopted
    (source ``probed``) when every probed kind gives the same non-attending one (zero or
    nan). A policy that differs between kinds, attends blocked keys (``uniform``) or could
    not be classified (``unspecified``) is not: the declaration stays at the agreeing
    kinds' zero or nan, else the contract default zero (source ``contract``), so the
    fully-masked property fails on the offending rows; the note names what was seen and
    the ``--impl-option`` that would declare it (``DTYPE.fully_masked=`` when ``dtype`` is
    given: the rows were probed in that dtype and another dtype's differ)."""
    where = (f" at the {level} level" if level else "") + (f" in {dtype}" if dtype else "")
    key = f"{dtype}.fully_masked" if dtype else "fully_masked"
    if not observed:
        return "zero", "contract"
    seen = set(observed.values())
    text = _kinds_text(observed)
    blocked_by = {**_BLOCKED_BY, **(blocked_by or {})}
    said = "; ".join(f"{blocked_by.get(kind, kind)}: {policy}" for kind, policy in observed.items())
    if len(seen) == 1 and seen <= {"zero", "nan"}:
        notes.append(f"fully_masked: a row with every key blocked came out {seen.pop()} ({said}){where}; "
                     "the contract leaves it open, so this probed policy is adopted")
        return observed[next(iter(observed))], "probed"
    why = []
    if len(seen) > 1:
        why.append("it differs between the kinds of blocking")
    if "uniform" in seen:
        why.append("uniform rows attend the keys the mask or causal rule blocks")
    if "unspecified" in seen:
        why.append("the probe could not classify " + ", ".join(
            k for k, p in observed.items() if p == "unspecified") + " rows (neither zero, NaN nor the mean of V, "
            "or the call raised)")
    agreeing = seen & {"zero", "nan"}
    fallback = agreeing.pop() if len(agreeing) == 1 else "zero"
    hint = text if len(seen) > 1 else seen.pop()
    notes.append(f"fully_masked: probed {text}{where} ({said}); not adopted: {'; '.join(why)}; declared "
                 f"{fallback}, so the fully-masked property tests it and fails on those rows; if the "
                 f"probed behaviour is intended, declare --impl-option {key}={hint}")
    return fallback, "contract"
