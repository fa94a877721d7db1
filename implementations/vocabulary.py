"""The protocol's words: the dtypes, causal alignments, fully-masked policies and
sources of a declaration, and the optional features of each level, each as the set an
implementation's :class:`~implementations.capabilities.Capabilities` may claim from.

A declaration naming a word outside these sets is refused with
:class:`ImplementationError` (the argument, the known words, and a former name's new one).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ALL_DTYPES",
    "ALL_FLASH_FEATURES",
    "ALL_KVCACHE_FEATURES",
    "ALL_MASK_KINDS",
    "ALL_MHA_FEATURES",
    "ALL_SHARDED_FEATURES",
    "ALL_VARLEN_FEATURES",
    "CAUSAL_ALIGNMENTS",
    "DEFAULT_FLASH_FEATURES",
    "FP8_DESCALE_FORMS",
    "FP8_DTYPES",
    "FULLY_MASKED_KINDS",
    "FULLY_MASKED_POLICIES",
    "PER_DTYPE_FIELDS",
    "RENAMED_MHA_FEATURES",
    "implied_mha_features",
    "SEMANTIC_FIELDS",
    "SHARDED_LAYOUTS",
    "SOURCES",
    "VARLEN_LEVELS",
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
                    "dropout", "non_contiguous", "flash_features", "fully_masked")
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
        "per_head_attn_mask",  # attn_mask of shape (B*N, L, S), one per head (without: (L, S) only)
        "is_causal",         # is_causal argument (with its attn_mask hint)
        "need_weights",      # returns weights when need_weights=True
        "per_head_weights",  # average_attn_weights=False returns per-head weights
        "dropout",           # dropout>0 constructor option, train/eval modes
        "cross_attention",   # query, key, value may differ (without it: self-attention only)
        "kv_cross_attention",  # cross-attention with one key/value input (value is key); implied by cross_attention
    }
)
def implied_mha_features(features: Any) -> set[str]:
    """``features`` with what they imply: cross-attention with key and value apart covers
    the case where they are one input (``kv_cross_attention``)."""
    out = set(features)
    if "cross_attention" in out:
        out.add("kv_cross_attention")
    return out


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
