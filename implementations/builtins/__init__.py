"""The built-in implementations, built lazily by ``implementations.registry``.

``BUILTINS`` maps each registered name to ``"module:function"``; the function is
called (with the name as keyword ``name`` when it has that parameter) only when that
implementation is resolved, so listing the registry imports nothing heavy.

A built-in's expected failures are the entries of ``implementations/xfail/<name>.toml``
(``<name>`` its registered name); the registry attaches them when it builds the
built-in, so a built-in never loads them itself and never imports the registry.
"""

from __future__ import annotations

__all__ = ["BUILTINS"]

BUILTINS: dict[str, str] = {
    "spec": "implementations.builtins.references.spec_oracle:make_implementation",
    "handwritten": "implementations.builtins.references.handwritten_impl:make_implementation",
    "sdpa": "implementations.builtins.pytorch.torch_sdpa:make_default",
    "sdpa-math": "implementations.builtins.pytorch.torch_sdpa:make_backend",
    "sdpa-flash": "implementations.builtins.pytorch.torch_sdpa:make_backend",
    "sdpa-flash-cuda": "implementations.builtins.pytorch.torch_sdpa:make_backend",
    "sdpa-efficient": "implementations.builtins.pytorch.torch_sdpa:make_backend",
    "sdpa-cudnn": "implementations.builtins.pytorch.torch_sdpa:make_backend",
    "torch-mha": "implementations.builtins.pytorch.torch_mha:make_implementation",
    "flex": "implementations.builtins.pytorch.flex:make_implementation",
    "flash-ref": "implementations.builtins.references.flash_reference:make_implementation",
    "triton": "implementations.builtins.kernels.triton_attention:make_implementation",
    "jax": "implementations.builtins.frameworks.jax_attention:make_implementation",
    # varlen / kv-cache levels
    "varlen-reference": "implementations.builtins.references.varlen_reference:make_implementation",
    # sharded (context-parallel) level
    "ring": "implementations.builtins.distributed.ring_attention:make_implementation",
    "ulysses": "implementations.builtins.distributed.ulysses_attention:make_implementation",
    "torch-cp": "implementations.builtins.distributed.torch_cp:make_implementation",
    "torch-cp-alltoall": "implementations.builtins.distributed.torch_cp:make_implementation",
}
