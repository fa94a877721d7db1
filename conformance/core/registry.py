"""The property registry: every property's definition and check, and what one property
test on one target measured (:class:`Record`, for the certificate).

:func:`conformance.harness.runner.conformance_property` fills it as the
``conformance/test_*.py`` modules are imported; :func:`registered_properties` imports
them all.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

from conformance.core.target import Target
from conformance.core.requirements import unmet

__all__ = ["PropertyInfo", "Record", "registered_properties", "registered_checks", "skip_reasons"]


@dataclass(frozen=True)
class PropertyInfo:
    """A registered property: its id, level ("sdpa", "mha", "varlen", "kvcache"), the spec section
    it checks (``spec.<name> (...)``), its docstring, its share of the
    profile's examples, and its case sources: ``cases(target)`` (the Hypothesis
    strategy) and ``directed(target)`` (the explicit cases run first); ``skip_reason``
    as given to :func:`conformance_property`; ``sweep``: a sweep property's run."""

    id: str
    level: str
    section: str
    doc: str
    examples_factor: float
    cases: Callable[[Target], Any] | None = field(default=None, compare=False, repr=False)
    directed: Callable[[Target], list[Any]] | None = field(default=None, compare=False, repr=False)
    skip_reason: Callable[[Target], str | None] | None = field(default=None, compare=False, repr=False)
    #: What the property requires of the target's capabilities, as data
    #: (:data:`conformance.core.requirements.REQUIREMENTS` names), checked before ``skip_reason``.
    requires: tuple[str, ...] = ()
    #: A sweep's whole run (``conformance.harness.sweep``): ``sweep(target, session, record)`` -> its Sweep.
    sweep: Callable[[Target, Any, Record], Any] | None = field(default=None, compare=False, repr=False)


#: Every property, filled by :func:`conformance_property` as the
#: ``conformance/test_*.py`` modules are imported; read it through
#: :func:`registered_properties`. Definitions only: the same in every session.
_PROPERTIES: dict[str, PropertyInfo] = {}
#: Each property's ``check(target, case)`` by id (what an isolated worker runs).
_CHECKS: dict[str, Callable[[Any, Any], float | None]] = {}


def registered_properties() -> Mapping[str, PropertyInfo]:
    """Every property of the suite by id (imports each ``conformance/test_*.py``).

    The one list of properties: the README's table, docs/CONTRACTS.md and the
    bug zoo's records are tested against it.
    """
    import conformance

    for module in pkgutil.iter_modules(conformance.__path__):
        if module.name.startswith("test_"):
            importlib.import_module(f"conformance.{module.name}")
    return MappingProxyType(_PROPERTIES)


def registered_checks() -> Mapping[str, Callable[[Target, Any], float | None]]:
    """Each property's ``check(target, case)`` by id (imports every property module)."""
    registered_properties()
    return MappingProxyType(_CHECKS)


@dataclass
class Record:
    """What one property test on one target measured (for the certificate)."""

    property: str
    level: str
    dtype: str
    device: str
    outcome: str = "passed"
    examples: int = 0
    worst_ratio: float | None = None
    seconds: float = 0.0
    reason: str = ""
    counterexample: dict[str, Any] | None = None
    message: str = ""
    failure_file: str = ""
    reproducer: str = ""
    xfail_hits: int = 0
    xfail_reason: str = ""
    failing_case: Any = field(default=None, repr=False)
    #: The calls the failing example made, in order (replay call specs).
    failing_calls: tuple[Any, ...] = field(default=(), repr=False)
    first_failure_seconds: float | None = None
    causes: list[dict[str, Any]] = field(default_factory=list)  # conformance.diagnosis.diagnose, best first
    #: Examples run after the first failure (shrinking); ``examples`` stops counting there.
    shrink_examples: int = 0
    #: The call the reproducer makes, as a dict (set when it is not the drawn case as is).
    called: dict[str, Any] | None = None
    #: Per expected-failure entry of this property: index, hits, covered passes.
    expected_failures: list[dict[str, Any]] = field(default_factory=list)
    #: How the calls ran, where a level's call says (``CallSpec.ran()``; the sharded level:
    #: ``backend`` and ``world_sizes``), each a sorted list of the values seen.
    ran: dict[str, list[Any]] = field(default_factory=dict)

    def note_ran(self, calls: Any) -> None:
        """Add what ``calls`` (call specs) say of how they ran to :attr:`ran`."""
        for call in calls:
            for key, values in (call.ran() if hasattr(call, "ran") else {}).items():
                self.ran[key] = sorted(set(self.ran.get(key, ())) | set(values))
    #: The call the reproducer makes and whether it alone shows the failure, when the
    #: isolated worker picked it (``isolation.supervisor.Worker.annotate``); None: picked here.
    picked_call: tuple[Any, bool | None] | None = field(default=None, repr=False)
    #: Timed-out calls whose threads were still running when the test ended (thread mode).
    leftover_threads: int = 0
    isolated: bool = False

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(dataclasses.replace(self, failing_case=None, failing_calls=(), picked_call=None))
        del d["failing_case"], d["failing_calls"], d["picked_call"]
        return d


def skip_reasons(info: PropertyInfo, target: Target) -> list[str]:
    """Why ``target`` (at the property's level) cannot have property ``info`` checked:
    what the implementation does not support, what the property ``requires``, then its own
    ``skip_reason``."""
    reasons = _target_skip_reasons(target, info.level)
    if info.requires and not reasons:
        reasons = unmet(info.requires, target.caps)
    if info.skip_reason is not None and not reasons:
        reason = info.skip_reason(target)
        reasons = [reason] if reason else []
    if not reasons and target.caps.causal_only and info.level == "sdpa":
        reasons = _non_causal_only(info, target)
    if not reasons and target.caps.causal_only and info.level == "mha":
        reasons = _mha_causal_only(info, target)
    return reasons


def _mha_causal_only(info: PropertyInfo, target: Target) -> list[str]:
    """An MHA property whose cases cannot be drawn causal (non-causal calls only, or a
    fully-masked row with no key padding mask to put it in) on a ``causal_only`` target."""
    from hypothesis.errors import InvalidArgument

    try:
        info.cases(target)
    except InvalidArgument as err:
        return [f"causal_only declares causal calls only, and this property's cases cannot be: {err}"]
    except Exception:  # noqa: BLE001 - the property's own error shows when it runs
        return []
    return []


def _non_causal_only(info: PropertyInfo, target: Target) -> list[str]:
    """A property whose strategy asks for non-causal cases only (``causal=(None,)``) on a
    ``causal_only`` target: it cannot run there."""
    try:
        asked = getattr(info.cases(target), "case_arguments", {}).get("causal")
    except Exception:  # noqa: BLE001 - the property's own error shows when it runs
        return []
    if asked is not None and target.caps.causal not in asked:
        return [f"the property checks non-causal calls (causal={tuple(asked)}), but causal_only "
                "declares causal calls only"]
    return []


def _target_skip_reasons(target: Target, level: str) -> list[str]:
    reasons = target.impl.not_supported_reasons(
        {"level": level, "device": target.device, "dtype": target.dtype}
    )
    if not reasons and target.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return ["no CUDA device on this machine (torch.cuda.is_available() is False)"]
    return reasons
