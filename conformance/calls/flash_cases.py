"""The flash level's case model: one ``flash_attn_func`` call as data.

A :class:`FlashCase` is one call of FlashAttention's ``flash_attn_func`` in its layout:
query (B, L, N, E), key (B, S, K, E), value (B, S, K, Ev), with ``causal`` (lower-right),
``window`` (left, right), ``softcap`` and ``alibi_slopes`` (N,) or (B, N), float64
arrays and the attributes expected failures match on. Calling it is in
:mod:`conformance.calls.flash` (which re-exports these names), its oracle and its bounds
in :mod:`conformance.calls.flash_bounds`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

import spec
from conformance.core.cases import SDPACase, _scale_sign

__all__ = ["FLASH_ATTRIBUTES", "FlashCase", "case_from_meta", "case_meta", "tile_flash_case"]


#: Attributes of a flash-level call (``FlashCase.attrs()`` and what the call adds:
#: ``grad``, ``lse``): the keys an expected failure's ``match`` may use at this level.
FLASH_ATTRIBUTES = frozenset({
    "level", "device", "dtype", "causal", "scale", "scale_sign", "regime", "B", "N", "K", "L",
    "S", "E", "Ev", "gqa", "different_v_dim", "fully_masked_rows", "window", "window_left",
    "window_right", "softcap", "alibi", "sinks", "flash_features", "grad", "lse", "fp8", "descale",
    "descale_forms", "dropout_p",
})


@dataclass(frozen=True, eq=False, repr=False)
class FlashCase:
    """One ``flash_attn_func`` call (values exactly representable in ``dtype``).

    ``causal``: FlashAttention's flag (lower-right, i.e. ``right = 0``); ``window``
    (left, right), -1 = unbounded; ``softcap`` 0 = off; ``alibi_slopes`` float64 (N,) or
    (B, N), handed over as float32 (FlashAttention's), so stored float32-exact; ``sinks``
    float64 (N,) learned sink logits (None = no sink), handed over as float32 likewise.

    ``fp8``: q, k, v are handed over in that 8-bit float format (their values exact in it),
    with ``q_descale``, ``k_descale``, ``v_descale`` float64 (1,) or (B, K) (None: not
    passed), handed over as float32 (exact in it): FlashAttention-3's FP8 inputs
    (``spec.fp8``). ``dtype`` is then the target's dtype, not the inputs'.
    """

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: np.ndarray | None = None
    scale: float | None = None
    sinks: np.ndarray | None = None
    fp8: str | None = None
    q_descale: np.ndarray | None = None
    k_descale: np.ndarray | None = None
    v_descale: np.ndarray | None = None
    dtype: str = "float64"
    device: str = "cpu"
    regime: str = "normal"
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        object.__setattr__(self, "window", (int(self.window[0]), int(self.window[1])))

    @property
    def level(self) -> str:
        return "flash"

    @property
    def B(self) -> int:
        return int(self.query.shape[0])

    @property
    def L(self) -> int:
        return int(self.query.shape[1])

    @property
    def N(self) -> int:
        return int(self.query.shape[2])

    @property
    def E(self) -> int:
        return int(self.query.shape[3])

    @property
    def S(self) -> int:
        return int(self.key.shape[1])

    @property
    def K(self) -> int:
        return int(self.key.shape[2])

    @property
    def Ev(self) -> int:
        return int(self.value.shape[3])

    def sizes(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in ("B", "N", "K", "L", "S", "E", "Ev")}

    def options(self) -> dict[str, Any]:
        """The ``spec.flash_attention`` keyword arguments of this case."""
        options = {"causal": self.causal, "window": self.window, "softcap": self.softcap,
                   "alibi_slopes": self.alibi_slopes, "scale": self.scale}
        if self.sinks is not None:
            options["sinks"] = self.sinks
        for name in ("q_descale", "k_descale", "v_descale"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        return options

    def descale_forms(self) -> frozenset[str]:
        """How q's, k's and v's descales are each given: ``none``, ``per_tensor`` (1,),
        ``per_head`` (B, K) (``Capabilities.fp8_descales``); empty without FP8 inputs."""
        if self.fp8 is None:
            return frozenset()
        return frozenset("none" if d is None else "per_tensor" if d.shape == (1,) else "per_head"
                         for d in (self.q_descale, self.k_descale, self.v_descale))

    def descale_form(self) -> str | None:
        """How the FP8 case's descales are given: ``per_head`` when one is (B, K), else
        ``per_tensor`` when one is given, else ``none``; None without FP8 inputs."""
        if self.fp8 is None:
            return None
        given = [d for d in (self.q_descale, self.k_descale, self.v_descale) if d is not None]
        if any(d.shape != (1,) for d in given):
            return "per_head"
        return "per_tensor" if given else "none"

    def features(self) -> set[str]:
        """The ``Capabilities.flash_features`` this case uses (lse is the call's)."""
        used = set()
        if self.window != (-1, -1):
            used.add("window")
        if self.softcap:
            used.add("softcap")
        if self.alibi_slopes is not None:
            used.add("alibi")
        if self.sinks is not None:
            used.add("sinks")
        return used

    def empty_rows(self) -> np.ndarray:
        """Bool (L,): query rows that attend no key (window, causal, S = 0)."""
        return ~spec.window_mask(self.L, self.S, self.window, causal=self.causal).any(axis=-1)

    def attrs(self, **extra: Any) -> dict[str, Any]:
        out: dict[str, Any] = {
            "level": "flash", "device": self.device, "dtype": self.dtype,
            "causal": "lower_right" if self.causal else None,
            "scale": self.scale, "scale_sign": _scale_sign(self.scale), "regime": self.regime,
            **self.sizes(),
            "gqa": self.K != self.N, "different_v_dim": self.E != self.Ev,
            "fully_masked_rows": bool(self.empty_rows().any()),
            "window": self.window != (-1, -1), "window_left": self.window[0], "window_right": self.window[1],
            "softcap": self.softcap, "alibi": self.alibi_slopes is not None,
            "sinks": self.sinks is not None, "flash_features": self.features(),
            "fp8": self.fp8, "descale": self.descale_form(), "descale_forms": self.descale_forms(),
            "dropout_p": 0.0,  # a call's (FlashCallSpec.attrs) when it drops out
        }
        out.update(extra)
        return out

    def replace(self, **changes: Any) -> FlashCase:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return FlashCase(**values)

    def __repr__(self) -> str:
        return f"FlashCase({self.describe()})"

    def describe(self) -> str:
        sizes = " ".join(f"{k}={v}" for k, v in self.sizes().items())
        slopes = None if self.alibi_slopes is None else f"{tuple(self.alibi_slopes.shape)}"
        sinks = "" if self.sinks is None else f" sinks={[float(x) for x in self.sinks]}"
        fp8 = ""
        if self.fp8 is not None:
            shapes = {n: None if getattr(self, n) is None else tuple(getattr(self, n).shape)
                      for n in ("q_descale", "k_descale", "v_descale")}
            fp8 = f" q/k/v={self.fp8} descales={shapes}"
        return (f"{sizes} dtype={self.dtype} device={self.device} causal={self.causal} "
                f"window={self.window} softcap={self.softcap!r} alibi_slopes={slopes}{sinks}{fp8} "
                f"scale={self.scale!r} regime={self.regime}")

    def heads_first(self) -> SDPACase:
        """The same problem as an SDPA case, heads first, window/causal as an attend mask and
        ALiBi as an additive mask (not valid with soft-capping, sinks or FP8 inputs)."""
        attend = spec.window_mask(self.L, self.S, self.window, causal=self.causal)
        bias = None if self.alibi_slopes is None else spec.alibi_bias(self.L, self.S, self.alibi_slopes)
        t = (0, 2, 1, 3)
        additive = None
        if bias is not None:
            additive = np.where(attend, bias, -np.inf)
        return SDPACase(self.query.transpose(t), self.key.transpose(t), self.value.transpose(t),
                        attend_mask=None if additive is not None else attend, additive_mask=additive,
                        scale=self.scale, dtype=self.dtype, device=self.device)


def tile_flash_case(case: FlashCase, samples: int) -> FlashCase:
    """``samples`` copies of ``case`` along the batch (B -> samples·B): q, k, v, and the
    per-batch ALiBi slopes (B, N) and descales (B, K)."""
    if samples == 1:
        return case

    def tile(a: np.ndarray | None, per_batch: bool = True) -> np.ndarray | None:
        if a is None or not per_batch:
            return a
        return np.tile(a, (samples,) + (1,) * (a.ndim - 1))

    slopes = case.alibi_slopes
    descales = {n: tile(getattr(case, n), getattr(case, n) is not None and getattr(case, n).ndim == 2)
                for n in ("q_descale", "k_descale", "v_descale")}
    return case.replace(query=tile(case.query), key=tile(case.key), value=tile(case.value),
                        alibi_slopes=tile(slopes, slopes is not None and slopes.ndim == 2), **descales)


# --------------------------------------------------------------------------- saving


_ARRAYS = ("query", "key", "value", "alibi_slopes", "sinks", "q_descale", "k_descale", "v_descale")


def case_meta(case: FlashCase) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(meta, arrays)`` of a flash case for ``conformance.reporting.failures`` (kind ``"flash"``)."""
    arrays = {n: np.asarray(getattr(case, n)) for n in _ARRAYS if getattr(case, n) is not None}
    meta = {"kind": "flash", "causal": case.causal, "window": list(case.window), "softcap": case.softcap,
            "scale": case.scale, "dtype": case.dtype, "device": case.device, "regime": case.regime,
            "notes": list(case.notes)}
    if case.fp8 is not None:
        meta["fp8"] = case.fp8
    return meta, arrays


def case_from_meta(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> FlashCase:
    return FlashCase(**{n: arrays.get(n) for n in _ARRAYS}, causal=bool(meta["causal"]),
                     window=tuple(meta["window"]), softcap=float(meta["softcap"]), scale=meta["scale"],
                     fp8=meta.get("fp8"), dtype=meta["dtype"], device=meta["device"], regime=meta["regime"],
                     notes=tuple(meta["notes"]))
