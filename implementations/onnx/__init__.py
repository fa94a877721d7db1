"""ONNX: an SDPA-level torch implementation exported with ``torch.onnx.export`` and certified
as ONNX Runtime runs the exported graph, or an existing attention graph certified as is.

``--impl=onnx:SPEC`` resolves ``SPEC`` as ``--impl`` would (a built-in such as ``sdpa``,
``module:function``, ``file.py:function``) and certifies its SDPA callable exported per
export key (:class:`~.export.ExportedSDPA`): ``--impl-option onnx_exporter=torchscript|dynamo``
(default torchscript), ``--impl-option onnx_opset=N`` (default 17).

``--impl=path/model.onnx`` (or ``onnx:path/model.onnx``) certifies an existing graph
(:class:`~.graph.GraphSDPA`): ``--impl-option onnx_inputs=q,k,v[,mask]``,
``onnx_layout=BLNE``, ``onnx_causal=upper_left|lower_right``.

Capabilities: the exported graph is probed like any SDPA function (what it accepts: dtypes,
masks, GQA, Ev != E, scale), and claims no more than the eager implementation declares;
the semantics (causal alignment, fully-masked rows, shared key/value) are the eager
implementation's, so a graph that computes something else than its eager source fails
the properties. Dropout and gradients are declared off (an inference graph, computed by
ONNX Runtime); ``jit`` is declared, so the compile budget bounds the number of exports.
Without onnxruntime (or onnx, or onnxscript for the dynamo exporter) the implementation
is unavailable, its properties skipped with what to ``pip install``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from implementations.base import (
    PER_DTYPE_FIELDS,
    Capabilities,
    Implementation,
    ImplementationError,
)
from implementations.onnx.export import INPUT_NAMES, ExportedSDPA
from implementations.onnx.runtime import EXPORTERS, PROVIDER, missing_packages, versions

__all__ = ["EXPORT_OPTIONS", "GRAPH_OPTIONS", "ONNX_OPTIONS", "ONNX_PREFIX", "ExportedSDPA", "check_option_kinds",
           "exported_implementation", "graph_declarations", "graph_implementation", "onnx_declarations",
           "onnx_expected_failures_name", "onnx_options", "onnx_target", "split_onnx_options"]

#: The prefix of ``--impl=onnx:SPEC``.
ONNX_PREFIX = "onnx:"
#: ``--impl-option`` keys of an exported implementation (``--impl=onnx:SPEC``).
EXPORT_OPTIONS = {
    "onnx_exporter": f"torch.onnx.export's exporter: one of {sorted(EXPORTERS)} (default torchscript)",
    "onnx_opset": "the ONNX opset to export to, an integer (default 17)",
}
#: ``--impl-option`` keys of an existing graph (``--impl=path/model.onnx``).
GRAPH_OPTIONS = {
    "onnx_inputs": "the graph's query, key, value and optional mask input names, comma-separated",
    "onnx_layout": "the graph's layout of query, key, value and output: BNLE (default) or BLNE",
    "onnx_causal": "the graph is causal, with this alignment: upper_left or lower_right",
}
ONNX_OPTIONS = {**EXPORT_OPTIONS, **GRAPH_OPTIONS}
DEFAULT_EXPORTER, DEFAULT_OPSET = "torchscript", 17

_OPTIONS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("onnx_options", default=None)


def split_onnx_options(options: Mapping[str, str] | None) -> tuple[dict[str, str], dict[str, str]]:
    """``(ONNX options, the other options)``; a bad value raises ImplementationError."""
    mine, rest = {}, {}
    for key, value in (options or {}).items():
        (mine if key in ONNX_OPTIONS else rest)[key] = str(value).strip()
    checks: dict[str, Callable[[str], bool]] = {
        "onnx_exporter": lambda v: v in EXPORTERS,
        "onnx_opset": lambda v: v.isdigit() and 7 <= int(v) <= 30,
        "onnx_layout": lambda v: v.upper() in ("BNLE", "BLNE"),
        "onnx_causal": lambda v: v in ("upper_left", "lower_right"),
        "onnx_inputs": lambda v: len([n for n in v.split(",") if n.strip()]) in (3, 4),
    }
    for key, value in mine.items():
        if not checks[key](value):
            raise ImplementationError(f"--impl-option {key}={value}: expected {ONNX_OPTIONS[key]}")
    if "onnx_layout" in mine:
        mine["onnx_layout"] = mine["onnx_layout"].upper()
    return mine, rest


def onnx_target(spec: str) -> tuple[str, str] | None:
    """``("export", SPEC)`` for ``onnx:SPEC``, ``("graph", PATH)`` for a ``.onnx`` file
    (``onnx:`` before it or not), None for anything else."""
    inner = spec[len(ONNX_PREFIX):] if spec.startswith(ONNX_PREFIX) else None
    path = inner if inner is not None else spec
    if path.endswith(".onnx") and ":" not in path.replace("\\", "/").rpartition("/")[2]:
        return "graph", path
    return ("export", inner) if inner is not None else None


@contextlib.contextmanager
def onnx_options(options: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """While open, the builders below read ``options`` (:func:`onnx_declarations`)."""
    token = _OPTIONS.set(dict(options))
    try:
        yield _OPTIONS.get()
    finally:
        _OPTIONS.reset(token)


def onnx_declarations() -> dict[str, str]:
    """The ONNX options of the ``--impl`` being resolved (empty outside :func:`onnx_options`)."""
    held = _OPTIONS.get()
    return held if held is not None else {}


def onnx_expected_failures_name(builtin: str, exporter: str) -> str:
    """The name of the expected-failures file of built-in ``builtin`` exported by ``exporter``:
    ``implementations/xfail/onnx-<exporter>-<builtin>.toml``."""
    return f"onnx-{exporter}-{builtin}"


def check_option_kinds(kind: str | None, spec: str, options: Mapping[str, str]) -> None:
    """Export options apply to ``onnx:SPEC``, graph options to a ``.onnx`` file."""
    wrong = {"export": GRAPH_OPTIONS, "graph": EXPORT_OPTIONS, None: ONNX_OPTIONS}[kind]
    given = sorted(set(options) & set(wrong))
    if given:
        applies = "an existing graph (--impl=path/model.onnx)" if given[0] in GRAPH_OPTIONS else \
            "an exported implementation (--impl=onnx:SPEC)"
        raise ImplementationError(f"--impl-option {', '.join(given)}: applies to {applies}, and --impl={spec!r} "
                                  "is not one")


def _unavailable(name: str, exporter: str | None) -> Implementation | None:
    missing = missing_packages(exporter)
    if not missing:
        return None
    what = f"the {exporter} exporter needs" if exporter else "running an ONNX graph needs"
    return Implementation(name=name, unavailable_reason=(
        f"{what} {', '.join(missing)}, not installed: pip install {' '.join(missing)} "
        "(or pip install 'attention-conformance[onnx]')"))


# --------------------------------------------------------------------------- onnx:SPEC


def exported_implementation(inner: Implementation, *, name: str, origin: str,
                            probe: Callable[..., Capabilities], timeout: float | None) -> Implementation:
    """``inner``'s SDPA callable exported to ONNX and run in ONNX Runtime (module docstring)."""
    declared = onnx_declarations()
    exporter = declared.get("onnx_exporter", DEFAULT_EXPORTER)
    opset = int(declared.get("onnx_opset", DEFAULT_OPSET))
    unavailable = _unavailable(name, exporter)
    if unavailable is not None:
        return unavailable
    if not inner.available:
        return Implementation(name=name, unavailable_reason=f"{origin}: {inner.unavailable_reason}")
    if inner.sdpa is None:
        levels = [lvl for lvl in ("mha", "flash", "varlen", "kvcache", "sharded") if getattr(inner, lvl) is not None]
        raise ImplementationError(
            f"--impl={name!r}: {origin} has no SDPA-level callable to export (it has the {', '.join(levels)} "
            "level); the ONNX export certifies SDPA-level torch functions (scaled_dot_product_attention's "
            "signature) only")
    framework = getattr(getattr(inner.sdpa, "framework", None), "native_torch", True)
    if not framework:
        raise ImplementationError(
            f"--impl={name!r}: {origin} runs in {inner.sdpa.framework.name}, not torch; torch.onnx.export "
            "exports torch code only")
    exported = ExportedSDPA(inner.sdpa, exporter, opset, origin=origin)
    graph_caps = probe(exported, origin=name, timeout=timeout)
    if not set(inner.capabilities.dtypes) & set(graph_caps.dtypes):
        raise ImplementationError(
            f"--impl={name!r}: the exported graph runs in none of the dtypes {origin} declares "
            f"({', '.join(inner.capabilities.dtypes)}); the probes saw: "
            + "; ".join(n for n in graph_caps.probe_notes if n.startswith("dtypes:")))
    caps = _combined(inner.capabilities, graph_caps)
    note = (f"onnx: {origin} exported by torch.onnx.export ({exporter} exporter, opset {opset}) once per "
            f"export key (the shapes and dtypes of {', '.join(INPUT_NAMES)}; is_causal, scale, enable_gqa), "
            f"each graph cached for the run and run in {versions(exporter)} ({PROVIDER}); jit declared, so "
            "the compile budget bounds the number of exports")
    notes = (note,
             "autograd: ONNX Runtime computes the output, which has no gradient; declared off",
             "dropout: torch.onnx.export exports an inference graph (eval mode), without dropout; declared off",
             *(f"eager {n}" for n in inner.capabilities.probe_notes),
             *_graph_notes(graph_caps.probe_notes))
    caps = caps.replace(probe_notes=notes)
    return Implementation(
        name=name, capabilities=caps, sdpa=exported, version=f"{inner.version}; {versions(exporter)}",
        description=f"{origin} exported to ONNX ({exporter}, opset {opset}) and run in ONNX Runtime ({PROVIDER})",
        run_notes=lambda: (f"onnx: {exported.summary()} (in the process that wrote this certificate; with "
                           "-n, each worker exports its own)",),
    )


def _graph_notes(notes: tuple[str, ...]) -> tuple[str, ...]:
    """The exported graph's probe notes, each saying it is about the graph."""
    out = []
    for note in notes:
        field, sep, said = note.partition(": ")
        out.append(f"{field}: the exported graph: {said}" if sep else note)
    return tuple(out)


_BOOLEAN_FIELDS = ("different_v_dim", "gqa", "custom_scale", "non_contiguous")


def _combined(eager: Capabilities, graph: Capabilities) -> Capabilities:
    """What the exported graph is certified for: what both the eager implementation claims
    and the graph accepts; the eager implementation's semantics and size declarations."""
    dtypes = tuple(d for d in eager.dtypes if d in graph.dtypes)

    def in_dtype(dtype: str) -> dict[str, Any]:
        e, g = eager.for_dtype(dtype), graph.for_dtype(dtype)
        values = {name: getattr(e, name) and getattr(g, name) for name in _BOOLEAN_FIELDS}
        values["mask_kinds"] = frozenset(e.mask_kinds & g.mask_kinds)
        values["flash_features"] = e.flash_features
        return values

    first = "float32" if "float32" in dtypes else dtypes[0]  # the probes' base dtype
    base = in_dtype(first)
    by_dtype = {}
    for dtype in dtypes:
        differs = {k: v for k, v in in_dtype(dtype).items() if v != base[k] and k in PER_DTYPE_FIELDS}
        if differs:
            by_dtype[dtype] = differs
    return dataclasses.replace(
        eager, dtypes=dtypes, devices=("cpu",), **base,
        causal=eager.causal if graph.causal is not None else None,
        dropout=False, autograd=False, mask_grad=False, tf32=False, jit=True,
        self_attention_lengths=eager.self_attention_lengths or graph.self_attention_lengths,
        batch_dims=1 if 1 in (eager.batch_dims, graph.batch_dims) else None,
        by_dtype=by_dtype,
    )


# --------------------------------------------------------------------------- path/model.onnx


def graph_declarations(path: str, name: str) -> tuple[Any, dict[str, str]] | Implementation:
    """(the graph's :class:`~.graph.GraphInfo`, the capability declarations its signature
    makes), or an unavailable Implementation without onnxruntime."""
    unavailable = _unavailable(name, None)
    if unavailable is not None:
        return unavailable
    from implementations.onnx.graph import graph_options, read_graph

    if not Path(path).expanduser().is_file():
        raise ImplementationError(f"--impl={name!r}: no file {path!r} (looked for {Path(path).resolve()}); "
                                  "give an existing path/model.onnx")
    declared = onnx_declarations()
    info = read_graph(path, declared.get("onnx_inputs"), declared.get("onnx_layout", "BNLE"))
    return info, graph_options(info, declared.get("onnx_causal"))


def graph_implementation(info: Any, *, name: str, probe: Callable[..., Capabilities],
                         timeout: float | None) -> Implementation:
    """An existing graph run in ONNX Runtime (:mod:`.graph`), its capabilities probed inside
    what its signature declares."""
    from implementations.onnx.graph import GraphSDPA

    causal = onnx_declarations().get("onnx_causal")
    graph = GraphSDPA(info, causal)
    caps = probe(graph, origin=name, timeout=timeout)
    notes = (f"onnx: {info.describe()}, run in {versions(None)} ({PROVIDER}); its signature declares the "
             "dtype, the 4-D layout and any fixed head dim",
             "autograd: ONNX Runtime computes the output, which has no gradient; declared off",
             *caps.probe_notes)
    caps = caps.replace(autograd=False, mask_grad=False, dropout=False, probe_notes=notes,
                        by_dtype={d: {k: v for k, v in values if k not in ("autograd", "mask_grad", "dropout")}
                                  for d, values in caps.by_dtype})
    return Implementation(name=name, capabilities=caps, sdpa=graph, version=versions(None),
                          description=f"the ONNX graph {info.path} run in ONNX Runtime ({PROVIDER})")
