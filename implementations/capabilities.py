"""What an implementation claims to support, as data: :class:`Capabilities`.

Each declaration is checked when the capabilities are made (a word outside
``implementations.vocabulary``'s sets, a bound that leaves nothing, a per-dtype value of a
field that cannot differ per dtype: :class:`~implementations.vocabulary.ImplementationError`
naming the argument and the fix) and normalized to plain, hashable data (sets as
frozensets, per-dtype values and sources as sorted tuples).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from implementations.vocabulary import (
    _SET_FIELDS,
    ALL_DTYPES,
    ALL_FLASH_FEATURES,
    ALL_KVCACHE_FEATURES,
    ALL_MASK_KINDS,
    ALL_MHA_FEATURES,
    ALL_SHARDED_FEATURES,
    ALL_VARLEN_FEATURES,
    CAUSAL_ALIGNMENTS,
    DEFAULT_FLASH_FEATURES,
    FP8_DESCALE_FORMS,
    FP8_DTYPES,
    FULLY_MASKED_KINDS,
    FULLY_MASKED_POLICIES,
    PER_DTYPE_FIELDS,
    SEMANTIC_FIELDS,
    SHARDED_LAYOUTS,
    SOURCES,
    ImplementationError,
    check_mha_feature_names,
)

__all__ = ["Capabilities", "backward_allowed", "backward_lengths", "draw_length_cap", "length_allowed"]


@dataclass(frozen=True)
class Capabilities:
    """What an implementation claims to support, as data (xformers style).

    A case outside these claims is skipped with the reason from
    :meth:`Implementation.not_supported_reasons`; a case inside them must pass.
    """

    devices: tuple[str, ...] = ("cpu",)
    dtypes: tuple[str, ...] = ("float64", "float32")
    mask_kinds: frozenset[str] = ALL_MASK_KINDS
    #: Alignment that ``is_causal=True`` means; ``None``: no causal flag support.
    causal: str | None = "upper_left"
    #: Output for query rows where every key is blocked: zero / nan / uniform / unspecified;
    #: or a policy per kind of blocking (:data:`FULLY_MASKED_KINDS`), given as a mapping
    #: such as ``{"bool": "uniform", "additive": "nan"}`` (kinds left out: ``"zero"``) and
    #: kept as ``(kind, policy)`` pairs, or as one string when every kind agrees
    #: (``fully_masked_rows``, ``mha_fully_masked_rows``; read it with
    #: :meth:`fully_masked_policy`).
    fully_masked: str | tuple[tuple[str, str], ...] = "zero"
    different_v_dim: bool = True     # Ev != E
    gqa: bool = True                 # K < N with enable_gqa=True
    dropout: bool = False            # dropout_p > 0 honoured
    custom_scale: bool = True        # scale= honoured
    autograd: bool = True            # backward through q, k, v (and additive mask)
    mask_grad: bool = True           # gradient w.r.t. an additive mask
    non_contiguous: bool = True      # arbitrary strides accepted without error
    max_head_dim: int | None = None  # E and Ev at most this
    max_seq_len: int | None = None   # L and S at most this
    min_head_dim: int | None = None  # E and Ev at least this (e.g. tensor-core tiles)
    #: E and Ev each one of these (kernels compiled for a few head dims: 64, 96, 128).
    head_dims: tuple[int, ...] | None = None
    #: L and S multiples of this (kernels whose tiles are not masked at the edges).
    seq_multiple: int | None = None
    #: L and S each at most this or a multiple of it (a kernel that takes any length inside
    #: one block and whole blocks beyond it: "up to 128, or a multiple of 128", JAX's Pallas
    #: flash attention): random draws stay inside one block, the sweeps visit the multiples.
    seq_block: int | None = None
    #: The backward alone takes L and S multiples of this (a kernel whose forward takes any
    #: length and whose backward tiles need whole blocks): gradients are taken only where
    #: it holds (autograd off for the other cases, not for all); the gradient properties
    #: (gradient_agreement, flash_gradients) draw such lengths. SDPA and flash levels.
    backward_seq_multiple: int | None = None
    #: Every call is causal (a kernel without a non-causal path): the suite draws causal
    #: cases only (at the SDPA level: the flag, without a mask).
    causal_only: bool = False
    #: An explicit scale must be > 0 (the default 1/sqrt(E) always is).
    positive_scale: bool = False
    tf32: bool = False               # float32 matmuls may run as TF32 on CUDA
    #: Each new input shape costs a compilation (JAX, torch.compile): the runner then
    #: draws from a small budget of shapes (``sdpa_cases(shape_budget=...)``).
    jit: bool = False
    #: Only self-attention lengths, L == S (sliding-window and many fused self-attention
    #: kernels): the strategies draw L == S only, and L != S is outside the claims.
    self_attention_lengths: bool = False
    #: Key is value: one memory tensor (``forward(x, memory)``). The suite hands the same
    #: tensor over as ``key`` and ``value`` (so Ev == E); the gradient w.r.t. it is
    #: dkey + dvalue; properties that change the values apart from the keys skip.
    shared_kv: bool = False
    #: Leading batch dims the SDPA callable accepts: None, any number (torch's
    #: convention); 1, exactly (B, N, L, E) 4-D inputs and 4-D masks: the suite reshapes
    #: other ranks (masks (L, S), (N, L, S), ...) to 4-D and the output back.
    batch_dims: int | None = None
    mha_features: frozenset[str] = ALL_MHA_FEATURES
    # -- kv-cache level features (``conformance/test_varlen.py`` consumes them) --
    kv_paged: bool = True            # block_table= (paged cache) honoured: paged_equivalence
    kv_append: bool = True           # new k=/v= written at cache_seqlens: kvcache_equivalence
    #: Varlen level: the ``flash_attn_varlen_func`` options honoured (``ALL_VARLEN_FEATURES``).
    varlen_features: frozenset[str] = frozenset()
    #: KV-cache level: the ``flash_attn_with_kvcache`` options honoured (``ALL_KVCACHE_FEATURES``).
    kvcache_features: frozenset[str] = frozenset()
    #: KV-cache level, with ``rotary``: the rotary dim R (2·rotary_cos.shape[1]) a multiple of
    #: this (FlashAttention-2: 16); None: any even R <= E.
    rotary_dim_multiple: int | None = None
    #: Flash level: the ``flash_attn_func`` features honoured (``ALL_FLASH_FEATURES``;
    #: by default ``DEFAULT_FLASH_FEATURES``, flash_attn_func's own).
    flash_features: frozenset[str] = DEFAULT_FLASH_FEATURES
    #: SDPA level: the callable takes learned sinks (N,) as ``sinks=`` (one logit per query
    #: head joining the softmax denominator, ``spec.sdpa(sinks=)``; recognised from a
    #: parameter named ``sinks``, ``s_aux`` or ``learnable_sink`` and probed).
    sdpa_sinks: bool = False
    #: Flash level: the 8-bit float formats (:data:`FP8_DTYPES`) q, k, v may be given in,
    #: with ``q_descale``/``k_descale``/``v_descale`` (FlashAttention-3); () = no FP8 inputs.
    fp8_dtypes: tuple[str, ...] = ()
    #: How the descales of those calls may be given (:data:`FP8_DESCALE_FORMS`); a form that
    #: raises in the probe is left out (FlashAttention-3 takes (B, K) or none, not (1,)).
    fp8_descales: tuple[str, ...] = FP8_DESCALE_FORMS
    # -- sharded (context-parallel) level (``conformance/test_sharded.py`` consumes them) --
    #: The sequence layouts (``spec.sharding.LAYOUTS``) the sharded callable honours.
    sharded_layouts: frozenset[str] = frozenset({"contiguous", "zigzag"})
    #: The sharded callable returns ``(output, lse)`` (lse (B, N, L_shard), natural log).
    sharded_lse: bool = False
    #: The sharded callable re-shards over heads (all-to-all): N and K must be multiples
    #: of the world size (cases that are not are outside the claims).
    sharded_heads_divisible: bool = False
    #: The largest world size (number of ranks) the sharded callable supports.
    max_world_size: int = 4
    #: The sharded level's optional features honoured (``ALL_SHARDED_FEATURES``).
    sharded_features: frozenset[str] = frozenset()
    #: How probing decided a value when the answer was not a plain yes or no, e.g.
    #: ``"causal: is_causal=True has no effect ..."`` (shown on the certificate).
    probe_notes: tuple[str, ...] = ()
    #: Where each semantic value (:data:`SEMANTIC_FIELDS`) came from, as ``(field, source)``
    #: pairs (a mapping is accepted), source one of :data:`SOURCES`; a field not listed is
    #: ``declared``. Read it with :meth:`source`.
    sources: tuple[tuple[str, str], ...] = ()
    #: Values that differ in one dtype, as ``(dtype, ((field, value), ...))`` pairs (a mapping
    #: ``{"float16": {"autograd": False}}`` is accepted), fields among
    #: :data:`PER_DTYPE_FIELDS`; the other fields hold in every dtype. Read the capabilities
    #: of one dtype with :meth:`for_dtype` (``conformance.core.target.Target.caps`` does).
    by_dtype: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()

    def __post_init__(self) -> None:
        bad = [d for d in self.dtypes if d not in ALL_DTYPES]
        if bad:
            raise ImplementationError(
                f"dtypes={self.dtypes!r} contains {bad!r}; each must be one of {ALL_DTYPES}"
                + (" (8-bit float formats go in fp8_dtypes)" if set(bad) <= set(FP8_DTYPES) else "")
            )
        bad = [d for d in self.fp8_dtypes if d not in FP8_DTYPES]
        if bad:
            raise ImplementationError(
                f"fp8_dtypes={self.fp8_dtypes!r} contains {bad!r}; each must be one of {FP8_DTYPES}")
        object.__setattr__(self, "fp8_dtypes", tuple(d for d in FP8_DTYPES if d in self.fp8_dtypes))
        bad = [d for d in self.fp8_descales if d not in FP8_DESCALE_FORMS]
        if bad or not self.fp8_descales:
            raise ImplementationError(
                f"fp8_descales={self.fp8_descales!r}: each must be one of {FP8_DESCALE_FORMS}, at least one")
        object.__setattr__(self, "fp8_descales", tuple(d for d in FP8_DESCALE_FORMS if d in self.fp8_descales))
        if self.causal is not None and self.causal not in CAUSAL_ALIGNMENTS:
            raise ImplementationError(
                f"causal={self.causal!r} is not an alignment; use one of "
                f"{CAUSAL_ALIGNMENTS} or None for no causal flag"
            )
        object.__setattr__(self, "fully_masked", _fully_masked_value(self.fully_masked))
        if self.batch_dims not in (None, 1):
            raise ImplementationError(
                f"batch_dims={self.batch_dims!r} is not supported; use None (any number of "
                "leading batch dims) or 1 (exactly (B, N, L, E))"
            )
        if not set(self.mask_kinds) <= ALL_MASK_KINDS:
            raise ImplementationError(
                f"mask_kinds={set(self.mask_kinds)!r} must be a subset of {set(ALL_MASK_KINDS)}"
            )
        check_mha_feature_names(self.mha_features)
        _check_size_declarations(self)
        object.__setattr__(self, "sources", _sources_value(self.sources))
        object.__setattr__(self, "by_dtype", _by_dtype_value(self.by_dtype))

        for name, known in (("varlen_features", ALL_VARLEN_FEATURES), ("kvcache_features", ALL_KVCACHE_FEATURES)):
            unknown = set(getattr(self, name)) - known
            if unknown:
                raise ImplementationError(f"{name} has unknown entries {sorted(unknown)}; known: {sorted(known)}")
            object.__setattr__(self, name, frozenset(getattr(self, name)))
        if not set(self.flash_features) <= ALL_FLASH_FEATURES:
            raise ImplementationError(
                f"flash_features has unknown entries "
                f"{sorted(set(self.flash_features) - ALL_FLASH_FEATURES)}; known: "
                f"{sorted(ALL_FLASH_FEATURES)}"
            )
        unknown = set(self.sharded_features) - ALL_SHARDED_FEATURES
        if unknown:
            raise ImplementationError(f"sharded_features has unknown entries {sorted(unknown)}; "
                                      f"known: {sorted(ALL_SHARDED_FEATURES)}")
        object.__setattr__(self, "sharded_features", frozenset(self.sharded_features))
        object.__setattr__(self, "sharded_layouts", frozenset(self.sharded_layouts))
        if not self.sharded_layouts <= SHARDED_LAYOUTS:
            raise ImplementationError(
                f"sharded_layouts has unknown entries {sorted(self.sharded_layouts - SHARDED_LAYOUTS)}; "
                f"known: {sorted(SHARDED_LAYOUTS)} (spec.sharding.LAYOUTS)"
            )

    def replace(self, **changes: Any) -> "Capabilities":
        return dataclasses.replace(self, **changes)

    def source(self, name: str) -> str:
        """Where the value of ``name`` came from: ``declared``, ``contract`` or ``probed``."""
        return dict(self.sources).get(name, "declared")

    def probe_note(self, name: str) -> str:
        """The probe notes about ``name`` (``"causal: ..."``), joined; "" when there are none
        or the value is declared (the notes then no longer describe it)."""
        if self.source(name) == "declared" and name in SEMANTIC_FIELDS:
            return ""
        return " ".join(n for n in self.probe_notes if n.split(":", 1)[0] == name)

    def for_dtype(self, dtype: str) -> "Capabilities":
        """The capabilities in ``dtype``: :attr:`by_dtype`'s values for it applied."""
        values = dict(self.by_dtype).get(dtype)
        return dataclasses.replace(self, **{k: _per_dtype_value(k, v) for k, v in values}) if values else self

    def dtype_differences(self, name: str) -> dict[str, Any]:
        """dtype -> the value of ``name`` there, for each dtype where it differs."""
        return {dtype: _per_dtype_value(name, dict(values)[name]) for dtype, values in self.by_dtype
                if name in dict(values) and _per_dtype_value(name, dict(values)[name]) != getattr(self, name)}

    def fully_masked_policy(self, kind: str) -> str:
        """The policy for a row emptied by ``kind`` (one of :data:`FULLY_MASKED_KINDS`)."""
        if isinstance(self.fully_masked, str):
            return self.fully_masked
        return dict(self.fully_masked)[kind]

    @property
    def fully_masked_policies(self) -> dict[str, str]:
        """Kind -> policy, for every kind in :data:`FULLY_MASKED_KINDS`."""
        return {kind: self.fully_masked_policy(kind) for kind in FULLY_MASKED_KINDS}

    def fully_masked_text(self) -> str:
        """``"zero"``, or per kind ``"bool:uniform,additive:nan,causal:uniform"``
        (the ``--impl-option fully_masked=`` syntax)."""
        if isinstance(self.fully_masked, str):
            return self.fully_masked
        return ",".join(f"{kind}:{policy}" for kind, policy in self.fully_masked)


def _check_size_declarations(caps: Capabilities) -> None:
    """``head_dims`` (normalized to a sorted tuple), ``seq_multiple``, ``seq_block`` and ``causal_only``
    checked against each other and the other bounds."""
    if caps.head_dims is not None:
        try:
            dims = tuple(sorted({int(d) for d in caps.head_dims}))
        except (TypeError, ValueError):
            dims = ()
        if not dims or dims[0] < 1:
            raise ImplementationError(f"head_dims={caps.head_dims!r} must be a non-empty set of positive "
                                      "integers, e.g. (64, 96, 128), or None (any head dim)")
        inside = [d for d in dims if (caps.min_head_dim or 1) <= d <= (caps.max_head_dim or d)]
        if not inside:
            raise ImplementationError(
                f"head_dims={dims} has no head dim inside min_head_dim={caps.min_head_dim}, "
                f"max_head_dim={caps.max_head_dim}; widen the bounds or the set")
        object.__setattr__(caps, "head_dims", dims)
    if caps.rotary_dim_multiple is not None and (not isinstance(caps.rotary_dim_multiple, int)
                                                 or caps.rotary_dim_multiple < 2 or caps.rotary_dim_multiple % 2):
        raise ImplementationError(f"rotary_dim_multiple={caps.rotary_dim_multiple!r} must be an even integer >= 2 "
                                  "(FlashAttention-2: 16), or None (any even rotary dim)")
    if caps.seq_multiple is not None:
        if not isinstance(caps.seq_multiple, int) or caps.seq_multiple < 1:
            raise ImplementationError(f"seq_multiple={caps.seq_multiple!r} must be a positive integer "
                                      "(L and S multiples of it) or None")
        if caps.max_seq_len is not None and caps.max_seq_len < caps.seq_multiple:
            raise ImplementationError(f"seq_multiple={caps.seq_multiple} > max_seq_len={caps.max_seq_len} "
                                      "leaves no length; raise max_seq_len or lower seq_multiple")
    if caps.seq_block is not None:
        if not isinstance(caps.seq_block, int) or isinstance(caps.seq_block, bool) or caps.seq_block < 2:
            raise ImplementationError(f"seq_block={caps.seq_block!r} must be an integer >= 2 (L and S at most "
                                      "it or multiples of it) or None")
        if caps.seq_multiple is not None and caps.seq_multiple > 1:
            raise ImplementationError(f"seq_block={caps.seq_block} with seq_multiple={caps.seq_multiple}: declare "
                                      "one length rule (seq_multiple: every length a multiple; seq_block: "
                                      "any length up to the block, multiples beyond)")
    multiple = caps.backward_seq_multiple
    if multiple is not None:
        if not isinstance(multiple, int) or isinstance(multiple, bool) or multiple < 2:
            raise ImplementationError(f"backward_seq_multiple={multiple!r} must be an integer >= 2 (gradients "
                                      "where L and S are multiples of it) or None")
        if not length_allowed(caps, multiple):
            raise ImplementationError(f"backward_seq_multiple={multiple} is not a length the forward takes "
                                      f"(max_seq_len={caps.max_seq_len}, seq_multiple={caps.seq_multiple}, "
                                      f"seq_block={caps.seq_block}): no case could take gradients")
    if caps.causal_only and caps.causal is None:
        raise ImplementationError("causal_only=True but causal=None (no causal flag): a kernel that runs "
                                  "only causal needs its causal flag declared")


def _fully_masked_value(value: Any) -> str | tuple[tuple[str, str], ...]:
    """``Capabilities.fully_masked`` checked and normalized: one policy string, or
    (kind, policy) pairs for every kind in :data:`FULLY_MASKED_KINDS` (a mapping or a
    sequence of pairs; kinds left out get ``"zero"``); one string when all agree."""
    if isinstance(value, str):
        if value not in FULLY_MASKED_POLICIES:
            raise ImplementationError(
                f"fully_masked={value!r} is not a policy; use one of {FULLY_MASKED_POLICIES}, "
                "or a policy per kind such as {'bool': 'uniform', 'additive': 'nan'}"
            )
        return value
    try:
        pairs = dict(value.items() if isinstance(value, Mapping) else value)
    except (TypeError, ValueError):
        raise ImplementationError(
            f"fully_masked={value!r} is neither a policy nor a mapping kind -> policy; use one "
            f"of {FULLY_MASKED_POLICIES} or e.g. {{'bool': 'uniform', 'additive': 'nan'}}"
        ) from None
    unknown = sorted(set(pairs) - set(FULLY_MASKED_KINDS))
    bad = {kind: policy for kind, policy in pairs.items() if policy not in FULLY_MASKED_POLICIES}
    if unknown or bad:
        raise ImplementationError(
            f"fully_masked={value!r}: " + (f"unknown kinds {unknown} (kinds: {FULLY_MASKED_KINDS})"
                                           if unknown else f"{bad} are not policies")
            + f"; give each of {FULLY_MASKED_KINDS} one of {FULLY_MASKED_POLICIES}"
        )
    full = tuple((kind, pairs.get(kind, "zero")) for kind in FULLY_MASKED_KINDS)
    if len({policy for _, policy in full}) == 1:
        return full[0][1]
    return full


def _sources_value(value: Any) -> tuple[tuple[str, str], ...]:
    pairs = dict(value.items() if isinstance(value, Mapping) else value)
    bad = {k: v for k, v in pairs.items() if k not in SEMANTIC_FIELDS or v not in SOURCES}
    if bad:
        raise ImplementationError(
            f"sources={pairs!r}: {bad!r} is not (semantic field, source); fields: "
            f"{SEMANTIC_FIELDS}, sources: {SOURCES}"
        )
    return tuple(sorted(pairs.items()))


def _by_dtype_value(value: Any) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]:
    per_dtype = dict(value.items() if isinstance(value, Mapping) else value)
    out = []
    for dtype, values in sorted(per_dtype.items()):
        values = dict(values.items() if isinstance(values, Mapping) else values)
        bad = sorted(set(values) - set(PER_DTYPE_FIELDS))
        if dtype not in ALL_DTYPES or bad:
            raise ImplementationError(
                f"by_dtype={per_dtype!r}: " + (f"{dtype!r} is not a dtype of {ALL_DTYPES}" if dtype not in ALL_DTYPES
                                              else f"{bad} cannot differ per dtype")
                + f"; give dtype -> {{field: value}} with fields among {PER_DTYPE_FIELDS}"
            )
        for name in _SET_FIELDS:  # kept as a sorted tuple: plain data (JSON), read as a set
            if name in values:
                values[name] = tuple(sorted(values[name]))
        if values:
            out.append((dtype, tuple(sorted(values.items()))))
    return tuple(out)


def _per_dtype_value(name: str, value: Any) -> Any:
    """A ``by_dtype`` value as the field holds it (``mask_kinds``, ``flash_features``: a frozenset)."""
    return frozenset(value) if name in _SET_FIELDS else value


def length_allowed(caps: Any, n: int) -> bool:
    """Whether a sequence length ``n`` is inside the declared length rules of ``caps``
    (``max_seq_len``, ``seq_multiple``, ``seq_block``)."""
    if caps.max_seq_len is not None and n > caps.max_seq_len:
        return False
    if caps.seq_multiple and n % caps.seq_multiple:
        return False
    block = getattr(caps, "seq_block", None)
    return not (block and n > block and n % block)


def backward_allowed(caps: Any, *lengths: int) -> bool:
    """Whether the backward takes these lengths (``backward_seq_multiple``)."""
    multiple = getattr(caps, "backward_seq_multiple", None)
    return not multiple or all(n % multiple == 0 for n in lengths)


def backward_lengths(caps: Any) -> Any:
    """``caps`` whose length rules are the backward's (``backward_seq_multiple``) inside the
    forward's: what a gradient property draws from; ``caps`` itself without the rule."""
    multiple = getattr(caps, "backward_seq_multiple", None)
    if not multiple:
        return caps
    block, bound = caps.seq_block, caps.max_seq_len
    if block and multiple <= block:  # inside one block every length runs; beyond it, whole blocks
        bound = min(block, bound or block)
    return caps.replace(seq_multiple=math.lcm(caps.seq_multiple or 1, multiple), seq_block=None,
                        max_seq_len=bound)


def draw_length_cap(caps: Any) -> int | None:
    """The longest L or S a random draw or a directed example takes: ``max_seq_len``, or
    one ``seq_block`` where that is smaller (None: no cap)."""
    caps_bounds = [b for b in (caps.max_seq_len, getattr(caps, "seq_block", None)) if b]
    return min(caps_bounds) if caps_bounds else None
