"""spec.variants: each wrong convention differs from the oracle where it applies, is what
its summary says (checked by an independent loop or by hand), and rank() picks it out.

Every deterministic variant has a case below where it applies; ``TIES`` lists the
variants that give exactly the same output on that case (so rank cannot separate them).
"""

from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pytest

import spec
from flash_variant_cases import FAMILY_CASES, observed_parts
from spec import variants as V

ROOT = pathlib.Path(spec.__file__).parent.parent
SDPA_IDS = [v.id for v in V.SDPA_VARIANTS]
MHA_IDS = [v.id for v in V.MHA_VARIANTS]
SHARDED_IDS = [v.id for v in V.SHARDED_VARIANTS]
FAMILY_IDS = [v.id for v in (*V.FLASH_VARIANTS, *V.VARLEN_VARIANTS, *V.KVCACHE_VARIANTS)]


# --------------------------------------------------------------------------- cases


def sdpa_problem(seed: int = 0, *, B: int = 1, N: int = 1, K: int = 1, L: int = 2, S: int = 3, E: int = 2,
                 Ev: int = 2, spread: float = 1.0, **fields) -> V.SDPAProblem:
    rng = np.random.default_rng(seed)
    return V.SDPAProblem(rng.normal(0, spread, (B, N, L, E)), rng.normal(0, spread, (B, K, S, E)),
                         rng.normal(0, 1, (B, K, S, Ev)), **fields)


def bool_mask(seed: int, shape: tuple[int, ...], keep: float = 0.6) -> np.ndarray:
    mask = np.random.default_rng(seed).random(shape) < keep
    mask[..., 0] = True                                  # no row fully masked by accident
    return mask


def fully_masked_case() -> V.SDPAProblem:
    mask = bool_mask(3, (2, 3))
    mask[1] = False                                      # row 1 may attend nothing
    return sdpa_problem(3, attend_mask=mask)


def float16_huge() -> V.SDPAProblem:
    # q·k = 300 · 300 = 90000 > 65504 for key 0; the scale brings the logits back in range
    query = np.array([[[[300.0], [1.0]]]])
    key = np.array([[[[300.0], [2.0]]]])
    value = np.array([[[[1.0], [-1.0]]]])
    return V.SDPAProblem(query, key, value, scale=1e-4, dtype="float16")


def wide_rows(dtype: str = "float32", size: float = 10.0) -> V.SDPAProblem:
    # query row 0 = +10, row 1 = -10, keys +10 and +9: logits ±100 and ±90, rows 200 apart
    query = np.array([[[[size], [-size]]]])
    key = np.array([[[[10.0], [9.0]]]])
    value = np.array([[[[1.0], [3.0]]]])
    return V.SDPAProblem(query, key, value, scale=1.0, dtype=dtype)


def blocked_large_value() -> V.SDPAProblem:
    # key 1 blocked and its value 1e30: a weight of exp(-64) on it is 1.6e2 in the output
    value = np.array([1.0, 1e30]).reshape(1, 1, 2, 1)
    mask = np.array([[True, False]])
    return V.SDPAProblem(np.ones((1, 1, 1, 1)), np.zeros((1, 1, 2, 1)), value, attend_mask=mask)


def float16_cancellation() -> V.SDPAProblem:
    # equal logits, weights 1/3; values 2048, 1, -2048 sum to 1 only in float32 accumulation
    value = np.array([2048.0, 1.0, -2048.0]).reshape(1, 1, 3, 1)
    return V.SDPAProblem(np.zeros((1, 1, 1, 1)), np.zeros((1, 1, 3, 1)), value, dtype="float16")


def ascending_keys(S: int = 20) -> V.SDPAProblem:
    # q = 1, key s = s / 4: the running max grows with every key block
    key = (np.arange(S) / 4.0).reshape(1, 1, S, 1)
    value = np.random.default_rng(5).normal(size=(1, 1, S, 2))
    return V.SDPAProblem(np.ones((1, 1, 1, 1)), key, value, scale=1.0)


def in_dtype(problem: V.SDPAProblem, dtype: str, **changes) -> V.SDPAProblem:
    """``problem`` with its inputs rounded to ``dtype`` and computed in it."""
    values = {name: spec.emulate.round_to(getattr(problem, name), dtype) for name in ("query", "key", "value")}
    return V.SDPAProblem(**{**problem.__dict__, **values, "dtype": dtype, **changes})


def first_block_blocked(S: int = 20) -> V.SDPAProblem:
    # query row 0 may attend only the keys of the second block; row 1 every key
    mask = np.ones((2, S), dtype=bool)
    mask[0, :V.KERNEL_BLOCK] = False
    return sdpa_problem(8, S=S, attend_mask=mask)


SDPA_CASES: dict[str, Callable[[], V.SDPAProblem]] = {
    "causal_ignored_when_L1": lambda: sdpa_problem(1, L=1, S=3, causal="upper_left"),
    "causal_ignored": lambda: sdpa_problem(1, L=3, S=3, causal="upper_left"),
    "causal_upper_left": lambda: sdpa_problem(1, L=2, S=4, causal="lower_right"),
    "causal_lower_right": lambda: sdpa_problem(1, L=2, S=4, causal="upper_left"),
    "causal_excludes_diagonal": lambda: sdpa_problem(1, L=3, S=3, causal="upper_left"),
    "gqa_tiled": lambda: sdpa_problem(2, N=4, K=2),
    "kv_batch_offset": lambda: sdpa_problem(2, B=2),
    "scale_value_dim": lambda: sdpa_problem(2, E=2, Ev=3),
    "scale_zero_falsy": lambda: sdpa_problem(2, scale=0.0),
    "scale_arg_ignored": lambda: sdpa_problem(2, scale=0.3),
    "unscaled": lambda: sdpa_problem(2, E=4),
    "scale_squared": lambda: sdpa_problem(2, E=4),
    "mask_inverted": lambda: sdpa_problem(3, attend_mask=bool_mask(3, (2, 3))),
    "float_mask_as_bool": lambda: sdpa_problem(3, additive_mask=np.array([[0.0, 1.5, -np.inf],
                                                                          [0.0, -0.5, 0.0]])),
    "additive_mask_subtracted": lambda: sdpa_problem(3, additive_mask=np.array([[0.0, 1.5, -2.0],
                                                                                [0.0, -0.5, 3.0]])),
    "mask_after_softmax": lambda: sdpa_problem(3, attend_mask=bool_mask(3, (2, 3))),
    "fully_masked_nan": fully_masked_case,
    "fully_masked_uniform": fully_masked_case,
    "softmax_float32": lambda: sdpa_problem(4, S=4, spread=4.0),
    "float16_overflow": float16_huge,
    "no_max_subtraction": lambda: wide_rows("float32"),
    "global_max": lambda: wide_rows("float32"),
    "softmax_clamped": blocked_large_value,
    "low_precision_accumulation": float16_cancellation,
    "bfloat16_accumulator": lambda: sdpa_problem(5, S=20, dtype="float32"),
    "ragged_tail_dropped": lambda: sdpa_problem(6, S=20),
    "online_softmax_no_rescale": ascending_keys,
    "dropout_no_rescale": lambda: sdpa_problem(7, dropout_p=0.25),
    "fully_masked_zero": lambda: V.SDPAProblem(**{**fully_masked_case().__dict__, "fully_masked": "nan"}),
    # float16: s - 1e4 rounds to a grid of 8, s + finfo.min (-65504) overflows below s = -16
    "mask_fill_1e4": lambda: in_dtype(sdpa_problem(3, spread=2.0, attend_mask=fully_masked_case().attend_mask),
                                      "float16"),
    "mask_fill_1e9": fully_masked_case,
    # float16: the fill cancels out in float64 arithmetic (Keras' -0.7 * 65500, added by SDPA in float32)
    "mask_fill_cancels": lambda: in_dtype(sdpa_problem(3, attend_mask=fully_masked_case().attend_mask), "float16"),
    "mask_fill_finfo_min": lambda: in_dtype(sdpa_problem(3, spread=4.0, attend_mask=fully_masked_case().attend_mask),
                                            "float16"),
    "first_block_nan": first_block_blocked,
    "causal_before_scale": lambda: sdpa_problem(9, L=3, S=3, causal="upper_left", scale=-0.5),
    "value_is_key": lambda: sdpa_problem(10),
    "inputs_rounded_to_float16": lambda: in_dtype(sdpa_problem(11, S=4), "float32"),
    "inputs_rounded_to_bfloat16": lambda: in_dtype(sdpa_problem(11, S=4), "float32"),
}


def mha_problem(seed: int = 0, *, B: int = 2, N: int = 2, L: int = 3, S: int = 3, D: int = 4,
                **fields) -> V.MHAProblem:
    rng = np.random.default_rng(seed)
    params = spec.MHAParams.random(rng, D, N)
    return V.MHAProblem(params, rng.normal(size=(L, B, D)), rng.normal(size=(S, B, D)),
                        rng.normal(size=(S, B, D)), **fields)


def causal_blocked(L: int = 3, S: int = 3) -> np.ndarray:
    return spec.masks.to_mha_bool(spec.masks.causal_mask(L, S, "upper_left"))   # True = blocked


def padding(B: int = 2, S: int = 3, *, all_of_item: int | None = None) -> np.ndarray:
    blocked = np.zeros((B, S), dtype=bool)
    blocked[:, -1] = True                                # last key is padding
    if all_of_item is not None:
        blocked[all_of_item] = True
    return blocked


MHA_CASES: dict[str, Callable[[], V.MHAProblem]] = {
    "mha_scale_model_dim": lambda: mha_problem(1),
    "mha_heads_split_without_transpose": lambda: mha_problem(1),
    "mha_heads_merged_without_transpose": lambda: mha_problem(1),
    "mha_no_out_proj": lambda: mha_problem(1),
    "mha_packed_projection_order": lambda: mha_problem(1),
    "mha_batch_first_ignored": lambda: mha_problem(1),
    "mha_mask_inverted": lambda: mha_problem(2, attn_mask=causal_blocked()),
    "mha_padding_mask_inverted": lambda: mha_problem(2, key_padding_mask=padding()),
    "mha_float_mask_as_bool": lambda: mha_problem(2, attn_mask=np.random.default_rng(2).normal(size=(3, 3))),
    "mha_float_padding_ignored": lambda: mha_problem(2, key_padding_mask=spec.masks.to_additive(~padding())),
    "mha_padding_mask_on_queries": lambda: mha_problem(2, key_padding_mask=padding()),
    "mha_causal_hint_dropped": lambda: mha_problem(2, attn_mask=causal_blocked(), is_causal=True),
    "mha_fully_masked_nan": lambda: mha_problem(2, key_padding_mask=padding(all_of_item=1)),
    "mha_fully_masked_uniform": lambda: mha_problem(2, key_padding_mask=padding(all_of_item=1)),
    "mha_weights_summed_over_heads": lambda: mha_problem(1),
    "mha_softmax_over_queries": lambda: mha_problem(1),
}

def sharded_problem(seed: int = 0, *, L: int = 2, N: int = 1, E: int = 2, spread: float = 1.0,
                    **fields) -> V.ShardedProblem:
    rng = np.random.default_rng(seed)
    return V.ShardedProblem(rng.normal(0, spread, (1, N, L, E)), rng.normal(0, spread, (1, N, L, E)),
                            rng.normal(0, 1, (1, N, L, E)), **fields)


#: The smallest case of each sharded variant's bug (tests/spec/test_sharded_variants.py
#: works each out by hand).
SHARDED_CASES: dict[str, Callable[[], V.ShardedProblem]] = {
    "sharded_causal_local": lambda: sharded_problem(1, world_size=2, causal=True),
    "sharded_window_local": lambda: sharded_problem(2, world_size=2, window=(0, 0)),
    "sharded_zigzag_swapped": lambda: sharded_problem(3, world_size=1, layout="zigzag", causal=True),
    "sharded_last_step_skipped": lambda: sharded_problem(4, L=3, world_size=3),
    "sharded_padding_attended": lambda: sharded_problem(5, L=1, world_size=1, layout="zigzag"),
    "sharded_heads_reversed": lambda: sharded_problem(6, N=2, world_size=2),
    "sharded_merge_no_max": lambda: sharded_problem(7, L=2, E=4, spread=30.0, world_size=2),   # logits > 709
    # The SDPA-level variants over the whole sequence (spec.variants.sharded.as_sdpa).
    "sharded_gqa_tiled": lambda: V.ShardedProblem(*(np.random.default_rng(8).normal(0, 1, shape) for shape in
                                                    ((1, 4, 2, 2), (1, 2, 2, 2), (1, 2, 2, 2))), world_size=2),
    "sharded_softmax_float32": lambda: sharded_problem(9, L=4, world_size=2),
    "sharded_causal_excludes_diagonal": lambda: sharded_problem(11, world_size=1, causal=True),
    "sharded_unscaled": lambda: sharded_problem(12, E=4, world_size=2),
    "sharded_scale_value_dim": lambda: V.ShardedProblem(*(np.random.default_rng(13).normal(0, 1, shape) for shape
                                                          in ((1, 1, 2, 4), (1, 1, 2, 4), (1, 1, 2, 2))), world_size=2),
}

#: The flash, varlen and kvcache variants: their mutants' smallest cases
#: (tests/spec/flash_variant_cases.py; tests/spec/test_flash_variants.py runs the mutants).
CASES = {**SDPA_CASES, **MHA_CASES, **SHARDED_CASES, **FAMILY_CASES}

#: Variants with exactly the same output as the key's on the key's case.
TIES = {
    # with one query, upper-left sees key 0 only and lower-right sees every key
    "causal_ignored_when_L1": {"causal_ignored", "causal_lower_right"},
    "causal_ignored": set(),
    "scale_zero_falsy": {"scale_arg_ignored"},
    # the float16 product overflows whether or not the sums are float16 too
    "float16_overflow": {"low_precision_accumulation"},
    # -1e9 added in float64 keeps the scores: a fully blocked row is the unmasked row, as
    # a -1e4 fill makes it too (float64 rounding of s - 1e4 and s - 1e9 is far below the
    # tolerance); only the precision of the fill's sum tells them apart
    "mask_fill_1e9": {"mask_fill_1e4"},
    # s + finfo.min rounds every score of a fully blocked float64 row to finfo.min: uniform
    "fully_masked_uniform": {"mask_fill_finfo_min"},
    # with S <= 16 a fully blocked first key block is a fully blocked row
    "fully_masked_nan": {"first_block_nan"},
    # a diagonal moved right by a pad of 1 with L = 2 is the top-left one
    "kvcache_leftpad_causal_offset": {"kvcache_causal_upper_left"},
}


# --------------------------------------------------------------------------- the table


def test_every_deterministic_variant_has_a_case():
    deterministic = {v.id for v in V.VARIANTS.values() if v.deterministic}
    assert set(CASES) == deterministic
    assert [v.id for v in V.VARIANTS.values() if not v.deterministic] == ["mha_dropout_in_eval"]


def test_table_is_well_formed():
    assert set(SDPA_IDS).isdisjoint(MHA_IDS) and set(SHARDED_IDS).isdisjoint(SDPA_IDS + MHA_IDS)
    assert set(FAMILY_IDS).isdisjoint(SDPA_IDS + MHA_IDS + SHARDED_IDS)
    assert len(V.VARIANTS) == len(SDPA_IDS) + len(MHA_IDS) + len(SHARDED_IDS) + len(FAMILY_IDS)
    for variant in V.VARIANTS.values():
        assert variant.level in V.LEVELS
        for level in ("mha", "sharded", *V.FLASH_FAMILY):
            assert variant.id.startswith(level + "_") == (variant.level == level), variant.id
        assert variant.summary and "." not in variant.summary[-1:] and "\n" not in variant.summary
        assert variant.models, variant.id
    required = {"causal_upper_left", "causal_lower_right", "causal_ignored", "causal_ignored_when_L1",
                "causal_excludes_diagonal", "gqa_tiled", "scale_value_dim", "unscaled",
                "scale_arg_ignored", "scale_squared", "mask_inverted", "additive_mask_subtracted",
                "float_mask_as_bool", "mask_after_softmax", "fully_masked_nan", "fully_masked_uniform",
                "softmax_float32", "float16_overflow", "low_precision_accumulation", "dropout_no_rescale",
                "mha_scale_model_dim", "mha_heads_split_without_transpose",
                "mha_heads_merged_without_transpose", "mha_no_out_proj", "mha_mask_inverted",
                "mha_padding_mask_on_queries", "mha_weights_summed_over_heads", "mha_dropout_in_eval",
                "mha_batch_first_ignored", "mha_packed_projection_order", "mha_softmax_over_queries"}
    assert required <= set(V.VARIANTS)
    assert V.lookup("fully_masked_mean") is V.VARIANTS["fully_masked_uniform"]
    with pytest.raises(spec.SpecError, match="name="):
        V.lookup("no_such_variant")


def test_docs_list_every_variant():
    text = (ROOT / "docs" / "DIAGNOSIS.md").read_text()
    for name in (*V.VARIANTS, *V.ALIASES):
        assert f"`{name}`" in text, name
    assert "variants" in (ROOT / "spec" / "README.md").read_text()


# --------------------------------------------------------------------------- (a) differs, (c) ranked first


@pytest.mark.parametrize("variant_id", list(CASES))
def test_variant_applies_and_differs_from_the_oracle(variant_id):
    problem, variant = CASES[variant_id](), V.VARIANTS[variant_id]
    assert variant.applies(problem)
    correct, result = V.reference(problem), variant.compute(problem)
    assert result.output.shape == correct.output.shape
    allowed = V.default_allowed(problem)("output", result) + result.slack
    differs = V.fit(correct.output, result.output, allowed) > 1
    if variant_id == "mha_weights_summed_over_heads":         # the output is right, the weights are not
        differs = V.fit(correct.weights, result.weights, V.default_allowed(problem)("weights", result)) > 1
    if problem.level in V.FLASH_FAMILY:                       # or the LSE, or the caches after the call
        differs = any(V.fit(getattr(correct, part), value, V.default_allowed(problem)(part, result)) > 1
                      for part, value in observed_parts(result).items())
    assert differs


@pytest.mark.parametrize("variant_id", list(CASES))
def test_rank_puts_the_variant_first_on_its_own_output(variant_id):
    problem, variant = CASES[variant_id](), V.VARIANTS[variant_id]
    result = variant.compute(problem)
    observed = (result.output, result.weights) if problem.level == "mha" else result.output
    if problem.level in V.FLASH_FAMILY:
        observed = observed_parts(result)
    matches = V.rank(observed, problem)
    assert matches and matches[0].fit == 0.0, matches
    exact = {m.variant_id for m in matches if m.fit == 0.0}
    assert variant_id in exact and exact - {variant_id} <= TIES.get(variant_id, set()), matches


@pytest.mark.parametrize("variant_id", list(CASES))
def test_rank_finds_nothing_in_the_correct_output(variant_id):
    problem = CASES[variant_id]()
    correct = V.reference(problem)
    assert V.rank(correct.output, problem) == []
    assert V.rank((correct.output, correct.weights), problem) == []
    assert V.rank(observed_parts(correct), problem) == []


def test_non_deterministic_variant_is_described_not_computed():
    variant = V.VARIANTS["mha_dropout_in_eval"]
    assert variant.compute is None and "mha_eval_determinism" in variant.detect
    assert variant.applies(mha_problem(1, dropout=0.5))
    assert not variant.applies(mha_problem(1, dropout=0.5, training=True))
    assert not variant.applies(mha_problem(1))


# --------------------------------------------------------------------------- applies() is honest


def random_sdpa_problems(count: int = 60):
    rng = np.random.default_rng(2024)
    for seed in range(count):
        K = int(rng.integers(1, 3))
        sizes = dict(B=int(rng.integers(1, 3)), K=K, N=K * int(rng.integers(1, 3)), L=int(rng.integers(1, 4)),
                     S=int(rng.integers(1, 5)), E=int(rng.integers(1, 4)), Ev=int(rng.integers(1, 4)))
        fields = dict(causal=rng.choice([None, "upper_left", "lower_right"]),
                      scale=rng.choice([None, 0.0, 0.5, 1.0]),
                      dtype=str(rng.choice(["float64", "float32", "float16", "bfloat16"])),
                      fully_masked=str(rng.choice(V.POLICIES)))
        target = (sizes["B"], sizes["N"], sizes["L"], sizes["S"])
        kind = rng.integers(0, 3)
        if kind == 1:
            fields["attend_mask"] = rng.random(target) < 0.7
        elif kind == 2:
            additive = np.where(rng.random(target) < 0.5, 0.0, rng.normal(size=target))
            fields["additive_mask"] = np.where(rng.random(target) < 0.2, -np.inf, additive)
        problem = sdpa_problem(seed, **sizes, **fields)
        values = {name: spec.emulate.round_to(getattr(problem, name), problem.dtype)
                  for name in ("query", "key", "value")}           # representable in the dtype
        yield V.SDPAProblem(**{**problem.__dict__, **values})


def random_mha_problems(count: int = 30):
    rng = np.random.default_rng(7)
    for _ in range(count):
        N = int(rng.integers(1, 3))
        B, L, S, D = int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.integers(1, 4)), 2 * N
        params = spec.MHAParams.random(rng, D, N, bias=bool(rng.integers(2)), add_bias_kv=bool(rng.integers(2)),
                                       add_zero_attn=bool(rng.integers(2)),
                                       kdim=int(rng.choice([D, 3])), vdim=D)
        batch_first, unbatched = bool(rng.integers(2)), rng.random() < 0.2
        layout = (lambda T, dim: (T, dim)) if unbatched else \
            (lambda T, dim, B=B: (B, T, dim)) if batch_first else (lambda T, dim, B=B: (T, B, dim))
        fields = dict(need_weights=bool(rng.integers(2)), average_attn_weights=bool(rng.integers(2)),
                      batch_first=batch_first, fully_masked=str(rng.choice(V.POLICIES)))
        kind = rng.integers(0, 4)
        if kind == 1:
            fields["key_padding_mask"] = rng.random((S,) if unbatched else (B, S)) < 0.4
        elif kind == 2:
            fields["attn_mask"] = np.where(rng.random((L, S)) < 0.3, -np.inf, rng.normal(size=(L, S)))
        elif kind == 3 and L == S:
            fields.update(attn_mask=causal_blocked(L, S), is_causal=True)
        query, key, value = (rng.normal(size=layout(T, dim)) for T, dim in ((L, D), (S, params.kdim), (S, D)))
        yield V.MHAProblem(params, query, key, value, **fields)


def assert_same_where_not_applicable(problem):
    from spec.variants._rank import _compared_rows       # rows an "unspecified" policy leaves free

    correct = V.reference(problem)
    for variant in V.VARIANTS.values():
        if variant.level != problem.level or not variant.deterministic or variant.applies(problem):
            continue
        result, bound = variant.compute(problem), V.default_allowed(problem)
        for part, extra in (("output", result.slack), ("weights", 0.0)):
            mine, right = getattr(result, part), getattr(correct, part)
            if mine is None or right is None:
                continue
            rows = _compared_rows(problem, part, right.shape)
            assert V.fit(mine, right, bound(part, result) + extra, rows) <= 1, (variant.id, part)


def test_applies_false_means_the_oracle_output_sdpa():
    for problem in random_sdpa_problems():
        assert_same_where_not_applicable(problem)


def test_applies_false_means_the_oracle_output_mha():
    for problem in random_mha_problems():
        assert_same_where_not_applicable(problem)


def test_rank_finds_nothing_in_correct_outputs_of_random_problems():
    for problem in (*random_sdpa_problems(30), *random_mha_problems(15)):
        correct = V.reference(problem)
        assert V.rank((correct.output, correct.weights), problem) == []


# --------------------------------------------------------------------------- (b) brute force and by hand


def loop_attention(query, key, value, *, scale, kv_head, attend=lambda b, h, i, j: True,
                   bias=lambda b, h, i, j: 0.0, kv_batch=lambda b: b):
    """SDPA one scalar at a time, with each convention as a plug (fully-masked rows -> 0)."""
    B, N, L, _ = query.shape
    S, Ev = key.shape[2], value.shape[3]
    output = np.zeros((B, N, L, Ev))
    for b in range(B):
        for h in range(N):
            kb, kh = kv_batch(b), kv_head(h)
            for i in range(L):
                scores = [scale * float(query[b, h, i] @ key[kb, kh, j]) + bias(b, h, i, j)
                          if attend(b, h, i, j) else None for j in range(S)]
                live = [s for s in scores if s is not None]
                if not live:
                    continue
                top = max(live)
                exps = [0.0 if s is None else math.exp(s - top) for s in scores]
                for c in range(Ev):
                    output[b, h, i, c] = sum(e * value[kb, kh, j, c] for j, e in enumerate(exps)) / sum(exps)
    return output


def assert_variant_output(variant_id, problem, expected, rtol=1e-12):
    result = V.VARIANTS[variant_id].compute(problem)
    np.testing.assert_allclose(result.output, expected, rtol=rtol, atol=1e-12)


def test_causal_variants_against_a_loop():
    for L, S in ((2, 4), (4, 2), (1, 3), (3, 3)):
        for alignment in ("upper_left", "lower_right"):
            p = sdpa_problem(L * 10 + S, L=L, S=S, causal=alignment)
            scale = 1 / math.sqrt(2)
            args = (p.query, p.key, p.value)

            def plain(args=args, scale=scale, **kw):
                return loop_attention(*args, scale=scale, kv_head=lambda h: h, **kw)

            offset = 0 if alignment == "upper_left" else S - L
            assert_variant_output("causal_ignored", p, plain())
            assert_variant_output("causal_upper_left", p, plain(attend=lambda b, h, i, j: j <= i))
            assert_variant_output("causal_lower_right", p,
                                  plain(attend=lambda b, h, i, j, shift=S - L: j <= i + shift))
            assert_variant_output("causal_excludes_diagonal", p,
                                  plain(attend=lambda b, h, i, j, offset=offset: j < i + offset))
            decoding = plain() if L == 1 else V.reference(p).output
            assert_variant_output("causal_ignored_when_L1", p, decoding)


def test_head_and_batch_variants_against_a_loop():
    p = sdpa_problem(11, B=2, N=6, K=3, L=2, S=3)
    scale = 1 / math.sqrt(2)
    assert_variant_output("gqa_tiled", p, loop_attention(p.query, p.key, p.value, scale=scale,
                                                         kv_head=lambda h: h % 3))
    assert_variant_output("kv_batch_offset", p, loop_attention(p.query, p.key, p.value, scale=scale,
                                                               kv_head=lambda h: h // 2, kv_batch=lambda b: 0))


def test_mask_variants_against_a_loop():
    mask = np.array([[0.0, 1.5, -np.inf], [0.0, -0.5, 0.0]])
    p = sdpa_problem(12, additive_mask=mask)
    scale = 1 / math.sqrt(2)
    expected = loop_attention(p.query, p.key, p.value, scale=scale, kv_head=lambda h: h,
                              attend=lambda b, h, i, j: mask[i, j] == 0)
    assert_variant_output("float_mask_as_bool", p, expected)
    finite = np.array([[0.0, 1.5, -2.0], [0.0, -0.5, 3.0]])
    p = sdpa_problem(12, additive_mask=finite)
    expected = loop_attention(p.query, p.key, p.value, scale=scale, kv_head=lambda h: h,
                              bias=lambda b, h, i, j: -finite[i, j])
    assert_variant_output("additive_mask_subtracted", p, expected)
    # a -inf entry subtracted is +inf: that row is NaN, the other row is finite
    output = V.VARIANTS["additive_mask_subtracted"].compute(sdpa_problem(12, additive_mask=mask)).output
    assert np.isnan(output[0, 0, 0]).all() and np.isfinite(output[0, 0, 1]).all()
    attend = bool_mask(3, (2, 3))
    p = sdpa_problem(13, attend_mask=attend)
    assert_variant_output("mask_inverted", p, loop_attention(p.query, p.key, p.value, scale=scale,
                                                             kv_head=lambda h: h,
                                                             attend=lambda b, h, i, j: not attend[i, j]))


def test_mask_after_softmax_by_hand():
    # one query, keys with logits 0 and ln 3, key 1 blocked: softmax over both = 1/4, 3/4;
    # zeroing key 1 leaves weight 1/4 on key 0, so the output is v0 / 4 (the oracle: v0)
    key = np.array([0.0, math.log(3.0)]).reshape(1, 1, 2, 1)
    value = np.array([8.0, 100.0]).reshape(1, 1, 2, 1)
    p = V.SDPAProblem(np.ones((1, 1, 1, 1)), key, value, scale=1.0, attend_mask=np.array([[True, False]]))
    result = V.VARIANTS["mask_after_softmax"].compute(p)
    np.testing.assert_allclose(result.weights[0, 0, 0], [0.25, 0.0], rtol=1e-15)
    np.testing.assert_allclose(result.output[0, 0, 0], [2.0], rtol=1e-15)
    assert V.reference(p).output[0, 0, 0, 0] == 8.0


def test_fully_masked_and_dropout_variants_by_hand():
    p = fully_masked_case()
    uniform = V.VARIANTS["fully_masked_uniform"].compute(p).output
    np.testing.assert_allclose(uniform[0, 0, 1], p.value[0, 0].mean(axis=0), rtol=1e-15)   # mean of V
    assert np.isnan(V.VARIANTS["fully_masked_nan"].compute(p).output[0, 0, 1]).all()
    assert not V.VARIANTS["fully_masked_nan"].applies(V.SDPAProblem(**{**p.__dict__, "fully_masked": "nan"}))
    p = sdpa_problem(7, dropout_p=0.25)
    np.testing.assert_allclose(V.VARIANTS["dropout_no_rescale"].compute(p).output, 0.75 * V.reference(p).output)


def test_overflow_variants_by_hand():
    # float16: 300 · 300 = 90000 -> inf; inf · 1e-4 = inf -> row 0 NaN; row 1 (q = 1) is finite
    output = V.VARIANTS["float16_overflow"].compute(float16_huge()).output
    assert np.isnan(output[0, 0, 0]).all() and np.isfinite(output[0, 0, 1]).all()
    # float32 without the max shift: exp(100) = inf -> row 0 NaN; exp(-100) and exp(-90) are
    # float32 subnormals, so row 1 is still about right; at logits -200, -180 they are 0
    output = V.VARIANTS["no_max_subtraction"].compute(wide_rows()).output
    assert np.isnan(output[0, 0, 0]).all()
    np.testing.assert_allclose(output[0, 0, 1], V.reference(wide_rows()).output[0, 0, 1], rtol=1e-3)
    assert V.VARIANTS["no_max_subtraction"].compute(wide_rows(size=20.0)).output[0, 0, 1, 0] == 0.0
    # one shift for both rows (100): row 1's exps are exp(-200), exp(-190): 0 in float32
    output = V.VARIANTS["global_max"].compute(wide_rows()).output
    oracle = V.reference(wide_rows()).output
    np.testing.assert_allclose(output[0, 0, 0], oracle[0, 0, 0], rtol=1e-6)
    assert output[0, 0, 1, 0] == 0.0 and oracle[0, 0, 1, 0] > 1.0
    assert not V.VARIANTS["global_max"].applies(wide_rows("float64"))   # exp(-200) > 0 in float64


def test_low_precision_accumulation_by_hand_and_against_float16_scalars():
    # weights round(1/3) = 0.33325; 0.33325·2048 = 682.5, + 0.33325 = 682.83 -> 683.0 (spacing 0.5),
    # - 682.5 = 0.5; accumulating in float32 gives 0.33325 (the oracle: 1/3)
    output = V.VARIANTS["low_precision_accumulation"].compute(float16_cancellation()).output
    assert output[0, 0, 0, 0] == 0.5
    # a random case against a loop over numpy float16 scalars, left to right
    p = sdpa_problem(21, L=2, S=5, E=3, Ev=2, dtype="float16")
    q, k, v = (spec.emulate.round_to(x, "float16").astype(np.float16) for x in (p.query, p.key, p.value))
    scale = 1 / math.sqrt(3)
    expected = np.zeros((2, 2))
    for i in range(2):
        logits = []
        for j in range(5):
            dot = np.float16(0)
            for e in range(3):
                dot = np.float16(dot + np.float16(q[0, 0, i, e] * k[0, 0, j, e]))
            logits.append(np.float16(scale * float(dot)))
        top = max(logits)
        exps = [np.float16(math.exp(float(np.float16(s - top)))) for s in logits]
        total = np.float16(0)
        for e in exps:
            total = np.float16(total + e)
        weights = [np.float16(e / total) for e in exps]
        for c in range(2):
            acc = np.float16(0)
            for j in range(5):
                acc = np.float16(acc + np.float16(weights[j] * v[0, 0, j, c]))
            expected[i, c] = acc
    np.testing.assert_array_equal(V.VARIANTS["low_precision_accumulation"].compute(p).output[0, 0], expected)


def test_kernel_block_variants_by_hand():
    # S = 20: the ragged tail is keys 16..19; a kernel dropping it attends keys 0..15 only
    p = sdpa_problem(6, S=20)
    expected = V.reference(V.SDPAProblem(p.query, p.key[:, :, :16], p.value[:, :, :16])).output
    assert_variant_output("ragged_tail_dropped", p, expected)
    assert np.all(V.VARIANTS["ragged_tail_dropped"].compute(sdpa_problem(6, S=5)).output == 0)
    # no rescale, by the kernel's own loop: block 0 enters at its max m0, block 1 at m1 > m0
    p = ascending_keys(20)
    scores = p.key[0, 0, :, 0]                              # q = 1, scale 1
    m0, m1 = scores[:16].max(), scores.max()
    acc = np.exp(scores[:16] - m0) @ p.value[0, 0, :16] + np.exp(scores[16:] - m1) @ p.value[0, 0, 16:]
    total = np.exp(scores - m1).sum()
    assert_variant_output("online_softmax_no_rescale", p, (acc / total).reshape(1, 1, 1, 2))
    assert not V.VARIANTS["online_softmax_no_rescale"].applies(ascending_keys(16))
    # the bf16 accumulator: one block, sum and output accumulator rounded to bfloat16 once
    p = sdpa_problem(5, S=3, dtype="float32")
    weights = V.reference(p).weights[0, 0]
    logits = (p.query[0, 0] @ p.key[0, 0].T / math.sqrt(2)).astype(np.float32)
    exps = np.exp(logits - logits.max(axis=-1, keepdims=True))
    row_sum = spec.emulate.round_to(exps.sum(axis=-1, keepdims=True), "bfloat16")
    acc = spec.emulate.round_to(exps @ p.value[0, 0].astype(np.float32), "bfloat16")
    assert_variant_output("bfloat16_accumulator", p, (acc / row_sum)[None, None], rtol=1e-6)
    np.testing.assert_allclose(acc / row_sum, weights @ p.value[0, 0], rtol=2**-7)   # near the oracle


def online_softmax_loop(scores: list[float | None], values: list[list[float]], block: int) -> list[float]:
    """One query row of a FlashAttention-style loop over key blocks, written with no
    guard for a fully blocked block: m = -inf, then per block m_new = max(m, block max),
    p = exp(s - m_new), alpha = exp(m - m_new); acc and l rescaled by alpha."""
    inf = float("inf")
    m, total, acc = -inf, 0.0, [0.0] * len(values[0])
    for start in range(0, len(scores), block):
        chunk = [(-inf if s is None else s) for s in scores[start:start + block]]
        m_new = max([m, *chunk])
        with np.errstate(all="ignore"):
            p = [float(np.exp(np.float64(s) - np.float64(m_new))) for s in chunk]      # exp(-inf - -inf) = NaN
            alpha = float(np.exp(np.float64(m) - np.float64(m_new)))
        total = alpha * total + sum(p)
        acc = [alpha * a + sum(pj * values[start + j][c] for j, pj in enumerate(p)) for c, a in enumerate(acc)]
        m = m_new
    return [a / total if total else float("nan") for a in acc]


def test_first_block_nan_against_an_unguarded_online_softmax_loop():
    mask = np.ones((3, 40), dtype=bool)
    mask[0, :V.KERNEL_BLOCK] = False                      # the first block fully blocked: NaN
    mask[1, 17] = False                                   # a blocked key in a later block: harmless
    mask[2, :V.KERNEL_BLOCK // 2] = False                 # half the first block blocked: harmless
    p = sdpa_problem(8, L=3, S=40, attend_mask=mask)
    scale = 1 / math.sqrt(2)
    expected = np.zeros((1, 1, 3, 2))
    for i in range(3):
        scores = [scale * float(p.query[0, 0, i] @ p.key[0, 0, j]) if mask[i, j] else None for j in range(40)]
        expected[0, 0, i] = online_softmax_loop(scores, p.value[0, 0].tolist(), V.KERNEL_BLOCK)
    assert np.isnan(expected[0, 0, 0]).all() and np.isfinite(expected[0, 0, 1:]).all()
    result = V.VARIANTS["first_block_nan"].compute(p).output
    np.testing.assert_array_equal(np.isnan(result), np.isnan(expected))
    np.testing.assert_allclose(result[0, 0, 1:], expected[0, 0, 1:], rtol=1e-12)


def test_causal_before_scale_against_a_loop():
    for scale in (0.0, -0.5):
        p = sdpa_problem(9, L=3, S=4, causal="lower_right", scale=scale)
        expected = np.zeros((1, 1, 3, 2))
        for i in range(3):
            with np.errstate(all="ignore"):
                # the causal -inf enters q·k before the scale multiplies it
                raw = [float(p.query[0, 0, i] @ p.key[0, 0, j]) + (0.0 if j <= i + 1 else -np.inf) for j in range(4)]
                scores = np.array(raw) * scale
                exps = np.exp(scores - scores.max())
                expected[0, 0, i] = (exps / exps.sum()) @ p.value[0, 0]
        assert_variant_output("causal_before_scale", p, expected)
        assert np.isnan(expected[0, 0, :2]).all() and np.isfinite(expected[0, 0, 2]).all()
    positive = sdpa_problem(9, L=3, S=4, causal="lower_right", scale=0.5)
    assert not V.VARIANTS["causal_before_scale"].applies(positive)


def test_value_is_key_against_a_loop():
    p = sdpa_problem(10, L=2, S=3)
    assert_variant_output("value_is_key", p, loop_attention(p.query, p.key, p.key, scale=1 / math.sqrt(2),
                                                            kv_head=lambda h: h))
    assert not V.VARIANTS["value_is_key"].applies(sdpa_problem(10, E=2, Ev=3))


def test_finite_fills_against_float16_scalars():
    # a fully blocked float16 row: s + fill in float16, softmax of the filled scores
    p = CASES["mask_fill_1e4"]()
    scale = 1 / math.sqrt(2)
    for name, fill in (("mask_fill_1e4", -1e4), ("mask_fill_finfo_min", -65504.0)):
        p = CASES[name]()
        expected = V.reference(p).output.copy()
        row = 1                                            # row 1 attends nothing
        scores = [float(np.float16(np.float16(scale * float(p.query[0, 0, row] @ p.key[0, 0, j])) + np.float16(fill)))
                  for j in range(3)]
        top = max(scores)
        exps = [0.0 if s == -np.inf else math.exp(s - top) for s in scores]
        expected[0, 0, row] = np.array(exps) @ p.value[0, 0] / sum(exps)
        result = V.VARIANTS[name].compute(p)
        np.testing.assert_allclose(result.output, expected, rtol=1e-6, atol=1e-6)
    # float64 and -1e9: the fill cancels in s - max, the blocked row is the unmasked row
    p = fully_masked_case()
    unmasked = V.reference(V.SDPAProblem(p.query, p.key, p.value)).output
    np.testing.assert_allclose(V.VARIANTS["mask_fill_1e9"].compute(p).output[0, 0, 1], unmasked[0, 0, 1],
                               rtol=1e-6)
    # where every score of the row overflows to -inf in float16, the row is NaN
    low = in_dtype(V.SDPAProblem(-4.0 * np.ones((1, 1, 2, 2)), 4.0 * np.ones((1, 1, 3, 2)),
                                 np.ones((1, 1, 3, 2)), attend_mask=fully_masked_case().attend_mask), "float16")
    assert np.isnan(V.VARIANTS["mask_fill_finfo_min"].compute(low).output[0, 0, 1]).all()


def test_input_round_trip_against_torch_and_apart_from_accumulators():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    p = CASES["inputs_rounded_to_float16"]()
    q, k, v = (torch.tensor(getattr(p, n), dtype=torch.float32) for n in ("query", "key", "value"))
    for to, torch_dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        out = F.scaled_dot_product_attention(*(x.to(torch_dtype).float() for x in (q, k, v))).double().numpy()
        matches = V.rank(out, p)
        assert matches and matches[0].variant_id == f"inputs_rounded_to_{to}", (to, matches)
        assert "bfloat16_accumulator" not in {m.variant_id for m in matches}
    # a bfloat16 accumulator is not an input round trip
    accumulated = V.VARIANTS["bfloat16_accumulator"].compute(p).output
    assert not {"inputs_rounded_to_float16", "inputs_rounded_to_bfloat16"} & {m.variant_id for m in
                                                                               V.rank(accumulated, p)}


def test_fully_masked_zero_and_mha_uniform_by_hand():
    p = CASES["fully_masked_zero"]()
    result = V.VARIANTS["fully_masked_zero"].compute(p)
    assert (result.output[0, 0, 1] == 0).all() and np.isnan(V.reference(p).output[0, 0, 1]).all()
    m = MHA_CASES["mha_fully_masked_uniform"]()
    out, weights = V.VARIANTS["mha_fully_masked_uniform"].compute(m)[:2]
    # batch item 1 has every key padded: uniform weights over the 3 keys, the mean of the values
    np.testing.assert_allclose(weights[1], np.full((3, 3), 1 / 3))
    values = m.value[:, 1] @ m.params.in_proj_weight[8:].T + m.params.in_proj_bias[8:]    # (S, D)
    expected = values.mean(axis=0) @ m.params.out_proj_weight.T + m.params.out_proj_bias
    np.testing.assert_allclose(out[:, 1], np.broadcast_to(expected, (3, 4)), rtol=1e-12)


def test_declarations_are_one_place_per_fact():
    declared = {v.id: v.declaration for v in V.VARIANTS.values() if v.declaration}
    assert declared["causal_lower_right"] == "--impl-option causal=lower_right"
    assert declared["causal_upper_left"] == "--impl-option causal=upper_left"
    assert declared["value_is_key"] == "--impl-option shared_kv=true"
    assert V.VARIANTS["fully_masked_nan"].declaration_for("additive") == "--impl-option fully_masked=additive:nan"
    for bug in ("causal_ignored", "causal_ignored_when_L1", "mask_inverted"):
        assert not V.VARIANTS[bug].declaration and "no declaration" in V.VARIANTS[bug].undeclarable
    with pytest.raises(spec.SpecError, match="declaration="):
        V.Variant(id="x", level="sdpa", summary="s", models="m", applies=lambda p: True,
                  compute=V.reference, declaration="causal=lower_right")


def test_softmax_float32_has_float32_precision():
    p = sdpa_problem(4, S=4, spread=4.0)
    result = V.VARIANTS["softmax_float32"].compute(p)
    error = np.abs(result.output - V.reference(p).output).max()
    assert 1e-12 < error < 1e-5


def torch_float32_softmax(p: V.SDPAProblem) -> np.ndarray:
    """A float64 attention whose softmax is torch's float32 one (not the model's rounding)."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x) for x in (p.query, p.key, p.value))
    scores = p.resolved_scale * (q @ k.transpose(-2, -1))
    return (torch.softmax(scores.float(), dim=-1).double() @ v).numpy()


def test_softmax_float32_is_matched_at_float32_precision_on_random_cases():
    # the model rounds in its own order; torch's float32 softmax in another, so only an
    # allowed error scaled to float32 recognises it (with float64's it matched 11 of 200)
    rng = np.random.default_rng(11)
    for seed in range(40):
        sizes = {d: int(rng.integers(1, 4)) for d in ("B", "N", "L", "E", "Ev")}
        p = sdpa_problem(seed, **sizes, K=sizes["N"], S=int(rng.integers(2, 6)),
                         spread=float(rng.choice([0.1, 1.0, 4.0])))
        observed = torch_float32_softmax(p)
        assert V.correct_fit(observed, p) > 1                              # a float64 failure
        matches = V.rank(observed, p)
        assert matches and matches[0].variant_id == "softmax_float32", (seed, matches)
    assert V.precision_factor(V.VARIANTS["softmax_float32"], p) == 2.0**29
    assert V.precision_factor(V.VARIANTS["unscaled"], p) == 1.0


def softcapped(p: V.SDPAProblem, cap: float) -> np.ndarray:
    """A float64 attention whose scores are soft-capped, cap·tanh(s/cap): a small
    systematic error, not a coarse precision."""
    logits = p.resolved_scale * (p.query @ np.swapaxes(p.key, -1, -2))
    scores = cap * np.tanh(logits / cap)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ p.value


def test_an_error_far_below_float32s_is_not_a_float32_softmax():
    # A soft cap of 1e6 moves logits of size ~1 by ~3e-13: wrong at float64's
    # precision, and within float32's allowed error of the float32 model, but 1e4-1e6
    # times smaller than what a float32 softmax errs by: no coarse match.
    named = 0
    for seed in range(20):
        p = sdpa_problem(seed, L=3, S=4, E=4, Ev=3, spread=1.0)
        observed = softcapped(p, cap=1e6)
        assert V.correct_fit(observed, p) > 1                              # a float64 failure
        model = V.VARIANTS["softmax_float32"].compute(p).output
        assert np.abs(observed - model).max() < 1e-6                       # inside float32's band
        named += any(m.variant_id == "softmax_float32" for m in V.rank(observed, p))
        assert V.variant_fit(observed, p, "softmax_float32") == float("inf")
    assert named == 0
    # the floor is what separates them: without it the float32 model is named
    p = sdpa_problem(0, L=3, S=4, E=4, Ev=3, spread=1.0)
    ratio = (np.abs(softcapped(p, cap=1e6) - V.reference(p).output).max()
             / np.abs(V.VARIANTS["softmax_float32"].compute(p).output - V.reference(p).output).max())
    assert ratio < V.COARSE_ERROR_FLOOR


def test_a_coarse_precision_match_comes_after_a_match_at_the_problems_precision():
    p = sdpa_problem(8, E=4, scale=0.5 * (1 + 1e-9))
    exact = V.VARIANTS["scale_arg_ignored"].compute(p).output
    observed = exact + 4 * 2.0**-53 * np.abs(exact)                        # a few float64 roundings off
    matches = V.rank(observed, p)
    fits = {m.variant_id: m.fit for m in matches}
    assert [m.variant_id for m in matches][:2] == ["scale_arg_ignored", "softmax_float32"], matches
    assert fits["softmax_float32"] < fits["scale_arg_ignored"]            # better fit, weaker evidence


def test_correct_fit_says_whether_the_oracle_explains_an_observation():
    p = sdpa_problem(4, S=4, spread=4.0)
    assert V.correct_fit(V.reference(p).output, p) == 0.0
    assert V.correct_fit(V.VARIANTS["unscaled"].compute(p).output, p) > 1
    assert V.rank(V.reference(p).output + 2.0**-53, p) == []               # within rounding: no variant


def test_precision_must_be_a_known_dtype():
    with pytest.raises(spec.SpecError, match="precision="):
        V.Variant("x", "sdpa", "s", "m", applies=lambda p: True, compute=V.reference, precision="float8")


def mha_views(p: V.MHAProblem, *, split: str = "transpose", merge: str = "transpose") -> np.ndarray:
    """MHA (no masks, packed, batch-second) with head split/merge done by index arithmetic."""
    params = p.params
    D, N = params.embed_dim, params.num_heads
    hd = D // N
    (w_q, w_k, w_v), (b_q, b_k, b_v) = params.projection_weights(), params.projection_biases()
    x = {name: np.swapaxes(getattr(p, name), 0, 1) for name in ("query", "key", "value")}  # (B, T, D)
    projected = {"query": x["query"] @ w_q.T + b_q, "key": x["key"] @ w_k.T + b_k,
                 "value": x["value"] @ w_v.T + b_v}

    def head(array, b, n, t, f):                           # element (b, n, t, f) of the split view
        T = array.shape[1]
        if split == "view":                                 # flat index n·T·hd + t·hd + f of item b
            t, d = divmod(n * T * hd + t * hd + f, D)
            return array[b, t, d]
        return array[b, t, n * hd + f]

    B, L, S = x["query"].shape[0], x["query"].shape[1], x["key"].shape[1]
    heads = np.zeros((B, N, L, hd))
    for b in range(B):
        for n in range(N):
            q = np.array([[head(projected["query"], b, n, t, f) for f in range(hd)] for t in range(L)])
            k = np.array([[head(projected["key"], b, n, t, f) for f in range(hd)] for t in range(S)])
            v = np.array([[head(projected["value"], b, n, t, f) for f in range(hd)] for t in range(S)])
            logits = q @ k.T / math.sqrt(hd)
            weights = np.exp(logits - logits.max(axis=1, keepdims=True))
            heads[b, n] = (weights / weights.sum(axis=1, keepdims=True)) @ v
    merged = np.zeros((B, L, D))
    for b in range(B):
        for t in range(L):
            for d in range(D):
                if merge == "view":                         # flat index t·D + d of (N, L, hd)
                    n, rest = divmod(t * D + d, L * hd)
                    merged[b, t, d] = heads[b, n, rest // hd, rest % hd]
                else:
                    merged[b, t, d] = heads[b, d // hd, t, d % hd]
    output = merged @ params.out_proj_weight.T + params.out_proj_bias
    return np.swapaxes(output, 0, 1)                        # (B, L, D) -> (L, B, D)


def test_head_split_and_merge_against_index_arithmetic():
    p = mha_problem(31, B=2, N=2, L=3, S=2, D=4)
    np.testing.assert_allclose(mha_views(p), V.reference(p).output, rtol=1e-12)
    np.testing.assert_allclose(V.VARIANTS["mha_heads_split_without_transpose"].compute(p).output,
                               mha_views(p, split="view"), rtol=1e-12)
    np.testing.assert_allclose(V.VARIANTS["mha_heads_merged_without_transpose"].compute(p).output,
                               mha_views(p, merge="view"), rtol=1e-12)


def test_mha_variants_against_reformulations():
    p = mha_problem(32)
    correct = V.reference(p)
    # batch_first ignored = the right module on inputs with the first two axes swapped
    swapped = V.MHAProblem(p.params, *(np.swapaxes(x, 0, 1) for x in (p.query, p.key, p.value)))
    np.testing.assert_allclose(V.VARIANTS["mha_batch_first_ignored"].compute(p).output,
                               np.swapaxes(V.reference(swapped).output, 0, 1), rtol=1e-12)
    # packed order k, q, v = the right module with the first two in_proj chunks exchanged
    w_q, w_k, w_v = np.split(p.params.in_proj_weight, 3)
    b_q, b_k, b_v = np.split(p.params.in_proj_bias, 3)
    reordered = spec.MHAParams(**{**p.params.__dict__, "in_proj_weight": np.concatenate([w_k, w_q, w_v]),
                                  "in_proj_bias": np.concatenate([b_k, b_q, b_v])})
    np.testing.assert_allclose(V.VARIANTS["mha_packed_projection_order"].compute(p).output,
                               V.reference(V.MHAProblem(reordered, p.query, p.key, p.value)).output, rtol=1e-12)
    # weights summed over N = 2 heads = twice the averaged weights; the output is unchanged
    summed = V.VARIANTS["mha_weights_summed_over_heads"].compute(p)
    np.testing.assert_allclose(summed.weights, 2 * correct.weights, rtol=1e-14)
    np.testing.assert_array_equal(summed.output, correct.output)
    # sqrt(D) scale = the right module with q scaled by sqrt(hd / D)
    q_rows = np.repeat([math.sqrt(0.5), 1.0, 1.0], 4)          # hd / D = 2 / 4
    params = spec.MHAParams(**{**p.params.__dict__, "in_proj_weight": p.params.in_proj_weight * q_rows[:, None],
                               "in_proj_bias": p.params.in_proj_bias * q_rows})
    np.testing.assert_allclose(V.VARIANTS["mha_scale_model_dim"].compute(p).output,
                               V.reference(V.MHAProblem(params, p.query, p.key, p.value)).output, rtol=1e-12)
    # no out_proj: out_proj_weight = I and no bias
    identity = spec.MHAParams(**{**p.params.__dict__, "out_proj_weight": np.eye(4), "out_proj_bias": None})
    np.testing.assert_allclose(V.VARIANTS["mha_no_out_proj"].compute(p).output,
                               V.reference(V.MHAProblem(identity, p.query, p.key, p.value)).output, rtol=1e-12)


def test_softmax_over_queries_against_a_loop():
    """Each key's column of weights sums to 1 over the queries; a column every query
    blocks gets weight 0 (here key 2 of batch item 0 is padding)."""
    kpm = np.zeros((2, 4), dtype=bool)
    kpm[0, 2] = True
    p = mha_problem(35, L=3, S=4, key_padding_mask=kpm)
    params, N, D = p.params, p.params.num_heads, p.params.embed_dim
    hd = D // N
    w_q, w_k, w_v = np.split(params.in_proj_weight, 3)
    b_q, b_k, b_v = np.split(params.in_proj_bias, 3)
    expected = np.zeros((3, 2, D))
    for b in range(2):
        q, k, v = p.query[:, b] @ w_q.T + b_q, p.key[:, b] @ w_k.T + b_k, p.value[:, b] @ w_v.T + b_v
        heads = []
        for n in range(N):
            cols = slice(n * hd, (n + 1) * hd)
            weights = np.zeros((3, 4))
            for s_ in range(4):
                if kpm[b, s_]:
                    continue
                column = [math.exp(float(q[t, cols] @ k[s_, cols]) / math.sqrt(hd)) for t in range(3)]
                weights[:, s_] = np.array(column) / sum(column)
            heads.append(weights @ v[:, cols])
        expected[:, b] = np.concatenate(heads, axis=-1) @ params.out_proj_weight.T + params.out_proj_bias
    got = V.VARIANTS["mha_softmax_over_queries"].compute(p)
    np.testing.assert_allclose(got.output, expected, rtol=1e-12)
    assert not np.allclose(got.output, V.reference(p).output)


def test_mha_mask_variants_against_reformulations():
    blocked = causal_blocked()
    p = mha_problem(33, attn_mask=blocked)
    inverted = V.reference(V.MHAProblem(p.params, p.query, p.key, p.value, attn_mask=~blocked)).output
    np.testing.assert_allclose(V.VARIANTS["mha_mask_inverted"].compute(p).output, inverted, rtol=1e-12)
    unmasked = V.reference(V.MHAProblem(p.params, p.query, p.key, p.value)).output
    hinted = V.MHAProblem(p.params, p.query, p.key, p.value, attn_mask=blocked, is_causal=True)
    np.testing.assert_allclose(V.VARIANTS["mha_causal_hint_dropped"].compute(hinted).output, unmasked, rtol=1e-12)
    bias = np.random.default_rng(2).normal(size=(3, 3))
    p = mha_problem(33, attn_mask=bias)
    everything_blocked = V.reference(V.MHAProblem(p.params, p.query, p.key, p.value, attn_mask=bias != 0)).output
    np.testing.assert_allclose(V.VARIANTS["mha_float_mask_as_bool"].compute(p).output, everything_blocked)
    # key padding read on the queries: padded query rows are fully masked -> out_proj_bias;
    # the other rows attend every key (the padding no longer reaches the keys)
    p = mha_problem(34, key_padding_mask=padding())
    output = V.VARIANTS["mha_padding_mask_on_queries"].compute(p).output    # (L, B, D)
    np.testing.assert_allclose(output[-1], np.broadcast_to(p.params.out_proj_bias, (2, 4)), rtol=1e-15)
    np.testing.assert_allclose(output[:-1], unmasked_rows(p)[:-1], rtol=1e-12)
    # fully-masked item 1 is NaN under the nan reading
    p = mha_problem(35, key_padding_mask=padding(all_of_item=1))
    result = V.VARIANTS["mha_fully_masked_nan"].compute(p)
    assert np.isnan(result.output[:, 1]).all() and np.isfinite(result.output[:, 0]).all()


def unmasked_rows(p: V.MHAProblem) -> np.ndarray:
    return V.reference(V.MHAProblem(p.params, p.query, p.key, p.value)).output


def test_forward_with_default_steps_is_the_oracle():
    from spec.variants.mha import _forward, _Steps

    for problem in random_mha_problems(20):
        mine, oracle = _forward(problem, _Steps()), V.reference(problem)
        np.testing.assert_allclose(mine.output, oracle.output, rtol=1e-13, atol=1e-15)
        if oracle.weights is None:
            assert mine.weights is None
        else:
            np.testing.assert_allclose(mine.weights, oracle.weights, rtol=1e-13, atol=1e-15)


# --------------------------------------------------------------------------- rank's API


def test_rank_accepts_ids_allowed_arrays_and_callables():
    problem = CASES["gqa_tiled"]()
    observed = V.VARIANTS["gqa_tiled"].compute(problem).output
    assert [m.variant_id for m in V.rank(observed, problem, ["gqa_tiled", "unscaled"])] == ["gqa_tiled"]
    assert V.rank(observed, problem, {"unscaled": V.VARIANTS["unscaled"]}) == []
    nudged = observed + 1e-9
    assert V.rank(nudged, problem, ["gqa_tiled"]) == []                        # 64 ulps is far less
    match, = V.rank(nudged, problem, ["gqa_tiled"], allowed=2e-9)
    assert match == ("gqa_tiled", pytest.approx(0.5))
    calls = []

    def runner_rule(part, result):
        calls.append(part)
        return 1e-8 * (1 + np.abs(result.output))

    assert V.rank(nudged, problem, ["gqa_tiled"], allowed=runner_rule)[0].variant_id == "gqa_tiled"
    assert set(calls) == {"output"}


def test_rank_compares_only_defined_rows_under_an_unspecified_policy():
    problem = V.SDPAProblem(**{**fully_masked_case().__dict__, "fully_masked": "unspecified"})
    observed = V.reference(problem).output.copy()
    observed[0, 0, 1] = 123.0                                                  # the undefined row
    assert V.rank(observed, problem) == []
    assert not V.VARIANTS["fully_masked_nan"].applies(problem)


def test_from_case_converts_the_runners_cases():
    from conformance.core.cases import MHACase, SDPACase

    problem = CASES["mask_inverted"]()
    case = SDPACase(problem.query, problem.key, problem.value, attend_mask=problem.attend_mask,
                    causal="upper_left", scale=0.5, dtype="float32", layout="transposed")
    converted = V.SDPAProblem.from_case(case, fully_masked="nan")
    assert (converted.causal, converted.scale, converted.dtype, converted.fully_masked) == \
        ("upper_left", 0.5, "float32", "nan")
    assert converted.attend_mask is problem.attend_mask and converted.dropout_p == 0.0
    p = mha_problem(1, attn_mask=causal_blocked())
    mha_case = MHACase(p.params, p.query, p.key, p.value, attn_mask=p.attn_mask, need_weights=False)
    converted = V.MHAProblem.from_case(mha_case, dropout=0.1)
    assert converted.attn_mask is p.attn_mask and not converted.need_weights and converted.dropout == 0.1
    duck = SimpleNamespace(query=p.query, key=p.key, value=p.value, params=p.params)
    assert V.MHAProblem.from_case(duck).params is p.params


def test_problems_reject_what_they_cannot_describe():
    good = sdpa_problem()
    with pytest.raises(spec.SpecError, match="query="):
        V.SDPAProblem(good.query[0], good.key, good.value)
    with pytest.raises(spec.SpecError, match="fully_masked="):
        V.SDPAProblem(good.query, good.key, good.value, fully_masked="ignore")
    with pytest.raises(spec.SpecError, match="dropout_p="):
        V.SDPAProblem(good.query, good.key, good.value, dropout_p=1.0)
    with pytest.raises(spec.SpecError, match="params="):
        V.MHAProblem(None, good.query, good.key, good.value)


def test_variants_run_without_torch():
    code = ("import sys, numpy as np; from spec import variants as V; "
            "p = V.SDPAProblem(np.ones((1, 2, 2, 1)), np.ones((1, 1, 3, 1)), np.ones((1, 1, 3, 1)), "
            "causal='upper_left', dtype='bfloat16'); "
            "[v.compute(p) for v in V.SDPA_VARIANTS]; V.rank(np.zeros((1, 2, 2, 1)), p); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')); "
            "assert not bad, bad")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------- the bug zoo


#: Bug-zoo mutant -> the variant that models its bug (every deterministic one the zoo has).
ZOO = {
    "fully_masked_nan": "fully_masked_nan", "bool_mask_inverted": "mask_inverted",
    "causal_lower_right": "causal_lower_right", "logits_in_input_dtype": "float16_overflow",
    "gqa_tile": "gqa_tiled", "scale_ignored": "scale_arg_ignored", "scale_sqrt_ev": "scale_value_dim",
    "scale_zero_falsy": "scale_zero_falsy", "no_max_subtraction": "no_max_subtraction",
    "mask_after_softmax": "mask_after_softmax", "tiled_ragged_tail_dropped": "ragged_tail_dropped",
    "tiled_no_rescale": "online_softmax_no_rescale", "tiled_bf16_accumulator": "bfloat16_accumulator",
    "tiled_kv_batch_offset": "kv_batch_offset", "tiled_global_max": "global_max",
    "mha_float_mask_as_bool": "mha_float_mask_as_bool", "mha_float_padding_ignored": "mha_float_padding_ignored",
    "mha_causal_hint_dropped": "mha_causal_hint_dropped", "mha_weights_summed": "mha_weights_summed_over_heads",
    "mha_fully_masked_nan": "mha_fully_masked_nan", "mha_scale_sqrt_embed_dim": "mha_scale_model_dim",
    "mha_split_heads_view": "mha_heads_split_without_transpose",
    "mha_missing_contiguous": "mha_heads_split_without_transpose",
    "mha_merge_without_transpose": "mha_heads_merged_without_transpose", "mha_no_out_proj": "mha_no_out_proj",
    "mha_mask_eq_zero": "mha_mask_inverted",
}


def run_mutant(name: str, problem):
    """The mutant's output on ``problem`` (SDPA: causal as the flag, upper-left as it declares)."""
    torch = pytest.importorskip("torch")
    from implementations.mutants import MUTANTS

    impl = MUTANTS[name].build()
    dtype = getattr(torch, problem.dtype)

    def tensor(array, cast=True):
        if array is None:
            return None
        result = torch.from_numpy(np.ascontiguousarray(array))
        return result.to(dtype) if cast and result.is_floating_point() else result

    if problem.level == "sdpa":
        assert problem.causal in (None, "upper_left")
        mask = tensor(problem.attend_mask if problem.additive_mask is None else problem.additive_mask)
        output = impl.sdpa(tensor(problem.query), tensor(problem.key), tensor(problem.value), attn_mask=mask,
                           is_causal=problem.causal is not None, scale=problem.scale,
                           enable_gqa=problem.key.shape[1] != problem.query.shape[1])
        return output.to(torch.float64).numpy()
    params = problem.params
    module = impl.mha(params.embed_dim, params.num_heads, batch_first=problem.batch_first, dtype=torch.float64)
    impl.load_weights(module, params)
    output, weights = module.eval()(tensor(problem.query), tensor(problem.key), tensor(problem.value),
                                    key_padding_mask=tensor(problem.key_padding_mask),
                                    need_weights=problem.need_weights, attn_mask=tensor(problem.attn_mask),
                                    average_attn_weights=problem.average_attn_weights,
                                    is_causal=problem.is_causal)
    return output.detach().numpy(), (None if weights is None else weights.detach().numpy())


#: Learner-level mutants (self-attention modules with no adapter) -> their variant.
LEARNER_ZOO = {
    "learner_scale_d_model": "mha_scale_model_dim",
    "learner_view_without_transpose": "mha_heads_split_without_transpose",
    "learner_softmax_over_queries": "mha_softmax_over_queries",
    "learner_padding_mask_inverted": "mha_padding_mask_inverted",
}


@pytest.mark.parametrize("mutant", sorted(LEARNER_ZOO))
def test_learner_mutants_are_explained_by_their_variant(mutant):
    """Through the learner level (probed conventions, no adapter) each classic mistake
    is still named: the probes did not absorb it."""
    variant_id = LEARNER_ZOO[mutant]
    base = mha_problem(36, B=2, N=2, L=3, S=3, D=4)
    kpm = padding(2, 3) if variant_id == "mha_padding_mask_inverted" else None
    problem = V.MHAProblem(base.params, base.query, base.query, base.query, key_padding_mask=kpm,
                           fully_masked="zero")
    matches = V.rank(run_mutant(mutant, problem), problem)
    assert matches, mutant
    best = {m.variant_id for m in matches if m.fit == matches[0].fit}
    assert variant_id in best and best - {variant_id} <= TIES.get(variant_id, set()), matches


@pytest.mark.parametrize("mutant", sorted(ZOO))
def test_bug_zoo_mutants_are_explained_by_their_variant(mutant):
    variant_id = ZOO[mutant]
    problem = CASES[variant_id]()
    matches = V.rank(run_mutant(mutant, problem), problem)
    assert matches, mutant
    best = {m.variant_id for m in matches if m.fit == matches[0].fit}
    assert variant_id in best and best - {variant_id} <= TIES.get(variant_id, set()), matches
