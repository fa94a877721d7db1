"""A module file given as ``path/to/pkg/module.py:Class`` that uses a relative import
(``from .helpers import ...``) runs only as a member of its package: imported by its
dotted name from the folder above its outermost package."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

__all__ = ["member_of_package"]


def member_of_package(path: Path, error: BaseException) -> Any | None:
    """The module at ``path`` imported as a member of its package where running it alone
    raised ``error``, a relative import with no parent package; None otherwise (not that
    error, or the file's folder is no package)."""
    if not (isinstance(error, ImportError) and "relative import" in str(error)):
        return None
    path = Path(path).resolve()
    parts, folder = [path.stem], path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    if len(parts) == 1:
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
