"""``ring-attention-pytorch`` (``pip install ring-attention-pytorch``; the
``ring_attention`` optional dependencies) at the sharded level, as a user adapts it.

The adapter only translates: the suite's heads-first shards (B, H, Ls, D) to the
library's sequence-first (B, Ls, H, D) and back, and the suite's argument names to the
library's (``world_size`` is its ``ring_size``; ``ring_reduce_col=True`` is how its
``ring_flash_attn`` turns the ring on: without it each rank attends its own block only).
The library's communication is its own, as written: ``dist.isend``/``irecv`` and
``dist.barrier()`` on the **default** process group, rank and world size read from it
(the suite's group for a world size is exactly the call's ranks), so ``group`` and
``rank`` are not passed on.

What it declares is what the library says it does: float64 and float32, causal, GQA
(query heads a multiple of the kv heads), autograd, the contiguous layout (its causal
mask numbers the blocks by rank); no scale argument (it always uses ``1/sqrt(E)``), the
value's head dim equal to the key's (it asserts so), no LSE returned. Its deviations
(docs/FINDINGS.md) are findings, not declared away.
"""

from __future__ import annotations

from typing import Any

from implementations.base import Capabilities, Implementation

__all__ = ["ring_flash", "sharded"]

PACKAGE = "ring-attention-pytorch"


def sharded(q: Any, k: Any, v: Any, *, group: Any = None, rank: int | None = None,
            world_size: int | None = None, causal: bool = False, softmax_scale: float | None = None,
            layout: str = "contiguous") -> Any:
    """One rank's shard through ``ring_flash_attn`` (layout and names translated)."""
    from ring_attention_pytorch import ring_flash_attn

    out = ring_flash_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                          ring_reduce_col=True, ring_size=world_size)
    return out.transpose(1, 2)


def _version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return None


def make_implementation() -> Implementation:
    version = _version()
    caps = Capabilities(devices=("cpu", "cuda"), dtypes=("float64", "float32"), causal="upper_left",
                        fully_masked="zero", different_v_dim=False, gqa=True, dropout=False,
                        custom_scale=False, autograd=True, mask_grad=False, mask_kinds=frozenset({"none"}),
                        sharded_layouts=frozenset({"contiguous"}), sharded_lse=False)
    return Implementation(
        name=PACKAGE, capabilities=caps, sharded=sharded, version=version or "absent",
        unavailable_reason=None if version else f"{PACKAGE} is not installed (pip install {PACKAGE}, or "
        "the project's ring_attention optional dependencies)",
        description="ring_attention_pytorch.ring_flash_attn(ring_reduce_col=True): the library's ring over "
        "the default process group (implementations/builtins/distributed/ring_attention_pytorch.py)")


ring_flash = make_implementation()
