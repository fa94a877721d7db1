"""Importing Triton for the triton built-in: under its interpreter when there is no GPU.

The interpreter must be switched on *before* triton is first imported (docs/TRITON.md):
importing this module does that, then imports triton (``triton`` None and
``_IMPORT_ERROR`` saying why when it is not installed). :func:`_launching` is put around
each launch; :func:`_interpreter_mismatch` says why the interpreter cannot run when triton
was imported earlier in the other mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import torch

__all__ = ["libdevice", "tl", "triton"]

_TRITON_IMPORTED_EARLIER = "triton" in sys.modules
if not torch.cuda.is_available():
    # Must happen before triton is first imported (docs/TRITON.md, the interpreter).
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError as exc:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None
    libdevice = None
    _IMPORT_ERROR: str | None = f"triton is not importable ({exc})"
else:
    _IMPORT_ERROR = None


def _interpreting() -> bool:
    return triton is not None and bool(triton.knobs.runtime.interpret)


@contextlib.contextmanager
def _launching():
    """Around a launch: under the interpreter, no int32 overflow check of each integer
    add and multiply (a cast to int64, two compares and a device assert per op, about a
    third of a call's time here). Compiled kernels assert nothing without ``debug``; the
    index arithmetic is bounded by the tensors' sizes, as on a GPU. Put back afterwards,
    so another Triton kernel in the process keeps the interpreter's default."""
    if not _interpreting():
        yield
        return
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    saved = builder.options
    builder.options = dataclasses.replace(saved, sanitize_overflow=False)
    try:
        yield
    finally:
        builder.options = saved


def _interpreter_mismatch() -> str | None:
    """Why the interpreter cannot run here, when triton was imported in the other mode.

    triton.language's own helpers (``tl.max``, ``tl.sum``, ``tl.zeros`` ...) are
    decorated once, when triton is first imported: compiled ``JITFunction`` s
    cannot be called by interpreted code, and interpreted ones cannot be compiled.
    """
    if not _interpreting():
        return None
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.zeros, InterpretedFunction):
        return ("triton was imported before TRITON_INTERPRET=1 was set, so its language "
                "helpers cannot run under the interpreter; import "
                "implementations.builtins.kernels.triton_attention before triton, or export TRITON_INTERPRET=1")
    return None
