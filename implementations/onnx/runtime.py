"""ONNX Runtime for the ONNX implementations: what must be installed, a session on the CPU
provider, and the arrays that go in and come out.

A session runs with one intra-op and one inter-op thread (the suite's cases are tiny, as
with ``--torch-threads``), ONNX Runtime's default graph optimizations (what a deployment
runs), and its log at errors only (its constant-folding warnings are not findings).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import torch

__all__ = ["EXPORTERS", "PROVIDER", "missing_packages", "open_session", "run_session", "to_feed", "to_torch",
           "versions"]

#: The ONNX Runtime execution provider the graphs are certified on.
PROVIDER = "CPUExecutionProvider"
#: ``torch.onnx.export``'s exporters (``--impl-option onnx_exporter=``) -> the packages each needs.
EXPORTERS = {"torchscript": ("onnx", "onnxruntime"), "dynamo": ("onnx", "onnxruntime", "onnxscript")}


def missing_packages(exporter: str | None) -> list[str]:
    """The packages ``exporter`` (None: running an existing graph) needs that are not installed."""
    needed = EXPORTERS[exporter] if exporter else ("onnxruntime",)
    return [name for name in needed if importlib.util.find_spec(name) is None]


def versions(exporter: str | None) -> str:
    """``onnxruntime 1.32.0, onnx 1.23.2`` (what runs and exports here)."""
    import importlib

    names = ("onnxruntime", *(n for n in EXPORTERS[exporter] if n != "onnxruntime")) if exporter else ("onnxruntime",)
    return ", ".join(f"{n} {getattr(importlib.import_module(n), '__version__', '?')}" for n in names)


def open_session(model: bytes | str) -> Any:
    """An ``onnxruntime.InferenceSession`` of ``model`` (serialized bytes or a path) on the CPU provider."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(model, options, providers=[PROVIDER])


def to_feed(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy array of the tensor's values and dtype, contiguous (bfloat16 as ml_dtypes')."""
    from implementations.bridge.frameworks import torch_to_numpy

    return np.ascontiguousarray(torch_to_numpy(tensor))


def to_torch(array: Any, like: torch.Tensor) -> torch.Tensor:
    """The session's output as a torch tensor on ``like``'s device (its own dtype, which the
    caller checks)."""
    from implementations.bridge.frameworks import numpy_to_torch

    return numpy_to_torch(array, like.device)


def run_session(session: Any, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The first output of ``session`` on ``feeds`` (only the inputs the graph has)."""
    names = {i.name for i in session.get_inputs()}
    return session.run(None, {name: array for name, array in feeds.items() if name in names})[0]
