"""Session state lives on ``config.stash``, not in module globals: two pytest
sessions in one process (pytester's in-process runs) share nothing."""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

import conformance
from conformance.core.cases import SDPACase
from conformance.reporting import failures

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
#: Imported here, before any in-process run, so that pytester's restoring of
#: sys.modules keeps them: both runs then see the same module objects.
MODULES = [importlib.import_module(m.name)
           for m in pkgutil.walk_packages(conformance.__path__, "conformance.")]


def _globals():
    for module in MODULES:
        for name, value in vars(module).items():
            if not name.startswith("__"):
                yield module, name, value


def _fingerprint() -> dict[tuple[str, str], object]:
    """Every module global's identity, and the contents of dicts, lists and sets."""
    return {(m.__name__, name): (id(v), repr(v) if isinstance(v, (dict, list, set)) else None)
            for m, name, v in _globals()}


def test_no_module_level_holder_of_state():
    """No module global is an instance of a mutable class of the suite (the old
    ``RECORDS`` holder); constants are frozen dataclasses, enums or plain data."""
    holders = []
    for module, name, value in _globals():
        cls = type(value)
        if isinstance(value, (type, types.ModuleType, types.FunctionType)):
            continue
        if cls.__module__.startswith("conformance") and not (
                dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
            holders.append(f"{module.__name__}.{name}: {cls.__name__}")
    assert not holders, f"module-level objects that can hold state: {holders}"


@pytest.fixture
def restore_hypothesis_profile():
    """An in-process run loads its Hypothesis profile globally: put ours back."""
    settings.register_profile("_outer_session", parent=settings.default)
    yield
    settings.load_profile("_outer_session")


def test_two_in_process_sessions_share_no_state(pytester, tmp_path, restore_hypothesis_profile):
    rng = np.random.default_rng(0)
    case = SDPACase(rng.standard_normal((1, 1, 2, 3)), rng.standard_normal((1, 1, 2, 3)),
                    rng.standard_normal((1, 1, 2, 3)))
    saved = failures.save_case(case, tmp_path / "case.npz", property="forward_agreement",
                               impl="spec", target="sdpa-float64-cpu")
    before = _fingerprint()
    common = [str(ROOT / "conformance"), f"--rootdir={ROOT}", "-p", "no:cacheprovider", "--hypothesis-profile=ci"]

    first = pytester.runpytest_inprocess(*common, "--impl=spec", f"--replay={saved}",
                                         f"--conformance-report={tmp_path / 'first'}")
    assert first.ret == 0 and first.parseoutcomes()["passed"] == 1, first.stdout.str()[-2000:]

    second = pytester.runpytest_inprocess(*common, "--impl=sdpa-math", "--dtype=float64",
                                          "-k", "forward_agreement and not flash",
                                          f"--conformance-report={tmp_path / 'second'}")
    assert second.ret == 0, second.stdout.str()[-2000:]
    cert = json.loads((tmp_path / "second.json").read_text())
    assert cert["implementation"]["spec"] == "sdpa-math"
    # Only the second run's own result, not replayed-only (the first run's --replay),
    # and none of the first run's records.
    [only] = cert["results"]
    assert (only["property"], only["dtype"], only["outcome"]) == ("forward_agreement", "float64", "passed")
    assert only["examples"] > 1

    after = _fingerprint()
    changed = sorted(".".join(k) for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"module globals changed by a run: {changed}"
