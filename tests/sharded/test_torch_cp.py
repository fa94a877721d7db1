"""PyTorch's context-parallel attention on the CPU (torch 2.13): what runs, what does not, and
the deviations ``implementations/xfail/torch-cp.toml`` lists, measured again.

* The public API, ``context_parallel(mesh, buffers=...)`` around
  ``F.scaled_dot_product_attention``, raises for a causal call on the CPU: the CPU flash
  kernel has no sharding rule (a process of world size 1 with gloo shows it).
* The ring itself (``_templated_ring_attention``), which the ``torch-cp`` built-ins call
  with the CPU flash kernel, runs with gloo and agrees with the spec in float32; in
  float64 it carries float32 rounding (the merge and the gradients are float32), and
  causal calls with a negative scale are NaN in the rows whose own block blocks a key.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conformance.core.compare import PropertyFailure
from conformance.core.target import Target
from conformance.sharded import checks
from conformance.sharded import group as groups
from conformance.sharded.cases import ShardedCallSpec, run_call
from conformance.sharded.strategies import make_case
from implementations.registry import resolve

ROOT = Path(__file__).resolve().parents[2]

PUBLIC_API = textwrap.dedent(
    """
    import os, sys, tempfile
    import torch, torch.distributed as dist, torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    init = os.path.join(tempfile.mkdtemp(), "rendezvous")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    for causal in (True, False):
        q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
        try:
            with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            print(f"causal={causal}: ran")
        except Exception as exc:
            print(f"causal={causal}: {type(exc).__name__}: {exc}".splitlines()[0])
    dist.destroy_process_group()
    """
)


def test_the_public_api_raises_for_causal_calls_on_the_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", PUBLIC_API], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert ("causal=True: NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default "
            "does not have a sharding strategy registered") in out, out
    assert "causal=False: ran" in out, out


@pytest.fixture(scope="module")
def torch_cp():
    impl = resolve("torch-cp")
    if not impl.available:
        pytest.skip(impl.unavailable_reason)
    caps = impl.capabilities.replace(max_world_size=2)
    impl = impl.__class__(**{**{f: getattr(impl, f) for f in impl.__dataclass_fields__},
                             "capabilities": caps, "sharded_capabilities": caps, "expected_failures": ()})
    yield impl
    groups.close_all()


def _run(impl, case, grad=False):
    g = checks.grad_output_for(case) if grad else None
    return run_call(impl, ShardedCallSpec(case, g), timeout=120.0, lse_declared=True), g


@pytest.mark.parametrize("layout, causal", [("contiguous", True), ("zigzag", True), ("zigzag", False)])
def test_float32_agrees_with_the_spec(torch_cp, layout, causal):
    target = Target(torch_cp, "sharded", "float32", "cpu")
    case = make_case(world_size=2, layout=layout, shard=2, E=4, causal=causal, dtype="float32", seed=1)
    result, g = _run(torch_cp, case, grad=True)
    checks.check_backward(target, case, g, result)
    checks.check_forward(target, case, _run(torch_cp, case)[0])


def test_float64_carries_float32_rounding(torch_cp):
    target = Target(torch_cp, "sharded", "float64", "cpu")
    for world in (1, 2):
        case = make_case(world_size=world, layout="contiguous", shard=2, E=4, seed=2)
        result, _ = _run(torch_cp, case)
        expected, _ = checks.bounds(target, case)
        relative = np.abs(result.output - expected).max() / np.abs(expected).max()
        assert 1e-10 < relative < 1e-5, relative                 # float32 rounding, not a wrong convention
        with pytest.raises(PropertyFailure):
            checks.check_forward(target, case, result)


def test_causal_with_a_negative_scale_is_nan_where_the_own_block_blocks_a_key(torch_cp):
    target = Target(torch_cp, "sharded", "float32", "cpu")
    two = make_case(world_size=2, layout="contiguous", shard=2, causal=True, scale=-1.0, dtype="float32", seed=3)
    assert two.shard_length == 2
    out = _run(torch_cp, two)[0].output
    # the first position of each shard has a causally blocked key in the rank's own block
    # (the next position): NaN; the second has none: finite (and the other rank's block is
    # called non-causal)
    assert np.isnan(out[:, :, [0, 2]]).all() and np.isfinite(out[:, :, [1, 3]]).all()
    one = make_case(world_size=2, layout="contiguous", shard=1, causal=True, scale=-1.0, dtype="float32", seed=3)
    checks.check_forward(target, one, _run(torch_cp, one)[0])   # shards of one position: right
