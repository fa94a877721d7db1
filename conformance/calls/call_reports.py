"""How one call's result differs from what the spec says: the report a reproducer prints.

:class:`CallReport` is what each level's report function fills (``report_sdpa_call`` /
``report_mha_call`` in :mod:`conformance.calls.replay`, ``report_call`` in the module of
each level of :mod:`conformance.core.levels`), with the helpers they share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["CallReport"]


@dataclass
class CallReport:
    """How one call's result differs from what it should be (:func:`report_sdpa_call`)."""

    call: Any
    lines: list[str] = field(default_factory=list)  # what :meth:`text` prints, findings included
    findings: list[str] = field(default_factory=list)  # each way the result is wrong
    max_difference: float | None = None  # max |out - oracle| where both are finite

    @property
    def shows_failure(self) -> bool:
        return bool(self.findings)

    def finding(self, message: str) -> None:
        self.findings.append(message)
        self.lines.append("FAILS: " + message.replace("\n", "\n       "))

    def text(self) -> str:
        verdict = (f"=> this call shows the failure ({len(self.findings)} finding(s))" if self.findings
                   else "=> this call alone agrees with the oracle; the property compares several "
                        "calls (see --replay)")
        return "\n".join([*self.lines, verdict])


def _raised(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def _untouched(report: CallReport, handed: dict[str, Any], fresh: dict[str, Any]) -> None:
    """Inputs handed over must come back unchanged (compared with a fresh copy)."""
    import torch

    for name, old in fresh.items():
        now = handed.get(name)
        if not isinstance(old, torch.Tensor) or not isinstance(now, torch.Tensor):
            continue
        now, old = now.detach(), old.detach()
        same = torch.equal(now, old) if old.dtype == torch.bool else torch.equal(
            torch.nan_to_num(now), torch.nan_to_num(old))
        if not same:
            report.finding(f"input {name} was modified in place by the call, but should be left unchanged")


def _difference_line(report: CallReport, out: np.ndarray, ref: np.ndarray,
                     where: np.ndarray | None = None) -> None:
    if out.shape != ref.shape:
        return
    sel = np.ones(out.shape, bool) if where is None else np.broadcast_to(where, out.shape)
    both = sel & np.isfinite(out) & np.isfinite(ref)
    bad = sel & (np.isfinite(ref) != np.isfinite(out))
    diff = np.where(both, np.abs(out - ref), 0.0)
    report.max_difference = float(diff.max()) if diff.size else 0.0
    extra = f"; non-finite where the oracle is finite (or the reverse): {int(bad.sum())}" if bad.any() else ""
    report.lines.append(f"max |out - oracle| = {report.max_difference:.6g}{extra}")
