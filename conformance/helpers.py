"""Small pieces the property tests share: drawing within a target's claims,
probes, skip reasons. (An input that must raise: ``calls.expect_sdpa_raises``.)"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

import spec
from conformance.cases import SDPACase
from conformance.runner import Target
from conformance.strategies import mha_cases, sdpa_cases

__all__ = [
    "cases_for",
    "mha_cases_for",
    "case_rng",
    "identity_probe",
    "attend_matrix",
    "skip_unless",
]


def cases_for(target: Target, **kwargs: Any) -> Any:
    """``sdpa_cases`` restricted to what ``target`` declares."""
    return sdpa_cases(dtype=target.dtype, device=target.device, caps=target.caps, **kwargs)


def mha_cases_for(target: Target, **kwargs: Any) -> Any:
    """``mha_cases`` restricted to what ``target`` declares (self-attention only
    without the ``cross_attention`` feature)."""
    if "cross_attention" not in target.caps.mha_features:
        kwargs["self_attention"] = True
        features = set(kwargs.get("features", target.caps.mha_features))
        kwargs["features"] = features - {"kdim_vdim"}
    return mha_cases(dtype=target.dtype, device=target.device, caps=target.caps, **kwargs)


def case_rng(case: SDPACase, salt: str = "") -> np.random.Generator:
    """A generator seeded by the case's contents: replaying a case replays its draws."""
    h = hashlib.blake2b(salt.encode(), digest_size=8)
    for a in (case.query, case.key, case.value):
        h.update(np.ascontiguousarray(a).tobytes())
    return np.random.default_rng(int.from_bytes(h.digest(), "little"))


def identity_probe(case: SDPACase) -> SDPACase:
    """The case with V = I (Ev = S): the output is then the attention weights."""
    eye = np.broadcast_to(np.eye(case.S), (case.B, case.K, case.S, case.S)).copy()
    return case.replace(value=eye, layout="contiguous")


def attend_matrix(case: SDPACase) -> np.ndarray:
    """Bool (B, N, L, S): which keys each query may attend (masks and causal combined)."""
    return spec.masks.combined_attend_mask(
        (case.B, case.N, case.L, case.S), case.attend_mask, case.additive_mask, case.causal
    )


def skip_unless(condition: bool, reason: str) -> str | None:
    """For ``conformance_property(requires=...)``: None (run) when ``condition``
    holds, else ``reason`` (the skip reason)."""
    return None if condition else reason
