"""Calling a varlen or kvcache implementation: the tensors handed over (a cache as pages
too), what must come back, and the call checked against the declarations and logged
before it is made."""

from __future__ import annotations

from typing import Any

import numpy as np

from conformance.calls.cache_options import check_fp8_output_dtype
from conformance.calls.declarations import require_inside
from conformance.calls.sdpa import assert_returned_tensor
from conformance.core.compare import fail
from conformance.core.target import Target
from conformance.core.tensors import dtype_of

__all__ = ["as_pages", "check_returned_output", "int32", "is_tensor", "log_call", "tensor"]


def tensor(array: np.ndarray, case: Any) -> Any:
    """A fresh tensor of ``array`` in the case's dtype (FP8: its format) on its device."""
    import torch

    if getattr(case, "fp8", None) is not None:  # float64 -> float8 (exact), on the CPU, then moved
        return torch.tensor(np.asarray(array, dtype=np.float64)).to(getattr(torch, case.fp8)).to(case.device)
    return torch.tensor(np.asarray(array, dtype=np.float64), dtype=dtype_of(case.dtype), device=case.device)


def int32(values: Any, device: str) -> Any:
    import torch

    return torch.tensor(np.asarray(values, dtype=np.int64), dtype=torch.int32, device=device)


def is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def as_pages(case: Any, cache: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The logical cache (B, S_cache, K, X) of a kvcache case as pages (num_pages, page_size,
    K, X) and the block table (B, max_pages); spare pages hold integers up to ±30 (exact in
    every dtype), seeded by the page count and size, so a read from one shows."""
    B, S_cache, K, X = cache.shape
    size = case.page_size
    max_pages = S_cache // size
    order = np.asarray(case.page_order, dtype=np.int64)
    table = order[:B * max_pages].reshape(B, max_pages)
    rng = np.random.default_rng(len(order) * 7919 + size)
    pages = np.round(rng.standard_normal((len(order), size, K, X)) * 8, 0)   # exact in every dtype
    pages[table.reshape(-1)] = cache.reshape(B * max_pages, size, K, X)
    return pages, table


def check_returned_output(out: Any, case: Any, shape: tuple[int, ...], dims: str) -> None:
    """What came back is a tensor on the case's device, of ``shape`` and the input dtype
    (an FP8 call's: a 16- or 32-bit float dtype)."""
    __tracebackhide__ = True
    assert_returned_tensor("output", out, device=case.device, shape=shape, dims=dims)
    if getattr(case, "fp8", None) is not None:
        check_fp8_output_dtype(out, case.fp8)
    elif out.dtype != dtype_of(case.dtype):
        fail(f"output dtype={out.dtype}, but should be {dtype_of(case.dtype)} (the input dtype)")


def log_call(target: Target, call: Any) -> None:
    """Before ``call`` is made: inside the declarations (or the case is skipped), and in
    the target's log (so a failure can replay it)."""
    __tracebackhide__ = True
    require_inside(target, call)
    if target.log is not None:
        target.log.calls.append(call)
