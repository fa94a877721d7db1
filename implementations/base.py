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

The protocol's words (dtypes, policies, each level's features) live in
``implementations.vocabulary``, :class:`Capabilities` in ``implementations.capabilities``,
:class:`ExpectedFailure` in ``implementations.expected_failure``; all are importable from
here, as they always were.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from implementations.capabilities import Capabilities
from implementations.expected_failure import MATCH_COMPARISONS, ExpectedFailure
from implementations.vocabulary import (
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
    RENAMED_MHA_FEATURES,
    implied_mha_features,
    SEMANTIC_FIELDS,
    SHARDED_LAYOUTS,
    SOURCES,
    VARLEN_LEVELS,
    ImplementationError,
    check_mha_feature_names,
    renamed_mha_features,
)

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
    "ALL_SHARDED_FEATURES",
    "SHARDED_LAYOUTS",
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
    "implied_mha_features",
    "renamed_mha_features",
]

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
            if v is not None and c.seq_block and v > c.seq_block and v % c.seq_block and level in ("sdpa", "mha", "flash"):
                reasons.append(f"{dim}={v} is above seq_block={c.seq_block} and not a multiple of it")
            multiple = c.backward_seq_multiple
            if v is not None and case.get("grad") and multiple and v % multiple and level in ("sdpa", "flash"):
                reasons.append(f"gradients with {dim}={v}, not a multiple of backward_seq_multiple={multiple}")
        rotary_dim = case.get("rotary_dim")
        if rotary_dim and c.rotary_dim_multiple and rotary_dim % c.rotary_dim_multiple:
            reasons.append(f"rotary_dim={rotary_dim} is not a multiple of rotary_dim_multiple={c.rotary_dim_multiple}")
        for feature in ("kv_paged", "kv_append"):
            if case.get(feature) and not getattr(c, feature):
                reasons.append(f"{feature} not supported")
        missing = set(case.get("mha_features", ())) - implied_mha_features(c.mha_features)
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
