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

The way back, a declaration drafted from what resolution and probing found
(``--conformance-write-declaration``), is :func:`draft_declaration`.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any, Iterable, Mapping

from implementations.base import ALL_DTYPES, ImplementationError

__all__ = ["DECLARATION_TABLE", "Declaration", "draft_declaration", "find_declaration", "known_keys",
           "load_declaration_file", "option_text", "read_declaration", "toml_value"]

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
    ``NAME=VALUE`` (``learner_config``, ``call_kwargs``: a TOML boolean as Python's) pairs; a
    string stays as written."""
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
        name = key.rpartition(".")[2]
        if name == "call_kwargs":  # Python literals: a TOML true is True
            return ",".join(f"{k}={v!r}" if isinstance(v, bool) else f"{k}={v}" for k, v in value.items())
        sep = "=" if name == "learner_config" else ":"
        return ",".join(f"{k}{sep}{v}" for k, v in value.items())
    raise ImplementationError(
        f"{where}: {key} = {value!r} is a {type(value).__name__}; a value is a string, an integer, "
        f"a boolean, a list of strings or integers, or (fully_masked, learner_config, call_kwargs) an inline table; "
        f"write e.g. {key} = \"...\" as you would after --impl-option {key}=")


def read_declaration(table: Mapping[str, Any], *, source: str, base: Path) -> Declaration:
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
    return Declaration(spec=spec.strip(), options=options, xfail_file=xfail_path, source=source)


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
    return read_declaration(table, source=str(path), base=file.resolve().parent)


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
    return read_declaration(table, source=where, base=base)


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
        value: Any = text
        if text in ("true", "false"):
            value = text == "true"
        elif text.isdigit():
            value = int(text)
        elif "," in text and not any(c in text for c in ":="):
            value = [int(item) if item.isdigit() else item for item in text.split(",")]
        if dot:
            scoped.setdefault(scope, []).append(f"{inner} = {toml_value(value)}")
        else:
            lines.append(f"{key} = {toml_value(value)}")
    for scope, entries in scoped.items():
        lines += [f"[{scope}]", *entries]
    return "\n".join(lines)


# --------------------------------------------------------------------------- drafting from a run

#: The fields the SDPA-level probe finds (``probing.probe_sdpa``): ``probe`` in a draft.
_PROBED = frozenset({"dtypes", "mask_kinds", "causal", "different_v_dim", "gqa", "dropout", "custom_scale",
                     "autograd", "mask_grad", "non_contiguous", "self_attention_lengths", "batch_dims",
                     "fully_masked"})
#: ... and at the MHA and flash levels (``mha_probing``, ``flash_recognition``).
_PROBED_AT = {"sdpa": _PROBED, "mha": _PROBED | {"mha_features"},
              "flash": _PROBED | {"flash_features", "fp8_dtypes", "fp8_descales"}}
_SOURCE_WORDS = {"contract": "contract (the signature's meaning)", "probed": "probe", "declared": "declared"}


def _native(value: Any) -> Any:
    """A capability value as TOML: None is ``"none"``, a set a sorted list, an empty one ``"none"``."""
    if value is None:
        return "none"
    if isinstance(value, (set, frozenset)):
        value = sorted(value)
    if isinstance(value, (list, tuple)):
        return list(value) if value else "none"
    return dict(value) if isinstance(value, Mapping) else value


def _expressible(key: str, value: Any, caps: Any) -> bool:
    """Whether ``value`` written for ``key`` reads back as the same capability."""
    from implementations.registry.options import parse_options

    try:
        parsed = parse_options({key: option_text(key, _native(value))}).common
        return getattr(caps.replace(**parsed), key) == getattr(caps, key)
    except (ImplementationError, TypeError, ValueError):
        return False


def _source(key: str, caps: Any, given: Mapping[str, str], scoped_key: str, recognised: bool,
            derived: bool) -> str:
    from implementations.base import Capabilities

    if scoped_key in given:
        return "declared"
    if caps.sources and dict(caps.sources).get(key):
        return _SOURCE_WORDS.get(dict(caps.sources)[key], dict(caps.sources)[key])
    note = " ".join(n for n in caps.probe_notes if n.split(":", 1)[0] == key)
    if derived:
        return "derived from the SDPA level"
    if recognised and (note or key in _PROBED_AT[scoped_key.partition(".")[0] if "." in scoped_key else "sdpa"]):
        return f"probe: {note.split(': ', 1)[-1][:90]}" if note else "probe"
    if getattr(Capabilities(), key) == getattr(caps, key):
        return "default"
    return "signature" if recognised else "the implementation's own declaration"


def _learner_entries(impl: Any, given: Mapping[str, str]) -> list[str]:
    """The conventions the learner level probed on a hand-written module (its layout, the
    cut of a fused projection, the mask convention), as ``learner_*`` entries that a
    read-back takes instead of probing them; one that was assumed, or whose declaration
    would change what is certified, is written as a comment saying why."""
    from implementations.registry.learner.plan import LearnerPlan

    plan = getattr(getattr(impl, "mha", None), "plan", None)
    if not isinstance(plan, LearnerPlan):
        return []
    out = []
    if "learner_layout" not in given:
        layout = "seq_first" if plan.seq_first else "batch_first"
        out.append(f"learner_layout = {toml_value(layout)}  # probe: {plan.layout_how or 'batch-first, on its calls'}")
    if plan.role("qkv") and "learner_fused" not in given:
        entry = f"learner_fused = {toml_value(plan.fused)}"
        out.append(f"# {entry}  ({plan.fused_how})" if plan.fused_how.startswith("assumed") else
                   f"{entry}  # probe: {plan.fused_how.split(' (', 1)[0]}")
    if plan.mask is not None and "learner_mask" not in given:
        entry = f"learner_mask = {toml_value(plan.mask)}"
        if "ASSUMED" in plan.mask_how:
            out.append(f"# {entry}  (assumed: no convention passed the probe)")
        elif plan.also_additive:
            out.append(f"# {entry}  (probe; declaring it would stop float masks going additive, which the "
                       "probe saw the module follow)")
        else:
            out.append(f"{entry}  # probe: {plan.mask_how.split(' (', 1)[0]}")
    return out


def _bridge_entries(impl: Any, given: Mapping[str, str]) -> list[str]:
    """The framework and layout the bridge read for a function of another framework."""
    from implementations.bridge import BridgedSDPA

    bridged = getattr(impl, "sdpa", None)
    if not isinstance(bridged, BridgedSDPA):
        return []
    out = []
    if "framework" not in given:
        out.append(f"framework = {toml_value(bridged.framework.name)}  # read: the function's module and body")
    if "layout" not in given:
        out.append(f"layout = {toml_value(bridged.layout)}  # read: the function's own layout")
    return out


def draft_declaration(impl: Any, spec: str, options: Mapping[str, str] | None = None,
                      declaration: Declaration | None = None) -> str:
    """The effective declaration of ``impl`` (resolved from ``--impl=spec`` with ``options``,
    and ``declaration`` when the spec named one) as a TOML file: every capability that has an
    option key, at the SDPA level, then ``[mha]``/``[flash]`` where a level differs and
    ``[DTYPE]`` where a dtype does; each entry with a comment saying where it came from
    (declared, contract, probe, signature, default). ``--impl=that.toml`` reads it back."""
    from implementations.base import PER_DTYPE_FIELDS
    from implementations.registry.options import CAPABILITY_OPTION_KEYS

    given = {**(declaration.options if declaration else {}), **(options or {})}
    base = impl.capabilities
    recognised = bool(base.sources)
    lines = [f"# Declaration of --impl={spec} drafted by --conformance-write-declaration: what resolution",
             "# and probing found. Review it, then certify with --impl=THIS.toml (or paste it as",
             f"# [{DECLARATION_TABLE}.NAME] in pyproject.toml): what it declares is not probed.",
             f"spec = {toml_value(declaration.spec if declaration else spec)}"]
    if declaration and declaration.xfail_file:
        lines.append(f"xfail_file = {toml_value(declaration.xfail_file)}")
    for key, text in given.items():  # the bridge's, the learner's, ONNX's, derived_flash: as given
        if key not in CAPABILITY_OPTION_KEYS and "." not in key:
            lines.append(f"{key} = {toml_value(text)}  # declared")

    def entries(caps: Any, keys: Iterable[str], scope: str, derived: bool = False) -> list[str]:
        out = []
        for key in keys:
            value = getattr(caps, key)
            scoped = f"{scope}.{key}" if scope else key
            entry = f"{key} = {toml_value(_native(value))}"
            why = _source(key, caps, given, scoped, recognised, derived)
            out.append(f"{entry}  # {why}" if _expressible(key, value, caps) else
                       f"# {entry}  (no option value gives this; {why})")
        return out

    lines += _learner_entries(impl, given) + _bridge_entries(impl, given)
    lines += entries(base, CAPABILITY_OPTION_KEYS, "")
    for level in ("mha", "flash"):
        if getattr(impl, level, None) is None:
            continue
        caps = impl.caps(level)
        differing = [key for key in CAPABILITY_OPTION_KEYS if getattr(caps, key) != getattr(base, key)]
        if differing:
            derived = any("derived" in n for n in caps.probe_notes) and level == "flash"
            lines += ["", f"[{level}]", *entries(caps, differing, level, derived)]
    for dtype, values in base.by_dtype:
        per = [(k, v) for k, v in values if k in PER_DTYPE_FIELDS]
        if per:
            lines += ["", f"[{dtype}]"]
            lines += [f"{k} = {toml_value(_native(v))}  # {'declared' if f'{dtype}.{k}' in given else 'probe'}"
                      for k, v in per]
    return "\n".join(lines) + "\n"
