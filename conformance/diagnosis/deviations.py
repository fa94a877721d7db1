"""The built-ins' known deviations in a diagnosis: a failure that an expected-failures
entry of a built-in covers (same property, same call attributes) is that deviation, where
the implementation calls the built-in's library (:func:`_with_known_deviations`)."""

from __future__ import annotations

from typing import Any

from conformance.diagnosis.verdict import Verdict

#: The id prefix of a cause that is a built-in's known deviation (``known_deviation:sdpa``).
KNOWN_DEVIATION = "known_deviation"


def _with_known_deviations(target: Any, record: Any, verdict: Verdict) -> Verdict:
    """``verdict`` with the built-ins' known deviations that cover this failure (same
    property, same call attributes, matched as ``--xfail-file`` entries are): an
    implementation that calls a built-in (a plain wrapper of PyTorch's SDPA) fails
    where the built-in deviates from the contract, and the cause is that deviation."""
    from implementations.registry.expected_failures import (
        BUILTIN_LIBRARIES,
        builtin_deviations,
    )

    property_id = getattr(record, "property", "")
    if not property_id or record.failing_case is None:
        return verdict
    calls = getattr(record, "failing_calls", ()) or ()
    attrs = [c.attrs() for c in calls if hasattr(c, "attrs")] or [record.failing_case.attrs()]
    own = list(getattr(target.impl, "expected_failures", ()) or ())
    named = bool(verdict.causes) and bool(verdict.causes[0].get("confirmed"))
    found = [(name, path, entry) for name, path, entry in builtin_deviations(property_id, attrs)
             if entry not in own and _specific(entry)]
    found = _offered(found, target, BUILTIN_LIBRARIES)
    if found and any(name in COMPILED_DEVIATIONS for name, _, _ in found) and _fails_eagerly(target, calls):
        # the deviation is the compiled program's (an eager call is finite): a function
        # whose eager call fails the same way has a bug of its own (a kernel that computes
        # its own softmax), and the deviation's file would hide it
        found = [item for item in found if item[0] not in COMPILED_DEVIATIONS]
    if not found:
        return verdict
    name, path, entry = found[0]
    reference = f" ({entry.reference})" if entry.reference else ""
    avoid = ", ".join(f"{k}={v!r}" for k, v in entry.match.items()) or f"every case of {property_id}"
    known = (f"known deviation of the built-in `{name}`: {entry.reason}{reference}. If the implementation "
             f"calls it, excuse the failure with --xfail-file {path} (or avoid {avoid})")
    if any(str(note).startswith("compiled: ") for note in getattr(target.caps, "probe_notes", ()) or ()):
        # the bridge compiled the function (JAX by default): the deviation is the compiled program's
        known += ("; the bridge ran the function compiled (jax.jit), as a jitted caller runs it: "
                  "--impl-option jit=false certifies it op by op")
    others = sorted({n for n, _, _ in found[1:]} - {name})
    if others:
        known += "; also listed for " + ", ".join(f"`{n}`" for n in others)
    deviation = {"name": name, "path": str(path), "property": entry.property, "reason": entry.reason,
                 "reference": entry.reference, "match": dict(entry.match), "specific": _specific(entry)}
    if named:
        causes = [dict(verdict.causes[0], known_deviation=deviation), *verdict.causes[1:]]
        return Verdict(causes, verdict.line + f"; this matches a {known}", verdict.call)
    # no variant named: the deviation is the cause
    pseudo = {"variant": f"{KNOWN_DEVIATION}:{name}",
              "summary": f"a known deviation of the built-in `{name}` (--xfail-file {path})",
              "fit": None, "relative_error": None, "note": entry.reason, "finite_evidence": True,
              "confirmed": True, "known_deviation": deviation}
    line = f"probable cause: {known}" + (f" [{verdict.line.removeprefix('probable cause: ')}]"
                                          if verdict.line else "")
    return Verdict([pseudo, *verdict.causes], line, verdict.call)


#: Built-ins whose known deviations are their compiled program's (XLA's fused softmax under
#: ``jax.jit``), offered to a compiled bridged function only where its eager call passes.
COMPILED_DEVIATIONS = frozenset({"jax"})


def _fails_eagerly(target: Any, calls: Any) -> bool:
    """Whether a compiled bridged SDPA function's failing call fails when made eagerly too
    (the bridge's same function with ``jit=False``); False where that cannot be asked."""
    import dataclasses

    from conformance.calls.call_specs import SDPACallSpec
    from conformance.calls.replay import report_sdpa_call

    bridged = getattr(target.impl, "sdpa", None)
    if not getattr(bridged, "fallbacks", None) or not hasattr(bridged, "eager"):
        return False
    specs = [c for c in calls or () if isinstance(c, SDPACallSpec)]
    if not specs:
        return False
    eager = dataclasses.replace(target.impl, sdpa=bridged.eager())
    try:
        return any(report_sdpa_call(eager, spec).shows_failure for spec in specs[:2])
    except Exception:  # noqa: BLE001 - a diagnosis that cannot replay offers as before
        return False


#: Built-ins that are a library's layer, not a kernel: their deviations are in that layer's
#: own code (nn.MultiheadAttention's fast path, its need_weights softmax), which a layer of
#: another framework bridged onto the same library's kernels (Keras' MultiHeadAttention on
#: the torch backend) does not run.
LAYER_BUILTINS = frozenset({"torch-mha"})


def _offered(found: list[tuple[str, Any, Any]], target: Any,
             libraries_of: dict[str, str]) -> list[tuple[str, Any, Any]]:
    """The known deviations of ``found`` that the implementation can inherit: those of
    built-ins whose library it calls (all of them when nothing it references is a
    built-in's library and nothing is bridged), never a layer built-in's for a bridged one."""
    libraries, bridged = _libraries_used(target)
    used = libraries & set(libraries_of.values())
    if used or bridged:                   # the built-ins of the libraries the implementation calls
        found = [item for item in found if libraries_of.get(item[0]) in used]
    if bridged:
        found = [item for item in found if item[0] not in LAYER_BUILTINS]
    return found


def _libraries_used(target: Any) -> tuple[set[str], bool]:
    """Top-level packages the implementation's callables reference (their module and
    the modules in their globals): ``torch`` for a wrapper of PyTorch's SDPA; and
    whether a callable runs through the framework bridge, whose framework is then known
    (the bridge's own plumbing imports torch, the code it runs need not: a Keras layer on
    the tensorflow backend calls no torch kernel). When none of them is a built-in's
    library and nothing is bridged, every built-in's deviations are considered."""
    import inspect
    import types

    used: set[str] = set()
    bridged = False
    impl = target.impl
    for attr in ("sdpa", "mha", "flash"):
        fn = getattr(impl, attr, None)
        if fn is None:
            continue
        framework = getattr(fn, "framework", None)
        if framework is not None and isinstance(getattr(framework, "package", None), str):
            bridged = True
            used.add(framework.package.split(".")[0])
            if getattr(framework, "native_torch", False):  # Keras on torch calls torch's kernels
                used.add("torch")
            continue
        if not inspect.isfunction(fn) and not inspect.ismethod(fn):
            fn = type(fn).__call__                         # a callable object: its method
        fn = inspect.unwrap(fn)
        module = getattr(fn, "__module__", None) or ""
        used.add(module.split(".")[0])
        for value in getattr(fn, "__globals__", {}).values():
            if isinstance(value, types.ModuleType):
                used.add(value.__name__.split(".")[0])
            elif getattr(value, "__module__", None):
                used.add(str(value.__module__).split(".")[0])
    return used, bridged


#: Case attributes that only say where an entry applies, not which deviation it is.
_SCOPE_ATTRIBUTES = frozenset({"dtype", "device", "level"})


def _specific(entry: Any) -> bool:
    """Whether a known deviation says which failure it is: it names its property, or
    its match constrains the call beyond dtype and device. A "*" entry matching every
    float64 call (JAX's float32 softmax) covers failures of any cause, so it names none
    (its effect, when that is the cause, is a variant: ``softmax_float32``)."""
    return entry.property != "*" or bool(set(entry.match) - _SCOPE_ATTRIBUTES)
