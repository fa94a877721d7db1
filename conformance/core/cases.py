"""Problem instances the suite draws: one SDPA call or one MHA module call.

A case holds float64 NumPy arrays whose values are exactly representable in the
case's ``dtype`` (drawn in float64, then rounded through the dtype), so the
oracle sees the very values the implementation stores. Memory layout and device
are applied only when the case is turned into tensors (``conformance.core.tensors``).

Dimension letters: B batch, N query heads, K kv heads, L query length, S key
length, E q/k head dim, Ev value head dim, D model dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

__all__ = [
    "SDPACase",
    "MHACase",
    "SDPA_ATTRIBUTES",
    "MHA_ATTRIBUTES",
    "LAYOUTS",
    "NOTE_MASK_EXPANDED",
    "NOTE_STRIDE0_BATCH",
    "NOTE_STRIDE0_HEADS",
]

#: Memory layouts a case's tensors may be handed over in:
#: contiguous; transposed (stored (B, L, N, E) and viewed as (B, N, L, E));
#: stride0 (K/V heads or batch expanded from size 1 with stride 0, where shapes allow);
#: poisoned (a slice of a larger buffer whose outside is filled with NaN).
LAYOUTS = ("contiguous", "transposed", "stride0", "poisoned")

# Layout instructions a case may carry in ``notes``, written by
# ``conformance.strategies`` and read by ``conformance.core.tensors``.
#: Hand the mask over expanded to (B, N, L, S) with stride 0 along its broadcast dims.
NOTE_MASK_EXPANDED = "mask:expanded"
#: Layout "stride0": key/value expanded with stride 0 along the batch dim.
NOTE_STRIDE0_BATCH = "stride0:batch"
#: Layout "stride0": key/value expanded with stride 0 along the kv-head dim.
NOTE_STRIDE0_HEADS = "stride0:heads"


#: Attributes of an SDPA-level case as called, the keys an expected failure's
#: ``match`` may use at this level: ``SDPACase.attrs()`` and what the call adds
#: (``replay.SDPACallSpec.attrs``: the ``is_causal`` flag passed, ``dropout_p``,
#: ``grad``: whether gradients were taken).
SDPA_ATTRIBUTES = frozenset({
    "level", "device", "dtype", "mask_kind", "causal", "scale", "scale_sign", "layout", "regime",
    "B", "N", "K", "L", "S", "E", "Ev", "gqa", "different_v_dim", "fully_masked_rows",
    "is_causal", "dropout_p", "grad", "sinks",
})
#: Attributes of an MHA-level call: ``MHACase.attrs()`` and what the call adds
#: (``replay.MHACallSpec.attrs``: ``grad`` (autograd on, else torch.no_grad()),
#: ``dropout_p`` (the module's dropout), ``training``).
MHA_ATTRIBUTES = frozenset({
    "level", "device", "dtype", "B", "N", "K", "L", "S", "D", "E", "Ev", "need_weights",
    "average_attn_weights", "key_padding_mask", "attn_mask", "is_causal", "batch_first", "unbatched",
    "add_bias_kv", "add_zero_attn", "kdim_vdim", "bias", "mha_features", "self_attention", "mask_kind",
    "fully_masked_rows", "grad", "dropout_p", "training",
})


def _scale_sign(scale: float | None) -> str:
    if scale is None:
        return "default"
    return "positive" if scale > 0 else "zero" if scale == 0 else "negative"


def _mask_kind(attend_mask: Any, additive_mask: Any) -> str:
    if additive_mask is not None:
        return "additive"
    if attend_mask is not None:
        return "bool"
    return "none"


@dataclass(frozen=True, eq=False, repr=False)
class SDPACase:
    """One scaled-dot-product-attention call.

    query (B, N, L, E), key (B, K, S, E), value (B, K, S, Ev); at most one of
    ``attend_mask`` (bool, **True = may attend**) and ``additive_mask`` (float,
    added to scaled scores), broadcastable to (B, N, L, S). ``causal`` is the
    alignment the case asks for (None, "upper_left", "lower_right"); the runner
    passes ``is_causal=True`` only to implementations whose flag means that
    alignment. ``scale=None`` means the default 1/sqrt(E). ``sinks`` (N,): learned sink
    logits (float32-exact), handed over as ``sinks=`` to an SDPA callable that declares
    them (``Capabilities.sdpa_sinks``); None: no sinks, nothing passed.
    """

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    attend_mask: np.ndarray | None = None
    additive_mask: np.ndarray | None = None
    causal: str | None = None
    scale: float | None = None
    sinks: np.ndarray | None = None
    dtype: str = "float64"
    device: str = "cpu"
    layout: str = "contiguous"
    regime: str = "normal"
    #: Descriptive labels (e.g. "mask_pattern=padding") and the layout
    #: instructions NOTE_MASK_EXPANDED, NOTE_STRIDE0_BATCH, NOTE_STRIDE0_HEADS.
    notes: tuple[str, ...] = ()

    # -- sizes -------------------------------------------------------------
    @property
    def B(self) -> int:
        return int(self.query.shape[0])

    @property
    def N(self) -> int:
        return int(self.query.shape[1])

    @property
    def K(self) -> int:
        return int(self.key.shape[1])

    @property
    def L(self) -> int:
        return int(self.query.shape[2])

    @property
    def S(self) -> int:
        return int(self.key.shape[2])

    @property
    def E(self) -> int:
        return int(self.query.shape[3])

    @property
    def Ev(self) -> int:
        return int(self.value.shape[3])

    @property
    def mask_kind(self) -> str:
        return _mask_kind(self.attend_mask, self.additive_mask)

    def sizes(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in ("B", "N", "K", "L", "S", "E", "Ev")}

    def fully_masked_rows(self) -> np.ndarray:
        """Bool (B, N, L): query rows where every key is blocked."""
        from spec import masks

        return masks.fully_masked_rows(
            (self.B, self.N, self.L, self.S),
            self.attend_mask,
            self.additive_mask,
            self.causal,
        )

    def attrs(self, **extra: Any) -> dict[str, Any]:
        """Case attributes for capability checks and expected-failure filters."""
        out: dict[str, Any] = {
            "level": "sdpa",
            "device": self.device,
            "dtype": self.dtype,
            "mask_kind": self.mask_kind,
            "causal": self.causal,
            "scale": self.scale,
            "scale_sign": _scale_sign(self.scale),
            "layout": self.layout,
            "regime": self.regime,
            **self.sizes(),
        }
        out["gqa"] = self.K != self.N
        out["different_v_dim"] = self.E != self.Ev
        out["sinks"] = self.sinks is not None
        try:
            out["fully_masked_rows"] = bool(self.fully_masked_rows().any())
        except ValueError:  # an invalid case (a mask of the wrong shape) has no rows to judge
            out["fully_masked_rows"] = False
        out.update(extra)
        return out

    def replace(self, **changes: Any) -> "SDPACase":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return SDPACase(**values)

    def __repr__(self) -> str:
        return f"SDPACase({self.describe()})"

    def describe(self) -> str:
        """One line naming the case (sizes, dtype, device, mask, causal, scale, layout)."""
        sizes = " ".join(f"{k}={v}" for k, v in self.sizes().items())
        mask = self.mask_kind
        for m in (self.attend_mask, self.additive_mask):
            if m is not None:
                mask += f"{tuple(m.shape)}"
        sinks = "" if self.sinks is None else f" sinks={[float(x) for x in self.sinks]}"
        return (
            f"{sizes} dtype={self.dtype} device={self.device} mask={mask} "
            f"causal={self.causal} scale={self.scale}{sinks} layout={self.layout} "
            f"regime={self.regime}"
        )


@dataclass(frozen=True, eq=False, repr=False)
class MHACase:
    """One ``nn.MultiheadAttention``-style module call, in that module's conventions.

    ``params`` is a ``spec.mha.MHAParams`` (float64, values representable in
    ``dtype``). query (L, B, D) or (B, L, D) when ``batch_first``, (L, D) when
    ``unbatched``; key (S, B, kdim), value (S, B, vdim) likewise.
    ``key_padding_mask`` (B, S) and ``attn_mask`` (L, S) or (B*N, L, S) are in
    MHA's convention: bool **True = blocked**, float **added**.
    """

    params: Any
    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    key_padding_mask: np.ndarray | None = None
    attn_mask: np.ndarray | None = None
    is_causal: bool = False
    need_weights: bool = True
    average_attn_weights: bool = True
    batch_first: bool = False
    unbatched: bool = False
    dtype: str = "float64"
    device: str = "cpu"
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def D(self) -> int:
        return int(self.params.embed_dim)

    @property
    def N(self) -> int:
        return int(self.params.num_heads)

    def _len_batch(self, x: np.ndarray) -> tuple[int, int]:
        if self.unbatched:
            return int(x.shape[0]), 1
        if self.batch_first:
            return int(x.shape[1]), int(x.shape[0])
        return int(x.shape[0]), int(x.shape[1])

    @property
    def L(self) -> int:
        return self._len_batch(self.query)[0]

    @property
    def S(self) -> int:
        return self._len_batch(self.key)[0]

    @property
    def B(self) -> int:
        return self._len_batch(self.query)[1]

    @property
    def self_attention(self) -> bool:
        """Whether key and value are the query itself (one input, as self-attention)."""
        return self.key is self.query and self.value is self.query

    def mha_features(self) -> set[str]:
        p = self.params
        used = set()
        if p.in_proj_bias is None:
            used.add("no_bias")
        if p.kdim != p.embed_dim or p.vdim != p.embed_dim:
            used.add("kdim_vdim")
        if p.bias_k is not None:
            used.add("bias_kv")
        if p.add_zero_attn:
            used.add("zero_attn")
        if self.batch_first:
            used.add("batch_first")
        if self.unbatched:
            used.add("unbatched")
        if self.key_padding_mask is not None:
            used.add("key_padding_mask")
        if self.attn_mask is not None:
            used.add("attn_mask")
            if self.attn_mask.ndim == 3:
                used.add("per_head_attn_mask")
        if self.is_causal:
            used.add("is_causal")
        if not self.self_attention and self.value is self.key:
            used.add("kv_cross_attention")
        if self.need_weights:
            used.add("need_weights")
        if not self.average_attn_weights:
            used.add("per_head_weights")
        return used

    def blocked_rows(self) -> np.ndarray:
        """Bool (B, N, L): query rows of a head whose keys are all blocked.

        bias_k/bias_v and add_zero_attn append keys no mask blocks, so with
        either of them no row is ever fully masked.
        """
        B, N, L, S = self.B, self.N, self.L, self.S
        if self.params.bias_k is not None or self.params.add_zero_attn:
            return np.zeros((B, N, L), dtype=bool)
        blocked = np.zeros((B, N, L, S), dtype=bool)
        for m, is_kpm in ((self.key_padding_mask, True), (self.attn_mask, False)):
            if m is None:
                continue
            b = m if m.dtype == np.bool_ else np.isneginf(m)
            if is_kpm:
                blocked |= b.reshape(B, 1, 1, S)
            elif b.ndim == 3:
                blocked |= b.reshape(B, N, L, S)
            else:
                blocked |= b.reshape(1, 1, L, S)
        return blocked.all(axis=-1)

    def fully_masked_rows(self) -> bool:
        """True when some query row of some head has every key blocked."""
        return bool(self.blocked_rows().any())

    def attrs(self, **extra: Any) -> dict[str, Any]:
        def kind(m: np.ndarray | None) -> str | None:
            if m is None:
                return None
            return "bool" if m.dtype == np.bool_ else "float"

        p = self.params
        out: dict[str, Any] = {
            "level": "mha",
            "device": self.device,
            "dtype": self.dtype,
            "B": self.B,
            "N": self.N,
            "K": self.N,
            "L": self.L,
            "S": self.S,
            "D": self.D,
            "E": self.D // self.N,
            "Ev": self.D // self.N,
            "need_weights": self.need_weights,
            "average_attn_weights": self.average_attn_weights,
            "key_padding_mask": kind(self.key_padding_mask),
            "attn_mask": kind(self.attn_mask),
            "is_causal": self.is_causal,
            "batch_first": self.batch_first,
            "unbatched": self.unbatched,
            "add_bias_kv": p.bias_k is not None,
            "add_zero_attn": bool(p.add_zero_attn),
            "kdim_vdim": p.kdim != p.embed_dim or p.vdim != p.embed_dim,
            "bias": p.in_proj_bias is not None,
            "mha_features": self.mha_features(),
            "self_attention": self.self_attention,
            "mask_kind": "none",
        }
        out["fully_masked_rows"] = self.fully_masked_rows()
        out.update(extra)
        return out

    def replace(self, **changes: Any) -> "MHACase":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return MHACase(**values)

    def __repr__(self) -> str:
        return f"MHACase({self.describe()})"

    def describe(self) -> str:
        p = self.params
        return (
            f"B={self.B} L={self.L} S={self.S} D={self.D} N={self.N} kdim={p.kdim} "
            f"vdim={p.vdim} bias={p.in_proj_bias is not None} "
            f"bias_kv={p.bias_k is not None} zero_attn={p.add_zero_attn} "
            f"batch_first={self.batch_first} unbatched={self.unbatched} "
            f"key_padding_mask={None if self.key_padding_mask is None else self.key_padding_mask.dtype} "
            f"attn_mask={None if self.attn_mask is None else (self.attn_mask.dtype, self.attn_mask.shape)} "
            f"is_causal={self.is_causal} need_weights={self.need_weights} "
            f"average_attn_weights={self.average_attn_weights} dtype={self.dtype} device={self.device} "
            f"inputs={'self-attention' if self.self_attention else 'key=value' if self.value is self.key else 'q,k,v'}"
        )
