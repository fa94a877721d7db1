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
    "spec": "implementations.builtins.spec_oracle:make_implementation",
    "handwritten": "implementations.builtins.handwritten_impl:make_implementation",
    "sdpa": "implementations.builtins.torch_sdpa:make_default",
    "sdpa-math": "implementations.builtins.torch_sdpa:make_backend",
    "sdpa-flash": "implementations.builtins.torch_sdpa:make_backend",
    "sdpa-flash-cuda": "implementations.builtins.torch_sdpa:make_backend",
    "sdpa-efficient": "implementations.builtins.torch_sdpa:make_backend",
    "sdpa-cudnn": "implementations.builtins.torch_sdpa:make_backend",
    "torch-mha": "implementations.builtins.torch_mha:make_implementation",
    "flex": "implementations.builtins.flex:make_implementation",
    "flash-ref": "implementations.builtins.flash_reference:make_implementation",
    "triton": "implementations.builtins.triton_attention:make_implementation",
    "jax": "implementations.builtins.jax_attention:make_implementation",
    # varlen / kv-cache levels
    "varlen-reference": "implementations.builtins.varlen_reference:make_implementation",
    # sharded (context-parallel) level
    "ring": "implementations.builtins.ring_attention:make_implementation",
    "ulysses": "implementations.builtins.ulysses_attention:make_implementation",
    "torch-cp": "implementations.builtins.torch_cp:make_implementation",
    "torch-cp-alltoall": "implementations.builtins.torch_cp:make_implementation",
}
