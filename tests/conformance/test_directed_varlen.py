"""The varlen level's directed cases carry their names (``notes``: ``directed: NAME``),
which a report names a shrunk case's start by: every property's cases (the options, FP8
and dropout builders included, on a target that declares every varlen feature) are named,
each name once per property, a variant's name saying what it adds; a name stays true of
lengths fitted to the declarations; and a saved case keeps its name (one saved before
cases carried names loads with none)."""

from __future__ import annotations

from conformance.calls.varlen import VarlenCase, case_from_meta, case_meta
from conformance.core.target import Target
from conformance.harness.directed_shrink import _name
from conformance.reporting.failures import load_case, save_case
from conformance.strategies.varlen import varlen_directed
from implementations import registry
from implementations.base import Capabilities
from implementations.capabilities import ALL_VARLEN_FEATURES
from tests.directed_cases import directed_cases

#: A correct implementation that declares every varlen feature (options, LSE, FP8, dropout).
REFERENCE = registry.resolve("varlen-reference")
PROPERTIES = {"varlen_agreement", "varlen_equivalence", "varlen_feature_agreement", "varlen_lse_agreement",
              "varlen_fp8_agreement", "varlen_dropout_expectation", "varlen_dropout_pattern_agreement"}


def _directed(dtype: str) -> list[tuple[str, VarlenCase]]:
    """(property, directed case) for every varlen property the reference runs in ``dtype``."""
    return directed_cases(Target(REFERENCE, "varlen", dtype, "cpu"))


def test_every_varlen_directed_case_is_named_and_keeps_its_name_when_saved(tmp_path):
    assert REFERENCE.caps("varlen").varlen_features == ALL_VARLEN_FEATURES   # every builder runs
    for dtype in ("float32", "float64"):
        directed = _directed(dtype)
        names = {(pid, _name(case)) for pid, case in directed}
        assert {pid for pid, _ in names} == PROPERTIES, dtype
        assert len(names) == len(directed) and not any(name == "?" for _, name in names), (dtype, names)
    # float64's cases below
    for named in [("varlen_agreement", "a query whose neighbour's first key sits right after its own"),
                  ("varlen_equivalence", "empty and one-token sequences side by side"),
                  ("varlen_lse_agreement", "causal with L > S and L < S in one packed batch"),
                  ("varlen_feature_agreement", "causal with L > S and L < S in one packed batch, window (1, 0)"),
                  ("varlen_feature_agreement", "empty and one-token sequences side by side, ALiBi slopes"),
                  ("varlen_fp8_agreement",
                   "empty and one-token sequences side by side, float8_e5m2, descales per sequence and kv head"),
                  ("varlen_fp8_agreement", "a query whose neighbour's first key sits right after its own, "
                                           "float8_e4m3fn, descales per tensor"),
                  ("varlen_dropout_expectation",
                   "a query whose neighbour's first key sits right after its own, V positive"),
                  ("varlen_dropout_pattern_agreement", "empty and one-token sequences side by side")]:
        assert named in names, named
    seen = set()
    for pid, case in directed:
        kind = (case.fp8 is not None, case.alibi_slopes is not None, case.window)
        if (pid, kind) in seen:
            continue
        seen.add((pid, kind))
        loaded, _ = load_case(save_case(case, tmp_path / f"{pid}-{len(seen)}.npz"))
        assert loaded.notes == case.notes and _name(loaded) == _name(case), pid
        assert loaded.describe() == case.describe(), pid
    # a case saved before cases carried names loads without one
    meta, arrays = case_meta(directed[0][1])
    del meta["notes"]
    assert case_from_meta(meta, arrays).notes == ()


def test_a_varlen_directed_name_stays_true_of_lengths_fitted_to_the_declarations():
    def named(**declared: object) -> list[tuple[str, list[tuple[int, int]]]]:
        caps = Capabilities(causal="lower_right", **declared)
        return [(_name(case), case.lengths()) for case in varlen_directed(caps=caps)]

    assert [name for name, _ in named()] == ["a query whose neighbour's first key sits right after its own",
                                             "empty and one-token sequences side by side",
                                             "causal with L > S and L < S in one packed batch"]
    # L == S declared: no empty sequence, no L != S
    assert named(self_attention_lengths=True) == [
        ("a query whose neighbour's first key sits right after its own", [(1, 1), (1, 1)]),
        ("one-token sequences beside longer ones", [(2, 2), (1, 1), (1, 1), (3, 3)]),
        ("causal sequences of (L, S) = (3, 3), (3, 3), (2, 2) in one packed batch", [(3, 3), (3, 3), (2, 2)])]
    assert named(max_seq_len=1)[2][0] == "causal sequences of (L, S) = (1, 1), (1, 1), (1, 1) in one packed batch"
    # causal only: every case is causal, and says so
    assert all(name.startswith("causal") or name.endswith(", causal") for name, _ in named(causal_only=True))
    # a variant's name extends the directed name and leaves other notes alone
    case = varlen_directed()[0].replace(notes=("directed: first", "other"))
    assert case.named_with("softcap 0.125") == ("directed: first, softcap 0.125", "other")
    assert case.replace(notes=()).named_with("softcap 0.125") == ()
