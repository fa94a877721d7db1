"""A module file given as ``path/to/pkg/module.py:Class`` that imports its own package,
relatively (``from .helpers import ...``) or by name (minGPT's ``from mingpt.utils import
CfgNode`` in ``mingpt/model.py``), runs only as a member of that package: imported by its
dotted name from the folder above its outermost package."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

__all__ = ["member_of_package"]


def member_of_package(path: Path, error: BaseException) -> Any | None:
    """The module at ``path`` imported as a member of its package where running it alone
    raised ``error``: a relative import with no parent package, or no module named after
    a package the file is in; None otherwise (another error, or the file's folder is no
    package)."""
    if not isinstance(error, ImportError):
        return None
    path = Path(path).resolve()
    parts, folder = [path.stem], path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    if len(parts) == 1:
        return None
    top = (getattr(error, "name", None) or "").split(".")[0]
    if isinstance(error, ModuleNotFoundError) and top in parts[:-1]:
        # imported by the name of a package it is in: that package is the outermost one
        first = parts.index(top)
        for name in parts[:first]:
            folder = folder / name
        parts = parts[first:]
    elif "relative import" not in str(error):
        return None
    root = str(folder)
    added = root not in sys.path
    if added:
        sys.path.insert(0, root)
    try:
        return importlib.import_module(".".join(parts))
    finally:
        if added:
            sys.path.remove(root)
