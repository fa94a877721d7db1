"""The framework bridge: an SDPA-level function of another array framework (NumPy,
JAX, Keras 3 on any backend, TensorFlow, tinygrad, CuPy, MLX, PaddlePaddle) certified with
no adapter.

``--impl=module:function`` finds the function; the framework is

* declared: ``--impl-option framework=NAME`` (a key of :data:`FRAMEWORKS`), else
* the top-level package of ``fn.__module__`` (``keras.ops.dot_product_attention`` is
  Keras', ``jax.nn.dot_product_attention`` JAX's), else
* for a function of the user's own module that does not use torch: the one framework
  whose modules the function refers to (``np.einsum`` in its body: NumPy), else
* for a body of method calls only (``query.scaled_dot_product_attention(...)``): the one
  framework other than NumPy that its module imports (``from tinygrad import Tensor``).

Its layout is declared with ``--impl-option layout=BNLE|BLNE``; without it, a framework's
own ``dot_product_attention`` (Keras, JAX: documented as ``(B, L, N, E)``) and Paddle's
``scaled_dot_product_attention`` (its ``paddle.compat`` twin is torch's) are ``BLNE``, and
every other function torch's ``BNLE``. Its arguments are mapped from its signature
(:mod:`.arguments`), arrays converted and gradients taken by the framework
(:mod:`.frameworks`), and the call made by :class:`~.sdpa.BridgedSDPA`. Capabilities are
probed like any SDPA function's; the semantics are SDPA's contract through that mapping,
so a bug of the framework's function stays a failure of the suite's properties.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import sys
import types
from typing import Any, Callable, Iterator, Mapping

from implementations.base import Implementation, ImplementationError
from implementations.bridge.arguments import ArgumentMap, map_arguments, signature_of
from implementations.bridge.frameworks import FRAMEWORKS, PACKAGES, UNBRIDGED, Framework, framework_named
from implementations.bridge.mha import KerasMHAFactory, keras_mha_framework, load_keras_weights
from implementations.bridge.module_tables import module_table
from implementations.bridge.modules import ModuleMHAFactory, load_module_weights
from implementations.bridge.sdpa import LAYOUTS, BridgedSDPA

__all__ = [
    "BRIDGE_OPTIONS", "FRAMEWORKS", "LAYOUTS", "ArgumentMap", "BridgedSDPA", "Framework",
    "bridge_declarations", "bridge_options", "bridged_implementation", "bridged_mha_implementation",
    "bridged_module_implementation", "detect_framework", "keras_mha_framework", "make_bridge", "map_arguments",
    "module_table", "signature_of", "split_bridge_options",
]

#: ``--impl-option`` keys the bridge reads (not capabilities).
BRIDGE_OPTIONS = {
    "framework": f"the array framework of the function: one of {sorted(FRAMEWORKS)}",
    "layout": f"the layout of query, key, value and output: one of {list(LAYOUTS)} (default BNLE, "
              "BLNE for Keras' and JAX's own dot_product_attention)",
    "call_kwargs": "keyword arguments given to every call of the function, NAME=VALUE with Python literal values, "
                   "comma-separated (interpret=True,segment_ids=None): parameters SDPA's arguments do not fill "
                   "(a required one, a mode switch)",
    "interface_mask": "the attention_mask form of a transformers attention-interface function: additive or bool "
                      "(default: bool for sdpa_attention_forward, additive otherwise)",
}

_OPTIONS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("bridge_options", default=None)


def split_bridge_options(options: Mapping[str, str] | None) -> tuple[dict[str, str], dict[str, str]]:
    """``(bridge options, the other options)``; a bad value raises ImplementationError."""
    bridge, rest = {}, {}
    for key, value in (options or {}).items():
        (bridge if key in BRIDGE_OPTIONS else rest)[key] = str(value).strip()
    if "framework" in bridge and bridge["framework"] not in FRAMEWORKS:
        raise ImplementationError(f"--impl-option framework={bridge['framework']}: unknown framework; "
                                  f"expected {BRIDGE_OPTIONS['framework']}")
    if "layout" in bridge and bridge["layout"].upper() not in LAYOUTS:
        raise ImplementationError(f"--impl-option layout={bridge['layout']}: unknown layout; "
                                  f"expected {BRIDGE_OPTIONS['layout']}")
    if "layout" in bridge:
        bridge["layout"] = bridge["layout"].upper()
    if "call_kwargs" in bridge:
        parse_call_kwargs(bridge["call_kwargs"])  # checked here: a usage error before anything runs
    if bridge.get("interface_mask", "additive") not in ("additive", "bool"):
        raise ImplementationError(f"--impl-option interface_mask={bridge['interface_mask']}: unknown mask form; "
                                  f"expected {BRIDGE_OPTIONS['interface_mask']}")
    return bridge, rest


def parse_call_kwargs(text: str) -> dict[str, Any]:
    """``interpret=True,segment_ids=None`` -> ``{"interpret": True, "segment_ids": None}``
    (``--impl-option call_kwargs=``); ImplementationError naming the rule and the fix."""
    import ast
    import re

    found: dict[str, Any] = {}
    for item in (p for p in re.split(r",(?=\s*[A-Za-z_]\w*\s*=)", text) if p.strip()):
        name, eq, value = item.partition("=")
        name = name.strip()
        try:
            if not eq or not name.isidentifier():
                raise ValueError("not NAME=VALUE")
            found[name] = ast.literal_eval(value.strip())
            hash(found[name])
        except (ValueError, SyntaxError, TypeError) as exc:
            raise ImplementationError(
                f"--impl-option call_kwargs={text}: {item.strip()!r} is not NAME=VALUE with a hashable Python "
                f"literal value ({exc}); write e.g. call_kwargs=interpret=True,segment_ids=None") from exc
    if not found:
        raise ImplementationError(f"--impl-option call_kwargs={text!r}: no NAME=VALUE given; write e.g. "
                                  "call_kwargs=interpret=True")
    return found


@contextlib.contextmanager
def bridge_options(options: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """While open, :func:`detect_framework` and :func:`bridged_implementation` read
    ``options``; the yielded dict gets ``"_used"`` once they are read."""
    held = dict(options)
    token = _OPTIONS.set(held)
    try:
        yield held
    finally:
        _OPTIONS.reset(token)


def bridge_declarations() -> dict[str, str]:
    """The bridge options of the ``--impl`` being resolved (empty outside :func:`bridge_options`)."""
    held = _OPTIONS.get()
    return held if held is not None else {}


_declared = bridge_declarations


def _top_package(module_name: str | None) -> str:
    return (module_name or "").partition(".")[0]


def _referenced_packages(fn: Callable[..., Any]) -> set[str]:
    """Top-level packages of the modules (and of the objects' modules) that ``fn``'s code
    names as globals, nested functions included."""
    code = getattr(fn, "__code__", None)
    namespace = getattr(fn, "__globals__", None)
    if code is None or namespace is None:
        return set()
    names: set[str] = set()
    stack = [code]
    while stack:
        current = stack.pop()
        names.update(current.co_names)
        stack.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    found = set()
    for name in names:
        obj = namespace.get(name)
        if isinstance(obj, types.ModuleType):
            found.add(_top_package(obj.__name__))
        elif obj is not None and callable(obj):
            found.add(_top_package(getattr(obj, "__module__", None)))
    return found


def detect_framework(fn: Any) -> str | None:
    """The framework that runs ``fn`` (see the module docstring), or None for a torch
    function (or one that uses no known framework): that one is not bridged."""
    declared = _declared().get("framework")
    if declared:
        return declared
    if inspect.isclass(fn):
        return None
    package = _top_package(getattr(fn, "__module__", None))
    if package in PACKAGES:
        return PACKAGES[package]
    _refuse_unbridged(fn, package)
    if package == "torch" or not inspect.isfunction(fn):
        return None
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    if module is not None and any(_top_package(getattr(v, "__name__", "")) == "torch"
                                  for v in vars(module).values() if isinstance(v, types.ModuleType)):
        return None  # a module that imports torch holds torch code
    used = _referenced_packages(fn)
    if "torch" in used:
        return None
    frameworks = {PACKAGES[p] for p in used if p in PACKAGES}
    if not frameworks:
        for other in sorted(used & set(UNBRIDGED)):
            _refuse_unbridged(fn, other)
    if len(frameworks) > 1:
        frameworks.discard("numpy")  # NumPy beside another framework is that framework's helper
    if not frameworks and module is not None:
        # a body of method calls only (query.scaled_dot_product_attention(...)): the one
        # framework other than NumPy its module imports (a module or a name from it), and
        # no torch name there
        imported = {_top_package(v.__name__ if isinstance(v, types.ModuleType) else getattr(v, "__module__", None))
                    for v in vars(module).values() if isinstance(v, types.ModuleType) or callable(v)}
        if "torch" not in imported:
            frameworks = {PACKAGES[p] for p in imported if p in PACKAGES} - {"numpy"}
    return frameworks.pop() if len(frameworks) == 1 else None


def _refuse_unbridged(fn: Any, package: str | None) -> None:
    """ImplementationError for a function of an array framework the bridge does not run
    (its first call would get torch tensors and fail with an unrelated message)."""
    if package not in UNBRIDGED:
        return
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
    raise ImplementationError(
        f"{name} is a {UNBRIDGED[package]} function (it uses the {package} package), and {UNBRIDGED[package]} "
        f"is not a bridged framework: the bridge runs {', '.join(sorted(FRAMEWORKS))}. Wrap it in a torch "
        f"function that converts the tensors (for example through DLPack or NumPy) and calls it, or "
        f"declare --impl-option framework=NAME if it really runs on one of those")


def _how_recognised(fn: Any, framework: str, declared: Mapping[str, str]) -> str:
    if "framework" in declared:
        return "declared"
    if _top_package(getattr(fn, "__module__", None)) in PACKAGES:
        return f"recognised from its module {fn.__module__}"
    return f"recognised from the {framework} modules the function uses"


#: A framework's own attention functions: (framework, name) -> their layout. Each takes
#: K < N key/value heads (GQA) without an ``enable_gqa`` parameter, or with one that
#: defaults to True (Paddle's), as documented.
_OWN_FUNCTIONS = {("keras", "dot_product_attention"): "BLNE", ("jax", "dot_product_attention"): "BLNE",
                  ("mlx", "scaled_dot_product_attention"): "BNLE",
                  ("paddle", "scaled_dot_product_attention"): "BLNE"}

#: The measured deviations of those functions: (framework, name) -> the short name of their
#: expected-failures file (``implementations/xfail/libraries/``), attached when the
#: function itself is certified.
_OWN_DEVIATIONS = {("paddle", "scaled_dot_product_attention"): "paddle-sdpa"}

#: Modules of torch-compatible twins of those functions (torch's BNLE layout and
#: ``enable_gqa=False``): ``paddle.compat.nn.functional.scaled_dot_product_attention``.
_TORCH_COMPATIBLE = ("paddle.compat",)


def _frameworks_own(fn: Any, framework: str) -> bool:
    """Whether ``fn`` is a framework's own attention function (:data:`_OWN_FUNCTIONS`),
    not its torch-compatible twin."""
    module = getattr(fn, "__module__", None) or ""
    own = _top_package(module) in PACKAGES and not module.startswith(_TORCH_COMPATIBLE)
    return own and (framework, getattr(fn, "__name__", "")) in _OWN_FUNCTIONS


def _own_deviations(fn: Any, framework: str) -> str | None:
    """The short name of the measured deviations of a framework's own function or of its
    torch-compatible twin (the same code behind another layout), or None."""
    if _top_package(getattr(fn, "__module__", None)) not in PACKAGES:
        return None
    return _OWN_DEVIATIONS.get((framework, getattr(fn, "__name__", "")))


def make_bridge(fn: Callable[..., Any], framework: str, *, layout: str | None = None, origin: str = "",
                jit: bool | str | Callable[[Any], bool | str] = False,
                call_kwargs: Mapping[str, Any] | None = None) -> BridgedSDPA:
    """A :class:`BridgedSDPA` of ``fn`` run by ``framework`` (ImportError: not installed;
    ImplementationError: a signature the bridge cannot call). ``call_kwargs``: keyword
    arguments given to every call (``--impl-option call_kwargs=``)."""
    origin = origin or getattr(fn, "__name__", "the function")
    try:
        parameters = list(signature_of(fn).parameters.values())
    except (TypeError, ValueError) as exc:
        raise ImplementationError(f"{origin}: its signature cannot be read ({exc}); wrap it in a Python "
                                  "function taking query, key, value") from exc
    arguments = map_arguments(parameters, origin, given=tuple(call_kwargs or ()))
    own = _frameworks_own(fn, framework)
    own_layout = _OWN_FUNCTIONS[(framework, fn.__name__)] if own else "BNLE"
    return BridgedSDPA(fn, framework_named(framework), arguments, layout or own_layout, jit=jit, native_gqa=own,
                       call_kwargs=call_kwargs)


#: Frameworks whose functions the bridge compiles unless ``jit=false`` is declared: a
#: JAX function run op by op costs seconds a call (Flax's ``dot_product_attention`` about
#: 20 s a test, over an hour for a four-dtype certificate on two cores).
COMPILED_BY_DEFAULT = ("jax",)


def bridged_implementation(fn: Callable[..., Any], framework: str, *, name: str, origin: str,
                           probe: Callable[..., Any], timeout: float | None,
                           jit: bool | None = None) -> Implementation:
    """The Implementation of a framework function: bridged, then probed by ``probe``
    (:func:`implementations.registry.probing.probe_sdpa`). ``jit``: the declared
    ``--impl-option jit=`` (None: not declared). A function of :data:`COMPILED_BY_DEFAULT`
    is compiled per configuration unless ``jit=false`` is declared, a configuration that
    does not trace running eagerly (``BridgedSDPA(jit="fallback")``); its capabilities say
    ``jit`` (a small budget of shapes, no derived flash level unless asked)."""
    declared = _declared()
    declared["_used"] = "yes"
    compiled = framework in COMPILED_BY_DEFAULT and jit is not False
    try:
        bridged = make_bridge(fn, framework, layout=declared.get("layout"), origin=origin,
                              call_kwargs=parse_call_kwargs(declared["call_kwargs"]) if "call_kwargs" in declared
                              else None,
                              jit="fallback" if compiled else False)
    except ImportError as exc:
        return Implementation(name=name, unavailable_reason=(
            f"{origin} is a {framework} function, and {framework} is not importable ({exc}); install it "
            "(pip install 'attention-conformance[frameworks]' has NumPy, Keras and tinygrad)"))
    how = _how_recognised(fn, framework, declared)
    caps = probe(bridged, origin=origin, timeout=timeout)
    if bridged.gqa_by_behaviour:  # from now on, K < N heads only where the probe saw GQA computed
        bridged.gqa_taken = bool(caps.gqa) or any(dict(values).get("gqa") for _, values in caps.by_dtype)
    given = ", ".join(f"{k}={v!r}" for k, v in bridged.call_kwargs.items())
    notes = [f"bridge: {bridged.framework.version} ({how}), layout {bridged.layout}, "
             f"arguments {bridged.arguments.describe()}" + (f"; every call also gets {given} (declared)"
                                                           if given else "")]
    if compiled:
        notes.append(f"compiled: {framework}.jit per configuration (a new shape or dtype is a compilation; one "
                     "that does not trace runs eagerly); --impl-option jit=false runs every call eagerly")
        caps = caps.replace(jit=True)
    elif framework in COMPILED_BY_DEFAULT:
        notes.append("eager: every call runs op by op (jit=false declared)")
    if not bridged.framework.autodiff and not bridged.framework.native_torch:
        notes.append(f"autograd: {bridged.framework.name} has no automatic differentiation; declared off")
        caps = caps.replace(autograd=False, mask_grad=False)
    deviations, short = (), _own_deviations(fn, framework)
    if short is not None:
        from implementations.registry.expected_failures import LIBRARY_XFAIL_DIR, load_expected_failures

        deviations = load_expected_failures(short, LIBRARY_XFAIL_DIR)
        notes.append(f"expected failures: the deviations measured on {origin} "
                     f"(implementations/xfail/libraries/{short}.toml), attached to the library's own function")
    caps = caps.replace(probe_notes=(*notes, *caps.probe_notes))
    return Implementation(
        name=name, capabilities=caps, sdpa=bridged, version=bridged.framework.version, expected_failures=deviations,
        description=f"{bridged.framework.name} function {origin} through the framework bridge "
                    f"(layout {bridged.layout}); capabilities probed, semantics scaled_dot_product_attention's",
    )


def bridged_mha_implementation(cls: type, framework: str, *, name: str, origin: str,
                               probe: Callable[..., Any], timeout: float | None) -> Implementation:
    """The MHA-level Implementation of a Keras MultiHeadAttention class (:mod:`.mha`):
    bridged, then probed by ``probe`` (:func:`implementations.registry.probing.probe_mha`)."""
    declared = _declared()
    if declared:
        declared["_used"] = "yes"  # framework=/layout= say nothing here: refused below
        raise ImplementationError(
            f"--impl-option {', '.join(k for k in declared if k != '_used')}: {origin} is a Keras "
            "MultiHeadAttention layer (the MHA level), recognised from its class; the bridge options apply "
            "to SDPA-level functions")
    try:
        factory = KerasMHAFactory(cls, framework)
    except ImportError as exc:
        return Implementation(name=name, unavailable_reason=(
            f"{origin} is a {framework} layer, and {framework} is not importable ({exc}); install it"))
    caps = probe(factory, origin=origin, timeout=timeout)
    version = factory.framework.version
    notes = [f"bridge: {version}, {cls.__module__}.{cls.__qualname__} behind nn.MultiheadAttention's "
             "constructor and forward (key_dim = value_dim = embed_dim // num_heads; (B, L, D) layout; masks "
             "inverted to attention_mask, True = attend; is_causal as use_causal_mask; need_weights as "
             "return_attention_scores; weights written into the layer's variables)"]
    if not factory.native_torch:
        notes.append(f"autograd: {factory.framework.name} arrays pass through NumPy; declared off")
        caps = caps.replace(autograd=False, mask_grad=False, by_dtype={
            d: {k: v for k, v in values if k not in ("autograd", "mask_grad")} for d, values in caps.by_dtype})
    caps = caps.replace(probe_notes=(*notes, *caps.probe_notes))
    return Implementation(
        name=name, capabilities=caps, mha=factory, load_weights=load_keras_weights, version=version,
        description=f"Keras {cls.__qualname__} ({origin}) through the framework bridge; capabilities probed, "
                    "semantics nn.MultiheadAttention's",
    )


def bridged_module_implementation(cls: type, *, name: str, origin: str, probe: Callable[..., Any],
                                  timeout: float | None) -> Implementation:
    """The MHA-level Implementation of another framework's multi-head layer class
    (:mod:`.modules`, its table in :mod:`.module_tables`), probed by ``probe``."""
    table = module_table(cls)
    declared = _declared()
    if declared:
        declared["_used"] = "yes"
        raise ImplementationError(
            f"--impl-option {', '.join(k for k in declared if k != '_used')}: {origin} is a {table.name} layer "
            "(the MHA level), recognised from its class; the bridge options apply to SDPA-level functions")
    try:
        factory = ModuleMHAFactory(cls, table)
    except ImportError as exc:
        return Implementation(name=name, unavailable_reason=(
            f"{origin} is a {table.name} layer, and {table.framework} is not importable ({exc}); install it"))
    caps = probe(factory, origin=origin, timeout=timeout)
    version = factory.framework.version
    package = (cls.__module__ or "").partition(".")[0]
    top = sys.modules.get(package)
    if getattr(top, "__version__", None):
        version = f"{package} {top.__version__}, {version}"
    notes = [f"bridge: {version}, {cls.__module__}.{cls.__qualname__} behind nn.MultiheadAttention's constructor "
             f"and forward (table {table.name}: (B, L, D) layout; masks inverted to one bool mask, True = attend; "
             f"is_causal {'as the causal flag' if table.causal_flag else 'through attn_mask'}; weights written "
             "into the layer's (D, N, hd) and (N, hd, D) kernels)",
             f"autograd: {factory.framework.name} arrays pass through NumPy; declared off"]
    deviations, note = _module_deviations(cls, table)
    caps = caps.replace(autograd=False, mask_grad=False, by_dtype={
        d: {k: v for k, v in values if k not in ("autograd", "mask_grad")} for d, values in caps.by_dtype},
        probe_notes=(*notes, *caps.probe_notes, *note))
    return Implementation(
        name=name, capabilities=caps, mha=factory, load_weights=load_module_weights, version=version,
        expected_failures=deviations,
        description=f"{table.name} ({origin}) through the module bridge; capabilities probed, semantics "
                    "nn.MultiheadAttention's",
    )


def _module_deviations(cls: type, table: Any) -> tuple[tuple, list[str]]:
    """The measured deviations of the library's layer (its table's file), attached to the
    library's class itself; a subclass is told the file's short name instead (its own code
    may differ from what was measured)."""
    from implementations.registry.expected_failures import LIBRARY_XFAIL_DIR, load_expected_failures

    if table.deviations is None:
        return (), []
    if cls.__qualname__ == table.name.rpartition(".")[2] and (cls.__module__ or "").startswith(
            table.name.partition(".")[0]):
        return load_expected_failures(table.deviations, LIBRARY_XFAIL_DIR), [
            f"expected failures: the deviations measured on {table.name} "
            f"(implementations/xfail/libraries/{table.deviations}.toml), attached to the library's own class"]
    return (), [f"expected failures: {cls.__qualname__} subclasses {table.name}, whose measured deviations are "
                f"not attached (a subclass may compute otherwise); if its attention is the library's, pass "
                f"--xfail-file={table.deviations}"]
