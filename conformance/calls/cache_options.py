"""FlashAttention's options at the varlen and kvcache levels: window, soft-capping, ALiBi, LSE.

``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` take the options of
``flash_attn_func`` (``spec.flash``): each sequence of a packed batch or of a cache is one
flash problem of its own (B = 1, its own L and S, its ALiBi slopes row), bounded by the
flash level's rule (``conformance.calls.flash_bounds``). Here: the options a case uses (as
``spec`` keywords, as FlashAttention's keyword arguments, as text), one sequence as a
:class:`~conformance.calls.flash_cases.FlashCase`, and the LSE's bounds and check.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conformance.calls.flash_bounds import allowed_lse
from conformance.calls.flash_bounds import oracle as flash_oracle
from conformance.calls.flash_cases import FlashCase
from conformance.core.compare import compare_values, fail
from conformance.core.target import Target

__all__ = ["check_lse_against_oracle", "flash_options", "float32_tensor", "option_features", "option_kwargs",
           "option_text", "sequence_flash_case", "sequence_lse_bounds", "slopes_row", "split_lse"]


def flash_options(case: Any) -> dict[str, Any]:
    """The FlashAttention options a varlen or kvcache case uses, as ``spec`` keywords
    (window, softcap, alibi_slopes; those at their default left out)."""
    options: dict[str, Any] = {}
    if tuple(case.window) != (-1, -1):
        options["window"] = tuple(case.window)
    if case.softcap:
        options["softcap"] = float(case.softcap)
    if case.alibi_slopes is not None:
        options["alibi_slopes"] = case.alibi_slopes
    return options


def option_features(case: Any) -> set[str]:
    """The features (``ALL_VARLEN_FEATURES`` names) a case's options use."""
    names = {"window": "window", "softcap": "softcap", "alibi_slopes": "alibi"}
    return {names[k] for k in flash_options(case)}


def option_kwargs(case: Any, tensor: Any) -> dict[str, Any]:
    """FlashAttention's keyword arguments for the options a case uses (defaults not
    passed, so a function lacking an unused parameter is still called); ``tensor(a)``
    makes the float32 slopes tensor."""
    kwargs: dict[str, Any] = {}
    if tuple(case.window) != (-1, -1):
        kwargs["window_size"] = tuple(int(x) for x in case.window)
    if case.softcap:
        kwargs["softcap"] = float(case.softcap)
    if case.alibi_slopes is not None:
        kwargs["alibi_slopes"] = tensor(case.alibi_slopes)
    return kwargs


def option_text(case: Any) -> str:
    """The options a case uses, for its description ("" when none)."""
    text = ""
    if tuple(case.window) != (-1, -1):
        text += f" window={tuple(case.window)}"
    if case.softcap:
        text += f" softcap={case.softcap!r}"
    if case.alibi_slopes is not None:
        text += f" alibi_slopes={tuple(np.shape(case.alibi_slopes))}"
    return text


def slopes_row(slopes: np.ndarray | None, b: int) -> np.ndarray | None:
    """Sequence b's ALiBi slopes (N,) from (N,) or (B, N)."""
    if slopes is None:
        return None
    slopes = np.asarray(slopes)
    return slopes if slopes.ndim == 1 else slopes[b]


def sequence_flash_case(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool, scale: float | None,
                        dtype: str, device: str, options: dict[str, Any]) -> FlashCase:
    """One sequence (q (L, N, E), k (S, K, E), v (S, K, Ev)) as a flash case (B = 1) with
    the options (window, softcap, alibi_slopes (N,)) in ``spec.flash_attention``'s names."""
    return FlashCase(q[None], k[None], v[None], causal=causal, window=options.get("window", (-1, -1)),
                     softcap=options.get("softcap", 0.0), alibi_slopes=options.get("alibi_slopes"),
                     scale=scale, dtype=dtype, device=device)


def sequence_lse_bounds(target: Target, q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool,
                        scale: float | None, dtype: str, device: str, options: dict[str, Any],
                        stored: str | None) -> tuple[np.ndarray, np.ndarray]:
    """One sequence's (expected LSE (N, L), allowed error (N, L)): the flash level's rule;
    -inf (allowed 0) in rows attending no key, an empty sequence has no rows."""
    L, N = q.shape[0], q.shape[1]
    if L == 0:
        return np.zeros((N, 0)), np.zeros((N, 0))
    if k.shape[0] == 0:
        return np.full((N, L), -np.inf), np.zeros((N, L))
    flash_case = sequence_flash_case(q, k, v, causal=causal, scale=scale, dtype=dtype, device=device,
                                     options=options)
    ref = flash_oracle(flash_case)
    return ref.lse[0], allowed_lse(target, flash_case, ref, stored=stored)[0]


def check_lse_against_oracle(what: str, lse: np.ndarray, expected: np.ndarray, allowed: np.ndarray) -> float:
    """An LSE (FlashAttention-2's +inf for a row with no key read as -inf) against the oracle's."""
    __tracebackhide__ = True
    lse = np.where(np.isposinf(lse), -np.inf, lse)
    with np.errstate(invalid="ignore"):  # -inf against -inf
        return compare_values(what, lse, expected, allowed).ratio


def float32_tensor(array: np.ndarray, case: Any) -> Any:
    import torch

    return torch.tensor(np.asarray(array, dtype=np.float64), dtype=torch.float32, device=case.device)


def split_lse(result: Any, lse_shape: tuple[int, ...], what: str, shape_text: str) -> tuple[Any, Any]:
    """(output, lse) of a call made with the LSE asked for: a tuple whose second item is the
    LSE tensor of ``lse_shape``."""
    __tracebackhide__ = True
    import torch

    if not isinstance(result, (tuple, list)) or len(result) < 2:
        fail(f"{what}=True returned {type(result).__name__}, but should return (output, softmax_lse, ...) "
             "as FlashAttention does")
    out, lse = result[0], result[1]
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != tuple(lse_shape):
        fail(f"softmax_lse shape={tuple(getattr(lse, 'shape', ()))}, but should be {tuple(lse_shape)} {shape_text}")
    return out, lse
