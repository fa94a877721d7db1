"""Small pieces the property tests share (drawing, rounding, probes, bounds)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

import spec
from conformance.cases import SDPACase
from conformance.compare import fail
from conformance.runner import ImplementationRaised, Target
from conformance.strategies import sdpa_cases

__all__ = [
    "cases_for",
    "case_rng",
    "round_to",
    "identity_probe",
    "attend_matrix",
    "allowed_for",
    "require",
    "expect_raise",
]


def cases_for(target: Target, **kwargs: Any) -> Any:
    """``sdpa_cases`` restricted to what ``target`` declares."""
    return sdpa_cases(dtype=target.dtype, device=target.device, caps=target.caps, **kwargs)


def case_rng(case: SDPACase, salt: str = "") -> np.random.Generator:
    """A generator seeded by the case's contents: replaying a case replays its draws."""
    h = hashlib.blake2b(salt.encode(), digest_size=8)
    for a in (case.query, case.key, case.value):
        h.update(np.ascontiguousarray(a).tobytes())
    return np.random.default_rng(int.from_bytes(h.digest(), "little"))


def round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64 values through ``dtype`` (what storing them there keeps)."""
    return spec.emulate.round_to(values, dtype)


def identity_probe(case: SDPACase) -> SDPACase:
    """The case with V = I (Ev = S): the output is then the attention weights."""
    eye = np.broadcast_to(np.eye(case.S), (case.B, case.K, case.S, case.S)).copy()
    return case.replace(value=eye, layout="contiguous")


def attend_matrix(case: SDPACase) -> np.ndarray:
    """Bool (B, N, L, S): which keys each query may attend (masks and causal combined)."""
    return spec.masks.combined_attend_mask(
        (case.B, case.N, case.L, case.S), case.attend_mask, case.additive_mask, case.causal
    )


def allowed_for(target: Target, case: SDPACase) -> tuple[np.ndarray, spec.SDPAResult]:
    """Elementwise allowed error of ``case``'s output, and the oracle's result."""
    from conformance.calls import allowed_error, oracle

    ref = oracle(case)
    return allowed_error(target, case, ref), ref


def require(condition: bool, reason: str) -> str | None:
    return None if condition else reason


def expect_raise(target: Target, what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
    """The call must raise (invalid input per the spec), not return a result."""
    from conformance.runner import call_guarded

    try:
        out = call_guarded(target, fn, *args, **kwargs)
    except ImplementationRaised:
        return
    shape = tuple(getattr(out, "shape", ()))
    fail(f"{what}: returned a result of shape {shape}, but should raise an error "
         "(the input is invalid per the spec)")
