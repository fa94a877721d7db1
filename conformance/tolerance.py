"""The tolerance rule, in one table.

Per example, not per suite (docs/DESIGN.md#tolerance): an implementation's error
against the float64 oracle may be at most

    allowed = k × (error of a naive same-precision computation of this case)
              + floor × eps(dtype) × magnitude

elementwise, where the naive error is measured with ``spec.emulate_sdpa`` on the
very same stored inputs (its largest absolute error over the case), and
``magnitude`` is the size of what the output element sums: ``weights @ |V|``
from the oracle (an attention output is a convex combination of value rows, so
its rounding error scales with the attended values, not with the output, which
may cancel to ~0). NaN or inf where the oracle is finite always fails.

The measured ratio ``error / allowed`` (its maximum over the case) is the
headroom shown on the certificate: 0.1 means ten times inside the bound.

Gradients have no emulation in ``spec``: their bound is the rounding floor at the
gradient's magnitude (computed by running the VJP on absolute values), times
``1 + max|scaled logit|`` because a logit error of δ moves the weights by δ.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["TOLERANCES", "Tolerance", "EPS", "tolerance_for"]

#: Unit roundoff (half the machine epsilon) of each dtype, and of TF32.
EPS = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "tf32": 2.0**-11,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
}


@dataclass(frozen=True)
class Tolerance:
    """k: multiple of the naive same-precision error; floor: ulps at the magnitude;
    grad_floor: ulps at the gradient magnitude (times 1 + max|logit|);
    mha_floor: ulps at the module output's magnitude (no emulation at module level)."""

    k: float
    floor: float
    grad_floor: float
    mha_floor: float


#: The one table of tolerances. Measured headroom of the built-in correct
#: implementations under the ``thorough`` profile is reported by
#: ``benchmarks/runner_speed.py``; keep every entry at least 4× above it.
TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(k=8.0, floor=256.0, grad_floor=256.0, mha_floor=256.0),
    "float32": Tolerance(k=8.0, floor=256.0, grad_floor=256.0, mha_floor=256.0),
    "tf32": Tolerance(k=8.0, floor=64.0, grad_floor=64.0, mha_floor=64.0),
    "float16": Tolerance(k=8.0, floor=16.0, grad_floor=256.0, mha_floor=256.0),
    "bfloat16": Tolerance(k=8.0, floor=16.0, grad_floor=256.0, mha_floor=256.0),
}


def tolerance_for(dtype: str, *, tf32: bool = False) -> tuple[Tolerance, float]:
    """The table row and unit roundoff for ``dtype`` (TF32 when declared on float32)."""
    key = "tf32" if (tf32 and dtype == "float32") else dtype
    return TOLERANCES[key], EPS[key]


def sdpa_allowed(
    dtype: str,
    naive_error: float,
    magnitude: np.ndarray,
    *,
    tf32: bool = False,
    logit_scale: np.ndarray | float = 0.0,
) -> np.ndarray:
    """Elementwise allowed absolute error of an SDPA output (see module docstring).

    ``logit_scale`` (per row): the largest |scaled logit| a row attends. exp(s)
    carries a relative error of about eps·|s| in any implementation, so the
    floor grows with it (it matters in float64, where the naive error is 0).
    """
    tol, eps = tolerance_for(dtype, tf32=tf32)
    magnitude = magnitude * (1.0 + logit_scale)
    # The smallest positive normal of the dtype keeps subnormal-only rows from
    # demanding exactness below what the dtype can represent.
    tiny = {"float64": 2.2e-308, "float32": 1.2e-38, "float16": 6.1e-5, "bfloat16": 1.2e-38}[dtype]
    return tol.k * naive_error + tol.floor * eps * np.maximum(magnitude, tiny)


#: Smallest positive subnormal of each dtype: gradients below a few of these
#: are lost to underflow in any same-precision backward.
SUBNORMAL = {"float64": 5e-324, "float32": 1.4e-45, "float16": 6.0e-8, "bfloat16": 9.2e-41}


def grad_allowed(dtype: str, magnitude: np.ndarray, logit_range: float, *, tf32: bool = False) -> np.ndarray:
    tol, eps = tolerance_for(dtype, tf32=tf32)
    return tol.grad_floor * eps * (1.0 + logit_range) * magnitude + 16 * SUBNORMAL[dtype]


def mha_allowed(dtype: str, magnitude: np.ndarray, logit_range: float, *, tf32: bool = False) -> np.ndarray:
    tol, eps = tolerance_for(dtype, tf32=tf32)
    return tol.mha_floor * eps * (1.0 + logit_range) * magnitude
