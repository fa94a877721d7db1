"""The registry builds the built-ins, never the other way round.

Built-ins and mutants do not import ``implementations.registry`` (not at the top, not
inside a function: the registry imports them, so such an import is a cycle), but for the
contract mutants, which are bare callables built the way ``--impl`` builds one (through
``registry.recognition``, inside ``build()``, never at import), and the learner mutants,
hand-written modules built the way ``--impl=file.py:Class`` builds one (through
``registry.learner``, inside a function, never at import), and the
registry attaches each built-in's ``implementations/xfail/<name>.toml`` itself, so a
built-in cannot forget its expected failures.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from implementations import registry
from implementations.builtins import BUILTINS

ROOT = Path(__file__).resolve().parents[2] / "implementations"
#: Modules that build their implementations through recognition and probing, inside a
#: function (checked below: never at the top).
THROUGH_RECOGNITION = {"contract_mutants.py", "learner_mutants.py"}
MODULES = sorted([*(ROOT / "builtins").glob("*.py"), *(ROOT / "mutants").glob("*.py")])
XFAIL_FILES = sorted((ROOT / "xfail").glob("*.toml"))


def _imported_modules(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in ``tree``, relative ones made absolute,
    ``from a import b`` giving ``a.b``, plus ``import_module("...")`` calls."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
            "import_module", "__import__"
        ):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def test_the_scan_sees_imports_inside_functions_and_relative_ones():
    source = (
        "def f():\n    from implementations.registry import resolve\n"
        "from .. import registry\n"
        "import importlib\nimportlib.import_module('implementations.registry.resolution')\n"
    )
    found = set(_imported_modules(ast.parse(source), "implementations.builtins"))
    assert {(2, "implementations.registry"), (3, "implementations.registry"),
            (5, "implementations.registry.resolution")} <= found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_builtins_and_mutants_do_not_import_the_registry(path):
    package = f"implementations.{path.parent.name}"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if path.name in THROUGH_RECOGNITION:  # only inside functions: the module's own top level is checked
        tree = ast.Module(body=[node for node in tree.body
                                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))],
                          type_ignores=[])
    offending = [
        f"line {line}: {name}"
        for line, name in _imported_modules(tree, package)
        if name == "implementations.registry" or name.startswith("implementations.registry.")
    ]
    assert not offending, f"{path.relative_to(ROOT.parent)} imports the registry: {offending}"


def owner(stem: str) -> tuple[str, dict[str, str]]:
    """The ``--impl`` (and options) whose expected failures ``<stem>.toml`` holds: a built-in's
    name, or ``onnx:<name>`` exported by ``<exporter>`` for ``onnx-<exporter>-<name>``."""
    if stem.startswith("onnx-"):
        exporter, _, name = stem.removeprefix("onnx-").partition("-")
        return f"onnx:{name}", {"onnx_exporter": exporter}
    return stem, {}


def test_every_expected_failures_file_names_a_builtin():
    assert XFAIL_FILES
    from implementations.onnx.runtime import EXPORTERS

    orphans = [p.name for p in XFAIL_FILES if owner(p.stem)[0].removeprefix("onnx:") not in BUILTINS
               or owner(p.stem)[1].get("onnx_exporter", "torchscript") not in EXPORTERS]
    assert not orphans, (f"files in implementations/xfail name no built-in (or onnx-EXPORTER-BUILTIN): {orphans}; "
                         f"known: {sorted(BUILTINS)}")


@pytest.mark.parametrize("path", XFAIL_FILES, ids=lambda p: p.stem)
def test_builtins_get_the_entries_of_their_expected_failures_file(path):
    entries = registry.load_expected_failures(path.stem)
    assert entries, f"{path.name} has no [[xfail]] entries"
    spec, options = owner(path.stem)
    impl = registry.resolve(spec, options)
    if spec.startswith("onnx:") and not impl.available:  # without onnxruntime: nothing to attach them to
        pytest.skip(f"{spec} is unavailable here: {impl.unavailable_reason}")
    assert impl.expected_failures == entries


def test_builtins_without_a_file_have_no_expected_failures():
    for name in sorted(set(BUILTINS) - {p.stem for p in XFAIL_FILES}):
        assert registry.resolve(name).expected_failures == (), name
