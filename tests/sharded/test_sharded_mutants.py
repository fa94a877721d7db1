"""The sharded level's bug zoo: each mutant's smallest case exposes its bug and its safe case
does not (run on a worker group of two ranks), and on the smallest case the diagnosis names
the variant of its record (``expected_cause``) first."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conformance.core.compare import PropertyFailure
from conformance.core.target import Target
from conformance.diagnosis.diagnose import diagnose, start_example
from conformance.sharded import checks
from conformance.sharded import group as groups
from conformance.sharded.cases import ShardedCase, ShardedCallSpec, run_call, run_sharded
from conformance.sharded.strategies import make_case
from implementations.mutants import MUTANTS
from spec import sharding

SHARDED = sorted(name for name, m in MUTANTS.items() if m.level == "sharded")


def case_of(record: dict, dtype: str = "float64") -> ShardedCase:
    """A record's smallest or safe case (``implementations/mutants/sharded/sharded_mutants.py``'s
    vocabulary) as a sharded case."""
    W, layout = record.get("world_size", 1), record.get("layout", "contiguous")
    L, d = record.get("L", 1), sharding.divisor(layout, W)
    shard = -(-max(L, record.get("padded_to", L)) // d)
    heads = record.get("N", W if W > 1 else 1)
    return make_case(world_size=W, layout=layout, N=heads, K=record.get("K", heads), shard=shard,
                     E=record.get("E", 2), causal=record.get("causal", False), dtype=dtype, seed=5,
                     regime="huge" if record.get("values") == "huge" else "normal", pad=shard * d - L,
                     window=tuple(record.get("window", (-1, -1))))


def _target(name: str) -> Target:
    impl = MUTANTS[name].build()
    caps = impl.capabilities.replace(max_world_size=2)  # a group of two ranks is enough here
    impl = impl.__class__(**{**{f: getattr(impl, f) for f in impl.__dataclass_fields__},
                             "capabilities": caps, "sharded_capabilities": caps})
    return Target(impl, "sharded", "float64", "cpu")


def _check(target: Target, case: ShardedCase, grad: bool) -> None:
    if grad:
        g = checks.grad_output_for(case)
        checks.check_backward(target, case, g, run_call(target.impl, ShardedCallSpec(case, g), timeout=60.0,
                                                       lse_declared=target.caps.sharded_lse))
    else:
        checks.check_forward(target, case, run_call(target.impl, ShardedCallSpec(case), timeout=60.0,
                                                    lse_declared=target.caps.sharded_lse))


@pytest.fixture(scope="module", autouse=True)
def _close_groups():
    yield
    groups.close_all()


@pytest.mark.parametrize("name", SHARDED)
def test_smallest_case_exposes_the_bug_and_the_diagnosis_names_it(name):
    mutant, target = MUTANTS[name], _target(name)
    case = case_of(mutant.smallest_case)
    assert case.L == mutant.smallest_case["L"]
    with pytest.raises(PropertyFailure) as failed:
        _check(target, case, mutant.smallest_case.get("grad", False))
    assert "wrong positions by rank" in str(failed.value) + "".join(getattr(failed.value, "__notes__", []))
    if mutant.safe_case is not None:
        _check(target, case_of(mutant.safe_case), mutant.safe_case.get("grad", False))
    if mutant.expected_cause is None:
        return
    start_example(case)
    run_sharded(target, case)                                 # observed, as in a property
    record = SimpleNamespace(failing_case=case, property=mutant.expected_property, failing_calls=())
    verdict = diagnose(target, record)
    assert verdict.causes and verdict.causes[0]["variant"] == mutant.expected_cause, verdict.line
    if mutant.smallest_case.get("values") != "huge":          # every row NaN: a NaN-only match, not confirmed
        assert verdict.causes[0]["confirmed"], verdict.line
        assert verdict.line.startswith(f"probable cause: {mutant.expected_cause} — "), verdict.line
