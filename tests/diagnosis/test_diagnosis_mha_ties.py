"""Ties at the MHA level: variants that explain a failing module call equally are told
apart on cases derived from it (``conformance.diagnosis.mha_cases``), as at the SDPA
level. Without them a learner's inverted padding mask, first failing on one fully
masked key (S = 1, where attending it and attending every key uniformly agree), read
"unknown"."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

import spec
from conformance.core.cases import MHACase
from conformance.diagnosis.mha_cases import mha_derived_cases
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]


def _case(self_attention: bool = True, **changes) -> MHACase:
    rng = np.random.default_rng(3)
    params = spec.MHAParams.random(rng, 4, 2)
    x = rng.standard_normal((3, 2, 4))
    other = rng.standard_normal((3, 2, 4))
    case = MHACase(params, x, x if self_attention else other, x if self_attention else other,
                   key_padding_mask=np.array([[False, False, True], [True, True, True]]), need_weights=False)
    return case.replace(**changes) if changes else case


def test_derived_cases_keep_self_attention_and_let_the_new_keys_attend():
    derived = dict(mha_derived_cases(_case()))
    assert set(derived) == {"B=2, L=4, S=4", "B=2, L=5, S=5", "B=3, L=3, S=3"}  # L grows with S
    grown = derived["B=2, L=4, S=4"]
    assert grown.key is grown.query and grown.value is grown.query
    assert grown.key_padding_mask.tolist() == [[False, False, True, False], [True, True, True, False]]
    assert grown.query.shape == (4, 2, 4) and np.array_equal(grown.query[:3], _case().query)
    more = derived["B=3, L=3, S=3"]
    assert more.query.shape == (3, 3, 4) and more.key_padding_mask[2].tolist() == [False] * 3


def test_derived_cases_of_a_cross_attention_grow_keys_alone_and_respect_batch_first():
    case = _case(self_attention=False)
    case = case.replace(query=np.swapaxes(case.query, 0, 1).copy(), key=np.swapaxes(case.key, 0, 1).copy(),
                        value=np.swapaxes(case.value, 0, 1).copy(), batch_first=True)
    derived = dict(mha_derived_cases(case))
    assert derived["B=2, L=3, S=4"].key.shape == (2, 4, 4) and derived["B=2, L=3, S=4"].query.shape == (2, 3, 4)
    assert derived["B=2, L=4, S=3"].query.shape == (2, 4, 4)


def test_a_causal_case_keeps_its_sizes_and_a_per_head_mask_its_batch():
    causal = _case(is_causal=True, attn_mask=np.triu(np.ones((3, 3), dtype=bool), 1))
    assert [d for d, _ in mha_derived_cases(causal)] == ["B=3, L=3, S=3"]
    per_head = _case(attn_mask=np.zeros((4, 3, 3), dtype=bool))
    assert "B=3, L=3, S=3" not in dict(mha_derived_cases(per_head))
    assert dict(mha_derived_cases(per_head))["B=2, L=4, S=4"].attn_mask.shape == (4, 4, 4)


def test_an_inverted_padding_mask_first_failing_on_one_key_is_named(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    env["ATTENTION_CONFORMANCE_FAILURES"] = str(tmp_path / "failures")
    proc = pytest_process.run(
        [sys.executable, "-m", "pytest", str(ROOT / "conformance"), "-p", "no:cacheprovider", "-q",
         "--impl=mutant:learner_padding_mask_inverted", "-k", "mha_fully_masked_rows", "--dtype=float64",
         "--hypothesis-profile=ci"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert "shrunk case: B=1 L=1 S=1" in output, output[-3000:]   # the case that cannot tell them apart
    assert "probable cause: mha_padding_mask_inverted — " in output, output[-3000:]
    line = next(x for x in output.splitlines() if x.startswith("probable cause: mha_padding_mask_inverted"))
    assert "fewer other cases: mha_fully_masked_uniform" in line, line   # a tie, broken by other cases
    assert "a discriminating case (B=1, L=2, S=2)" in line, line         # one of them derived here
