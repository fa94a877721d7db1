"""The suite's packages import each other in layers, with no import cycle.

Every ``import`` and ``from ... import`` of every module of ``spec``, ``implementations``
and ``conformance`` counts, those inside functions (deferred) included: a deferred
import is still an arrow, and a cycle through one is still a cycle. docs/DESIGN.md
draws the layers; :data:`LAYERS` is that drawing as a table, so a new upward arrow
(or a new subpackage not in the table) fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("spec", "implementations", "conformance")

#: Each subpackage of ``conformance`` and the layers below it that it may import,
#: bottom first. The package's own top-level modules (the property files ``test_*.py``,
#: ``plugin``, ``activation``, ``docgen``) are the top layer and may import any layer;
#: no layer may import them.
LAYERS: dict[str, frozenset[str]] = {}
_ORDER = ("core", "calls", "strategies", "directed", "sharded", "diagnosis", "reporting", "isolation", "harness")
for _i, _name in enumerate(_ORDER):
    LAYERS[_name] = frozenset(_ORDER[:_i])

#: The packages themselves: each may import only those before it.
PACKAGE_ORDER = {"spec": frozenset(), "implementations": frozenset({"spec"}),
                 "conformance": frozenset({"spec", "implementations"})}

#: The most modules (``.py`` files) one folder of the three packages may hold.
MAX_MODULES = 15
#: The most lines one module of the three packages may have: a module longer than a
#: few screens does more than one job, and is split by job (not by size).
MAX_LINES = 500


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of :data:`PACKAGES` by dotted name (a package by its own name)."""
    mods = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def imported_modules(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``source`` (module ``module``) imports, anywhere in it
    (inside functions and ``if`` blocks too): ``from a import b`` imports ``a.b`` when that
    is a module, else ``a``; a name not in ``known`` counts as its nearest known parent."""

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        for name in targets:
            target = resolve(name)
            if target is not None and target != module:
                found.add(target)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of the three packages it imports."""
    files = module_files(root)
    known = set(files)
    return {m: imported_modules(p.read_text(encoding="utf-8"), m, p.name == "__init__.py", known)
            for m, p in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as [a, b, ..., a], or None when it has none."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = {node: WHITE for node in graph}
    for start in sorted(graph):
        if colour[start] != WHITE:
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        colour[start] = GREY
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                colour[path.pop()] = BLACK
                stack.pop()
            elif colour.get(nxt, BLACK) == GREY:
                return path[path.index(nxt):] + [nxt]
            elif colour.get(nxt, BLACK) == WHITE:
                colour[nxt] = GREY
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def layer_of(module: str) -> str:
    """``core``, ``calls``...: the layer of a module of ``conformance``; ``top`` for the
    package's own modules; the package name for ``spec`` and ``implementations``."""
    parts = module.split(".")
    if parts[0] != "conformance":
        return parts[0]
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else "top"


def layer_violations(graph: dict[str, set[str]], layers: dict[str, frozenset[str]] = LAYERS) -> list[str]:
    """Every arrow of ``graph`` that goes up (or sideways into an undeclared layer):
    ``'a -> b (layer x may import only ...)'``."""
    bad = []
    for module, targets in sorted(graph.items()):
        top = module.split(".")[0]
        for target in sorted(targets):
            other = target.split(".")[0]
            if other != top:
                if other not in PACKAGE_ORDER.get(top, frozenset()):
                    bad.append(f"{module} -> {target} (package {top} may import only "
                               f"{sorted(PACKAGE_ORDER.get(top, ()))})")
                continue
            if top != "conformance" or target == "conformance":
                continue
            mine, theirs = layer_of(module), layer_of(target)
            if mine == theirs or mine == "top":
                continue
            if mine not in layers:
                bad.append(f"{module} -> {target} (layer {mine} is not in the table)")
            elif theirs not in layers[mine]:
                bad.append(f"{module} -> {target} (layer {mine} may import only {sorted(layers[mine])})")
    return bad


# ----------------------------------------------------------------------------- the suite


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_each_layer_imports_only_the_layers_below_it():
    assert layer_violations(import_graph()) == []


def test_every_subpackage_is_a_declared_layer():
    subpackages = {p.parent.name for p in (ROOT / "conformance").glob("*/__init__.py")}
    assert subpackages == set(LAYERS), "declare each subpackage of conformance in LAYERS (and docs/DESIGN.md)"


def test_each_subpackage_says_its_job_in_one_line():
    for init in sorted((ROOT / "conformance").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")), clean=False)
        assert doc, f"{init} has no docstring"
        first, _, rest = doc.strip().partition("\n")
        assert first.endswith(".") and (not rest or rest.startswith("\n")), (
            f"{init}: its docstring starts with one line (a sentence) naming the package's job")


def crowded_folders(root: Path = ROOT) -> list[str]:
    """Every folder of :data:`PACKAGES` that holds more than :data:`MAX_MODULES` modules."""
    folders = [root / package for package in PACKAGES]
    folders += [p for package in PACKAGES for p in sorted((root / package).rglob("*")) if p.is_dir()]
    return [f"{folder.relative_to(root)} holds {count} modules"
            for folder in folders if (count := len(list(folder.glob("*.py")))) > MAX_MODULES]


def long_modules(root: Path = ROOT) -> list[str]:
    """Every module of :data:`PACKAGES` longer than :data:`MAX_LINES` lines."""
    return [f"{path.relative_to(root)} has {lines} lines"
            for path in module_files(root).values()
            if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES]


def test_no_folder_holds_more_than_fifteen_modules():
    assert crowded_folders() == [], "split the folder by job (docs/DESIGN.md)"


def test_no_module_is_longer_than_five_hundred_lines():
    assert long_modules() == [], "split the module by job (docs/DESIGN.md)"


# ----------------------------------------------------------------------------- the checks can fail


def test_find_cycle_finds_a_synthetic_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_a_deferred_import_is_an_arrow():
    source = "def f():\n    from conformance.harness import runner\n    return runner\n"
    known = {"conformance", "conformance.harness", "conformance.harness.runner", "conformance.core.target"}
    assert imported_modules(source, "conformance.core.target", False, known) == {"conformance.harness.runner"}


def test_a_cycle_through_a_deferred_import_fails(tmp_path):
    for name, text in {"spec/__init__.py": "", "implementations/__init__.py": "",
                       "conformance/__init__.py": "", "conformance/core/__init__.py": "",
                       "conformance/core/a.py": "def f():\n    from conformance.core import b\n",
                       "conformance/core/b.py": "from conformance.core.a import f\n"}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert find_cycle(import_graph(tmp_path)) == ["conformance.core.a", "conformance.core.b", "conformance.core.a"]


@pytest.mark.parametrize("edge, allowed", [
    (("conformance.core.target", "conformance.harness.runner"), False),   # up
    (("conformance.calls.sdpa", "conformance.diagnosis.diagnose"), False),  # up
    (("conformance.harness.runner", "conformance.core.target"), True),     # down
    (("conformance.core.target", "conformance.plugin"), False),            # into the top layer
    (("conformance.test_x", "conformance.harness.runner"), True),          # the top layer
    (("spec.x", "conformance.core.target"), False),                        # package upward
])
def test_an_upward_arrow_is_a_violation(edge, allowed):
    source, target = edge
    assert (layer_violations({source: {target}}) == []) is allowed


def test_a_crowded_folder_and_a_long_module_are_found(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    for i in range(MAX_MODULES):  # with __init__.py: one module too many
        (tmp_path / "implementations" / f"m{i}.py").write_text("")
    (tmp_path / "spec" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "spec" / "fits.py").write_text("x = 1\n" * MAX_LINES)
    assert crowded_folders(tmp_path) == [f"implementations holds {MAX_MODULES + 1} modules"]
    assert long_modules(tmp_path) == [f"spec/long.py has {MAX_LINES + 1} lines"]
