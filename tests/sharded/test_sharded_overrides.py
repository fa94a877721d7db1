"""``--impl-option`` overrides reach the sharded level's capabilities on the built-in ring
and all-to-all attention: ``dtypes`` chooses the dtypes the level runs, and
``sharded_features`` the features its cases use (none: no window, no padding)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings

from conformance.sharded.strategies import sharded_cases, sharded_directed
from implementations import registry
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]
BUILTINS = ("ring", "ulysses")


@pytest.mark.parametrize("name", BUILTINS)
def test_dtypes_override_reaches_the_sharded_level(name):
    impl = registry.resolve(name, {"dtypes": "float32"})
    assert impl.caps("sharded").dtypes == ("float32",)
    assert registry.resolve(name).caps("sharded").dtypes == ("float64", "float32")  # the declaration


@pytest.mark.parametrize("name", BUILTINS)
@pytest.mark.parametrize("features, allowed", [("none", set()), ("window", {"window"})])
def test_sharded_features_override_reaches_the_cases(name, features, allowed):
    """With ``sharded_features=none`` no drawn or directed case has a window or padding;
    with ``window`` only, some have a window and none padding."""
    caps = registry.resolve(name, {"sharded_features": features}).caps("sharded")
    assert caps.sharded_features == frozenset(allowed)
    seen: set[str] = set()

    @settings(max_examples=60, database=None, deadline=None)
    @given(sharded_cases(dtype="float64", device="cpu", caps=caps))
    def drawn(case):
        assert case.features() <= allowed, case
        seen.update(case.features())

    drawn()
    assert all(c.features() <= allowed for c in sharded_directed(dtype="float64", device="cpu", caps=caps))
    assert seen == allowed, (features, seen)


@pytest.mark.parametrize("name", BUILTINS)
def test_dtypes_override_chooses_the_targets_pytest_runs(name):
    """The certification run itself: ``--impl-option dtypes=float32`` collects the sharded
    properties in float32 only (no float64 target)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = pytest_process.run(
        [sys.executable, "-m", "pytest", "conformance/test_sharded.py", f"--impl={name}",
         "--impl-option", "dtypes=float32", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    ids = re.findall(r"test_sharded\w+\[[^\]]+\]", proc.stdout)
    assert ids and all("float32" in i for i in ids), proc.stdout[-2000:] + proc.stderr[-2000:]
