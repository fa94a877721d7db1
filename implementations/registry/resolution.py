"""Resolution: find the implementation that ``--impl`` names.

``resolve(spec)`` tries, in this order:

1. a registered built-in name (``handwritten``, ``torch-mha``, ``sdpa``, ``spec`` ...,
   see :func:`registered`);
2. an installed entry point in the group ``attention_conformance.implementations``;
3. ``mutant:NAME``, a deliberately broken implementation from the bug zoo
   (``implementations.mutants.MUTANTS``);
4. ``package.module:attr``;
5. ``path/to/file.py:attr``.

A declaration (:mod:`.declaration`) comes before all of these: ``path/to/decl.toml``, or a
name that is not a built-in and has a table ``[tool.attention-conformance.implementations.NAME]``
in ``root/pyproject.toml``. Its ``spec`` is resolved as above, its values are options
(``options`` win key by key), its ``xfail_file`` entries are attached, and what it declares
is not probed.

``--impl-option`` values are parsed first, and every probe call is built inside them
(:mod:`.probe_plan`: dtype, head dims, lengths, causal only). Then they override the capabilities, and an implementation with an
SDPA callable but no flash callable of its own gets a flash level derived from the SDPA
callable through masks (:mod:`implementations.flash_from_sdpa`), its capabilities derived
from the SDPA capabilities as overridden (``derived_flash=false`` turns it off). An
implementation's own flash level is never replaced.

What an entry point or ``attr`` is turned into is :mod:`.recognition`'s job. Importing
a user's module, file or entry point runs its code: that goes through
:func:`implementations.guard.guarded_call` like every other call into it (a timeout;
any exception, ``SystemExit`` included, becomes a one-paragraph ImplementationError;
global state restored).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

from implementations.base import Implementation, ImplementationError
from implementations.bridge import FRAMEWORKS, bridge_options, split_bridge_options
from implementations.flash_from_sdpa import derive_flash
from implementations.guard import CallRaised, CallTimedOut, guarded_call
from implementations.onnx import (
    ONNX_PREFIX,
    check_option_kinds,
    exported_implementation,
    graph_declarations,
    graph_implementation,
    onnx_expected_failures_name,
    onnx_options,
    onnx_target,
    split_onnx_options,
)
from implementations.registry._errors import summarise
from implementations.registry.declaration import find_declaration
from implementations.registry.expected_failures import (
    load_expected_failures,
    load_expected_failures_file,
    with_expected_failures,
)
from implementations.registry.options import (
    DERIVED_FLASH_OPTION,
    apply_options,
    derived_flash_wanted,
    parse_options,
)
from implementations.registry.probe_plan import declared_for_probes
from implementations.registry.probing import DEFAULT_PROBE_TIMEOUT, build_limit, probe_sdpa
from implementations.registry.learner import learner_options, split_learner_options
from implementations.registry.learner.packages import member_of_package
from implementations.registry.recognition import ACCEPTED_OBJECTS, recognise

__all__ = ["ACCEPTED", "ENTRY_POINT_GROUP", "registered", "resolve"]

ENTRY_POINT_GROUP = "attention_conformance.implementations"
#: Every form ``--impl`` may take, for error messages.
ACCEPTED = (
    "a registered name, an entry point of group "
    f"{ENTRY_POINT_GROUP!r}, 'mutant:NAME', 'package.module:attr' or 'path/to/file.py:attr' "
    f"where attr is {ACCEPTED_OBJECTS}"
)


# --------------------------------------------------------------------------- built-ins


@functools.cache
def _build_builtin(name: str) -> Implementation:
    """Built-in ``name``, with the entries of ``implementations/xfail/<name>.toml`` attached."""
    from implementations.builtins import BUILTINS

    target = BUILTINS[name]
    module_name, _, attr = target.partition(":")
    try:
        maker = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        impl = Implementation(
            name=name, unavailable_reason=f"{target} cannot be loaded: {type(exc).__name__}: {exc}"
        )
    else:
        impl = maker(name=name) if "name" in inspect.signature(maker).parameters else maker()
    entries = load_expected_failures(name)
    if not entries:
        return impl
    return dataclasses.replace(impl, expected_failures=impl.expected_failures + entries)


def registered() -> dict[str, Callable[[], Implementation]]:
    """Listed built-ins, name -> zero-argument builder (each built once, on first call)."""
    from implementations.builtins import BUILTINS

    return {name: functools.partial(_build_builtin, name) for name in BUILTINS}


# --------------------------------------------------------------------------- resolution


def resolve(spec: str, options: Mapping[str, str] | None = None, *,
            timeout: float | None = DEFAULT_PROBE_TIMEOUT, root: str | Path | None = None) -> Implementation:
    """The implementation ``spec`` names (see the module docstring), with ``options``
    overriding its capabilities and, unless ``options`` has ``derived_flash=false``, a
    flash level derived from its SDPA callable where it has none of its own. Importing,
    building and probing a user's code is limited to ``timeout`` seconds a call
    (``0``/``None``: no limit). ``root``: where a name's ``pyproject.toml`` declaration is
    looked for (pytest's rootdir; default the current directory)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ImplementationError(f"--impl={spec!r} is empty; give {ACCEPTED}")
    declared = find_declaration(spec, root)
    if declared is None:
        return _resolve_with_options(spec.strip(), options, timeout, ())
    impl = _resolve_with_options(declared.spec, declared.merged(options), timeout, declared.unprobed(options))
    if declared.xfail_file:
        impl = with_expected_failures(impl, load_expected_failures_file(declared.xfail_file))
    return impl


def _resolve_with_options(spec: str, options: Mapping[str, str] | None, timeout: float | None,
                          unprobed: tuple[str, ...]) -> Implementation:
    learner, options = split_learner_options(options)
    bridge, options = split_bridge_options(options)
    onnx, options = split_onnx_options(options)
    target = onnx_target(spec)
    check_option_kinds(target[0] if target else None, spec, onnx)
    graph = None
    if target is not None and target[0] == "graph":
        with onnx_options(onnx):
            graph = graph_declarations(target[1], spec)
        if isinstance(graph, Implementation):  # onnxruntime is not installed
            return graph
        options = {**graph[1], **(options or {})}  # what the graph's signature declares; the user's win
    wanted = derived_flash_wanted(options)
    # Declarations first: parsed (and checked) before anything is probed, and every probe
    # call is built inside them (.probe_plan).
    parsed = parse_options({k: v for k, v in (options or {}).items() if k != DERIVED_FLASH_OPTION})
    with learner_options(learner) as held, bridge_options(bridge) as bridge_held, onnx_options(onnx), \
            declared_for_probes(parsed, unprobed):
        if graph is not None:
            impl = graph_implementation(graph[0], name=spec, probe=probe_sdpa, timeout=timeout)
        elif target is not None:
            impl = _resolve_exported(spec, target[1], timeout)
        else:
            impl = _resolve(spec, timeout)
    if bridge and "_used" not in bridge_held:
        raise ImplementationError(
            f"--impl-option {', '.join(bridge)}: bridge options apply to an SDPA-level function of another "
            f"array framework ({', '.join(sorted(FRAMEWORKS))}), and --impl={spec!r} is not one")
    if learner and "_used" not in held:
        raise ImplementationError(
            f"--impl-option {', '.join(learner)}: learner options apply to a hand-written attention module "
            f"class (not an nn.MultiheadAttention drop-in), and --impl={spec!r} is not one")
    derived = wanted if wanted is not None else not impl.capabilities.jit
    capability_options = {k: v for k, v in (options or {}).items() if k != DERIVED_FLASH_OPTION}
    if capability_options:
        impl = apply_options(impl, parsed)
    elif derived and spec in registered():
        return _builtin_with_derived_flash(spec)  # a built-in stays one object per process
    if not derived:
        return impl
    had_flash = impl.flash is not None
    impl = derive_flash(impl)
    flash_only = parsed.per_level.get("flash")
    if flash_only and not had_flash and impl.flash_capabilities is not None:  # flash.KEY=... on the derived level
        impl = dataclasses.replace(impl, flash_capabilities=impl.flash_capabilities.replace(**flash_only))
    return impl


def _resolve_exported(spec: str, inner_spec: str, timeout: float | None) -> Implementation:
    """``onnx:SPEC``: SPEC resolved as ``--impl`` would, its SDPA callable exported to ONNX
    (:mod:`implementations.onnx`). A built-in's deviations as exported are the entries of
    ``implementations/xfail/onnx-<exporter>-<name>.toml``, attached here (its own eager ones are not:
    the graph does not run its kernels)."""
    if not inner_spec.strip():
        raise ImplementationError(f"--impl={spec!r}: nothing after {ONNX_PREFIX!r}; give {ONNX_PREFIX}SPEC with "
                                  f"SPEC {ACCEPTED}")
    inner = _resolve(inner_spec.strip(), timeout)
    impl = exported_implementation(inner, name=spec, origin=inner_spec.strip(), probe=probe_sdpa, timeout=timeout)
    if inner_spec.strip() in registered() and impl.available:
        impl = dataclasses.replace(impl, expected_failures=load_expected_failures(
            onnx_expected_failures_name(inner_spec.strip(), impl.sdpa.exporter)))
    return impl


@functools.cache
def _builtin_with_derived_flash(name: str) -> Implementation:
    return derive_flash(_build_builtin(name))


def _resolve(spec: str, timeout: float | None) -> Implementation:
    builtins = registered()
    if spec in builtins:
        return builtins[spec]()
    entry_point = _find_entry_point(spec)
    if entry_point is not None:
        return _resolve_entry_point(spec, entry_point, timeout)
    if spec.startswith("mutant:"):
        return _resolve_mutant(spec.removeprefix("mutant:"))
    if ":" in spec:
        return _resolve_location(spec, timeout)
    raise ImplementationError(
        f"--impl={spec!r} is not a registered implementation (registered: "
        f"{', '.join(sorted(builtins))}), not an installed entry point of group "
        f"{ENTRY_POINT_GROUP!r} (installed: {', '.join(_entry_point_names()) or 'none'}), "
        f"and has no ':' for module:attr or file.py:attr; give {ACCEPTED}"
    )


def _find_entry_point(name: str) -> importlib.metadata.EntryPoint | None:
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.name == name:
            return entry_point
    return None


def _entry_point_names() -> list[str]:
    return sorted({ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)})


def _resolve_entry_point(spec: str, entry_point: importlib.metadata.EntryPoint,
                        timeout: float | None) -> Implementation:
    what = f"--impl={spec!r} is the entry point {entry_point.value!r} (group {ENTRY_POINT_GROUP!r}) but loading it"
    try:
        obj = guarded_call(entry_point.load, timeout=build_limit(timeout), rng=True)
    except CallRaised as exc:  # the user's package raised while importing
        raise ImplementationError(
            f"{what} raised {summarise(exc.error)}; fix that package or reinstall it"
        ) from exc.error
    except CallTimedOut:
        raise ImplementationError(_hung(what, build_limit(timeout))) from None
    return recognise(obj, name=spec, origin=f"entry point {entry_point.value!r}", timeout=timeout)


def _hung(what: str, timeout: float | None) -> str:
    return f"{what} did not return within {timeout:g}s; fix the hang"


def _resolve_mutant(name: str) -> Implementation:
    try:
        from implementations.mutants import MUTANTS
    except ImportError as exc:
        raise ImplementationError(
            f"--impl='mutant:{name}' needs the bug zoo implementations.mutants (a MUTANTS dict), "
            f"which does not import here: {summarise(exc)}"
        ) from exc
    if name not in MUTANTS:
        raise ImplementationError(
            f"--impl='mutant:{name}': no mutant named {name!r}; the bug zoo has "
            f"{', '.join(sorted(MUTANTS)) or 'none'}"
        )
    impl = MUTANTS[name].build()
    if not isinstance(impl, Implementation):
        raise ImplementationError(
            f"mutant {name!r}'s build() returned {type(impl).__name__}, expected an Implementation"
        )
    return impl


# --------------------------------------------------------------------------- module:attr, file.py:attr


def _resolve_location(spec: str, timeout: float | None) -> Implementation:
    """``package.module:attr`` or ``path/to/file.py:attr``."""
    location, _, attr = spec.rpartition(":")
    if location.endswith(".py") or "/" in location or "\\" in location:
        module = _import_file(spec, location, timeout)
    else:
        module = _import_module(spec, location, timeout)
    if not attr.isidentifier():
        raise ImplementationError(
            f"--impl={spec!r}: {attr!r} after the colon is not an attribute name; "
            f"write {location}:NAME where NAME is defined in it"
        )
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_"))[:20]
        raise ImplementationError(
            f"--impl={spec!r}: {location} has no attribute {attr!r}; it defines {public}. "
            f"Expected {attr!r} to be {ACCEPTED_OBJECTS}"
        )
    return recognise(getattr(module, attr), name=spec, origin=spec, timeout=timeout)


def _import_module(spec: str, module_name: str, timeout: float | None) -> Any:
    try:
        return guarded_call(importlib.import_module, module_name, timeout=build_limit(timeout), rng=True)
    except CallTimedOut:
        raise ImplementationError(_hung(f"--impl={spec!r}: importing module {module_name!r}",
                                     build_limit(timeout))) from None
    except CallRaised as raised:
        exc = raised.error
    if isinstance(exc, ModuleNotFoundError):
        if exc.name and module_name.startswith(exc.name):
            raise ImplementationError(
                f"--impl={spec!r}: no module named {module_name!r} is importable from "
                f"sys.path (looked for {exc.name!r}); install it, run from its directory, or "
                "give a file path as path/to/file.py:attr"
            ) from exc
        raise ImplementationError(
            f"--impl={spec!r}: importing module {module_name!r} raised {summarise(exc)}; "
            "the module itself imports something that is missing"
        ) from exc
    raise ImplementationError(
        f"--impl={spec!r}: importing module {module_name!r} raised {summarise(exc)}; "
        "fix the error in that module"
    ) from exc


def _import_file(spec: str, location: str, timeout: float | None) -> Any:
    path = Path(location).expanduser()
    if not path.is_file():
        raise ImplementationError(
            f"--impl={spec!r}: no file {location!r} (looked for {path.resolve()}); "
            "give an existing path/to/file.py:attr"
        )
    module_name = f"_attention_conformance_user_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImplementationError(f"--impl={spec!r}: {location!r} is not a loadable Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    try:
        guarded_call(module_spec.loader.exec_module, module, timeout=build_limit(timeout), rng=True)
    except CallRaised as exc:
        del sys.modules[module_name]
        if (packaged := member_of_package(path, exc.error)) is not None:  # a relative import: run in its package
            return packaged
        raise ImplementationError(
            f"--impl={spec!r}: running {location!r} raised {summarise(exc.error)}; fix the error in "
            "that file"
        ) from exc.error
    except CallTimedOut:
        del sys.modules[module_name]
        raise ImplementationError(_hung(f"--impl={spec!r}: running {location!r}", build_limit(timeout))) from None
    return module
