"""Levels beyond SDPA and MHA, and the call-layer module of each.

``LEVEL_MODULES[level]`` names the module that makes calls at that level (the flash
level's is ``conformance.calls.flash``; the varlen and kvcache levels' are
``conformance.calls.varlen`` and ``conformance.calls.kvcache``). It provides:

* ``Case``: a frozen dataclass of float64 arrays with ``level``, ``dtype``, ``device``,
  ``attrs()``, ``describe()`` and ``replace()``; ``ATTRIBUTES``: what ``attrs()`` and the
  call add (the keys an expected failure's ``match`` may use at that level);
* ``CallSpec``: one call as made (dataclass fields ``case`` and ``grad_output`` among
  them; ``level``, ``attrs()``, ``arguments()``, ``describe()``, ``same_as(case)``);
* ``case_meta(case) -> (meta with "kind": level, arrays)`` and ``case_from_meta(meta,
  arrays)`` (a saved failure, ``.npz`` without pickle); ``validate(case)`` (ValueError
  when the spec calls it invalid);
* ``report_call(impl, call, invoke=...) -> replay.CallReport`` and ``SHOW``, the name of
  the function a reproducer imports from the module to make and show the call.

The shared machinery (``failures``, ``replay``, ``expectations``, ``isolation``,
``diagnosis``, and ``declarations.call_of``, which the level modules import) reads
this table, so a new level is one entry here plus its module, its strategies and its
``conformance/test_<level>.py``. The implementation's callable
at the level is ``Implementation.<level>`` with its capabilities ``Implementation.caps(level)``
(``Implementation.<level>_capabilities`` where that field exists, as ``flash_capabilities``
does, else ``capabilities``).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["LEVEL_MODULES", "level_of", "module"]

LEVEL_MODULES: dict[str, str] = {
    "flash": "conformance.calls.flash",
    "varlen": "conformance.calls.varlen",
    "kvcache": "conformance.calls.kvcache",
    "sharded": "conformance.sharded.level",
}


def module(level: str) -> ModuleType:
    """The call-layer module of ``level`` (one of :data:`LEVEL_MODULES`)."""
    return importlib.import_module(LEVEL_MODULES[level])


def level_of(obj: Any) -> str | None:
    """The level of a case or call spec of one of these levels, else None (SDPA, MHA)."""
    level = getattr(obj, "level", None)
    return level if level in LEVEL_MODULES else None
