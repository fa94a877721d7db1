"""Shrinking a failing directed case of the sharded level (``conformance.directed.shrink``,
admitted by ``conformance.sharded.shrinking``): every sharded directed case remembers the
property's strategy arguments and is admitted; each pass proposes a smaller well-formed
case (fewer ranks, a shorter sequence, a narrower window, fewer heads, smaller head dims,
or quarter values) that a correct implementation agrees with; the world size is kept as
written where a group of another size does not start cheaply; proposals outside the
strategy or the declarations are refused; every directed case is named (the name kept
through shrinking, saving and loading); and sharded mutants are reported on cases shrunk
from the directed case they failed, the report naming where it started."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from conformance.core.target import Target
from conformance.directed import shrink
from conformance.sharded import shrinking
from conformance.sharded.cases import ShardedCallSpec, ShardedCase, validate
from conformance.sharded.level import report_sharded_call
from conformance.sharded.shrinking import admitted
from implementations import registry
from implementations.base import Implementation
from tests.mutant_runs import certify_mutant
from tests.directed_cases import directed_cases

ROOT = Path(__file__).resolve().parents[2]
RING, ULYSSES = registry.resolve("ring"), registry.resolve("ulysses")


def _target(impl: Implementation = RING) -> Target:
    return Target(impl, "sharded", "float64", "cpu")


def _directed(impl: Implementation = RING) -> list[tuple[str, ShardedCase]]:
    """(property, directed case) for every sharded property ``impl`` runs."""
    return directed_cases(_target(impl))


DIRECTED = {"ring": _directed(RING), "ulysses": _directed(ULYSSES)}
IMPLS = {"ring": RING, "ulysses": ULYSSES}


def _sizes(case: ShardedCase) -> tuple[int, ...]:
    # a window side of -1 (none) counts as the whole sequence
    sides = tuple(case.L if side < 0 else side for side in case.window)
    return (case.world_size, case.B, case.N, case.K, case.L, case.E, case.Ev, *sides)


def _proposals(impl: str, case: ShardedCase) -> list[tuple[int, ShardedCase]]:
    """(pass index, admitted proposal) of every pass on ``case``."""
    target, arguments = _target(IMPLS[impl]), shrink.arguments_of(case)
    return [(i, c) for i, p in enumerate(shrinking.passes(case)) for c in p(case)
            if admitted(target, c, **arguments)]


@pytest.mark.parametrize("impl", sorted(DIRECTED))
def test_every_sharded_directed_case_remembers_its_arguments_and_is_admitted(impl):
    assert len({pid for pid, _ in DIRECTED[impl]}) == 4 and len(DIRECTED[impl]) > 40
    target = _target(IMPLS[impl])
    for pid, case in DIRECTED[impl]:
        arguments = shrink.arguments_of(case)
        assert arguments is not None, (pid, case.describe())
        assert admitted(target, case, **arguments), (pid, case.describe())
        assert shrinking.passes(case), pid


@pytest.mark.parametrize("impl", sorted(DIRECTED))
def test_every_sharded_directed_case_is_named_and_keeps_its_name_when_saved(impl, tmp_path):
    from conformance.harness.directed_shrink import _name
    from conformance.reporting.failures import load_case, save_case
    from conformance.sharded.cases import case_from_meta, case_meta

    names = {(pid, _name(case)) for pid, case in DIRECTED[impl]}
    assert len(names) == len(DIRECTED[impl]) and not any(name == "?" for _, name in names), names
    ring = [("sharded_forward", "zigzag over 3 ranks, one position per chunk, causal: "
                                "the diagonal crosses every shard boundary"),
            ("sharded_backward", "every logit above 709, contiguous over 2 ranks, two positions per rank"),
            ("sharded_world_one", "window (1, 1), zigzag over 4 ranks, two positions per chunk"),
            ("sharded_layout_invariance", "window (1, 1), zigzag over 4 ranks, two positions per chunk, causal"),
            ("sharded_forward", "5 positions padded to 8, contiguous over 4 ranks, the last rank holding padding only")]
    for named in ring if impl == "ring" else ():
        assert named in names, named
    # a shrunk case keeps the name of the directed case it started from
    for pid, case in DIRECTED[impl][:3]:
        assert all(c.notes == case.notes for _, c in _proposals(impl, case)), pid
    for pid, case in [DIRECTED[impl][0], *[(p, c) for p, c in DIRECTED[impl] if c.padded or c.regime == "huge"]]:
        loaded, _ = load_case(save_case(case, tmp_path / f"{pid}-{id(case)}.npz"))
        assert loaded.notes == case.notes and _name(loaded) == _name(case), pid
        assert loaded.describe() == case.describe(), pid
    # a case saved before cases carried names loads without one
    meta, arrays = case_meta(DIRECTED[impl][0][1])
    del meta["notes"]
    assert case_from_meta(meta, arrays).notes == ()


@pytest.mark.parametrize("impl", sorted(DIRECTED))
def test_each_proposal_is_smaller_and_well_formed(impl):
    proposed, worlds = 0, 0
    for pid, case in DIRECTED[impl]:
        before = _sizes(case)
        for i, smaller in _proposals(impl, case):
            where = (pid, i, case.describe(), smaller.describe())
            after = _sizes(smaller)
            assert all(a <= b for a, b in zip(after, before, strict=True)), where
            if after == before:  # the values pass: quarters in [-2, 2]
                assert all(np.all(np.abs(a) <= 2) and np.all(a * 4 == np.round(a * 4))
                           for a in (smaller.query, smaller.key, smaller.value)), where
            # what the pass leaves alone stays as written
            assert (smaller.layout, smaller.causal, smaller.scale) == (case.layout, case.causal, case.scale), where
            if after != before:  # a cut: the first positions, heads and features of each input
                np.testing.assert_array_equal(smaller.query, case.query[:smaller.B, :smaller.N, :smaller.L, :smaller.E])
                np.testing.assert_array_equal(smaller.value, case.value[:smaller.B, :smaller.K, :smaller.L, :smaller.Ev])
            validate(smaller)
            worlds += smaller.world_size < case.world_size
            proposed += 1
    assert proposed > 300 and worlds > 40


def test_a_correct_implementation_agrees_with_the_first_proposal_of_each_pass():
    called = 0
    for impl in sorted(DIRECTED):
        for pid, case in DIRECTED[impl]:
            if pid != "sharded_forward":
                continue
            seen = set()
            for i, smaller in _proposals(impl, case):
                if i in seen:
                    continue
                seen.add(i)
                report = report_sharded_call(IMPLS[impl], ShardedCallSpec(smaller))
                assert not report.shows_failure, (impl, pid, i, smaller.describe(), report.text())
                called += 1
    assert called > 80


def test_a_window_cut_with_the_sequence_is_the_same_window():
    # a side longer than the sequence reaches every key, as one of L does: the oracle agrees
    [case] = [c for p, c in DIRECTED["ring"] if p == "sharded_forward" and c.window == (1, 1) and not c.causal
              and c.layout == "contiguous"]
    wide = case.replace(window=(7, 7))
    cut = shrinking._sharded_resized(wide, L=3)
    assert cut.window == (3, 3)
    from conformance.sharded.checks import bounds

    expected, _ = bounds(_target(), cut)
    whole, _ = bounds(_target(), shrinking._sharded_resized(wide.replace(window=(-1, -1)), L=3))
    np.testing.assert_array_equal(expected, whole)


def test_the_world_size_is_kept_where_groups_spawn(monkeypatch):
    [case] = [c for p, c in DIRECTED["ring"] if p == "sharded_forward" and c.regime == "huge"]
    assert case.world_size == 2
    fewer = list(shrinking._sharded_world(case))
    assert [c.world_size for c in fewer] == [1] and fewer[0].L == 3                # 4 positions, 3 at most on one rank
    monkeypatch.setenv("ATTENTION_CONFORMANCE_SHARDED_FORK", "0")                  # ranks spawned: no other size
    assert list(shrinking._sharded_world(case)) == []
    assert list(shrinking._sharded_world(case.replace(device="cuda"))) == []


def _refuses(target: Target, case: ShardedCase, **arguments: object) -> bool:
    return not admitted(target, case, **arguments)


def test_admission_refuses_a_case_the_property_does_not_draw():
    target = _target()
    [case] = [c for p, c in DIRECTED["ring"] if p == "sharded_world_one" and c.world_size == 2
              and c.layout == "contiguous" and c.causal and c.N == c.K][:1]
    arguments = shrink.arguments_of(case)
    assert arguments == {"min_world": 2}
    assert admitted(target, case, **arguments)
    assert _refuses(target, case.replace(world_size=1), **arguments)               # one rank: not this property's
    assert admitted(target, case.replace(world_size=1))
    assert _refuses(target, case, layouts=("zigzag",))                             # a layout it does not draw
    assert _refuses(target, case.replace(world_size=1), **{"causal": False})       # causal drawn off
    long = case.replace(query=np.zeros((1, 1, 7, 2)), key=np.zeros((1, 1, 7, 2)), value=np.zeros((1, 1, 7, 2)))
    assert _refuses(target, long)                                                  # 7 > 3 units of 2
    assert _refuses(target, case.replace(window=(1, 3)))                           # a side past L = 2
    assert _refuses(target, case.replace(scale=0.3))                               # a scale it does not draw
    wide = case.replace(query=np.zeros((3, 1, 2, 2)), key=np.zeros((3, 1, 2, 2)), value=np.zeros((3, 1, 2, 2)))
    assert _refuses(target, wide)                                                  # B = 3


def test_admission_refuses_a_case_outside_the_declarations():
    [case] = [c for p, c in DIRECTED["ring"] if p == "sharded_forward" and c.window != (-1, -1)][:1]
    arguments = shrink.arguments_of(case)
    assert admitted(_target(), case, **arguments)

    def narrow(**changes: object) -> Target:
        caps = RING.caps("sharded").replace(**changes)
        return _target(Implementation(name="narrow", sharded=RING.sharded, capabilities=caps))

    assert admitted(narrow(), case, **arguments)
    assert _refuses(narrow(sharded_features=frozenset({"padding"})), case, **arguments)   # a window
    unpadded = shrinking._sharded_resized(case, L=case.L - 1)
    assert admitted(narrow(), unpadded, **arguments)
    assert _refuses(narrow(sharded_features=frozenset({"window"})), unpadded, **arguments)  # padding
    assert _refuses(narrow(max_world_size=2), case, **arguments)                   # 4 ranks
    grouped = case.replace(query=np.concatenate([case.query, case.query], axis=1))
    assert admitted(narrow(), grouped, **arguments)
    assert _refuses(narrow(gqa=False), grouped, **arguments)                       # N = 2K
    # all-to-all: every rank holds whole heads, so N and K stay multiples of W
    [heads] = [c for p, c in DIRECTED["ulysses"] if p == "sharded_forward" and c.world_size == 2][:1]
    assert heads.N == 2 and admitted(_target(ULYSSES), heads, **shrink.arguments_of(heads))
    assert _refuses(_target(ULYSSES), shrinking._sharded_resized(heads, N=1, K=1), **shrink.arguments_of(heads))


def test_shrink_finds_the_smallest_case_a_failure_needs():
    # a check that fails while two ranks share a sequence of two positions or more
    [case] = [c for p, c in DIRECTED["ring"] if p == "sharded_forward" and c.window != (-1, -1) and c.causal
              and c.layout == "contiguous"]
    target, arguments = _target(), shrink.arguments_of(case)
    assert (case.world_size, case.L, case.window) == (4, 8, (1, 1))

    def fails(c: ShardedCase) -> bool:
        return c.world_size >= 2 and c.L >= 2

    smallest, checked = shrink.shrink(case, fails, admit=lambda c: admitted(target, c, **arguments), budget=200,
                                      passes_of=shrinking.passes)
    assert (smallest.world_size, smallest.B, smallest.N, smallest.L, smallest.E, smallest.Ev) == (2, 1, 1, 2, 1, 1)
    assert smallest.window == (0, 0) and smallest.causal and smallest.layout == "contiguous"
    assert 0 < checked <= 200



@pytest.mark.parametrize("mutant,prop,shrunk", [
    # at world size 1 the ring loop runs no step at all
    ("sharded_last_step_skipped", "sharded_forward", (1, 1, (-1, -1))),
    # rank 1's window placed at its local position 0: two ranks, one position each
    ("sharded_window_local", "sharded_forward", (2, 2, (0, 0))),
    # zigzag's two chunks read swapped: one rank, its two chunks
    ("sharded_zigzag_swapped", "sharded_layout_invariance", (1, 1, (-1, -1))),
])
def test_a_sharded_mutant_is_reported_on_a_shrunk_case(tmp_path, mutant, prop, shrunk):
    report, output = certify_mutant(tmp_path, mutant, "conformance/test_sharded.py", prop)
    [r] = [r for r in report["results"] if r["property"] == prop]
    assert r["outcome"] == "failed", output[-3000:]
    # where it started: the directed example's name and the case as written
    assert re.search(r'\(shrunk in \d+ examples from the directed example "[^"]+": sharded world_size=\d', output), \
        output[-3000:]
    ce = r["counterexample"]
    assert (ce["world_size"], ce["L"], (ce["window_left"], ce["window_right"])) == shrunk, ce
    assert (ce["B"], ce["E"], ce["Ev"]) == (1, 1, 1), ce
    assert r["causes"][0]["variant"] == mutant, r["causes"]                       # each variant named as its mutant
