"""ring-attention-pytorch (0.5.20) through its adapter
(``implementations/builtins/distributed/ring_attention_pytorch.py``: layout and argument
names only), run as written on the default process group of each world size: what it
gets right passes, and each of its deviations (docs/FINDINGS.md) fails as the certificate
reports it. Skipped, with the reason, without the package (``pip install
attention-conformance[ring_attention]``)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ring_attention_pytorch", reason="ring-attention-pytorch is not installed (the project's "
                    "ring_attention optional dependencies)")

from conformance.core.compare import PropertyFailure
from conformance.core.target import ImplementationRaised, Target
from conformance.sharded import checks
from conformance.sharded import group as groups
from conformance.sharded.cases import ShardedCallSpec, run_call
from conformance.sharded.strategies import make_case
from implementations import registry
from spec import variants as V

SPEC = "implementations/builtins/distributed/ring_attention_pytorch.py:ring_flash"


@pytest.fixture(scope="module")
def impl():
    resolved = registry.resolve(SPEC)
    groups.register(resolved, SPEC, {})
    yield resolved
    groups.close_all()


def _forward(impl, case):
    return run_call(impl, ShardedCallSpec(case), timeout=120.0, lse_declared=False)


@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_forward_is_right_without_gqa_at_every_world_size(impl, W):
    """No group redirection: the library's barriers and sends on the default group run."""
    target = Target(impl, "sharded", "float32", "cpu")
    for causal in (False, True):
        case = make_case(world_size=W, layout="contiguous", N=2, shard=2, E=4, causal=causal, dtype="float32", seed=W)
        checks.check_forward(target, case, _forward(impl, case))


def test_float64_inputs_raise_from_the_float32_running_buffers(impl):
    case = make_case(world_size=2, layout="contiguous", shard=1, E=2, dtype="float64")
    with pytest.raises(ImplementationRaised, match="value cannot be converted to type float without overflow"):
        _forward(impl, case)


def test_gqa_groups_query_head_h_with_kv_head_h_mod_k(impl):
    """Query heads 4, kv heads 2: the gathered output is ``sharded_gqa_tiled``'s, named first."""
    target = Target(impl, "sharded", "float32", "cpu")
    case = make_case(world_size=2, layout="contiguous", N=4, K=2, shard=1, E=2, dtype="float32", seed=3)
    result = _forward(impl, case)
    with pytest.raises(PropertyFailure, match="output"):
        checks.check_forward(target, case, result)
    problem = V.ShardedProblem(case.query, case.key, case.value, world_size=2, dtype="float32")
    assert V.rank(result.output, problem)[0].variant_id == "sharded_gqa_tiled"


@pytest.mark.parametrize("W", [2, 3, 4])
def test_backward_dk_dv_are_wrong_dq_right(impl, W):
    target = Target(impl, "sharded", "float32", "cpu")
    case = make_case(world_size=W, layout="contiguous", shard=1, E=2, dtype="float32", seed=W)
    grad = checks.grad_output_for(case)
    result = run_call(impl, ShardedCallSpec(case, grad), timeout=120.0, lse_declared=False)
    with pytest.raises(PropertyFailure, match="dkey|dvalue"):
        checks.check_backward(target, case, grad, result)
    expected = V.reference(V.ShardedProblem(case.query, case.key, case.value, world_size=W)).output
    assert np.allclose(result.output, expected, atol=1e-5)


def test_backward_at_world_size_one_raises_on_gloo(impl):
    """Its dK/dV ring pass sends to the rank itself, which gloo refuses."""
    case = make_case(world_size=1, layout="contiguous", shard=1, E=2, dtype="float32")
    grad = checks.grad_output_for(case)
    with pytest.raises(ImplementationRaised, match="rank 0 raised RuntimeError"):
        run_call(impl, ShardedCallSpec(case, grad), timeout=120.0, lse_declared=False)
