"""Declarations: what an implementation supports, written once, in TOML.

A declaration is a table whose keys are exactly the ``--impl-option`` keys, plus
``spec`` (what ``--impl`` would name: ``"my_pkg.attn:fwd"``, ``"path/to/file.py:fwd"``, a
registered name ...) and optionally ``xfail_file`` (expected failures, the schema of
``implementations/xfail/*.toml``, relative to the file that names it). A level-scoped
key (``flash.head_dims=``) is a subtable ``[flash]``, a dtype-scoped one
(``float64.mask_kinds=``) a subtable ``[float64]``. Values may be TOML's own (lists,
booleans, integers, an inline table for a per-kind ``fully_masked``) or the option's
text; both are turned into the option's text and parsed by the same parser, so a
declaration and ``--impl-option`` can never read a value differently.

It is found two ways (:func:`find_declaration`):

* ``--impl=path/to/decl.toml``: a TOML file holding one declaration;
* ``--impl=NAME``, NAME not a built-in: the table
  ``[tool.attention-conformance.implementations.NAME]`` of the ``pyproject.toml`` in
  pytest's rootdir (the current directory outside pytest).

``--impl-option KEY=VALUE`` on the command line overrides the declaration's value for
the same key (:meth:`Declaration.merged`). A field a declaration gives is not probed
(``resolution.resolve`` passes :meth:`Declaration.unprobed`); a field given only on the
command line is probed as before (a claim the probe saw fail is refused).

The way back, a declaration drafted from what resolution and probing found, is
:mod:`.declaration_draft`.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any, Iterable, Mapping

from implementations.base import ALL_DTYPES, ImplementationError

__all__ = ["DECLARATION_TABLE", "Declaration", "find_declaration", "known_keys", "load_declaration_file",
           "option_text", "read_declaration"]

#: Where a ``pyproject.toml`` holds declarations, one subtable per name.
DECLARATION_TABLE = "tool.attention-conformance.implementations"
#: The keys of a declaration that are not ``--impl-option`` keys.
RESERVED_KEYS = ("spec", "xfail_file")


def known_keys() -> tuple[str, ...]:
    """Every ``--impl-option`` key (capabilities, ``derived_flash``, the bridge's, the
    learner's, ONNX's): the keys a declaration may hold besides ``spec`` and ``xfail_file``."""
    from implementations.bridge import BRIDGE_OPTIONS
    from implementations.onnx import ONNX_OPTIONS
    from implementations.registry.learner import LEARNER_OPTIONS
    from implementations.registry.options import CAPABILITY_OPTION_KEYS, DERIVED_FLASH_OPTION

    return (*CAPABILITY_OPTION_KEYS, DERIVED_FLASH_OPTION, *BRIDGE_OPTIONS, *LEARNER_OPTIONS, *ONNX_OPTIONS)


def _scopes() -> tuple[str, ...]:
    from implementations.registry.options import OPTION_LEVELS

    return (*OPTION_LEVELS, *ALL_DTYPES)


@dataclasses.dataclass(frozen=True)
class Declaration:
    """One declaration: the implementation it names and its values as ``--impl-option`` text."""

    spec: str
    #: ``--impl-option`` key (``flash.head_dims`` for a subtable's) -> the option's text.
    options: dict[str, str]
    #: Absolute path of the expected-failures file, or None.
    xfail_file: str | None
    #: Where it was read, for messages and the certificate (``decl.toml``, ``pyproject.toml [tool...NAME]``).
    source: str
    #: The TOML as written (the table's lines), for the certificate.
    text: str = ""

    def merged(self, options: Mapping[str, str] | None) -> dict[str, str]:
        """The declaration's options with ``options`` (the command line's) winning key by key."""
        return {**self.options, **(options or {})}

    def unprobed(self, options: Mapping[str, str] | None) -> tuple[str, ...]:
        """The keys whose value comes from the declaration (not overridden by ``options``):
        what is declared there is not probed."""
        return tuple(key for key in self.options if key not in (options or {}))

    def pasteable(self) -> str:
        """The declaration as one TOML table, for the certificate (``spec`` first)."""
        return _render(self.spec, self.options, self.xfail_file)


def option_text(key: str, value: Any, where: str = "the declaration") -> str:
    """A TOML value of ``key`` as its ``--impl-option`` text: a list is comma-separated, a
    boolean ``true``/``false``, an inline table ``KIND:POLICY`` (``fully_masked``) or
    ``NAME=VALUE`` (``learner_config``) pairs; a string stays as written."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int)) and not isinstance(v, bool)
                                               for v in value):
        return ",".join(str(v) for v in value) if value else "none"
    if isinstance(value, Mapping) and all(isinstance(v, (str, int)) for v in value.values()):
        sep = "=" if key.rpartition(".")[2] == "learner_config" else ":"
        return ",".join(f"{k}{sep}{v}" for k, v in value.items())
    raise ImplementationError(
        f"{where}: {key} = {value!r} is a {type(value).__name__}; a value is a string, an integer, "
        f"a boolean, a list of strings or integers, or (fully_masked, learner_config) an inline table; "
        f"write e.g. {key} = \"...\" as you would after --impl-option {key}=")


def read_declaration(table: Mapping[str, Any], *, source: str, base: Path, text: str = "") -> Declaration:
    """The declaration in ``table`` (a parsed TOML table): unknown keys are an error naming
    the key, the known keys and the fix; every value is checked by the option's parser."""
    from implementations.registry.options import parse_options

    known = known_keys()
    spec = table.get("spec")
    if not isinstance(spec, str) or not spec.strip():
        raise ImplementationError(
            f"{source}: no spec; a declaration names the implementation it declares, as --impl "
            f"would: spec = \"my_pkg.attn:fwd\" (or \"path/to/file.py:fwd\", a registered name)")
    if spec.strip().lower().endswith(".toml"):
        raise ImplementationError(f"{source}: spec = {spec!r} names a declaration; name the implementation "
                                  "itself (module:attr, path/to/file.py:attr, a registered name)")
    options: dict[str, str] = {}
    xfail = table.get("xfail_file")
    if xfail is not None and not isinstance(xfail, str):
        raise ImplementationError(f"{source}: xfail_file = {xfail!r}; give a path, relative to {base}")
    for key, value in table.items():
        if key in RESERVED_KEYS:
            continue
        if key in _scopes() and isinstance(value, Mapping):
            for inner, inner_value in value.items():
                if inner not in known:
                    raise _unknown(f"{key}.{inner}", source, known)
                options[f"{key}.{inner}"] = option_text(f"{key}.{inner}", inner_value, source)
            continue
        if key not in known:
            raise _unknown(key, source, known)
        options[key] = option_text(key, value, source)
    try:
        parse_options(_capability_options(options))  # every value checked now, with its key named
    except ImplementationError as exc:
        raise ImplementationError(f"{source}: {exc} (the declaration's value, read as that option)") from None
    xfail_path = str((base / xfail).resolve()) if xfail else None
    if xfail_path and not Path(xfail_path).is_file():
        raise ImplementationError(f"{source}: xfail_file = {xfail!r}: no such file ({xfail_path}); the path is "
                                  f"relative to {base}")
    return Declaration(spec=spec.strip(), options=options, xfail_file=xfail_path, source=source, text=text)


def _capability_options(options: Mapping[str, str]) -> dict[str, str]:
    """The options ``parse_options`` reads (the bridge's, the learner's and ONNX's are checked
    where they are read)."""
    from implementations.bridge import BRIDGE_OPTIONS
    from implementations.onnx import ONNX_OPTIONS
    from implementations.registry.learner import LEARNER_OPTIONS

    other = {*BRIDGE_OPTIONS, *LEARNER_OPTIONS, *ONNX_OPTIONS}
    return {k: v for k, v in options.items() if k not in other}


def _unknown(key: str, source: str, known: Iterable[str]) -> ImplementationError:
    return ImplementationError(
        f"{source}: unknown key {key!r}; a declaration holds spec, xfail_file and the --impl-option keys: "
        f"{', '.join(sorted(known))}, each also in a subtable [LEVEL] ({', '.join(_scopes()[:3])}) or "
        f"[DTYPE] ({', '.join(ALL_DTYPES)}) for that level or dtype only; fix the spelling, or move the key "
        "into its subtable")


def load_declaration_file(path: str | Path) -> Declaration:
    """The declaration of a TOML file (``--impl=path/to/decl.toml``)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ImplementationError(f"--impl={path}: no declaration file {str(path)!r} (looked for "
                                  f"{file.resolve()}); give an existing path/to/decl.toml")
    text = file.read_text(encoding="utf-8")
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ImplementationError(f"--impl={path}: {path} is not valid TOML ({exc}); fix the file") from None
    return read_declaration(table, source=str(path), base=file.resolve().parent, text=text)


def _pyproject_table(name: str, root: Path) -> Mapping[str, Any] | None:
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        return None
    try:
        data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError):
        return None  # pytest reads it too, and reports a broken one itself
    table: Any = data
    for part in (*DECLARATION_TABLE.split("."), name):
        table = table.get(part) if isinstance(table, Mapping) else None
    return table if isinstance(table, Mapping) else None


def find_declaration(spec: str, root: str | Path | None = None) -> Declaration | None:
    """The declaration ``--impl=spec`` names: a ``.toml`` file, or (``spec`` a name, not a
    built-in) the table ``[tool.attention-conformance.implementations.NAME]`` of
    ``root/pyproject.toml`` (``root``: pytest's rootdir; default the current directory).
    None when ``spec`` names no declaration."""
    spec = (spec or "").strip()
    if spec.lower().endswith(".toml"):
        return load_declaration_file(spec)
    if not spec or ":" in spec or "/" in spec or "\\" in spec:
        return None
    from implementations.builtins import BUILTINS

    if spec in BUILTINS:
        return None
    base = Path(root) if root is not None else Path.cwd()
    table = _pyproject_table(spec, base)
    if table is None:
        return None
    where = f"{base / 'pyproject.toml'} [{DECLARATION_TABLE}.{spec}]"
    return read_declaration(table, source=where, base=base, text="")


# --------------------------------------------------------------------------- writing TOML


def toml_value(value: Any) -> str:
    """``value`` (a string, integer, boolean, list of those, or mapping of strings) as TOML."""
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string for the text the options use
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    return "[" + ", ".join(toml_value(v) for v in value) + "]"


def _render(spec: str, options: Mapping[str, str], xfail_file: str | None) -> str:
    """``spec = ...`` and the options (as their option text), subtables last."""
    lines = [f"spec = {toml_value(spec)}"]
    if xfail_file:
        lines.append(f"xfail_file = {toml_value(xfail_file)}")
    scoped: dict[str, list[str]] = {}
    for key, text in options.items():
        scope, dot, inner = key.partition(".")
        if dot:
            scoped.setdefault(scope, []).append(f"{inner} = {toml_value(text)}")
        else:
            lines.append(f"{key} = {toml_value(text)}")
    for scope, entries in scoped.items():
        lines += [f"[{scope}]", *entries]
    return "\n".join(lines)
