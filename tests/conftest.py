"""The suite's own tests run torch single-threaded, as ``pytest conformance`` does by
default (``--torch-threads=1``): their tensors are tiny, and under ``pytest -n 2`` on two
cores an intra-op thread pool per worker costs far more than it saves."""

from __future__ import annotations


def pytest_configure(config) -> None:
    try:
        import torch
    except ImportError:  # tests that need torch skip or fail on their own
        return
    torch.set_num_threads(1)
