"""Shrinking a failing directed case of the flash and varlen dropout properties
(``conformance.directed.shrink``, admitted by ``conformance.directed.admission``): their
directed cases remember the strategy's bounds and are admitted, no proposal leaves them,
a varlen expectation case keeps its values positive (the Hoeffding bound's premise, as
its strategy draws them), and dropout mutants are reported on cases shrunk from the
directed case they failed."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from conformance.core.registry import registered_properties
from conformance.core.target import Target
from conformance.directed import shrink
from conformance.directed.admission import admitted
from implementations import registry
from implementations.mutants import controls
from tests.mutant_runs import certify_mutant

ROOT = Path(__file__).resolve().parents[2]
#: Each property, the level, and a correct implementation that declares its dropout.
PROPERTIES = {"flash_dropout_expectation": ("flash", controls.flash),
              "varlen_dropout_expectation": ("varlen", registry.resolve("varlen-reference")),
              "varlen_dropout_pattern_agreement": ("varlen", registry.resolve("varlen-reference"))}


def _cases(pid: str) -> tuple[Target, list]:
    level, impl = PROPERTIES[pid]
    target = Target(impl, level, "float64", "cpu")
    info = registered_properties()[pid]
    assert info.skip_reason is None or not info.skip_reason(target)
    return target, info.directed(target)


@pytest.mark.parametrize("pid", sorted(PROPERTIES))
def test_dropout_directed_cases_remember_their_bounds_and_are_admitted(pid):
    target, cases = _cases(pid)
    assert len(cases) >= 3
    for case in cases:
        arguments = shrink.arguments_of(case)
        assert arguments is not None and arguments.get("max_len", arguments.get("max_S")) in (4, 8), arguments
        # as written (the varlen level's own directed layouts go to 4 sequences, one more
        # than these properties draw: only their proposals are held to 3)
        wider = {"max_batch": case.B} if pid.startswith("varlen") and case.B > 3 else {}
        assert admitted(target, case, **{**arguments, **wider}), case.describe()
        proposals = [c for p in shrink.passes(case) for c in p(case) if c is not None]
        assert any(admitted(target, c, **arguments) for c in proposals), case.describe()
        for c in proposals:
            if admitted(target, c, **arguments):  # inside the strategy's bounds
                assert max(max(pair) for pair in c.lengths()) <= 4 if pid.startswith("varlen") else \
                    (c.L <= 4 and c.S <= 8), c.describe()


def test_a_varlen_expectation_case_keeps_its_values_positive():
    target, cases = _cases("varlen_dropout_expectation")
    refused = kept = 0
    for case in cases:
        arguments = shrink.arguments_of(case)
        assert arguments["positive_values"] is True and np.all(case.value > 0)
        for c in (c for p in shrink.passes(case) for c in p(case) if c is not None):
            if admitted(target, c, **arguments):
                assert np.all(c.value > 0), c.describe()
                kept += 1
            elif np.any(c.value <= 0):
                # the same proposal with V positive would be admitted: refused for its values alone
                assert admitted(target, c.replace(value=np.abs(c.value) + 0.5), **arguments), c.describe()
                refused += 1
    assert kept > 20 and refused > 0
    # the pattern property draws values of any sign
    _, pattern = _cases("varlen_dropout_pattern_agreement")
    assert "positive_values" not in shrink.arguments_of(pattern[0])



@pytest.mark.parametrize("mutant,prop,name,directed", [
    ("flash_dropout_without_rescale", "flash_dropout_expectation", "L=[^\"]+", "B=1 N=1 K=1 L=1 S=2 E=2 Ev=2"),
    ("varlen_dropout_no_rescale", "varlen_dropout_expectation",
     re.escape("a query whose neighbour's first key sits right after its own, V positive"),
     "varlen B=2 N=2 K=1 E=2 Ev=3"),
])
def test_a_dropout_mutant_is_reported_on_a_shrunk_case(tmp_path, mutant, prop, name, directed):
    report, output = certify_mutant(tmp_path, mutant, "conformance/test_flash_dropout.py", f"test_{prop}[")
    [r] = [r for r in report["results"] if r["property"] == prop]
    assert r["outcome"] == "failed", output[-3000:]
    # where it started: the directed example's name and the case as written
    assert re.search(rf'\(shrunk in \d+ examples from the directed example "{name}": {re.escape(directed)}', output), \
        output[-3000:]
    ce = r["counterexample"]
    assert (ce["B"], ce["N"], ce["K"], ce["L"], ce["S"], ce["E"], ce["Ev"]) == (1, 1, 1, 1, 1, 1, 1), ce


def test_every_flash_level_directed_case_is_named():
    """Each directed case of the flash level (its properties, FP8 and dropout included) says
    what it is, so a report names the example a shrunk case started from: its lengths, then
    what its variant sets (a window, causal, ALiBi slopes, sinks, descales)."""
    names = []
    for pid, info in registered_properties().items():
        if info.level != "flash" or info.directed is None:
            continue
        for dtype in ("float64", "float32"):
            target = Target(controls.flash, "flash", dtype, "cpu")
            if info.skip_reason is not None and info.skip_reason(target):
                continue
            for case in info.directed(target):
                [note] = [n for n in case.notes if n.startswith("directed: ")]
                names.append((pid, note.removeprefix("directed: ")))
    assert len(names) >= 20, names
    assert all(name.split(",")[0].startswith("L=") for _, name in names), names
    assert any("window (0, 0)" in name for _, name in names), names
    assert any("causal" in name for _, name in names), names
