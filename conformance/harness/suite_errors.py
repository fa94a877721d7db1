"""The suite's own errors, told apart from the implementation's failures.

An exception is the suite's own when the line that raised it is the suite's code: the
runner and the properties (``conformance/``), the oracle (``spec/``), and the code that
wraps an implementation into a callable (``implementations/bridge/``, ``registry/``,
``guard.py``, ``flash_from_sdpa.py``). The framework bridge reading ``query_dense`` on a
Keras 2 layer that names it otherwise raises ``AttributeError`` inside the bridge: that is
not a failure of the layer, and every cell would read FAIL. Such an error is reported as
an ERROR ("the suite itself broke") that names the suite's frame (:func:`suite_error`);
a ``NotImplementedError`` is a deliberate refusal, never the suite's bug, and an
exception that a C function raised while the suite's code was calling it (torch's SDPA,
which has no Python frame, called by the registry's wrapper) is the implementation's.

Everything else that escapes a property's check is reported in the report's own form too
(:class:`SuiteError` is a ``PropertyFailure``, so the runner saves its case and writes the
reproducer): no traceback of the runner's frames, no Hypothesis dump.
"""

from __future__ import annotations

import dis
import traceback
from pathlib import Path
from typing import Any

from conformance.core.compare import PropertyFailure

__all__ = ["SuiteError", "suite_frame", "suite_error"]

_ROOT = Path(__file__).resolve().parents[2]
#: The suite's code: where an exception raised is the suite's own.
SUITE_CODE = tuple(str(_ROOT / p) for p in ("conformance", "spec", "implementations/bridge",
                                            "implementations/registry", "implementations/guard.py",
                                            "implementations/flash_from_sdpa.py"))


class SuiteError(PropertyFailure):
    """The suite itself broke on a case (an ERROR on the certificate, not a FAIL)."""


def _suite_path(filename: str) -> Path | None:
    path = Path(filename).resolve()
    return path.relative_to(_ROOT) if str(path).startswith(SUITE_CODE) else None


def _raised_by_a_callee(tb: Any) -> bool:
    """Whether the innermost Python frame of ``tb`` was making a call when the exception
    came: then a callee without a Python frame raised it (a C function: the implementation
    itself, such as torch's SDPA called from the registry's wrapper), not that frame's code."""
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    for instruction in dis.get_instructions(tb.tb_frame.f_code):
        if instruction.offset == tb.tb_lasti:
            return instruction.opname.startswith("CALL") or instruction.opname == "PRECALL"
    return False


def suite_frame(error: BaseException, *, raised_there: bool = True) -> str | None:
    """``path:line in function`` of the suite's frame behind ``error``: with
    ``raised_there``, only when the line that raised it is the suite's code (an error out
    of an implementation's call: raised by the bridge, not by the implementation or a
    library it calls); otherwise the deepest frame of the suite's code in its traceback
    (an error that escaped a check: the suite's own wherever it was raised). None: none."""
    if isinstance(error, NotImplementedError):
        return None
    if raised_there and _raised_by_a_callee(error.__traceback__):
        return None
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ is not None else []
    for frame in reversed(frames[-1:] if raised_there else frames):
        where = _suite_path(frame.filename)
        if where is not None:
            return f"{where}:{frame.lineno} in {frame.name}"
    return None


def suite_error(exc: BaseException, impl: str) -> SuiteError | None:
    """The suite's own error behind ``exc`` as a :class:`SuiteError`: ``exc`` itself when a
    check raised something other than a property failure, or the error an implementation's
    call raised (its ``__cause__``) when the suite's code raised it there. None when ``exc``
    is the implementation's failure."""
    if isinstance(exc, SuiteError):
        return exc
    if isinstance(exc, PropertyFailure):
        error, where = exc.__cause__, None
        if error is not None and not isinstance(error, PropertyFailure):
            where = suite_frame(error)
        if where is None:
            return None
    else:
        error, where = exc, suite_frame(exc, raised_there=False) or "(no frame of the suite's code)"
    text = f"{type(error).__name__}: {error}".strip()
    return SuiteError(f"the suite itself broke (not a failure of {impl}): {text}\n"
                      f"  raised in the suite's own code at {where}; please report it with the "
                      "replay line below (the whole traceback: --tb=long)")
