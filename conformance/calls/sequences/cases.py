"""What a varlen case and a kvcache case have in common: their capability attributes,
their saved fields, and a copy with some fields changed."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import numpy as np

from conformance.calls.cache_options import _DESCALES
from conformance.core.cases import _scale_sign

__all__ = ["fp8_meta", "head_attrs", "option_fields_from_meta", "replace"]


def replace(case: Any, **changes: Any) -> Any:
    """A copy of ``case`` (a frozen dataclass) with ``changes``."""
    values = {f.name: getattr(case, f.name) for f in fields(case)}
    values.update(changes)
    return type(case)(**values)


def head_attrs(case: Any, *, L: int, S: int) -> dict[str, Any]:
    """The attributes both levels start with (``level`` to ``different_v_dim``): ``L`` and
    ``S`` are the longest sequence's, which each level counts its own way."""
    return {"level": case.level, "device": case.device, "dtype": case.dtype,
            "causal": "lower_right" if case.causal else None, "scale": case.scale,
            "scale_sign": _scale_sign(case.scale), "B": case.B, "N": case.N, "K": case.K,
            "L": L, "S": S, "E": case.E, "Ev": case.Ev, "gqa": case.K != case.N,
            "different_v_dim": case.E != case.Ev}


def fp8_meta(case: Any, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> tuple[dict[str, Any],
                                                                                       dict[str, np.ndarray]]:
    """``meta`` and ``arrays`` with the case's FP8 format and descales added (the last
    fields a case saves)."""
    meta["fp8"] = case.fp8
    arrays.update({n: np.asarray(getattr(case, n)) for n in _DESCALES if getattr(case, n) is not None})
    return meta, arrays


def option_fields_from_meta(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """The fields both levels read back alike: scale, dtype, device, FlashAttention's
    options (window, softcap, ALiBi slopes; absent in older files: off) and FP8's."""
    return {"causal": bool(meta["causal"]), "scale": meta["scale"], "dtype": meta["dtype"],
            "device": meta["device"], "window": tuple(meta.get("window", (-1, -1))),
            "softcap": float(meta.get("softcap", 0.0)), "alibi_slopes": arrays.get("alibi_slopes"),
            "fp8": meta.get("fp8"), **{n: arrays.get(n) for n in _DESCALES}}
