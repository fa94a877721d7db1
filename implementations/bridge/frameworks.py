"""The array frameworks the bridge speaks: how a torch tensor becomes one of their
arrays and back, and how each differentiates (or that it cannot).

Each :class:`Framework` converts through NumPy (host memory; bfloat16 as ``ml_dtypes``'
where the framework has it) or DLPack (CuPy, whose arrays live on the GPU), except Keras
on its torch backend, whose tensors are torch tensors: nothing is converted and torch's
autograd differentiates it. Gradients use the framework's own autodiff: ``jax.vjp``
(JAX, Keras on JAX), ``tf.GradientTape`` (TensorFlow, Keras on TensorFlow), tinygrad's
``backward``, ``mlx.core.vjp``, ``paddle.grad``; NumPy and CuPy have none (``autodiff`` is False, the
bridge declares autograd off).

A framework is recognised by the top-level package of a callable's ``__module__``
(:data:`PACKAGES`) or declared by name (:data:`FRAMEWORKS`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
from typing import Any, Callable, Sequence

import numpy as np
import torch

__all__ = ["FRAMEWORKS", "PACKAGES", "UNBRIDGED", "Framework", "framework_named", "numpy_to_torch", "torch_to_numpy"]

#: Top-level package of a callable's module -> the framework that runs it.
PACKAGES = {
    "numpy": "numpy", "jax": "jax", "jaxlib": "jax", "flax": "jax", "keras": "keras",
    "tensorflow": "tensorflow", "tf_keras": "tensorflow", "tinygrad": "tinygrad",
    "cupy": "cupy", "cupyx": "cupy", "mlx": "mlx", "paddle": "paddle",
}

#: Top-level packages of array frameworks the bridge does not run (a function of one gets
#: torch tensors it cannot read): the name each goes by.
UNBRIDGED = {"mindspore": "MindSpore", "oneflow": "OneFlow", "mxnet": "MXNet",
             "dpnp": "dpnp"}


def torch_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy array with the tensor's values and dtype (bfloat16 as ml_dtypes')."""
    t = tensor.detach().cpu().resolve_conj().resolve_neg()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def numpy_to_torch(array: Any, device: torch.device) -> torch.Tensor:
    """A torch tensor with ``array``'s values and dtype (a copy), on ``device``."""
    host = np.array(array)  # a writable copy: frameworks' buffers may be read-only
    if host.dtype.name == "bfloat16":
        return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16).to(device)
    if host.dtype == object or host.dtype.kind not in "biuf":
        raise TypeError(f"the framework returned an array of dtype {host.dtype}, not a number type")
    return torch.from_numpy(host).to(device)


class Framework:
    """One array framework: conversion both ways, and its vjp where it has autodiff."""

    name = "?"
    package = "?"
    #: Whether :meth:`vjp` works (the framework differentiates the function itself).
    autodiff = False
    #: Whether arrays are torch tensors already (no conversion, torch's autograd).
    native_torch = False
    #: The installed distribution whose version is shown where the module has none
    #: (None: the package's own name).
    distribution: str | None = None

    def __init__(self) -> None:
        self.module = importlib.import_module(self.package)

    @property
    def version(self) -> str:
        found = getattr(self.module, "__version__", None)
        if found is None:  # tinygrad has none: the installed distribution's
            try:
                found = importlib.metadata.version(self.distribution or self.package)
            except importlib.metadata.PackageNotFoundError:
                found = "?"
        return f"{self.name} {found}"

    def from_torch(self, tensor: torch.Tensor) -> Any:
        return self.from_numpy(torch_to_numpy(tensor))

    def to_torch(self, array: Any, like: torch.Tensor) -> torch.Tensor:
        return numpy_to_torch(self.to_numpy(array), like.device)

    def from_numpy(self, array: np.ndarray) -> Any:
        return array

    def to_numpy(self, array: Any) -> np.ndarray:
        return np.asarray(array)

    def jit(self, fn: Callable[..., Any], static: Sequence[str] = ()) -> Callable[..., Any]:
        """``fn`` compiled once per configuration, where the framework compiles (JAX)."""
        return fn

    def vjp(self, fn: Callable[..., Any], primals: Sequence[Any], cotangent: Any) -> list[Any]:
        """The gradients of ``sum(fn(*primals) * cotangent)`` w.r.t. each primal."""
        raise NotImplementedError(f"{self.name} has no automatic differentiation")

    def with_default_precision(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` computing refused matmul precisions at the default one (JAX only)."""
        raise NotImplementedError(f"{self.name} has no rewrite of refused matmul precisions")

    def dtype_scope(self, dtype: Any) -> contextlib.AbstractContextManager:
        """What a call in ``dtype`` (a torch dtype or its name) runs inside: JAX's float64
        switch for a float64 call; nothing otherwise."""
        return contextlib.nullcontext()


class NumPy(Framework):
    name = package = "numpy"


class Jax(Framework):
    name = package = "jax"
    autodiff = True

    def __init__(self) -> None:
        super().__init__()
        # float64 arrays stay float64 inside dtype_scope(float64) only: JAX's thread-local
        # switch around each float64 call, so that every other call runs as JAX runs by
        # default (a process-wide jax_enable_x64 changes the code under test: integer and
        # index dtypes, what some kernels accept). A JAX without the switch gets it process-wide.
        self._x64 = getattr(self.module, "enable_x64", None)
        if self._x64 is None:
            try:
                from jax.experimental import enable_x64 as switch
            except ImportError:
                switch = None
            self._x64 = switch
        if self._x64 is None:
            self.module.config.update("jax_enable_x64", True)
        #: (precision, dtypes) -> whether the backend refuses it, shared by every rewrite
        self.refusals: dict[tuple, bool] = {}

    def dtype_scope(self, dtype: Any) -> contextlib.AbstractContextManager:
        if self._x64 is not None and str(dtype).removeprefix("torch.") == "float64":
            return self._x64(True)
        return contextlib.nullcontext()

    def from_numpy(self, array: np.ndarray) -> Any:
        # device_put of an owned copy: jnp.asarray compiles a copy program ("jit(stage)",
        # jax 0.10) for every new shape and dtype, half of a certificate's compilations
        return self.module.device_put(np.array(array, copy=True))

    def jit(self, fn: Callable[..., Any], static: Sequence[str] = ()) -> Callable[..., Any]:
        return self.module.jit(fn, static_argnames=tuple(static))

    def vjp(self, fn, primals, cotangent):
        _, pullback = self.module.vjp(fn, *primals)
        return list(pullback(cotangent))

    def with_default_precision(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with each matmul (``dot_general``) whose explicit precision the backend
        refuses computed at the default precision instead: for a function whose own eager
        code retries that way (JAX's ``dot_product_attention`` catches the refusal of
        F16_F16_F32 on a CPU and calls the same einsum with ``precision=None``), so that it
        can run under ``jax.jit``, which raises the refusal when it compiles, past any
        ``try``. Traced to a jaxpr, the refused ``dot_general`` equations rewritten
        (nested jaxprs too), then evaluated: traceable, so it jits and differentiates."""
        return _DefaultPrecision(self.module, fn, self.refusals)


class _DefaultPrecision:
    """:meth:`Jax.with_default_precision`'s function."""

    def __init__(self, jax: Any, fn: Callable[..., Any], refusals: dict[tuple, bool]) -> None:
        self.jax, self.fn, self.refusals = jax, fn, refusals

    def __call__(self, *args, **kwargs):
        from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

        tree_util = self.jax.tree_util
        leaves, tree = tree_util.tree_flatten((args, kwargs))

        def of_leaves(*values):
            a, kw = tree_util.tree_unflatten(tree, values)
            return self.fn(*a, **kw)

        closed, shape = self.jax.make_jaxpr(of_leaves, return_shape=True)(*leaves)
        fixed = ClosedJaxpr(self._rewrite(closed.jaxpr), closed.consts)
        return tree_util.tree_unflatten(tree_util.tree_structure(shape), jaxpr_as_fun(fixed)(*leaves))

    def _rewrite(self, jaxpr: Any) -> Any:
        from jax.extend.core import ClosedJaxpr, Jaxpr

        def rewritten(value: Any) -> Any:
            if isinstance(value, ClosedJaxpr):
                return ClosedJaxpr(self._rewrite(value.jaxpr), value.consts)
            if isinstance(value, Jaxpr):
                return self._rewrite(value)
            if isinstance(value, (tuple, list)) and any(isinstance(v, (ClosedJaxpr, Jaxpr)) for v in value):
                return type(value)(rewritten(v) for v in value)
            return value

        eqns = []
        for eqn in jaxpr.eqns:
            params = {name: rewritten(value) for name, value in eqn.params.items()}
            if eqn.primitive.name == "dot_general" and self._refused(
                    params.get("precision"), eqn.invars[0].aval.dtype, eqn.invars[1].aval.dtype,
                    params.get("preferred_element_type")):
                params["precision"] = None
            eqns.append(eqn.replace(params=params))
        return jaxpr.replace(eqns=eqns)

    def _refused(self, precision: Any, lhs: Any, rhs: Any, preferred: Any) -> bool:
        """Whether the default backend refuses a matmul of these dtypes at this explicit
        algorithm (lowered once, on a 1 x 1 matmul, per combination)."""
        lax = self.jax.lax
        if not isinstance(precision, (lax.DotAlgorithm, lax.DotAlgorithmPreset)):
            return False
        key = (precision, str(lhs), str(rhs), str(preferred))
        if key not in self.refusals:
            a, b = self.jax.ShapeDtypeStruct((1, 1), lhs), self.jax.ShapeDtypeStruct((1, 1), rhs)
            try:
                self.jax.jit(lambda x, y: lax.dot_general(
                    x, y, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=preferred)).lower(a, b)
            except ValueError:
                self.refusals[key] = True
            else:
                self.refusals[key] = False
        return self.refusals[key]


class TensorFlow(Framework):
    name = package = "tensorflow"
    autodiff = True

    def from_numpy(self, array: np.ndarray) -> Any:
        return self.module.convert_to_tensor(array)

    def to_numpy(self, array: Any) -> np.ndarray:
        return array.numpy() if hasattr(array, "numpy") else np.asarray(array)

    def vjp(self, fn, primals, cotangent):
        tf = self.module
        primals = [tf.identity(p) for p in primals]
        with tf.GradientTape() as tape:
            for p in primals:
                tape.watch(p)
            out = fn(*primals)
        return list(tape.gradient(out, primals, output_gradients=cotangent))


class Keras(Framework):
    """Keras 3 on whatever backend ``KERAS_BACKEND`` chose before keras was imported:
    torch (tensors pass as they are, torch's autograd), jax or tensorflow (their
    conversion and autodiff), numpy (no gradients)."""

    name = package = "keras"

    def __init__(self) -> None:
        super().__init__()
        self.backend = self.module.backend.backend()
        inner = {"jax": Jax, "tensorflow": TensorFlow, "numpy": NumPy}.get(self.backend)
        self.inner = inner() if inner else None
        self.native_torch = self.backend == "torch"
        self.autodiff = self.inner is not None and self.inner.autodiff

    @property
    def version(self) -> str:
        return f"keras {self.module.__version__} ({self.backend} backend)"

    def from_torch(self, tensor):
        return tensor if self.native_torch else self.inner.from_torch(tensor)

    def to_torch(self, array, like):
        if self.native_torch:
            return array.to(like.device)
        return self.inner.to_torch(array, like)

    def vjp(self, fn, primals, cotangent):
        return self.inner.vjp(fn, primals, cotangent)

    def dtype_scope(self, dtype):
        return self.inner.dtype_scope(dtype) if self.inner is not None else contextlib.nullcontext()


class Tinygrad(Framework):
    name = package = "tinygrad"
    autodiff = True

    def from_numpy(self, array: np.ndarray) -> Any:
        return self.module.Tensor(np.ascontiguousarray(array))

    def to_numpy(self, array: Any) -> np.ndarray:
        return array.numpy()

    def vjp(self, fn, primals, cotangent):
        Tensor = self.module.Tensor
        if hasattr(Tensor, "gradient"):  # tinygrad >= 0.10: no requires_grad, grads of a scalar
            leaves = [Tensor(p.numpy()) for p in primals]
            return list((fn(*leaves) * cotangent).sum().gradient(*leaves))
        leaves = [Tensor(p.numpy(), requires_grad=True) for p in primals]
        (fn(*leaves) * cotangent).sum().backward()
        return [leaf.grad for leaf in leaves]


class CuPy(Framework):
    """CuPy arrays on the GPU, exchanged with CUDA torch tensors through DLPack."""

    name = package = "cupy"

    def from_torch(self, tensor):
        if tensor.device.type != "cuda":
            return self.module.asarray(torch_to_numpy(tensor))
        return self.module.from_dlpack(tensor.detach().contiguous())

    def to_torch(self, array, like):
        return torch.from_dlpack(array).clone().to(like.device)


class MLX(Framework):
    name = "mlx"
    package = "mlx.core"  # its __version__ (the mlx package has none)
    distribution = "mlx"
    autodiff = True

    def from_numpy(self, array: np.ndarray) -> Any:
        """An mlx array of ``array``'s dtype: ``mx.array`` of a float64 array gives float32
        unless told, and reads no ml_dtypes bfloat16 (passed through float32, exactly)."""
        mx = self.module
        if array.dtype.name == "bfloat16":
            return mx.array(np.asarray(array, dtype=np.float32)).astype(mx.bfloat16)
        if array.dtype == np.float64:
            return mx.array(array, dtype=mx.float64)
        return mx.array(array)

    def to_numpy(self, array: Any) -> np.ndarray:
        mx = self.module
        if getattr(array, "dtype", None) == mx.bfloat16:  # no buffer format for it: through float32
            import ml_dtypes

            return np.array(array.astype(mx.float32)).astype(ml_dtypes.bfloat16)
        return np.array(array)

    def vjp(self, fn, primals, cotangent):
        _, grads = self.module.vjp(fn, list(primals), [cotangent])
        return list(grads)


class Paddle(Framework):
    """PaddlePaddle's dygraph tensors on the CPU, through NumPy; gradients by ``paddle.grad``.
    bfloat16 crosses through float32 (exactly): Paddle reads no ml_dtypes array and shows
    its own bfloat16 as uint16."""

    name = package = "paddle"
    distribution = "paddlepaddle"
    autodiff = True

    def __init__(self) -> None:
        import warnings

        with warnings.catch_warnings():  # paddle 3.3 warns at import that no ccache is installed
            warnings.filterwarnings("ignore", "No ccache found", UserWarning)
            super().__init__()

    def from_numpy(self, array: np.ndarray) -> Any:
        paddle = self.module
        if array.dtype.name == "bfloat16":
            return paddle.to_tensor(np.asarray(array, dtype=np.float32)).astype("bfloat16")
        return paddle.to_tensor(np.ascontiguousarray(array))

    def to_numpy(self, array: Any) -> np.ndarray:
        if getattr(array, "dtype", None) == self.module.bfloat16:
            import ml_dtypes

            return array.astype("float32").numpy().astype(ml_dtypes.bfloat16)
        return array.numpy() if hasattr(array, "numpy") else np.asarray(array)

    def vjp(self, fn, primals, cotangent):
        leaves = []
        for primal in primals:
            leaf = primal.detach()
            leaf.stop_gradient = False
            leaves.append(leaf)
        out = fn(*leaves)
        grads = self.module.grad([out], leaves, grad_outputs=[cotangent], allow_unused=True)
        return [None if g is None else g.detach() for g in grads]


#: Framework name -> its class (``--impl-option framework=NAME``).
FRAMEWORKS: dict[str, type[Framework]] = {
    "numpy": NumPy, "jax": Jax, "keras": Keras, "tensorflow": TensorFlow,
    "tinygrad": Tinygrad, "cupy": CuPy, "mlx": MLX, "paddle": Paddle,
}


def framework_named(name: str) -> Framework:
    """The framework ``name`` (ImportError when it is not installed)."""
    return FRAMEWORKS[name]()
