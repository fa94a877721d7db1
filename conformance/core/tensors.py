"""Turn cases into torch tensors (dtype, device and memory layout applied) and back.

A case holds float64 NumPy arrays whose values are exact in its dtype; this
module is the only place that decides how they are laid out in memory:

* ``contiguous``: plain contiguous tensors;
* ``transposed``: query stored (B, L, N, E), key/value (B, S, K, E|Ev), handed
  over as ``.transpose(1, 2)`` views (non-contiguous when N > 1 and L > 1);
* ``stride0``: key/value built from size-1 slices and ``.expand``-ed with stride 0
  along the dims the case notes (``"stride0:batch"``, ``"stride0:heads"``; without
  notes, every batch/kv-head dim along which they are constant); the case's
  values are equal along those dims by construction;
* ``poisoned``: every tensor is a strided view into a larger buffer filled with
  NaN (additive masks too; bool masks with False) — padding after each row and
  a storage offset — so a kernel that ignores strides or the offset reads NaN.

A mask flagged ``"mask:expanded"`` is handed over expanded to (B, N, L, S) with
stride 0 along its broadcast dims.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from conformance.core.cases import (
    NOTE_MASK_EXPANDED,
    NOTE_STRIDE0_BATCH,
    NOTE_STRIDE0_HEADS,
    MHACase,
    SDPACase,
)
from implementations.base import ALL_DTYPES

__all__ = ["dtype_of", "to_numpy", "sdpa_inputs", "mha_inputs", "POISON_PAD"]

#: The suite's dtype names are torch's attribute names (``implementations.base.ALL_DTYPES``).
_TORCH_DTYPES = {name: getattr(torch, name) for name in ALL_DTYPES}
#: Elements of padding after each innermost row (and before the first) of a poisoned tensor.
POISON_PAD = 3


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype called ``name`` ("float64", "float32", "float16", "bfloat16")."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype={name!r} is not one of {tuple(_TORCH_DTYPES)}") from None


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A float64 NumPy copy of ``tensor`` (exact for every float dtype, bfloat16
    included); bool tensors come back as bool arrays."""
    t = tensor.detach().cpu()
    if t.dtype == torch.bool:
        return t.numpy().copy()
    return t.to(torch.float64).numpy().copy()


def _tensor(array: np.ndarray, dtype: torch.dtype, device: str) -> torch.Tensor:
    # torch.tensor copies: an implementation writing into its inputs cannot touch the case.
    return torch.tensor(np.ascontiguousarray(array), dtype=dtype, device=device)


def _poisoned(array: np.ndarray, dtype: torch.dtype, device: str) -> torch.Tensor:
    """A view of ``array`` into a NaN-filled (False for bool) buffer: a storage
    offset of POISON_PAD and POISON_PAD poison elements after every innermost row."""
    shape = array.shape
    inner = shape[-1] if shape else 1
    row = inner + POISON_PAD
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    fill = False if dtype == torch.bool else float("nan")
    buffer = torch.full((POISON_PAD + rows * row + POISON_PAD,), fill, dtype=dtype, device=device)
    strides = []
    step = row
    for size in reversed(shape[:-1]):
        strides.append(step)
        step *= size
    strides = [1, *strides][::-1] if shape else []
    view = buffer.as_strided(shape, strides, POISON_PAD)
    with torch.no_grad():
        view.copy_(_tensor(array, dtype, device))
    return view


def _laid_out(array: np.ndarray, layout: str, dtype: torch.dtype, device: str,
              expand_axes: tuple[int, ...] = ()) -> torch.Tensor:
    """``array`` (B, H, T, F) as a tensor in ``layout``."""
    if layout == "transposed":
        return _tensor(np.swapaxes(array, 1, 2), dtype, device).transpose(1, 2)
    if layout == "poisoned":
        return _poisoned(array, dtype, device)
    if layout == "stride0" and expand_axes:
        index = tuple(slice(0, 1) if axis in expand_axes else slice(None) for axis in range(array.ndim))
        return _tensor(array[index], dtype, device).expand(*array.shape)
    return _tensor(array, dtype, device)


def _leaf(tensor: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """Make ``tensor`` (a view of an internal base) differentiable, keeping its strides.

    The base becomes the autograd leaf; the view retains its gradient so that
    ``view.grad`` is filled by ``backward()`` like a leaf's.
    """
    if not requires_grad:
        return tensor
    base = tensor._base
    if base is None:
        return tensor.requires_grad_(True)
    base.requires_grad_(True)
    view = base.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
    view.retain_grad()
    return view


def _sdpa_mask(case: SDPACase, dtype: torch.dtype, requires_grad: bool) -> torch.Tensor | None:
    if case.attend_mask is not None:
        array, mask_dtype, grad = np.asarray(case.attend_mask, dtype=bool), torch.bool, False
    elif case.additive_mask is not None:
        array, mask_dtype, grad = case.additive_mask, dtype, requires_grad
    else:
        return None
    full = (case.B, case.N, case.L, case.S)
    if NOTE_MASK_EXPANDED in case.notes:
        small = array.reshape((1,) * (4 - array.ndim) + array.shape)
        tensor = _leaf(_tensor(small, mask_dtype, case.device), grad)
        expanded = tensor.expand(*full)
        if grad:
            expanded.retain_grad()
        return expanded
    layout = "poisoned" if case.layout == "poisoned" else "contiguous"
    return _leaf(_laid_out(array, layout, mask_dtype, case.device), grad)


def _stride0_axes(case: SDPACase) -> tuple[int, ...]:
    """The dims key/value are expanded along: from the case's notes, or (a case
    built by hand or replayed without notes) every batch/kv-head dim of size > 1
    along which key and value are constant."""
    noted = tuple(axis for note, axis in ((NOTE_STRIDE0_BATCH, 0), (NOTE_STRIDE0_HEADS, 1))
                  if note in case.notes)
    if noted:
        return noted
    return tuple(
        axis for axis in (0, 1)
        if case.key.shape[axis] > 1
        and all(np.array_equal(x, np.broadcast_to(x.take([0], axis=axis), x.shape))
                for x in (case.key, case.value))
    )


def sdpa_inputs(case: SDPACase, *, requires_grad: bool = False) -> dict[str, Any]:
    """``dict(query=, key=, value=, attn_mask=, sinks=)`` torch tensors for ``case``.

    On ``case.device`` with ``case.dtype`` and ``case.layout`` applied. ``attn_mask``
    is the case's bool mask (True = may attend), or its additive mask in the case
    dtype (-inf kept), or None. With ``requires_grad`` the tensors (and a float mask)
    require grad and keep their layout; each one's ``.grad`` is filled by
    ``backward()`` (views retain their gradient).
    """
    dtype = dtype_of(case.dtype)
    kv_axes = _stride0_axes(case) if case.layout == "stride0" else ()
    query = _laid_out(case.query, case.layout, dtype, case.device)
    key = _laid_out(case.key, case.layout, dtype, case.device, kv_axes)
    value = _laid_out(case.value, case.layout, dtype, case.device, kv_axes)
    query, key, value = (_leaf(t, requires_grad) for t in (query, key, value))
    return {
        "query": query,
        "key": key,
        "value": value,
        "attn_mask": _sdpa_mask(case, dtype, requires_grad),
        # learned sinks (N,), float32 (the case's are float32-exact); None: nothing passed
        "sinks": None if case.sinks is None else torch.tensor(case.sinks, dtype=torch.float32, device=case.device),
    }


def mha_inputs(case: MHACase, *, requires_grad: bool = False) -> dict[str, Any]:
    """Keyword arguments of ``module.forward`` for ``case``, in MHA's conventions.

    ``query``, ``key``, ``value`` (contiguous, case dtype and device; one tensor
    object when the case is self-attention, as the module's fast path checks
    ``query is key is value``), ``key_padding_mask`` and ``attn_mask`` (bool:
    True = blocked; float: added, in the case dtype), ``need_weights``,
    ``average_attn_weights``, ``is_causal``.
    """
    dtype = dtype_of(case.dtype)
    query = _tensor(case.query, dtype, case.device).requires_grad_(requires_grad)
    if case.key is case.query:
        key = query
    else:
        key = _tensor(case.key, dtype, case.device).requires_grad_(requires_grad)
    if case.value is case.query:
        value = query
    elif case.value is case.key:
        value = key
    else:
        value = _tensor(case.value, dtype, case.device).requires_grad_(requires_grad)

    def mask(array: np.ndarray | None) -> torch.Tensor | None:
        if array is None:
            return None
        if array.dtype == np.bool_:
            return _tensor(array, torch.bool, case.device)
        return _tensor(array, dtype, case.device)

    return {
        "query": query,
        "key": key,
        "value": value,
        "key_padding_mask": mask(case.key_padding_mask),
        "attn_mask": mask(case.attn_mask),
        "need_weights": case.need_weights,
        "average_attn_weights": case.average_attn_weights,
        "is_causal": case.is_causal,
    }
