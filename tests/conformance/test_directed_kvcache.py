"""Shrinking a failing directed case of the kvcache level (``conformance.directed.shrink``,
admitted by ``conformance.directed.admission``): each pass proposes a smaller case that is
still well formed (the oracle takes it, a correct implementation agrees with it, and what
the pass leaves alone reads the same), proposals outside the property's strategy or the
target's declarations are refused, and a kvcache mutant is reported on a smaller case
than the directed one it failed first, the report naming where it started."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conformance.calls.kvcache import (
    KVCacheCallSpec,
    KVCacheCase,
    case_from_meta,
    case_meta,
    report_kvcache_call,
    validate,
)
from conformance.calls.sequences.calling import as_pages
from conformance.core.target import Target
from conformance.directed import shrink, shrink_sequences
from conformance.directed.admission import admitted
from implementations import registry
from implementations.base import Capabilities, Implementation
from tests.mutant_runs import certify_mutant
from tests.directed_cases import directed_cases

ROOT = Path(__file__).resolve().parents[2]
#: The kvcache properties' directed builders, each run on a correct implementation.
REFERENCE = registry.resolve("varlen-reference")


def _target(impl: Implementation = REFERENCE, dtype: str = "float64") -> Target:
    return Target(impl, "kvcache", dtype, "cpu")


def _directed() -> list[tuple[str, KVCacheCase]]:
    """(property, directed case) for every kvcache property the reference runs."""
    return directed_cases(_target())


DIRECTED = _directed()


def _sizes(case: KVCacheCase) -> tuple[int, ...]:
    pages = 0 if case.page_order is None else len(case.page_order) * case.page_size   # rows in all pages
    rotary = 0 if case.rotary_cos is None else int(np.size(case.rotary_cos))
    return (case.B, case.N, case.K, case.L, case.S_new, sum(case.cache_seqlens), case.S_cache, case.E, case.Ev,
            case.k_cache.shape[0], case.page_size or 0, pages, rotary)


def _values(case: KVCacheCase) -> list[np.ndarray]:
    return [np.asarray(getattr(case, n)) for n in ("query", "k_cache", "v_cache", "k_new", "v_new")
            if getattr(case, n) is not None]


def _proposals(case: KVCacheCase) -> list[tuple[int, KVCacheCase]]:
    """(pass index, admitted proposal) of every pass on ``case``."""
    target, arguments = _target(), shrink.arguments_of(case)
    return [(i, c) for i, p in enumerate(shrink.passes(case)) for c in p(case)
            if c is not None and admitted(target, c, **arguments)]


def test_every_kvcache_directed_case_remembers_its_arguments_and_is_admitted():
    assert len({pid for pid, _ in DIRECTED}) >= 12 and len(DIRECTED) > 60
    target = _target()
    for pid, case in DIRECTED:
        arguments = shrink.arguments_of(case)
        assert arguments is not None, (pid, case.describe())
        assert admitted(target, case, **arguments), (pid, case.describe())
        assert shrink.passes(case), pid


def test_each_proposal_is_smaller_and_well_formed():
    proposed = 0
    for pid, case in DIRECTED:
        before = _sizes(case)
        for i, smaller in _proposals(case):
            where = (pid, i, case.describe(), smaller.describe())
            after = _sizes(smaller)
            values_only = after == before
            assert values_only or all(a <= b for a, b in zip(after, before, strict=True)), where
            if values_only:  # the values pass: quarters in [-2, 2] (FP8 values are left as written)
                assert case.fp8 is None and all(np.all(np.abs(a) <= 2) and np.all(a * 4 == np.round(a * 4))
                                                for a in _values(smaller)), where
            validate(smaller)
            proposed += 1
    assert proposed > 500


def test_a_correct_implementation_agrees_with_the_first_proposal_of_each_pass():
    called = 0
    for pid, case in DIRECTED:
        seen = set()
        for i, smaller in _proposals(case):
            if i in seen:
                continue
            seen.add(i)
            for paged in sorted({False, smaller.paged}):
                report = report_kvcache_call(REFERENCE, KVCacheCallSpec(smaller, paged=paged))
                assert not report.shows_failure, (pid, i, smaller.describe(), report.text())
                called += 1
    assert called > 200


def _oracle(case: KVCacheCase) -> np.ndarray:
    return case.oracle().output


def test_a_sequence_alone_is_the_same_problem_as_in_the_batch():
    checked = 0
    for pid, case in DIRECTED:
        if case.B < 2:
            continue
        for b in range(case.B):
            alone = shrink_sequences._kvcache_resized(case, [b])
            assert alone is not None and alone.B == 1, pid
            assert alone.cache_seqlens == (case.cache_seqlens[b],)
            np.testing.assert_array_equal(_oracle(alone)[0], _oracle(case)[b], err_msg=f"{pid} {case.describe()}")
            checked += 1
    assert checked > 100


def test_room_pages_and_spare_rows_change_no_output():
    # less room past the valid rows, smaller pages, fewer spare pages or cache rows: the
    # same problem (the oracle's output, and a paged call's through its block table)
    changed = 0
    passes = (shrink_sequences._kvcache_capacity, shrink_sequences._kvcache_page_size, shrink_sequences._kvcache_spare)
    for pid, case in DIRECTED:
        for proposals in passes:
            for smaller in proposals(case):
                if smaller is None:
                    continue
                np.testing.assert_array_equal(_oracle(smaller), _oracle(case), err_msg=pid)
                if smaller.paged:
                    pages, table = as_pages(smaller, smaller.k_cache)
                    np.testing.assert_array_equal(pages[table].reshape(smaller.k_cache.shape), smaller.k_cache)
                    assert sorted(smaller.page_order) == list(range(len(smaller.page_order)))
                    assert len(smaller.page_order) - smaller.B * (smaller.S_cache // smaller.page_size) == \
                        len(shrink_sequences._kvcache_pages(smaller)[1])
                changed += 1
    assert changed > 50


def test_a_batch_cut_keeps_the_cache_rows_named_and_the_pages_in_their_order():
    [case] = [c for pid, c in DIRECTED if pid == "kvcache_batch_idx_agreement" and not c.causal]
    assert case.cache_batch_idx == (2, 0) and case.k_cache.shape[0] == 3
    first = shrink_sequences._kvcache_resized(case, [0])
    assert first.cache_batch_idx == (2,) and first.k_cache.shape[0] == 3           # two rows besides it
    np.testing.assert_array_equal(first.k_cache[2], case.k_cache[2, :first.S_cache])
    fewer = shrink_sequences._kvcache_resized(first, rows=[1, 2])                            # a spare row left out
    assert fewer.cache_batch_idx == (1,) and fewer.k_cache.shape[0] == 2
    np.testing.assert_array_equal(fewer.k_cache[1], case.k_cache[2, :fewer.S_cache])
    [paged] = [c for pid, c in DIRECTED if pid == "paged_equivalence" and c.B == 2 and not c.causal][:1]
    assert paged.page_order == (4, 3, 2, 1, 0)
    assert shrink_sequences._kvcache_resized(paged, [1]).page_order == (2, 1, 0)             # still reversed, one spare


def test_every_kvcache_directed_case_is_named_and_keeps_its_name_when_saved(tmp_path):
    from conformance.harness.directed_shrink import _name
    from conformance.reporting.failures import load_case, save_case

    names = {(pid, _name(case)) for pid, case in DIRECTED}
    assert len(names) == len(DIRECTED) and not any(name == "?" for _, name in names)
    assert ("kvcache_feature_agreement",
            "an empty cache beside one of 2 keys, stale rows past both, window (1, 0)") in names
    for pid, case in [DIRECTED[0], *[(p, c) for p, c in DIRECTED if c.paged or c.fp8 or c.rotary_cos is not None]]:
        loaded, _ = load_case(save_case(case, tmp_path / f"{pid}-{id(case)}.npz"))
        assert loaded.notes == case.notes and _name(loaded) == _name(case), pid
        assert loaded.describe() == case.describe(), pid
    # a case saved before cases carried names loads without one
    meta, arrays = case_meta(DIRECTED[0][1])
    del meta["notes"]
    assert case_from_meta(meta, arrays).notes == ()


def _refuses(target: Target, case: KVCacheCase, **arguments: Any) -> bool:
    return not admitted(target, case, **arguments)


def test_admission_refuses_a_case_outside_the_declarations():
    [(_, case)] = [(p, c) for p, c in DIRECTED if p == "kvcache_agreement"][:1]
    arguments = shrink.arguments_of(case)
    assert case.N == 2 and case.K == 1 and case.E == 2
    assert admitted(_target(), case, **arguments)

    def narrow(**caps: Any) -> Target:
        base = REFERENCE.caps("kvcache")
        fields = {name: getattr(base, name) for name in ("kvcache_features", "causal", "fp8_dtypes")}
        return _target(Implementation(name="narrow", kvcache=REFERENCE.kvcache,
                                      capabilities=Capabilities(**{**fields, **caps})))

    assert admitted(narrow(), case, **arguments)
    assert _refuses(narrow(gqa=False), case, **arguments)                      # K < N
    assert _refuses(narrow(max_head_dim=1), case, **arguments)                 # E = 2
    [append] = [c for p, c in DIRECTED if p == "kvcache_agreement" and c.S_new == 1]
    assert admitted(narrow(), append, **arguments)
    assert _refuses(narrow(kv_append=False), append, **arguments)              # new keys
    paged = [c for p, c in DIRECTED if p == "paged_equivalence"][0]
    assert _refuses(narrow(kv_paged=False), paged, **shrink.arguments_of(paged))
    fp8 = [c for p, c in DIRECTED if p == "kvcache_fp8_agreement"][0]
    assert admitted(narrow(), fp8, **shrink.arguments_of(fp8))
    assert _refuses(narrow(fp8_dtypes=()), fp8, **shrink.arguments_of(fp8))


def test_admission_refuses_a_case_the_property_does_not_draw():
    target = _target()
    [case] = [c for p, c in DIRECTED if p == "kvcache_agreement" and c.S_new == 1]
    arguments = shrink.arguments_of(case)
    assert admitted(target, case, **arguments)
    room = case.replace(k_cache=np.zeros((case.B, 9, case.K, case.E)), v_cache=np.zeros((case.B, 9, case.K, case.Ev)))
    assert _refuses(target, room, **arguments)                                 # more than 3 rows of room
    full = case.replace(cache_seqlens=(case.S_cache, 0))
    assert _refuses(target, full, **arguments)                                 # no row for the new key
    assert _refuses(target, case, **{**arguments, "append": False})            # new keys without an append
    assert _refuses(target, case, **{**arguments, "paged": True})              # contiguous where pages are drawn
    assert _refuses(target, case.replace(window=(0, 0)), **arguments)          # an option left False
    assert admitted(target, case.replace(window=(0, 0)), **{**arguments, "window": None})
    assert _refuses(target, case, **{**arguments, "max_batch": 1})             # B = 2
    rotary = [c for p, c in DIRECTED if p == "kvcache_rotary_agreement"][0]
    rotary_arguments = shrink.arguments_of(rotary)
    assert admitted(target, rotary, **rotary_arguments)
    assert _refuses(target, rotary.replace(rotary_cos=rotary.rotary_cos[:3], rotary_sin=rotary.rotary_sin[:3]),
                    **rotary_arguments)                                        # a table short of the positions
    assert _refuses(target, rotary.replace(rotary_cos=None, rotary_sin=None), **rotary_arguments)
    paged = [c for p, c in DIRECTED if p == "paged_equivalence"][0]
    order = list(paged.page_order)
    order[0] = order[1]
    assert _refuses(target, paged.replace(page_order=tuple(order)), **shrink.arguments_of(paged))


def test_shrink_finds_the_smallest_case_a_failure_needs():
    # a check that fails while some sequence's cache holds a row past the valid ones and
    # E >= 2: everything else shrinks away
    [case] = [c for p, c in DIRECTED if p == "kvcache_leftpad_agreement" and c.causal]
    target, arguments = _target(), shrink.arguments_of(case)

    def fails(c: KVCacheCase) -> bool:
        return c.E >= 2 and any(n + c.S_new < c.S_cache for n in c.cache_seqlens)

    smallest, checked = shrink.shrink(case, fails, admit=lambda c: admitted(target, c, **arguments), budget=200)
    assert (smallest.B, smallest.N, smallest.L, smallest.S_new, smallest.E, smallest.Ev) == (1, 1, 1, 0, 2, 1)
    # the cache no shorter than its pad (1) and one row of room past it
    assert (smallest.cache_seqlens, smallest.cache_leftpad, smallest.S_cache) == ((1,), (1,), 2)
    assert 0 < checked <= 200



@pytest.mark.parametrize("mutant,prop,test_file,name,directed", [
    ("paged_block_table_ignored", "paged_equivalence", "conformance/test_varlen.py",
     "an append of one key into a cache with room past it; paged: pages of 2 rows in reverse order, one spare",
     "kvcache B=2 L=1 N=2 K=1 E=2 Ev=2 S_cache=4 cache_seqlens=[1, 0] S_new=1 page_size=2 page_order=[4, 3, 2, 1, 0]"),
    ("kvcache_batch_idx_ignored_on_read", "kvcache_batch_idx_agreement", "conformance/test_varlen.py",
     "two sequences naming rows 2 and 0 of a three-row cache",
     "kvcache B=2 L=1 N=2 K=1 E=4 Ev=4 S_cache=4 cache_seqlens=[1, 2]"),
    ("kvcache_fp8_new_keys_undescaled", "kvcache_fp8_agreement", "conformance/test_flash_fp8.py",
     "an append of one key into a cache with room past it, float8_e4m3fn, descales per sequence and kv head",
     "kvcache B=2 L=1 N=2 K=1 E=2 Ev=2 S_cache=4 cache_seqlens=[1, 0] S_new=1"),
])
def test_a_kvcache_mutant_is_reported_on_a_shrunk_case(tmp_path, mutant, prop, test_file, name, directed):
    report, output = certify_mutant(tmp_path, mutant, test_file, prop)
    [r] = [r for r in report["results"] if r["property"] == prop]
    assert r["outcome"] == "failed", output[-3000:]
    # where it started: the directed example's name and the case as written
    assert re.search(rf'\(shrunk in \d+ examples from the directed example "{re.escape(name)}": '
                     rf"{re.escape(directed)}", output), output[-3000:]
    assert "shrunk case: kvcache B=1 L=1 N=1 K=1 E=1 Ev=1" in output, output[-3000:]
    ce = r["counterexample"]
    assert (ce["B"], ce["N"], ce["K"], ce["L"], ce["E"], ce["Ev"]) == (1, 1, 1, 1, 1, 1), ce
    assert ce["S"] <= 2, ce
