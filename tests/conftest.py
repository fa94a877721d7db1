"""Settings for the suite's own tests.

Torch runs single-threaded, as ``pytest conformance`` does by default
(``--torch-threads=1``): the tensors are tiny, and under ``pytest -n 2`` on two cores an
intra-op thread pool per worker costs far more than it saves.

Under ``pytest -n N`` (``--dist worksteal``, set in pyproject.toml) the long tests go
first, spread over the workers: worksteal hands worker k the k-th contiguous slice of
the collection and lets an idle worker take the tail of a busy one's queue, so a long
test left at the end of one slice would run alone while the other workers wait. The
measured seconds below (two-core machine, 2026-12-01, ``--durations``; the zoo chunks
re-measured with the measured property order) only order the tests; a test missing from
the table counts as short.
"""

from __future__ import annotations

import fnmatch

import pytest

from tests.quick_tier import SLOW_IN_QUICK_TIER

#: Seconds a test took, by node id pattern (first match wins). Only the order matters.
MEASURED_SECONDS = {
    "tests/test_mutants.py::test_correct_implementation_passes[jax-float16]": 57,  # 2026-12-04: compiled
    "tests/test_mutants.py::test_correct_implementation_passes[jax-bfloat16]": 53,
    "tests/test_mutants.py::test_correct_implementation_passes[jax-*": 46,
    "tests/test_mutants.py::test_correct_implementation_passes[triton-*": 75,
    # 2026-12-07, -n 2: the zoo's runs after the merge with the diagnosis' runs
    "tests/test_mutants.py::test_every_mutant_is_killed_and_its_bug_named[triton*": 10,
    "tests/test_mutants.py::test_every_mutant_is_killed_and_its_bug_named[family*": 100,
    "tests/test_mutants.py::test_every_mutant_is_killed_and_its_bug_named[*": 85,
    "tests/test_mutants.py::test_expected_property_alone_kills_each_mutant[zoo]": 161,
    "tests/test_mutants.py::test_correct_implementation_passes[*": 30,
    "tests/test_mutants.py::test_expected_property_alone_kills_each_mutant[*": 17,
    "tests/runner/test_replay.py::test_every_property_reproducer_shows_the_failure*": 63,
    "tests/runner/test_hostile.py::*": 6,
    "tests/runner/test_declarations.py::*": 6,
    "tests/runner/test_multiple_impls.py::*": 7,
    "tests/runner/test_runner_cli.py::*": 5,
    "tests/runner/test_sweep.py::test_an_isolated_implementation_is_swept_in_its_worker": 21,
    "tests/runner/test_sweep.py::*": 5,
    "tests/runner/test_isolated_certificate.py::test_expected_failures_matched*": 20,
    "tests/runner/test_isolated_certificate.py::test_an_isolated_failure*": 10,
    "tests/runner/test_regime_coverage.py::*": 12,
    "tests/test_installed_plugin.py::*": 6,
    "tests/sharded/test_sharded_shrinking.py::*": 60,
    "tests/sharded/test_group.py::*": 25,
    "tests/sharded/test_torch_cp.py::*": 12,
    "tests/sharded/test_sharded_mutants.py::*": 8,
    "tests/implementations/test_onnx.py::test_sdpa_exported_at_opset_17_certifies": 43,
    "tests/implementations/test_onnx.py::test_an_existing_graph_certifies": 25,
    "tests/implementations/test_onnx.py::test_an_export_*": 15,
    "tests/implementations/test_keras_mha.py::test_keras_mha_certifies_with_its_expected_failures": 74,
    "tests/implementations/test_keras_mha.py::test_keras_mha_deviations_fail_without_the_file": 38,
    "tests/implementations/test_keras_mha.py::test_a_keras_mha_subclass_*": 31,
}


def pytest_configure(config) -> None:
    try:
        import torch
    except ImportError:  # tests that need torch skip or fail on their own
        return
    torch.set_num_threads(1)


@pytest.fixture
def large_logit_heads():
    """``make(dtype, L, S, heads=16, seed=0)``: q, k, v, grad_out of ``heads`` independent
    heads, E = 2 (scale 1/sqrt(2), not a power of two) and |logits| up to about 5e9 (the
    wide_range regime at its edge), drawn in float64 from ``seed``, then cast to ``dtype``:
    the inputs on which backward passes that recompute the scores lose them."""
    import torch

    def make(dtype, L: int, S: int, heads: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(1, heads, L, 2, generator=g, dtype=torch.float64) * 2**15
        k = torch.randn(1, heads, S, 2, generator=g, dtype=torch.float64) * 2**15
        v = torch.randn(1, heads, S, 2, generator=g, dtype=torch.float64)
        grad_out = torch.randn(1, heads, L, 2, generator=g, dtype=torch.float64)
        return tuple(x.to(dtype) for x in (q, k, v, grad_out))

    return make


def _seconds(nodeid: str) -> float:
    for pattern, seconds in MEASURED_SECONDS.items():
        if fnmatch.fnmatchcase(nodeid, pattern):
            return seconds
    measured = SLOW_IN_QUICK_TIER.get(nodeid.split("[", 1)[0])
    return measured[0] / measured[1] if measured else 0.0


def pytest_itemcollected(item) -> None:
    """The tests measured too slow for the quick tier (``tests/quick_tier.py``) are marked
    ``slow`` as they are collected, before ``-m "not slow"`` deselects."""
    if item.nodeid.split("[", 1)[0] in SLOW_IN_QUICK_TIER:
        item.add_marker(pytest.mark.slow)


def pytest_addoption(parser) -> None:
    parser.addoption("--release-tier", action="store_true", default=False,
                     help="also run the tests marked release: the certificates the test command "
                          "leaves out (the slow built-ins' other dtypes; docs/SPEED.md, the tiers)")


def _deselect_release_tests(config, items) -> None:
    """The tiers (docs/SPEED.md): ``pytest -m "not slow"`` is the quick tier, ``pytest -n 2``
    the test command, and ``--release-tier`` adds the tests marked ``release``."""
    if config.getoption("--release-tier"):
        return
    left_out = [item for item in items if item.get_closest_marker("release") is not None]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item.get_closest_marker("release") is None]


def pytest_collection_modifyitems(config, items) -> None:
    """Leave out the release tier unless asked (:func:`_deselect_release_tests`). Then,
    under xdist, deal the long tests out longest first (greedily to the worker with
    the least so far), each worker's slice starting with its long tests; short tests fill
    the slices to equal lengths in their collected order. Without xdist: unchanged."""
    _deselect_release_tests(config, items)
    workers = getattr(config, "workerinput", {}).get("workercount", 0)
    if workers < 2 or len(items) < workers:
        return
    cost = {item.nodeid: _seconds(item.nodeid) for item in items}
    long_items = sorted((i for i in items if cost[i.nodeid] > 0), key=lambda i: -cost[i.nodeid])
    short_items = [i for i in items if cost[i.nodeid] == 0]
    slices: list[list] = [[] for _ in range(workers)]
    totals = [0.0] * workers
    for item in long_items:
        k = min(range(workers), key=lambda w: (totals[w], w))
        slices[k].append(item)
        totals[k] += cost[item.nodeid]
    left = len(items)
    for k in range(workers):  # the scheduler's slices: worker k gets left // (workers - k)
        size = left // (workers - k)
        while len(slices[k]) < size and short_items:
            slices[k].append(short_items.pop(0))
        left -= len(slices[k])
    slices[-1].extend(short_items)
    items[:] = [item for part in slices for item in part]
