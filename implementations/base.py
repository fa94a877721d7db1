"""The plug-in protocol: an implementation and its capabilities, as data.

An :class:`Implementation` exposes attention at one or both of two levels:

* **SDPA level** — ``sdpa(query, key, value, attn_mask=None, dropout_p=0.0,
  is_causal=False, scale=None, enable_gqa=False) -> Tensor`` with exactly the
  calling convention of ``torch.nn.functional.scaled_dot_product_attention``:
  ``query (B, N, L, E)``, ``key (B, K, S, E)``, ``value (B, K, S, Ev)`` (any number
  of leading batch dims), ``attn_mask`` broadcastable to ``(B, N, L, S)`` and either
  bool (**True = may attend**) or floating (**added** to the scaled scores).
  ``is_causal`` means the alignment the implementation declares in
  ``capabilities.causal`` (``"upper_left"`` is PyTorch's, ``"lower_right"`` is
  FlashAttention's). Returns the output ``(B, N, L, Ev)``.
* **MHA level** — ``mha(embed_dim, num_heads, **options) -> module`` building a
  module with the constructor options and ``forward`` of
  ``torch.nn.MultiheadAttention`` (bool masks there are **True = blocked**), plus
  ``load_weights(module, params)`` copying a ``spec.mha.MHAParams`` into it.
* **Varlen level** — ``varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False, ...)`` with
  FlashAttention's ``flash_attn_varlen_func`` convention: q ``(total_q, N, E)``, k
  ``(total_k, K, E)``, v ``(total_k, K, Ev)``, int32 cumulative lengths ``(B + 1,)``;
  ``causal`` is bottom-right per sequence. Returns ``(total_q, N, Ev)`` (``spec.varlen``).
* **KV-cache level** — ``kvcache(q, k_cache, v_cache, k=None, v=None, ...,
  cache_seqlens=None, block_table=None, softmax_scale=None, causal=False, ...)`` with
  ``flash_attn_with_kvcache``'s convention: q ``(B, L, N, E)``, caches ``(B, S_cache, K,
  E|Ev)`` or pages ``(num_pages, page_size, K, E|Ev)`` with ``block_table (B,
  max_pages)``; new k/v are written into the caches in place. Returns ``(B, L, N, Ev)``
  (``spec.kvcache``).
* **Flash level** — ``flash(q, k, v, dropout_p=0.0, softmax_scale=None,
  causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
  deterministic=False, return_attn_probs=False)`` with FlashAttention-2's
  ``flash_attn_func`` convention: ``q (B, L, N, E)``, ``k (B, S, K, E)``,
  ``v (B, S, K, Ev)``, causal **lower-right**; returns the output ``(B, L, N, Ev)``,
  or ``(output, lse (B, N, L), attn_probs or None)`` with ``return_attn_probs``.
  What it supports is ``Capabilities.flash_features`` (``spec.flash``); its
  ``Capabilities.causal`` is ``"lower_right"`` (or None: no ``causal=True``). With
  ``Capabilities.dropout`` it takes ``dropout_p > 0`` (after the softmax, rescaled by
  1/(1 - p)); with ``Capabilities.fp8_dtypes`` it takes q, k, v in those 8-bit float
  formats with FlashAttention-3's ``q_descale``, ``k_descale``, ``v_descale`` (float32,
  per tensor or (B, K)) and returns a 16- or 32-bit float output (``spec.fp8``).
* **Sharded (context-parallel) level** — ``sharded(q, k, v, *, group, rank, world_size,
  causal=False, softmax_scale=None, layout="contiguous")``, called on every rank of a
  ``torch.distributed`` process group with that rank's shard of one sequence: q
  ``(B, N, L_shard, E)``, k ``(B, K, L_shard, E)``, v ``(B, K, L_shard, Ev)`` (SDPA's
  heads-first layout, the sequence axis -2), positions by ``spec.sharding`` (``layout``
  ``"contiguous"`` or ``"zigzag"``); causal is over global positions (L == S). Returns
  the rank's output shard ``(B, N, L_shard, Ev)``, or ``(output, lse (B, N, L_shard))``
  with ``Capabilities.sharded_lse``; it does its own communication over ``group``.

Dimension letters: B batch, N query heads, K key/value heads, L query length,
S key length, E q/k head dim, Ev value head dim, D model dim.

The runner talks to implementations only through this module: it never imports
an implementation's internals, and implementations never import ``conformance``.
Every call into an implementation's code goes through ``implementations.guard``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = [
    "ALL_DTYPES",
    "FP8_DESCALE_FORMS",
    "FP8_DTYPES",
    "ALL_FLASH_FEATURES",
    "ALL_KVCACHE_FEATURES",
    "ALL_VARLEN_FEATURES",
    "DEFAULT_FLASH_FEATURES",
    "ALL_MASK_KINDS",
    "ALL_MHA_FEATURES",
    "RENAMED_MHA_FEATURES",
    "CAUSAL_ALIGNMENTS",
    "FULLY_MASKED_KINDS",
    "FULLY_MASKED_POLICIES",
    "MATCH_COMPARISONS",
    "PER_DTYPE_FIELDS",
    "SEMANTIC_FIELDS",
    "SOURCES",
    "VARLEN_LEVELS",
    "Capabilities",
    "ExpectedFailure",
    "Implementation",
    "ImplementationError",
    "check_mha_feature_names",
    "renamed_mha_features",
]

ALL_DTYPES = ("float64", "float32", "float16", "bfloat16")
#: The 8-bit float formats q, k, v may come in at the flash level (``Capabilities.fp8_dtypes``,
#: ``spec.fp8.FORMATS``); never a target dtype: an FP8 call's output is 16- or 32-bit.
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
#: How an FP8 call's descale factors may be given (``Capabilities.fp8_descales``): not
#: passed (1), one per tensor (shape (1,)), one per batch element and kv head ((B, K),
#: FlashAttention-3's only shape).
FP8_DESCALE_FORMS = ("none", "per_tensor", "per_head")
CAUSAL_ALIGNMENTS = ("upper_left", "lower_right")
FULLY_MASKED_POLICIES = ("zero", "nan", "uniform", "unspecified")
#: What blocks every key of a fully-masked row, as the implementation is called: a bool
#: ``attn_mask``, a -inf additive ``attn_mask``, or the ``is_causal`` flag alone (rows
#: emptied by a lower-right flag with L > S). A causal constraint the runner folds into a
#: mask is that mask's kind. ``Capabilities.fully_masked`` may give a policy per kind.
FULLY_MASKED_KINDS = ("bool", "additive", "causal")
#: Where a semantic value came from (``Capabilities.sources``): ``declared`` by the
#: implementation's author or ``--impl-option``; ``contract``, the documented meaning of
#: the signature it was recognised by (probing never changes it); ``probed``, read off the
#: implementation on a point the contract leaves open (the value of a fully-masked row).
SOURCES = ("declared", "contract", "probed")
#: The capabilities that say what a result *means* (not which inputs are accepted).
SEMANTIC_FIELDS = ("causal", "fully_masked", "shared_kv", "flash_features")
#: The capabilities that may differ per dtype (``Capabilities.by_dtype``).
PER_DTYPE_FIELDS = ("mask_kinds", "gqa", "different_v_dim", "autograd", "mask_grad", "custom_scale",
                    "dropout", "non_contiguous", "flash_features")
#: The per-dtype fields that hold sets (kept in ``by_dtype`` as sorted tuples: plain data).
_SET_FIELDS = ("mask_kinds", "flash_features", "sharded_layouts")
#: ``none`` (no mask), ``bool`` (True = may attend), ``additive`` (float, added).
ALL_MASK_KINDS = frozenset({"none", "bool", "additive"})
#: Optional features of an MHA-level implementation (constructor options and
#: forward arguments of ``torch.nn.MultiheadAttention``).
ALL_MHA_FEATURES = frozenset(
    {
        "no_bias",           # bias=False accepted (projections without bias)
        "kdim_vdim",         # kdim/vdim != embed_dim (separate projection weights)
        "bias_kv",           # add_bias_kv=True
        "zero_attn",         # add_zero_attn=True
        "batch_first",       # batch_first=True
        "unbatched",         # 2-D inputs (L, D)
        "key_padding_mask",  # key_padding_mask argument, bool and float
        "attn_mask",         # attn_mask argument, bool and float
        "is_causal",         # is_causal argument (with its attn_mask hint)
        "need_weights",      # returns weights when need_weights=True
        "per_head_weights",  # average_attn_weights=False returns per-head weights
        "dropout",           # dropout>0 constructor option, train/eval modes
        "cross_attention",   # query, key, value may differ (without it: self-attention only)
    }
)
#: Former MHA feature names -> their names now. The old ones read as the opposite of
#: what they meant ("bias" meant bias=False works), so they are refused, not mapped.
RENAMED_MHA_FEATURES = {"bias": "no_bias", "average_weights": "per_head_weights"}


def renamed_mha_features(names: Any) -> str:
    """``"'bias' is now 'no_bias'"`` for each former feature name in ``names`` ("" if none)."""
    return "; ".join(f"{old!r} is now {RENAMED_MHA_FEATURES[old]!r}"
                     for old in sorted(set(names) & RENAMED_MHA_FEATURES.keys()))


def check_mha_feature_names(names: Any, where: str = "mha_features") -> None:
    """Raise ImplementationError naming each unknown feature (and a former name's new one)."""
    unknown = sorted(set(names) - ALL_MHA_FEATURES)
    if unknown:
        renamed = renamed_mha_features(unknown)
        raise ImplementationError(
            f"{where} has unknown entries {unknown}{f' ({renamed})' if renamed else ''}; "
            f"known: {sorted(ALL_MHA_FEATURES)}"
        )


# -- varlen / kv-cache levels (FlashAttention's packed and decoding entry points) --
#: The levels whose callable is an ``Implementation`` field of the same name.
VARLEN_LEVELS = ("varlen", "kvcache")

#: Optional features of a flash-level implementation (``flash_attn_func`` arguments).
ALL_FLASH_FEATURES = frozenset(
    {
        "window",   # window_size=(left, right) other than (-1, -1)
        "softcap",  # softcap > 0
        "alibi",    # alibi_slopes (N,) or (B, N)
        "lse",      # return_attn_probs=True returns (output, lse, ...)
        "sinks",    # sinks= (N,) learned sink logits (gpt-oss style; not in flash_attn_func)
        # return_attn_probs=True with dropout_p > 0 returns (out, lse, S_dmask), S_dmask
        # (B, N, >= L, >= S) negative where a weight was dropped (FlashAttention-2's contract)
        "dropout_pattern",
    }
)
#: Optional FlashAttention options at the varlen level (``flash_attn_varlen_func``'s
#: ``window_size``, ``softcap``, ``alibi_slopes`` and ``return_attn_probs=True`` returning
#: ``(output, softmax_lse (N, T_q), ...)``; ``dropout``: ``dropout_p > 0`` honoured, each
#: packed sequence's weights dropped after the softmax with a pattern of its own and
#: rescaled by 1/(1 - p); ``fp8``: FP8 q, k, v of ``fp8_dtypes`` with FlashAttention-3's
#: ``q_descale``/``k_descale``/``v_descale``, (B, K) one row per sequence; ``dropout_pattern``:
#: ``return_attn_probs=True`` with ``dropout_p > 0`` returns ``(out, lse, S_dmask)``, S_dmask
#: (num_sequences, N, >= max_seqlen_q, >= max_seqlen_k) holding sequence b's weights at
#: ``[b, :, :L_b, :S_b]``, negative where dropped (FlashAttention-2's contract)); none is
#: claimed unless declared (or, for ``dropout`` and ``fp8``, read from a recognised
#: signature's ``dropout_p`` / descale parameters).
ALL_VARLEN_FEATURES = frozenset({"window", "softcap", "alibi", "lse", "dropout", "fp8", "dropout_pattern"})
#: The same at the kvcache level (``flash_attn_with_kvcache``; ``return_softmax_lse=True``
#: returns ``(output, softmax_lse (B, N, L))``), plus its cache options: ``rotary``
#: (rotary_cos/rotary_sin/rotary_interleaved), ``cache_batch_idx``, ``cache_leftpad`` and
#: ``num_splits`` (split-KV decoding, n > 1); ``fp8``: FP8 q, caches and new keys of
#: ``fp8_dtypes`` with FlashAttention-3's ``q_descale``/``k_descale``/``v_descale``, (B, K) one
#: row per sequence for everything it attends (read from a recognised signature's descale
#: parameters, or declared).
ALL_KVCACHE_FEATURES = frozenset({"window", "softcap", "alibi", "lse", "rotary", "cache_batch_idx",
                                  "cache_leftpad", "num_splits", "fp8"})
#: What a flash-level implementation is taken to honour when it declares nothing:
#: ``flash_attn_func``'s own features. ``sinks`` is no argument of FlashAttention-2's and
#: is claimed only when declared (or recognised from the signature and probed).
DEFAULT_FLASH_FEATURES = frozenset({"window", "softcap", "alibi", "lse"})


#: The sequence layouts of the sharded level (``spec.sharding.LAYOUTS``).
SHARDED_LAYOUTS = frozenset({"contiguous", "zigzag"})
#: Optional features of the sharded level (none is claimed unless declared):
#: ``window`` (``window_size=(left, right)`` over global positions) and ``padding``
#: (lengths that do not divide by the layout's divisor, padded at the end, ``seq_len=L``).
ALL_SHARDED_FEATURES = frozenset({"window", "padding"})


class ImplementationError(ValueError):
    """An implementation is misdeclared or cannot be resolved/loaded."""


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
    """``head_dims`` (normalized to a sorted tuple), ``seq_multiple`` and ``causal_only``
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


@dataclass(frozen=True)
class ExpectedFailure:
    """A known deviation: property id (+ optional case filter) -> reason.

    ``match`` maps case attribute names (see ``conformance.core.cases``) to the value
    (or list of values) they must have for the entry to apply, e.g. ``{"level": "mha",
    "need_weights": True}``; an empty match applies to every case of the property.
    """

    property: str
    reason: str
    match: Mapping[str, Any] = field(default_factory=dict)
    reference: str = ""  # e.g. "pytorch/pytorch#41508"

    def applies(self, property_id: str, case_attrs: Mapping[str, Any]) -> bool:
        """Whether this entry covers ``property_id`` on a case with ``case_attrs``.

        ``property`` may be ``"*"`` (a deviation that shows in every property).
        A ``match`` value is compared with the case attribute of that name: a
        list matches any of its members; a table of comparisons
        (``lt/le/gt/ge/ne/in``, e.g. ``{"le": 0.0}``) must all hold (a None
        attribute never satisfies one); the string ``"none"`` matches None
        (TOML has no null); anything else must be equal.
        """
        if self.property not in ("*", property_id):
            return False
        return all(_matches(case_attrs.get(key), wanted) for key, wanted in self.match.items())


#: The comparisons a table value of ``ExpectedFailure.match`` may use.
MATCH_COMPARISONS: dict[str, Callable[[Any, Any], bool]] = {
    "lt": lambda got, bound: got < bound,
    "le": lambda got, bound: got <= bound,
    "gt": lambda got, bound: got > bound,
    "ge": lambda got, bound: got >= bound,
    "ne": lambda got, bound: got != bound,
    "in": lambda got, bound: got in bound,
}


def _matches(got: Any, wanted: Any) -> bool:
    if isinstance(wanted, Mapping):
        if got is None:
            return False
        try:
            return all(MATCH_COMPARISONS[op](got, bound) for op, bound in wanted.items())
        except (TypeError, KeyError):
            return False
    if isinstance(wanted, (list, tuple, set, frozenset)):
        return any(_matches(got, w) for w in wanted)
    if wanted == "none":
        return got is None or got == "none"
    return got == wanted


SDPACallable = Callable[..., Any]
MHAFactory = Callable[..., Any]
WeightLoader = Callable[[Any, Any], None]


@dataclass
class Implementation:
    """One attention implementation to certify.

    ``sdpa``: function with ``torch.nn.functional.scaled_dot_product_attention``'s
    signature (see module docstring), or None.
    ``mha``: factory ``mha(embed_dim, num_heads, *, dropout=0.0, bias=True,
    add_bias_kv=False, add_zero_attn=False, kdim=None, vdim=None,
    batch_first=False, device=None, dtype=None)`` returning a module with
    ``torch.nn.MultiheadAttention``'s forward, or None.
    ``load_weights(module, params)``: copies ``spec.mha.MHAParams`` (NumPy,
    float64) into the module, casting to its dtype/device; required with ``mha``.
    """

    name: str
    capabilities: Capabilities = field(default_factory=Capabilities)
    sdpa: SDPACallable | None = None
    mha: MHAFactory | None = None
    load_weights: WeightLoader | None = None
    mha_capabilities: Capabilities | None = None  # defaults to ``capabilities``
    # -- varlen / kv-cache levels (see the module docstring) --
    varlen: Callable[..., Any] | None = None
    kvcache: Callable[..., Any] | None = None
    #: ``flash_attn_func``-signature callable (flash level, see the module docstring), or None.
    flash: SDPACallable | None = None
    flash_capabilities: Capabilities | None = None  # defaults to ``capabilities``
    #: Context-parallel callable (sharded level, see the module docstring), or None.
    sharded: Callable[..., Any] | None = None
    sharded_capabilities: Capabilities | None = None  # defaults to ``capabilities``
    version: str = "0"
    description: str = ""
    #: Known deviations. A built-in's are the entries of ``implementations/xfail/<name>.toml``,
    #: which the registry attaches when it builds the built-in.
    expected_failures: tuple[ExpectedFailure, ...] = ()
    #: Set when the implementation cannot run here (missing optional dependency...).
    unavailable_reason: str | None = None
    #: Registry implementations listed by ``--impl=list``; mutants are not.
    listed: bool = True
    #: What the implementation says about the run when its certificate is written, e.g.
    #: how many graphs an exporter made (``run: ...`` lines under the certificate's table).
    run_notes: Callable[[], tuple[str, ...]] | None = None

    def __post_init__(self) -> None:
        if self.unavailable_reason is None and all(
                fn is None for fn in (self.sdpa, self.mha, self.flash, self.varlen, self.kvcache, self.sharded)):
            raise ImplementationError(
                f"Implementation(name={self.name!r}) exposes none of sdpa=, mha=, flash=, varlen=, "
                "kvcache=, sharded=; give at least one callable"
            )
        if self.mha is not None and self.load_weights is None:
            raise ImplementationError(
                f"Implementation(name={self.name!r}) has mha= but no load_weights=; "
                "the suite must copy the oracle's weights into the module"
            )

    @property
    def available(self) -> bool:
        return self.unavailable_reason is None

    def caps(self, level: str) -> Capabilities:
        """Capabilities at ``level`` (``"sdpa"``, ``"mha"``, ``"flash"``): the field
        ``<level>_capabilities`` when set, else ``capabilities``."""
        specific = getattr(self, f"{level}_capabilities", None)
        return specific if specific is not None else self.capabilities

    def not_supported_reasons(self, case: Mapping[str, Any]) -> list[str]:
        """Readable reasons why ``case`` is outside this implementation's claims.

        ``case`` is a mapping of case attributes: ``level`` ("sdpa"/"mha"),
        ``device``, ``dtype``, ``mask_kind``, ``causal`` (None or alignment),
        ``E``, ``Ev``, ``L``, ``S``, ``N``, ``K``, ``dropout_p``, ``scale``
        (None = default), ``grad`` (bool), ``layout`` ("contiguous" or other),
        ``mha_features`` (set of features the case uses). Missing keys are not checked.
        """
        level = case.get("level", "sdpa")
        reasons: list[str] = []
        if not self.available:
            return [f"{self.name} is unavailable: {self.unavailable_reason}"]
        if level == "sdpa" and self.sdpa is None:
            return [f"{self.name} has no SDPA-level callable"]
        if level == "mha" and self.mha is None:
            return [f"{self.name} has no MHA-level module"]
        if level not in ("sdpa", "mha") and getattr(self, level, None) is None:
            return [f"{self.name} has no {level}-level callable"]
        c = self.caps(level)
        in_dtype: dict[str, str] = {}  # field -> " in float16" where that dtype's value differs
        if "dtype" in case:
            in_dtype = {name: f" in {case['dtype']}" for name in dict(dict(c.by_dtype).get(case["dtype"], ()))}
            c = c.for_dtype(case["dtype"])
        if "device" in case and case["device"] not in c.devices:
            reasons.append(f"device={case['device']!r} not in declared devices {c.devices}")
        if "dtype" in case and case["dtype"] not in c.dtypes:
            reasons.append(f"dtype={case['dtype']!r} not in declared dtypes {c.dtypes}")
        if case.get("mask_kind", "none") not in c.mask_kinds:
            reasons.append(f"mask_kind={case['mask_kind']!r} not in declared {sorted(c.mask_kinds)}"
                           f"{in_dtype.get('mask_kinds', '')}")
        causal = case.get("causal")
        if causal is not None and c.causal != causal:
            reasons.append(f"causal={causal!r} but the causal flag means {c.causal!r}")
        if case.get("E") is not None and case.get("Ev") is not None:
            if case["E"] != case["Ev"] and not c.different_v_dim:
                reasons.append(f"Ev != E not supported{in_dtype.get('different_v_dim', '')}")
            elif case["E"] != case["Ev"] and c.shared_kv and level == "sdpa":
                reasons.append("Ev != E but shared_kv declares key is value")
        if level == "sdpa" and c.self_attention_lengths and case.get("L") is not None \
                and case.get("S") is not None and case["L"] != case["S"]:
            reasons.append(f"L={case['L']} != S={case['S']} but self_attention_lengths declares L == S only")
        if case.get("N") is not None and case.get("K") is not None:
            if case["N"] != case["K"] and not c.gqa:
                reasons.append(f"GQA (K < N) not supported{in_dtype.get('gqa', '')}")
        if case.get("dropout_p", 0.0) and not c.dropout:
            reasons.append("dropout not supported")
        if level == "sdpa" and case.get("sinks") and not c.sdpa_sinks:
            reasons.append("learned sinks not supported at the SDPA level (sdpa_sinks)")
        if case.get("fp8") is not None and case["fp8"] not in c.fp8_dtypes:
            reasons.append(f"q, k, v in {case['fp8']} not supported (fp8_dtypes={list(c.fp8_dtypes)})")
        missing = set(case.get("descale_forms", ())) - set(c.fp8_descales)
        if case.get("fp8") is not None and missing:
            reasons.append(f"descales given {sorted(missing)} not supported (fp8_descales={list(c.fp8_descales)})")
        if case.get("scale") is not None and not c.custom_scale:
            reasons.append("custom scale not supported")
        elif case.get("scale") is not None and c.positive_scale and case["scale"] <= 0:
            reasons.append(f"scale={case['scale']!r} <= 0 but positive_scale declares scale > 0 only")
        if c.causal_only and level != "mha" and "causal" in case and case["causal"] is None:
            reasons.append("a non-causal call but causal_only declares causal calls only")
        if case.get("grad") and not c.autograd:
            reasons.append(f"autograd not supported{in_dtype.get('autograd', '')}")
        if case.get("mask_grad") and not c.mask_grad:
            reasons.append(f"gradient w.r.t. the additive mask not supported{in_dtype.get('mask_grad', '')}")
        if case.get("layout", "contiguous") != "contiguous" and not c.non_contiguous:
            reasons.append(f"layout={case['layout']!r} but only contiguous inputs are supported")
        for dim in ("E", "Ev"):
            v = case.get(dim)
            if v is not None and c.max_head_dim is not None and v > c.max_head_dim:
                reasons.append(f"{dim}={v} > max_head_dim={c.max_head_dim}")
            if v is not None and c.min_head_dim is not None and v < c.min_head_dim:
                reasons.append(f"{dim}={v} < min_head_dim={c.min_head_dim}")
            if v is not None and c.head_dims is not None and v not in c.head_dims:
                reasons.append(f"{dim}={v} not in head_dims={list(c.head_dims)}")
        for dim in ("L", "S"):
            v = case.get(dim)
            if v is not None and c.max_seq_len is not None and v > c.max_seq_len:
                reasons.append(f"{dim}={v} > max_seq_len={c.max_seq_len}")
            if v is not None and c.seq_multiple and v % c.seq_multiple and level in ("sdpa", "mha", "flash"):
                reasons.append(f"{dim}={v} is not a multiple of seq_multiple={c.seq_multiple}")
        rotary_dim = case.get("rotary_dim")
        if rotary_dim and c.rotary_dim_multiple and rotary_dim % c.rotary_dim_multiple:
            reasons.append(f"rotary_dim={rotary_dim} is not a multiple of rotary_dim_multiple={c.rotary_dim_multiple}")
        for feature in ("kv_paged", "kv_append"):
            if case.get(feature) and not getattr(c, feature):
                reasons.append(f"{feature} not supported")
        missing = set(case.get("mha_features", ())) - set(c.mha_features)
        if level == "mha" and missing:
            reasons.append(f"MHA features not supported: {sorted(missing)}")
        missing = set(case.get("flash_features", ())) - set(c.flash_features)
        if level == "flash" and missing:
            reasons.append(f"flash features not supported: {sorted(missing)}")
        for name in ("varlen_features", "kvcache_features"):
            missing = set(case.get(name, ())) - set(getattr(c, name))
            if level == name.removesuffix("_features") and missing:
                reasons.append(f"{level} features not supported: {sorted(missing)}")
        if level == "sharded":
            reasons += _sharded_reasons(c, case)
        return reasons


def _sharded_reasons(c: Capabilities, case: Mapping[str, Any]) -> list[str]:
    """The sharded level's own claims: layout, world size, heads per rank, causal flag,
    features (window, padding)."""
    reasons = []
    if case.get("sharding") is not None and case["sharding"] not in c.sharded_layouts:
        reasons.append(f"sharding layout {case['sharding']!r} not in declared sharded_layouts "
                       f"{sorted(c.sharded_layouts)}")
    world = case.get("world_size")
    if world is not None and world > c.max_world_size:
        reasons.append(f"world_size={world} > max_world_size={c.max_world_size}")
    if world is not None and c.sharded_heads_divisible:
        for dim in ("N", "K"):
            if case.get(dim) is not None and case[dim] % world:
                reasons.append(f"{dim}={case[dim]} is not a multiple of world_size={world} "
                               "(sharded_heads_divisible)")
    if case.get("sharded_causal") and c.causal is None:
        reasons.append("causal=True not supported (causal=None declared)")
    missing = set(case.get("sharded_features", ())) - set(c.sharded_features)
    if missing:
        reasons.append(f"sharded features not supported: {sorted(missing)} (declare sharded_features)")
    return reasons
