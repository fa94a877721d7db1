"""An SDPA-level torch function exported with ``torch.onnx.export`` and run in ONNX Runtime.

``ExportedSDPA(fn, exporter, opset)`` has scaled_dot_product_attention's signature. Each
call is looked up by its **export key**: the shapes and dtypes of query, key, value and
the mask (None, or its shape and dtype: bool or float, as given, broadcast form
included), ``is_causal``, ``scale`` and ``enable_gqa``. What the exporter bakes into the
graph is exactly that: the tensors' shapes and dtypes are static, and the flags and the
scale are Python values traced as constants. A new key is one export (``fn`` wrapped in
a ``torch.nn.Module`` whose ``forward(query, key, value[, attn_mask])`` passes the flags,
traced by the exporter, the graph serialized and opened in an
``onnxruntime.InferenceSession`` on the CPU provider); a known key reuses its session.
The sessions are cached for the run (:attr:`ExportedSDPA.exports` counts them).

What a call can and cannot be:

* ``dropout_p > 0``: refused (NotImplementedError). ``torch.onnx.export`` exports an
  inference graph (eval mode), which has no dropout.
* gradients: none. The output is computed by ONNX Runtime and does not require grad.
* an export the exporter refuses (``enable_gqa=True`` under the TorchScript exporter) or a
  graph ONNX Runtime cannot run (bfloat16 ``Sqrt`` on the CPU provider) raises, so probing
  declares that capability unsupported with a note of what was raised.

The graph's inputs are named ``query``, ``key``, ``value`` and ``attn_mask`` and its
output ``output``; the inputs go in as contiguous NumPy arrays of their own dtype.
"""

from __future__ import annotations

import io
import logging
import threading
import warnings
from typing import Any, Callable

import torch

from implementations.onnx.runtime import open_session, run_session, to_feed, to_torch

__all__ = ["ExportedSDPA", "INPUT_NAMES"]

#: The exported graph's input names, in order (the mask only when the call has one).
INPUT_NAMES = ("query", "key", "value", "attn_mask")


class _Traced(torch.nn.Module):
    """``fn`` with the flags of one export key fixed: what the exporter traces."""

    def __init__(self, fn: Callable[..., Any], is_causal: bool, scale: float | None, enable_gqa: bool) -> None:
        super().__init__()
        self.fn, self.flags = fn, {"is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa}

    def forward(self, query, key, value, attn_mask=None):
        flags = dict(self.flags)
        if attn_mask is not None:
            flags["attn_mask"] = attn_mask
        return self.fn(query, key, value, **flags)


class ExportedSDPA:
    """``fn`` exported per export key (see the module docstring) and run in ONNX Runtime.

    ``exporter``: ``"torchscript"`` (``torch.onnx.export(..., dynamo=False)``) or
    ``"dynamo"`` (``dynamo=True``, through ``torch.export`` and onnxscript);
    ``opset``: the ONNX opset asked for (the dynamo exporter converts its own down to it
    where it can; :attr:`opsets` records the opsets the graphs got)."""

    def __init__(self, fn: Callable[..., Any], exporter: str = "torchscript", opset: int = 17,
                 origin: str = "") -> None:
        self.fn, self.exporter, self.opset = fn, exporter, opset
        self.origin = origin or getattr(fn, "__name__", "sdpa")
        self.__name__ = f"onnx_{getattr(fn, '__name__', 'sdpa')}"
        self._sessions: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        #: The number of exports made (one per new export key), and seconds spent exporting.
        self.exports = 0
        self.export_seconds = 0.0
        #: The opsets of the graphs made (the dynamo exporter may keep a newer one).
        self.opsets: set[int] = set()

    def __repr__(self) -> str:
        return f"ExportedSDPA({self.origin}, exporter={self.exporter}, opset={self.opset})"

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
        if dropout_p:
            raise NotImplementedError(
                f"dropout_p={dropout_p}: torch.onnx.export exports an inference graph (eval mode), "
                "which has no dropout")
        tensors = [query, key, value] + ([attn_mask] if attn_mask is not None else [])
        config = (tuple((tuple(t.shape), str(t.dtype)) for t in tensors), bool(is_causal),
                  None if scale is None else float(scale), bool(enable_gqa))
        session = self._session(config, tensors)
        feeds = {name: to_feed(t) for name, t in zip(INPUT_NAMES, tensors, strict=False)}
        # The graph's output as it is: one of another dtype than the query's is a deviation
        # of the graph, which output_contract reports (not a refusal of the input).
        return to_torch(run_session(session, feeds), query)

    # ----------------------------------------------------------------------- exports

    def _session(self, config: tuple, tensors: list[torch.Tensor]) -> Any:
        with self._lock:
            if config not in self._sessions:
                _, is_causal, scale, enable_gqa = config
                import time

                started = time.perf_counter()
                model = self._export(_Traced(self.fn, is_causal, scale, enable_gqa),
                                     tuple(t.detach().contiguous() for t in tensors))
                self._sessions[config] = open_session(model)
                self.exports += 1
                self.export_seconds += time.perf_counter() - started
            return self._sessions[config]

    def _export(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> bytes:
        """The serialized ONNX model of ``module`` traced on ``args``."""
        names = list(INPUT_NAMES[:len(args)])
        quiet = logging.getLogger("torch.onnx")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        # The TorchScript exporter prints the whole graph when an export fails (torch 2.13
        # leaves its ONNX log switched on); the exception says what failed.
        log = getattr(torch._C, "_jit_onnx_log", None)
        torch._C._jit_onnx_log = lambda *_: None
        try:
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")
                if self.exporter == "dynamo":
                    program = torch.onnx.export(module, args, dynamo=True, opset_version=self.opset,
                                                input_names=names, output_names=["output"], verbose=False)
                    proto = program.model_proto
                    model = proto.SerializeToString()
                else:
                    buffer = io.BytesIO()
                    torch.onnx.export(module, args, buffer, dynamo=False, opset_version=self.opset,
                                      input_names=names, output_names=["output"])
                    model = buffer.getvalue()
                    proto = None
        finally:
            quiet.setLevel(level)
            if log is not None:
                torch._C._jit_onnx_log = log
        self.opsets.add(_opset_of(proto, model))
        return model

    def summary(self) -> str:
        """``12 exports (3.1 s), opset 17``: what the run has exported so far."""
        opsets = ", ".join(str(o) for o in sorted(self.opsets)) or str(self.opset)
        return (f"{self.exports} export{'s' if self.exports != 1 else ''} ({self.export_seconds:.1f} s) "
                f"by the {self.exporter} exporter, opset {opsets}, each cached for the run")


def _opset_of(proto: Any, model: bytes) -> int:
    """The default-domain opset of a model (its proto, or parsed from its bytes)."""
    if proto is None:
        import onnx

        proto = onnx.load_from_string(model)
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), -1)
