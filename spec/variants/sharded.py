"""The sharded-level variants: context-parallel attention assembled the ways ring and
all-to-all code gets it wrong, computed on the whole sequence (pure NumPy, float64).

Most are full-sequence attention under another rule of which key each query attends:
the rule a wrong rank applies to the positions it holds (``spec.sharding``), gathered
over every rank. The keys are those of the padded sequence (zeros at positions ``>= L``,
as the ranks hold them), so a variant that attends the padding attends those zeros.
The others re-order head groups (an all-to-all stacked in the wrong order) or merge
partial results without the running max in the problem's precision. The last ones are
SDPA-level variants seen through the whole sequence (:func:`as_sdpa`): a ring whose every
block groups its GQA heads wrongly, scales wrongly, or keeps its running sums in float32
gives, gathered, what the SDPA variant gives on the unsharded call.

Dimension letters: B batch, N query heads, K kv heads, L the sequence length, Lp the
padded length, E q/k head dim, Ev value head dim, W the world size.
"""

from __future__ import annotations

import numpy as np

from .. import sharding
from .._sdpa import sdpa
from ._core import SDPAProblem, ShardedProblem, Variant, VariantResult
from .sdpa import SDPA_VARIANTS

__all__ = ["SHARDED_VARIANTS", "as_sdpa", "reference"]

def _padded(p: ShardedProblem) -> tuple[np.ndarray, np.ndarray]:
    """The key and value of the padded sequence (zeros at positions >= L)."""
    extra = p.padded_length - p.length
    widths = ((0, 0), (0, 0), (0, extra), (0, 0))
    return np.pad(p.key, widths), np.pad(p.value, widths)


def _holders(p: ShardedProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Over the padded positions: the rank that holds each (Lp,), its index in that
    rank's shard (Lp,), and each rank's positions in its order (W, Lp / W)."""
    Lp, W = p.padded_length, p.world_size
    held = np.stack([sharding.positions(Lp, W, r, p.layout) for r in range(W)])
    owner, index = np.empty(Lp, dtype=np.int64), np.empty(Lp, dtype=np.int64)
    for r in range(W):
        owner[held[r]] = r
        index[held[r]] = np.arange(held.shape[1])
    return owner, index, held


def _attend(p: ShardedProblem, mask: np.ndarray) -> VariantResult:
    """Attention of the real queries over the padded keys under ``mask`` (L, Lp), True =
    may attend; a row attending nothing outputs 0 (a ring's empty merge)."""
    key, value = _padded(p)
    result = sdpa(p.query, key, value, attend_mask=mask, scale=p.scale, fully_masked="zero")
    return VariantResult(result.output, None)


def _correct_mask(p: ShardedProblem) -> np.ndarray:
    """(L, Lp): the spec's rule over global positions (causal, window, padding)."""
    return sharding.allowed(np.arange(p.length), np.arange(p.padded_length), causal=p.causal,
                            window=p.window, length=p.length)


def reference(p: ShardedProblem) -> VariantResult:
    """The correct convention: full-sequence attention (``spec.sharding``)."""
    return _attend(p, _correct_mask(p))


# -- the rule each wrong rank applies ----------------------------------------------------------


def _causal_local(p: ShardedProblem) -> VariantResult:
    # every block masked with its own triangle: key index <= query index within the shards
    if not p.causal:
        return reference(p)
    _, index, _ = _holders(p)
    local = index[None, :] <= index[: p.length, None]
    rest = sharding.allowed(np.arange(p.length), np.arange(p.padded_length), window=p.window, length=p.length)
    return _attend(p, local & rest)


def _window_local(p: ShardedProblem) -> VariantResult:
    # the window placed from the query's index in its shard, the keys' global positions
    if p.window == (-1, -1):
        return reference(p)
    _, index, _ = _holders(p)
    left, right = p.window
    window = sharding.allowed(index[: p.length], np.arange(p.padded_length),
                              window=(left, -1 if p.causal else right))
    rest = sharding.allowed(np.arange(p.length), np.arange(p.padded_length), causal=p.causal, length=p.length)
    return _attend(p, window & rest)


def _zigzag_swapped(p: ShardedProblem) -> VariantResult:
    # each rank reads its two chunks in the other order: row a of its shard is taken for
    # the position the other chunk has there (queries and keys alike)
    if p.layout != "zigzag":
        return reference(p)
    _, _, held = _holders(p)
    half = held.shape[1] // 2
    label = np.empty(p.padded_length, dtype=np.int64)
    for rows in held:
        label[rows] = np.concatenate([rows[half:], rows[:half]])
    return _attend(p, sharding.allowed(label[: p.length], label, causal=p.causal, window=p.window,
                                       length=p.length))


def _last_step_skipped(p: ShardedProblem) -> VariantResult:
    # the ring runs W - 1 steps: rank r never attends the block of rank r + 1 (mod W)
    owner, _, _ = _holders(p)
    skipped = owner[None, :] == (owner[: p.length, None] + 1) % p.world_size
    return _attend(p, _correct_mask(p) & ~skipped)


def _padding_attended(p: ShardedProblem) -> VariantResult:
    # the padded keys (zeros) are attended like real ones
    return _attend(p, sharding.allowed(np.arange(p.length), np.arange(p.padded_length), causal=p.causal,
                                       window=p.window))


def _heads_reversed(p: ShardedProblem) -> VariantResult:
    # the returning all-to-all stacks head group j from rank W - 1 - j
    out = reference(p).output
    B, N, L, Ev = out.shape
    W = p.world_size
    if N % W:
        return VariantResult(out, None)  # all-to-all attention needs N a multiple of W
    groups = out.reshape(B, W, N // W, L, Ev)[:, ::-1]
    return VariantResult(groups.reshape(B, N, L, Ev), None)


def _merge_without_max(p: ShardedProblem) -> VariantResult:
    """Each rank attends the blocks in ring order (its own first, then ranks r-1, r-2, ...)
    and merges them as (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2), log(e^lse1 + e^lse2),
    in the problem's precision, from out 0 and lse -inf: NaN (or 0) where exp overflows
    (or underflows)."""
    dtype = np.float64 if p.dtype == "float64" else np.float32
    key, value = _padded(p)
    _, _, held = _holders(p)
    B, N, L, _ = p.query.shape
    out = np.zeros((B, N, p.padded_length, p.value.shape[-1]))
    query = np.pad(p.query, ((0, 0), (0, 0), (0, p.padded_length - L), (0, 0)))
    for r, qpos in enumerate(held):
        o = np.zeros((B, N, len(qpos), p.value.shape[-1]), dtype=dtype)
        lse = np.full((B, N, len(qpos)), -np.inf, dtype=dtype)
        for s in range(p.world_size):
            kpos = held[(r - s) % p.world_size]
            mask = sharding.allowed(qpos, kpos, causal=p.causal, window=p.window, length=L)
            block = sdpa(query[:, :, qpos], key[:, :, kpos], value[:, :, kpos], attend_mask=mask, scale=p.scale,
                         fully_masked="zero")
            blse = _lse(query[:, :, qpos], key[:, :, kpos], mask, p.scale)
            with np.errstate(all="ignore"):
                a, b = np.exp(lse), np.exp(blse.astype(dtype))
                total = a + b
                safe = np.where(total == 0, dtype(1), total)
                o = (a[..., None] * o + b[..., None] * block.output.astype(dtype)) / safe[..., None]
                lse = np.log(total)
        out[:, :, qpos] = o.astype(np.float64)
    return VariantResult(out[:, :, :L], None)


def _lse(query: np.ndarray, key: np.ndarray, mask: np.ndarray, scale: float | None) -> np.ndarray:
    """(B, N, Lq): log-sum-exp of one block's scaled logits over its allowed keys (-inf: none)."""
    N, K = query.shape[1], key.shape[1]
    key = np.repeat(key, N // K, axis=1)
    s = (1.0 / np.sqrt(query.shape[-1]) if scale is None else scale) * (query @ np.swapaxes(key, -1, -2))
    s = np.where(mask, s, -np.inf)
    top = s.max(axis=-1, keepdims=True)
    top = np.where(np.isinf(top), 0.0, top)
    with np.errstate(divide="ignore"):
        return (top + np.log(np.exp(s - top).sum(axis=-1, keepdims=True)))[..., 0]


# -- when each applies -----------------------------------------------------------------------


def _some_shard_offset(p: ShardedProblem) -> bool:
    """Some query's index in its shard is not its global position."""
    _, index, _ = _holders(p)
    return bool((index[: p.length] != np.arange(p.length)).any())


def as_sdpa(p: ShardedProblem) -> SDPAProblem:
    """The whole sequence as one SDPA call: the real queries over the padded keys, the
    causal rule as the flag (upper-left: global positions), the window and the padding
    as a bool mask (None when they block nothing)."""
    key, value = _padded(p)
    mask = sharding.allowed(np.arange(p.length), np.arange(p.padded_length), window=p.window, length=p.length)
    return SDPAProblem(p.query, key, value, attend_mask=None if mask.all() else mask,
                       causal="upper_left" if p.causal else None, scale=p.scale, dtype=p.dtype, fully_masked="zero")


#: SDPA-level variants a context-parallel implementation shows on its gathered output
#: (every rank's block attention or merge making the SDPA-level mistake), with what the
#: mistake looks like in ring or all-to-all code. Not ``causal_ignored``: on the smallest
#: causal case (W = 2, L = 2) it gives what ``sharded_causal_local`` gives, and the
#: narrower sharded convention would lose its confirmation.
_LIFTED = {
    "gqa_tiled": "ring or all-to-all code expanding the kv heads with repeat(k, '... h d -> ... (g h) d') "
                 "or k.repeat(1, g, 1, 1) before each block's attention",
    "softmax_float32": "a ring whose running max, row sums or merge buffers are float32 "
                       "(torch.zeros(...) without the inputs' dtype) under float64 inputs",
    "causal_excludes_diagonal": "each rank's own block masked with triu(1) shifted by one (keys strictly before)",
    "unscaled": "block attention without the softmax scale",
    "scale_value_dim": "block attention scaled by 1/sqrt(Ev), the value head dim",
}


def _lifted(variant: Variant, models: str) -> Variant:
    return Variant(
        id=f"sharded_{variant.id}", level="sharded",
        summary=f"{variant.summary} (the SDPA-level variant {variant.id} over the whole sequence, gathered "
                "from the ranks)",
        models=models, applies=lambda p: variant.applies(as_sdpa(p)),
        compute=lambda p: VariantResult(variant.compute(as_sdpa(p)).output, None), precision=variant.precision)


_SDPA = {v.id: v for v in SDPA_VARIANTS}

SHARDED_VARIANTS: tuple[Variant, ...] = (
    Variant(
        id="sharded_causal_local",
        level="sharded",
        summary="masks every k/v block with its own causal triangle (key index <= query index within the "
                "shards) instead of comparing global positions, as if every block sat on the diagonal",
        models="ring attention masking each block with tril(ones(L_shard, L_shard)) (bug zoo: "
               "sharded_causal_offset)",
        applies=lambda p: p.causal and p.world_size > 1,
        compute=_causal_local,
    ),
    Variant(
        id="sharded_window_local",
        level="sharded",
        summary="places the sliding window from the query's index within its shard instead of its global "
                "position (the rank's offset lost), against the keys' global positions",
        models="a window over a sharded sequence written with arange(L_shard) for the queries (bug zoo: "
               "sharded_window_local)",
        applies=lambda p: p.window != (-1, -1) and _some_shard_offset(p),
        compute=_window_local,
    ),
    Variant(
        id="sharded_zigzag_swapped",
        level="sharded",
        summary="reads each rank's two zigzag chunks in the wrong order (chunk 2W-1-r first, then r), so "
                "every row is masked as if it sat at the other chunk's position",
        models="a zigzag shard built as chunks (2W-1-r, r) on one side and read as (r, 2W-1-r) on the "
               "other (bug zoo: sharded_zigzag_swapped)",
        applies=lambda p: p.layout == "zigzag" and (p.causal or p.window != (-1, -1) or p.padded_length > p.length),
        compute=_zigzag_swapped,
    ),
    Variant(
        id="sharded_last_step_skipped",
        level="sharded",
        summary="runs the ring loop W-1 times: rank r never attends the k/v block of rank r+1 (at world "
                "size 1 no block at all, every row 0)",
        models="`for step in range(world_size - 1)` with the send after the attend, dropping the last "
               "block received (bug zoo: sharded_last_step_skipped)",
        applies=lambda p: True,
        compute=_last_step_skipped,
    ),
    Variant(
        id="sharded_padding_attended",
        level="sharded",
        summary="attends the zero keys and values a padded sequence ends with, as if the padding were "
                "part of the sequence",
        models="a sequence zero-padded to a multiple of the world size with the padded keys left "
               "unmasked (bug zoo: sharded_padding_attended)",
        applies=lambda p: p.padded_length > p.length and not p.causal,
        compute=_padding_attended,
    ),
    Variant(
        id="sharded_heads_reversed",
        level="sharded",
        summary="stacks the head groups of the returning all-to-all in reverse rank order: head group j of "
                "the output is rank W-1-j's",
        models="the output all-to-all of sequence-parallel (Ulysses) attention concatenating the received "
               "head groups in the wrong order (bug zoo: sharded_heads_reversed)",
        applies=lambda p: p.world_size > 1 and p.query.shape[1] % p.world_size == 0,
        compute=_heads_reversed,
    ),
    Variant(
        id="sharded_merge_no_max",
        level="sharded",
        summary="merges the ranks' partial results as (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2) without "
                "shifting by the running max, so exp overflows (NaN rows) once an LSE passes 88 (float32) "
                "or 709 (float64), and rounds the weights to subnormals or 0 (wrong finite rows) far below 0",
        models="the LSE merge of ring attention written from the formula without the running max "
               "(spec.merge_partials subtracts it first)",
        applies=lambda p: True,
        compute=_merge_without_max,
    ),
    *(_lifted(_SDPA[name], models) for name, models in _LIFTED.items()),
)
