"""FlashAttention's packed and decoding entry points, written step by step in PyTorch.

Two functions with FlashAttention-2's signatures, written from ``spec/varlen.py`` and
``spec/kvcache.py`` (not from FlashAttention's code):

* :func:`flash_attn_varlen_func` — q (T_q, N, E), k (T_k, K, E), v (T_k, K, Ev) hold B
  packed sequences; sequence b owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and
  key rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` and attends nothing else.
* :func:`flash_attn_with_kvcache` — q (B, L, N, E) against a cache (B, S_cache, K, E|Ev),
  or pages (num_pages, page_size, K, E|Ev) with ``block_table`` (B, max_pages); new keys
  k/v (B, S_new, K, E|Ev) are written into the cache **in place** at
  ``cache_seqlens[b]``, then sequence b attends its first ``cache_seqlens[b] + S_new`` keys.

``causal`` is FlashAttention's bottom-right triangle: query i of a sequence with L
queries and S keys may attend key j when ``j <= i + S - L``; a query row with no key
(S = 0, or causal with L > S) gives 0. GQA: query head h uses kv head h // (N / K).
FlashAttention's options per sequence, as ``spec.flash`` defines them: ``window_size``
(left, right) around the aligned position ``p_i = i + S - L``, ``softcap`` (c·tanh(s/c)
before bias and masks), ``alibi_slopes`` (N,) or (B, N) (bias ``-slope·|p_i - j|``), and
the LSE (``return_attn_probs=True``: (out, lse (N, T_q), None); ``return_softmax_lse=True``:
(out, lse (B, N, L))), -inf in a row attending no key. The packed call's ``dropout_p``
drops each weight of a sequence after the softmax with probability p and rescales the
kept ones by 1/(1 - p), each sequence with a pattern of its own (its own offset in the
call's random stream); the LSE stays the dropout-free one. With ``return_attn_probs=True``
and ``dropout_p > 0`` the third element is FlashAttention-2's S_dmask (B, N, max_seqlen_q,
max_seqlen_k), in the input dtype: sequence b's weights at ``[b, :, :L_b, :S_b]``, negated
where dropped, 0 in the padding (FlashAttention-2 rounds the last two sizes up to multiples
of 128; the unrounded crop is returned here). FP8 q, k, v (FlashAttention-3's
``q_descale``, ``k_descale``, ``v_descale``: None, (1,) or (B, K), row b for packed
sequence b) are dequantised to float32 sequence by sequence; the output is bfloat16. The
decoding call takes them too: row b dequantises sequence b's query and every key it attends
(cached and appended; the new keys are stored in the cache as given), without rotary tables.
The decoding call's own options, as ``spec.kvcache`` defines them: ``rotary_cos``/``rotary_sin``
(seqlen_ro, R/2) with ``rotary_interleaved`` rotate q and the new keys at their cache
positions before the append (keys at ``cache_seqlens[b] + i``; queries likewise when causal
or local, else all at ``cache_seqlens[b]``); ``cache_batch_idx`` picks the cache row each
sequence reads and writes; ``cache_leftpad`` starts a sequence's keys later (the diagonal,
window, ALiBi and rotary positions stay in cache indices); ``num_splits`` > 1 attends the
keys in that many chunks and merges the partials by their LSEs (split-KV decoding).
16-bit inputs are computed in float32 and rounded once at the end; float64 stays float64.
Dimension letters: B batch, N query heads, K kv heads, L query length, S key length,
E q/k head dim, Ev value head dim, T packed total length.

Each sequence's steps (logits, allowed keys, softmax) are in
``implementations.builtins.references.sequence_steps``, the decoding call in
``kvcache_reference``; both are importable from here, as they always were.
"""

from __future__ import annotations

from typing import Any

import torch

from implementations.base import Capabilities, Implementation
from implementations.builtins.references.kvcache_reference import KVCacheAttention
from implementations.builtins.references.sequence_steps import (
    _FP8_TYPES,
    _check_options,
    _compute_dtype,
    _descale_rows,
    _refuse,
    _scale,
    _slopes_of,
    attend,
    logits,
    softmax_rows,
    window_allowed,
)

__all__ = [
    "VARLEN_CAPABILITIES",
    "KVCacheAttention",
    "VarlenAttention",
    "attend",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "logits",
    "make_implementation",
    "softmax_rows",
    "window_allowed",
]


class VarlenAttention:
    """``flash_attn_varlen_func``: each step is a method (the bug zoo overrides one)."""

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                 softcap=0.0, alibi_slopes=None, deterministic=False,
                 return_attn_probs=False, block_table=None, q_descale=None, k_descale=None, v_descale=None):
        """Packed variable-length attention (see the module docstring); returns (T_q, N, Ev),
        or with ``return_attn_probs`` (out, lse (N, T_q), S_dmask (B, N, max_seqlen_q, max_seqlen_k)
        with dropout, else None). FP8 q, k, v (FlashAttention-3):
        each sequence dequantised with its descale row (None, (1,) or (B, K)), the output bfloat16."""
        _refuse(block_table=(block_table, None))
        _check_options(window_size, softcap)
        if not 0 <= dropout_p < 1:
            raise ValueError(f"dropout_p={dropout_p} must be in [0, 1)")
        seed = int(torch.randint(0, 2 ** 62, ())) if dropout_p else 0   # one per call, from torch's generator
        starts_q, starts_k = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]
        if len(starts_q) != len(starts_k):
            raise ValueError(f"cu_seqlens_q has {len(starts_q)} entries but cu_seqlens_k {len(starts_k)}")
        if starts_q[-1] != q.shape[0] or starts_k[-1] != k.shape[0]:
            raise ValueError("cu_seqlens must end at the packed lengths total_q and total_k")
        scale = self.scale(softmax_scale, q.shape[-1])
        N = q.shape[1]
        fp8 = q.dtype in _FP8_TYPES
        if not fp8 and any(d is not None for d in (q_descale, k_descale, v_descale)):
            raise ValueError("q_descale/k_descale/v_descale apply only to FP8 q, k, v")
        descales = [_descale_rows(d, name, len(starts_q) - 1, k.shape[1])
                    for d, name in ((q_descale, "q_descale"), (k_descale, "k_descale"), (v_descale, "v_descale"))]
        out = torch.zeros(q.shape[0], N, v.shape[-1], dtype=torch.bfloat16 if fp8 else q.dtype, device=q.device)
        lse = torch.zeros(N, q.shape[0], dtype=_compute_dtype(q.dtype), device=q.device)
        B = len(starts_q) - 1
        lengths = [(starts_q[b + 1] - starts_q[b], starts_k[b + 1] - starts_k[b]) for b in range(B)]
        s_dmask = None
        if return_attn_probs and dropout_p:
            rows_max = max([int(max_seqlen_q)] + [L for L, _ in lengths])
            keys_max = max([int(max_seqlen_k)] + [S for _, S in lengths])
            s_dmask = torch.zeros(B, N, rows_max, keys_max, dtype=out.dtype, device=q.device)
        for b in range(B):
            rows, keys = self.sequence(starts_q, starts_k, b)
            dropout = self.dropout(float(dropout_p), seed, b, q.device)
            qs, ks, vs = q[rows], k[keys], v[keys]
            if fp8:
                qs, ks, vs = self.dequantize(qs, ks, vs, descales, b)
            out[rows], lse[:, rows] = self.attend(qs, ks, vs, scale=scale, causal=causal,
                                                  window=tuple(window_size), softcap=float(softcap),
                                                  slopes=_slopes_of(alibi_slopes, b, N), lse=True,
                                                  **({} if dropout is None else {"dropout": dropout}))
            if s_dmask is not None and dropout.pattern is not None:
                L, S = lengths[b]
                s_dmask[self.pattern_row(b), :, :L, :S] = dropout.pattern.to(s_dmask.dtype)
        if not return_attn_probs:
            return out
        return out, self.packed_lse(lse, q, k, starts_q, starts_k, scale), s_dmask

    def attend(self, q, k, v, **options):
        """One sequence (``attend``'s arguments)."""
        return attend(q, k, v, **options)

    def dequantize(self, q, k, v, descales, b: int):
        """Sequence b's FP8 q, k, v as float32 values ``stored · descale``: row
        :meth:`descale_row` of each (B, K) descale (query head h: kv head h // (N // K))."""
        qd, kd, vd = (d[self.descale_row(b)].to(q.device) for d in descales)   # (K,) each
        group = q.shape[1] // k.shape[1]
        return (q.to(torch.float32) * qd.repeat_interleave(group)[None, :, None],
                k.to(torch.float32) * kd[None, :, None], v.to(torch.float32) * vd[None, :, None])

    def descale_row(self, b: int) -> int:
        """The descale row of packed sequence b: its own (FlashAttention-3's varlen batch is
        the sequence)."""
        return b

    def dropout(self, p: float, seed: int, b: int, device: Any) -> Any:
        """Sequence b's dropout (None when p = 0): each weight kept with probability 1 - p
        and the kept ones rescaled by 1/(1 - p), the pattern drawn from the call's seed at
        the sequence's own offset (:meth:`rng_offset`), so no two sequences share one. The
        closure keeps the pattern it applied as ``pattern`` (N, L, S): the weights, negated
        where dropped (FlashAttention-2's S_dmask; None until it runs)."""
        if not p:
            return None
        generator = torch.Generator(device=device)
        generator.manual_seed((seed + self.rng_offset(b)) % 2 ** 63)

        def drop(weights):
            keep = torch.rand(weights.shape, generator=generator, device=device, dtype=weights.dtype) >= p
            drop.pattern = torch.where(keep, weights, -weights).detach()
            return self.rescale(weights * keep, p)

        drop.pattern = None
        return drop

    def pattern_row(self, b: int) -> int:
        """The row of S_dmask that holds packed sequence b's dropout pattern: its own."""
        return b

    def rng_offset(self, b: int) -> int:
        """Where sequence b's dropout pattern starts in the call's random stream: its index."""
        return b

    def rescale(self, kept, p: float):
        """The kept weights scaled by 1/(1 - p): the expectation stays the weights."""
        return kept / (1.0 - p)

    def packed_lse(self, lse, q, k, starts_q, starts_k, scale):
        """The LSE (N, T_q) as returned: each sequence's own."""
        return lse

    def scale(self, softmax_scale: float | None, head_dim: int) -> float:
        return _scale(softmax_scale, head_dim)

    def sequence(self, starts_q: list[int], starts_k: list[int], b: int) -> tuple[slice, slice]:
        """Sequence b's query rows and key rows in the packed tensors."""
        return slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])


flash_attn_varlen_func = VarlenAttention()
flash_attn_with_kvcache = KVCacheAttention()


VARLEN_CAPABILITIES = Capabilities(
    dtypes=("float64", "float32", "float16", "bfloat16"),
    causal="lower_right",
    fully_masked="zero",
    autograd=False,
    mask_grad=False,
    mask_kinds=frozenset({"none"}),
    varlen_features=frozenset({"window", "softcap", "alibi", "lse", "dropout", "fp8", "dropout_pattern"}),
    fp8_dtypes=("float8_e4m3fn", "float8_e5m2"),
    kvcache_features=frozenset({"window", "softcap", "alibi", "lse", "rotary", "cache_batch_idx",
                                "cache_leftpad", "num_splits", "fp8"}),
)


def make_implementation(*, name: str = "varlen-reference", varlen: Any = None, kvcache: Any = None,
                        description: str = "") -> Implementation:
    """The built-in (or, with ``varlen``/``kvcache`` given, one of the bug zoo's variants)."""
    devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    return Implementation(
        name=name,
        capabilities=VARLEN_CAPABILITIES.replace(devices=devices),
        varlen=varlen or flash_attn_varlen_func,
        kvcache=kvcache or flash_attn_with_kvcache,
        version=torch.__version__,
        listed=not name.startswith("mutant:"),
        description=description or "flash_attn_varlen_func and flash_attn_with_kvcache in plain PyTorch, "
        "written from spec/varlen.py and spec/kvcache.py (implementations/builtins/references/varlen_reference.py)",
    )
