"""Context-parallel (sharded) attention: one sequence split over the ranks of a process group.

The sharded level (``implementations.base``) is ``impl.sharded(q, k, v, *, group, rank,
world_size, causal, softmax_scale, layout)`` called on every rank with its shard; the
runner is ``conformance.sharded`` (a persistent worker group, world sizes 1..4: gloo on the
CPU, NCCL on CUDA with one process per GPU), the sharding ``spec.sharding``, the oracle
full-sequence attention. These properties run only for an implementation with a sharded
callable (the others skip at once, without starting any process).
"""

from __future__ import annotations

from conformance.core.target import Target
from conformance.directed.helpers import skip_unless
from conformance.directed.shrink import remember_arguments
from conformance.harness.runner import conformance_property
from conformance.sharded import backends
from conformance.sharded.cases import ShardedCase, run_sharded
from conformance.sharded.checks import check_backward, check_forward, compare_runs, grad_output_for
from conformance.sharded.strategies import sharded_cases, sharded_directed, top_world


def _cases(target: Target, **kwargs: object) -> object:
    return sharded_cases(dtype=target.dtype, device=target.device, caps=target.caps, **kwargs)


def _directed(target: Target, *, causal_only: bool = False, **kwargs: object) -> list[ShardedCase]:
    """The directed cases of the property whose cases are ``_cases(target, **kwargs)``, each
    remembering those arguments (a failing one is shrunk within them)."""
    cases = sharded_directed(dtype=target.dtype, device=target.device, caps=target.caps,
                             causal_only=causal_only, **kwargs)
    return remember_arguments(cases, kwargs)


def _runs_here(target: Target) -> str | None:
    """Why the worker group cannot run on the target's device here (CUDA: NCCL, a GPU)."""
    if target.device == "cpu":
        return None
    return backends.unavailable_reason(target.device, backends.local_gpus(), backends.nccl_available())


def _both_layouts(target: Target) -> str | None:
    return _runs_here(target) or skip_unless({"contiguous", "zigzag"} <= target.caps.sharded_layouts,
                                             "layout invariance needs both layouts (sharded_layouts "
                                             "contiguous and zigzag)")


def _multi_rank(target: Target) -> str | None:
    top = top_world(target.caps, target.device)
    why = ("one GPU here (NCCL runs one process per GPU)" if target.device == "cuda"
           and target.caps.max_world_size >= 2 else f"max_world_size={target.caps.max_world_size}")
    return _runs_here(target) or skip_unless(top >= 2, f"world size 1 only ({why})")


@conformance_property("sharded_forward", level="sharded", section="spec.sharding (forward)",
                      cases=_cases, directed=_directed, skip_reason=_runs_here)
def test_sharded_forward(target: Target, case: ShardedCase) -> float:
    """The ranks' output shards, put back at their global positions, equal full-sequence
    attention on the unsharded q, k, v (causal and a declared window over global
    positions, a declared padding dropped) under the SDPA tolerance rule; the LSE shards
    too where ``sharded_lse`` is declared. Directed cases put the causal diagonal and the
    window's edges across every shard boundary."""
    return check_forward(target, case, run_sharded(target, case))


@conformance_property("sharded_backward", level="sharded", section="spec.sharding (backward)",
                      cases=_cases, directed=_directed,
                      skip_reason=lambda t: _runs_here(t) or skip_unless(t.caps.autograd, "autograd not declared"))
def test_sharded_backward(target: Target, case: ShardedCase) -> float:
    """A backward on every rank with its shard of one random upstream gradient: the dq, dk,
    dv shards, unsharded, equal ``spec.sdpa_vjp`` of the full sequence (every rank's keys
    get the gradient of every rank's queries: dK/dV must come home)."""
    grad_out = grad_output_for(case)
    result = run_sharded(target, case, grad_output=grad_out)
    return check_backward(target, case, grad_out, result)


@conformance_property("sharded_world_one", level="sharded", section="spec.sharding (world size 1)",
                      cases=lambda t: _cases(t, min_world=2), directed=lambda t: _directed(t, min_world=2),
                      skip_reason=_multi_rank)
def test_sharded_world_one(target: Target, case: ShardedCase) -> float:
    """Sharding changes nothing: the output over W ranks equals the same implementation's
    output at world size 1 (one rank holding the whole sequence) on the same sequence."""
    sharded = run_sharded(target, case)
    alone = run_sharded(target, case.replace(world_size=1))
    return compare_runs(target, f"world size {case.world_size} vs 1", case, sharded, alone,
                        names=(f"the call over {case.world_size} ranks", "the call on one rank"),
                        paths=("the communication between ranks", "the single-rank computation"))


@conformance_property("sharded_layout_invariance", level="sharded", section="spec.sharding (layouts)",
                      cases=lambda t: _cases(t, layouts=("zigzag",)),
                      directed=lambda t: _directed(t, layouts=("zigzag",), causal_only=True),
                      skip_reason=_both_layouts)
def test_sharded_layout_invariance(target: Target, case: ShardedCase) -> float:
    """The same sequence re-sharded gives the same output: zigzag (rank r holds chunks r
    and 2W-1-r) equals contiguous, position by position."""
    zigzag = run_sharded(target, case)
    contiguous = run_sharded(target, case.replace(layout="contiguous"))
    return compare_runs(target, "zigzag vs contiguous layout", case, zigzag, contiguous,
                        names=("the zigzag call", "the contiguous call"),
                        paths=("the zigzag layout's positions", "the contiguous layout's positions"))
