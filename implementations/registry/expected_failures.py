"""Expected-failures files: ``implementations/xfail/<name>.toml`` as ExpectedFailure data.

A built-in's file is named after its registered name; the registry attaches the
entries when it builds the built-in (:func:`implementations.registry.resolution.registered`).
Any implementation, a plain ``file.py:attr`` function included, takes a file of the
same schema with ``--xfail-file PATH``, or a file shipped here by its short name
(``--xfail-file=keras-mha``: the deviations of a library the user certifies, as Keras'
MultiHeadAttention, kept in ``implementations/xfail/libraries/``) (:func:`load_expected_failures_file`,
:func:`with_expected_failures`).
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from implementations.base import (
    MATCH_COMPARISONS,
    ExpectedFailure,
    Implementation,
    ImplementationError,
)

__all__ = ["XFAIL_DIR", "load_expected_failures", "load_expected_failures_file", "with_expected_failures",
           "builtin_deviations", "BUILTIN_LIBRARIES", "LIBRARY_XFAIL_DIR"]

#: Where the built-ins' expected-failures files live.
XFAIL_DIR = Path(__file__).resolve().parent.parent / "xfail"
#: Where the files of libraries certified with no adapter live (Keras' MultiHeadAttention,
#: transformers' eager attention): shipped, named by ``--xfail-file=NAME``, and never
#: offered by a diagnosis to another implementation (:func:`builtin_deviations` reads
#: :data:`XFAIL_DIR` only).
LIBRARY_XFAIL_DIR = XFAIL_DIR / "libraries"

_ENTRY_KEYS = {"property", "match", "reason", "reference", "intermittent"}


def load_expected_failures(name: str, directory: Path | None = None) -> tuple[ExpectedFailure, ...]:
    """Entries of ``implementations/xfail/<name>.toml`` (none when the file is absent).

    Each ``[[xfail]]`` has ``property`` (or ``"*"``), ``reason``, optional ``match`` and
    ``reference`` and ``intermittent`` (CONTRACTS.md); ``match`` values are matched by
    :meth:`ExpectedFailure.applies` (plain value, list = any of, ``"none"`` = None, or a
    table of comparisons ``lt/le/gt/ge/ne/in``, validated here).
    """
    path = (directory or XFAIL_DIR) / f"{name}.toml"
    if not path.is_file():
        return ()
    return _load(path, str(path))


def load_expected_failures_file(path: str | Path) -> tuple[ExpectedFailure, ...]:
    """The entries of the expected-failures file ``path`` (``--xfail-file``), in the
    schema of ``implementations/xfail/*.toml``; a missing or unreadable file, bad TOML,
    or an entry that breaks the schema raises ImplementationError naming the argument,
    the rule and the fix. (Property ids and ``match`` keys are checked against the
    suite's properties when the run starts: ``conformance.core.expectations.entry_errors``.)"""
    where = f"--xfail-file {path}"
    file = Path(path).expanduser()
    shipped = [d / f"{path}.toml" for d in (LIBRARY_XFAIL_DIR, XFAIL_DIR) if (d / f"{path}.toml").is_file()]
    if not file.is_file() and _short_name(str(path)) and shipped:
        file = shipped[0]            # a short name: the file shipped in the package
    if not file.is_file():
        names = ", ".join(sorted(p.stem for d in (LIBRARY_XFAIL_DIR, XFAIL_DIR) for p in d.glob("*.toml")))
        raise ImplementationError(
            f"{where}: no such file (looked for {file.resolve()}); give the path of a TOML file "
            "of [[xfail]] tables, as in implementations/xfail/*.toml, or the short name of a file "
            f"shipped there ({names})"
        )
    return _load(file, where)


def _short_name(text: str) -> bool:
    """Whether ``--xfail-file`` was given a bare name (``keras-mha``), not a path."""
    return bool(text) and "/" not in text and "\\" not in text and not text.endswith(".toml")


def with_expected_failures(impl: Implementation, entries: tuple[ExpectedFailure, ...]) -> Implementation:
    """``impl`` with ``entries`` added after its own expected failures."""
    return dataclasses.replace(impl, expected_failures=tuple(impl.expected_failures) + tuple(entries))


def _load(path: Path, where: str) -> tuple[ExpectedFailure, ...]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ImplementationError(f"{where}: cannot read it ({type(exc).__name__}: {exc})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ImplementationError(f"{where} is not valid TOML: {exc}; fix the syntax") from exc
    unknown = sorted(set(data) - {"xfail"})
    entries = data.get("xfail", [])
    if unknown or not isinstance(entries, list):
        raise ImplementationError(
            f"{where}: top-level keys {unknown or ['xfail']} are not the schema: the file holds "
            "only [[xfail]] tables (each property, reason, optional match, reference, intermittent); "
            "write each entry under a [[xfail]] line"
        )
    return tuple(_entry(where, index, entry) for index, entry in enumerate(entries))


def _entry(where: str, index: int, entry: dict) -> ExpectedFailure:
    """One validated ``[[xfail]]`` table."""
    unknown = set(entry) - _ENTRY_KEYS
    if unknown or "property" not in entry or "reason" not in entry:
        raise ImplementationError(
            f"{where} entry {index}: needs property and reason (optional match, reference, intermittent); "
            f"got keys {sorted(entry)}" + (f"; remove {sorted(unknown)}" if unknown else "")
        )
    for key_name in ("property", "reason", "reference"):
        if key_name in entry and not isinstance(entry[key_name], str):
            raise ImplementationError(
                f"{where} entry {index}: {key_name}={entry[key_name]!r} must be a string; "
                f'write {key_name} = "..."'
            )
    if not isinstance(entry.get("intermittent", False), bool):
        raise ImplementationError(
            f"{where} entry {index}: intermittent={entry['intermittent']!r} must be a boolean; "
            "write intermittent = true (the covered cases may pass) or leave it out"
        )
    if not isinstance(entry.get("match", {}), dict):
        raise ImplementationError(
            f"{where} entry {index}: match={entry['match']!r} must be a table of case "
            'attributes; write e.g. match = { dtype = "float16", mask_kind = "additive" }'
        )
    match = dict(entry.get("match", {}))
    for key_name, wanted in match.items():
        if isinstance(wanted, dict) and (not wanted or set(wanted) - set(MATCH_COMPARISONS)):
            raise ImplementationError(
                f"{where} entry {index}: match.{key_name}={wanted!r}; a table value must use "
                f"only {sorted(MATCH_COMPARISONS)} (e.g. {{ le = 0.0 }})"
            )
    return ExpectedFailure(
        property=entry["property"], reason=entry["reason"],
        match=match, reference=entry.get("reference", ""), intermittent=entry.get("intermittent", False),
    )


#: The library each built-in with an expected-failures file calls: a user's function
#: that calls the same library may inherit its deviations.
BUILTIN_LIBRARIES = {"sdpa": "torch", "sdpa-flash": "torch", "sdpa-flash-cuda": "torch", "sdpa-cudnn": "torch",
                     "torch-mha": "torch", "jax": "jax"}


def builtin_deviations(property_id: str, attrs: list[dict], directory: Path | None = None,
                       ) -> list[tuple[str, Path, ExpectedFailure]]:
    """The built-ins' known deviations that cover a failure of ``property_id`` whose
    calls had ``attrs`` (case attributes, as the runner matches ``--xfail-file``
    entries: an entry covers the failure when it covers any of the calls), as
    ``(built-in name, path of its file, entry)``, the files in name order (``sdpa``
    before ``sdpa-flash``). An
    implementation that wraps a built-in inherits its deviations; this says which
    one a failure is (``conformance.diagnosis.diagnose``)."""
    found = []
    for path in sorted((directory or XFAIL_DIR).glob("*.toml"), key=lambda p: p.stem):
        try:
            entries = _load(path, str(path))
        except ImplementationError:
            continue                                    # a broken file is reported where it is loaded
        for entry in entries:
            if any(entry.applies(property_id, a) for a in attrs):
                found.append((path.stem, path, entry))
    return found
