"""pyproject's ``requires-python`` is true: no module uses Python newer than it states.

Two checks on every module of the packages and of the repository's scripts and tests:

* syntax: ``ast.parse(..., feature_version=minimum)`` rejects grammar newer than the
  minimum (``except*``, ``type X = ...``, PEP 695 generics, ...), best effort as the
  ``ast`` documentation says;
* names: a table of standard-library modules and names added after 3.10 (the ones this
  code base could plausibly reach for: ``tomllib``, ``ExceptionGroup``, ``typing.Self``,
  ``itertools.batched``, ...) is matched against imports, bare names and dotted
  attribute chains. Aliased imports (``import typing as t; t.Self``) are not followed.

It is a guard against the mistakes that happened (``tomllib`` and ``ExceptionGroup``
with ``>=3.10``), not a proof: a newer module not in the table would pass.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("spec", "conformance", "implementations", "examples", "benchmarks", "tests")

#: Standard-library modules and names, with the Python version that added them.
ADDED_IN = {
    # 3.11
    "tomllib": (3, 11), "wsgiref.types": (3, 11),
    "ExceptionGroup": (3, 11), "BaseExceptionGroup": (3, 11),
    "typing.Self": (3, 11), "typing.LiteralString": (3, 11), "typing.Never": (3, 11),
    "typing.assert_never": (3, 11), "typing.assert_type": (3, 11), "typing.reveal_type": (3, 11),
    "typing.TypeVarTuple": (3, 11), "typing.Unpack": (3, 11), "typing.Required": (3, 11),
    "typing.NotRequired": (3, 11), "typing.dataclass_transform": (3, 11),
    "enum.StrEnum": (3, 11), "enum.verify": (3, 11), "datetime.UTC": (3, 11),
    "asyncio.TaskGroup": (3, 11), "asyncio.timeout": (3, 11), "hashlib.file_digest": (3, 11),
    "math.cbrt": (3, 11), "math.exp2": (3, 11), "operator.call": (3, 11),
    "contextlib.chdir": (3, 11),
    # 3.12
    "typing.override": (3, 12), "typing.TypeAliasType": (3, 12), "itertools.batched": (3, 12),
    "math.sumprod": (3, 12), "pathlib.Path.walk": (3, 12), "sys.monitoring": (3, 12),
    # 3.13
    "warnings.deprecated": (3, 13), "typing.ReadOnly": (3, 13), "typing.TypeIs": (3, 13),
    "copy.replace": (3, 13),
}


def stated_minimum() -> tuple[int, int]:
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    match = re.fullmatch(r"\s*>=\s*3\.(\d+)\s*", requires)
    assert match, f"requires-python={requires!r}, but should read '>=3.X' (the form this test checks)"
    return (3, int(match.group(1)))


def modules() -> list[Path]:
    return sorted(path for folder in CHECKED for path in (ROOT / folder).rglob("*.py"))


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for an attribute chain on a bare name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def names_used(tree: ast.AST) -> set[str]:
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            used.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            used.add(node.module)
            used.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            chain = dotted(node)
            if chain:
                used.add(chain)
    return used


def test_stated_minimum_is_this_interpreter_or_older():
    assert sys.version_info[:2] >= stated_minimum()


def test_the_readme_states_the_same_minimum():
    major, minor = stated_minimum()
    assert f"Python ≥ {major}.{minor}" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_needs_no_newer_python(path):
    minimum = stated_minimum()
    source = path.read_text(encoding="utf-8")
    try:
        tree = ast.parse(source, filename=str(path), feature_version=minimum)
    except SyntaxError as exc:
        pytest.fail(f"{path.relative_to(ROOT)}:{exc.lineno}: syntax newer than Python "
                    f"{minimum[0]}.{minimum[1]}: {exc.msg}")
    newer = sorted(f"{name} (Python {'.'.join(map(str, ADDED_IN[name]))})"
                   for name in names_used(tree) if ADDED_IN.get(name, (0, 0)) > minimum)
    assert not newer, (f"{path.relative_to(ROOT)} uses {', '.join(newer)}, but requires-python "
                       f"says >={minimum[0]}.{minimum[1]}: raise it or avoid these")


def test_the_table_catches_what_it_should():
    """Meta-test: the two features that made the old '>=3.10' false are found under 3.10."""
    tree = ast.parse("import tomllib\ntry:\n    pass\nexcept ExceptionGroup:\n    pass\n")
    found = {name for name in names_used(tree) if ADDED_IN.get(name, (0, 0)) > (3, 10)}
    assert found == {"tomllib", "ExceptionGroup"}
    with pytest.raises(SyntaxError):
        ast.parse("try:\n    pass\nexcept* ValueError:\n    pass\n", feature_version=(3, 10))
