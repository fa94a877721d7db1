"""Under the derandomized ci profile every value regime a property's strategy can
draw reaches that property at least once (its directed examples carry each one):
``benchmarks/regime_coverage.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis.errors import InvalidArgument

from conformance.core.registry import registered_properties
from conformance.core.target import Target
from conformance.directed import examples as directed
from implementations import registry

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("impl", ["spec", "sdpa-flash", "triton"])
def test_directed_examples_carry_every_regime_the_strategy_can_draw(impl):
    implementation = registry.resolve(impl)
    caps = implementation.caps("sdpa")
    for info in registered_properties().values():
        if info.level != "sdpa" or info.cases is None:
            continue
        for dtype in caps.dtypes:
            target = Target(implementation, "sdpa", dtype, "cpu")
            try:
                strategy = info.cases(target)
            except InvalidArgument:  # the property's `requires` skips this target
                continue
            arguments = getattr(strategy, "case_arguments", None)
            if arguments is None:  # not an sdpa_cases strategy (scaling_variance: "normal" only)
                continue
            drawable = set(directed.producible_regimes(target, **arguments))
            carried = {case.regime for case in info.directed(target)} if info.directed else set()
            assert drawable <= carried, (info.id, dtype, sorted(drawable - carried))


def test_every_regime_property_pair_is_reached_under_ci(tmp_path):
    out = tmp_path / "coverage.json"
    proc = subprocess.run([sys.executable, "benchmarks/regime_coverage.py", "--impl", "spec",
                           "--dtype", "float32", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["exit"] == 0, proc.stdout[-3000:]
    assert len(result["producible"]) >= 15  # the SDPA properties that ran
    sdpa_level = {pid for pid, info in registered_properties().items() if info.level == "sdpa"}
    unreached = [(prop, regime) for prop, regimes in result["producible"].items() if prop in sdpa_level
                 for regime in regimes if not result["counts"].get(prop, {}).get(regime)]
    assert unreached == [], proc.stdout[-3000:]
