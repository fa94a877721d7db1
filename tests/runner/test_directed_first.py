"""A run that stops at its first failure checks every property's directed cases before
any random search (``conformance.harness.directed_first``): a wrong implementation caught by a
directed case of a late property fails it first, with no passing test before it, and a
correct one is certified exactly as without the pass, with no case checked twice. A
failing directed case is shrunk (``conformance.harness.directed_shrink``) and then followed
by the search, and the smaller of the two failing cases is reported
(``conformance.harness.runner``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]
COUNTING = "tests/runner/impls_for_tests.py:counting_impl"


def run(tmp_path: Path, name: str, *args: str, calls: Path | None = None) -> tuple[dict, str]:
    env = dict(os.environ, ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "failures"),
               ATTENTION_CONFORMANCE_STATE=str(tmp_path / "state"))
    env = {k: v for k, v in env.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    if calls is not None:
        env["CONFORMANCE_TEST_CALLS"] = str(calls)
    proc = pytest_process.run(
        [sys.executable, "-m", "pytest", "conformance", "-p", "no:cacheprovider", "-q",
         "--hypothesis-profile=ci", f"--conformance-report={tmp_path}/{name}", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env, check=False,
    )
    output = proc.stdout + proc.stderr
    report = tmp_path / f"{name}.json"
    assert report.exists(), output[-3000:]
    return json.loads(report.read_text()), output


def test_a_directed_case_of_a_late_property_fails_first_under_x(tmp_path):
    # logits_in_input_dtype is caught by a directed case of large_logits, a float16
    # property that comes after a dozen others (which pass on it) in the measured order.
    report, output = run(tmp_path, "cert", "--impl=mutant:logits_in_input_dtype", "-x")
    ran = [r for r in report["results"] if r["outcome"] != "skipped"]
    assert [r["outcome"] for r in ran] == ["failed"], output[-3000:]
    assert "passed" not in output.splitlines()[-1], output[-3000:]


def test_a_correct_implementation_is_certified_alike_with_and_without_x(tmp_path):
    selection = ("--dtype", "float64", "-k",
                 "forward_agreement or fully_masked_rows or layout_independence or small_sizes_sweep")

    def certify(name: str, *args: str) -> tuple[list[tuple], int]:
        calls = tmp_path / f"{name}.calls"
        report, output = run(tmp_path, name, f"--impl={COUNTING}", *selection, *args, calls=calls)
        rows = sorted((r["property"], r["dtype"], r["outcome"], r["examples"], r["worst_ratio"])
                      for r in report["results"] if r["outcome"] != "skipped")
        assert len(rows) == 4 and all(row[2] == "passed" for row in rows), output[-3000:]
        return rows, len(calls.read_text())

    plain, plain_calls = certify("plain")
    stopping, stopping_calls = certify("stopping", "-x")
    assert stopping == plain  # the same examples counted, the same headroom
    assert stopping_calls == plain_calls  # a directed case or sweep that passed is not called again


def test_a_bug_only_the_sweep_finds_fails_the_sweep_first_under_x(tmp_path):
    # NaN only at L = 3, S = 4: no directed case has that size; the sweep, run whole in
    # the directed pass after every directed case, finds it before any random search.
    report, output = run(tmp_path, "cert", "--impl=tests/runner/impls_for_tests.py:nan_at_one_size_impl", "-x")
    ran = [(r["property"], r["outcome"]) for r in report["results"] if r["outcome"] != "skipped"]
    assert ran == [("small_sizes_sweep", "failed")], output[-3000:]


def _sizes(record: dict) -> dict:
    return {k: record["counterexample"][k] for k in ("B", "N", "K", "L", "S", "E", "Ev")}


def test_a_failing_directed_case_is_followed_by_the_search_and_the_smaller_case_reported(tmp_path):
    # The explicit scale dropped: forward_agreement's first failing directed case is the
    # one with scale 0 (B=N=K=1, L=1, S=2, E=Ev=4: sizes summing to 14); the search goes
    # on, finds the bug too and shrinks it below that.
    report, output = run(tmp_path, "cert", "--impl=tests/runner/impls_for_tests.py:ignores_scale_impl",
                         "--dtype", "float64", "-k", "forward_agreement")
    (record,) = [r for r in report["results"] if r["outcome"] != "skipped"]
    assert record["outcome"] == "failed", output[-3000:]
    assert sum(_sizes(record).values()) < 14, (_sizes(record), output[-3000:])


def test_a_directed_failure_the_search_cannot_find_is_shrunk_keeping_what_makes_it_fail(tmp_path):
    # wrong only at S = 33 with Ev = 2 (the directed "two key blocks + 1" example, L=2 E=4):
    # the search never draws it; the directed case is shrunk where the bug allows
    report, output = run(tmp_path, "cert", "--impl=tests/runner/impls_for_tests.py:wrong_at_s33_ev2_impl",
                         "--dtype", "float64", "-k", "forward_agreement")
    (record,) = [r for r in report["results"] if r["outcome"] != "skipped"]
    assert record["outcome"] == "failed", output[-3000:]
    sizes = _sizes(record)
    assert (sizes["S"], sizes["Ev"], sizes["L"]) == (33, 2, 1), output[-3000:]
    assert sizes["E"] < 4, output[-3000:]
    assert 'from the directed example "two key blocks + 1 (S=33), Ev != E"' in output, output[-3000:]


def test_a_sweep_failure_keeps_its_ratio_on_the_certificate(tmp_path):
    # 1% too large at L = 7, S = 13 only: the sweep fails with a value mismatch, and the
    # FAIL cell shows that mismatch's worst error/allowed ratio, although the sweep
    # re-raises the failure with the smallest size added to its message.
    report, output = run(tmp_path, "cert", "--impl=tests/runner/impls_for_tests.py:scaled_at_one_size_impl",
                         "--dtype", "float64", "-k", "small_sizes_sweep")
    (record,) = [r for r in report["results"] if r["outcome"] != "skipped"]
    assert record["outcome"] == "failed", output[-3000:]
    assert record["worst_ratio"] is not None and record["worst_ratio"] > 1, (record, output[-3000:])
    assert "smallest failing size of the sweep: L=7, S=13" in output, output[-3000:]


def test_the_mha_shrink_passes_drop_masks_cut_batch_and_lengths_and_round_weights():
    import numpy as np

    import spec
    from conformance.core.cases import MHACase
    from conformance.directed import shrink

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 4))
    causal = np.triu(np.ones((3, 3), dtype=bool), 1)
    case = MHACase(spec.MHAParams.random(rng, 4, 2), x, x, x, attn_mask=causal, is_causal=True,
                   key_padding_mask=np.array([[False, False, True], [False, True, True]]))
    masks, batch, heads, head_dim, lengths, queries, values, weights = shrink.passes(case)
    fewer = list(queries(case))  # fewer queries over the same keys: cross-attention, key = value
    assert [c.L for c in fewer] == [1, 2] and all(c.S == 3 and c.key is c.value and not c.self_attention
                                                 for c in fewer)
    assert fewer[0].attn_mask.tolist() == [[False, True, True]]
    # the key padding goes (an is_causal case keeps its attn_mask, which the flag describes)
    (unpadded,) = list(masks(case))
    assert unpadded.key_padding_mask is None and unpadded.attn_mask is causal
    bare, unpadded, unmasked = list(masks(case.replace(is_causal=False, notes=("fully_masked:forced",))))
    assert bare.key_padding_mask is None and bare.attn_mask is None and bare.notes == ()
    assert unpadded.attn_mask is causal and unmasked.key_padding_mask is case.key_padding_mask
    (first_weights, *_) = list(weights(case))
    w = first_weights.params.in_proj_weight
    assert np.all(np.abs(w) <= 2) and np.all(w == np.round(w)) and np.abs(w).max() == 2
    assert list(weights(first_weights)) == []  # already simple: nothing more to propose
    assert [c.N for c in heads(case)] == [1] and [c.D for c in head_dim(case)] == [2]
    (one,) = list(batch(case))
    assert one.query.shape == (3, 1, 4) and one.key_padding_mask.tolist() == [[False, False, True]]
    smaller = list(lengths(case))
    assert [c.L for c in smaller] == [1, 2] and all(c.key is c.query and c.value is c.query for c in smaller)
    assert smaller[1].attn_mask.tolist() == np.triu(np.ones((2, 2), dtype=bool), 1).tolist()
    rounded = next(values(case))
    assert rounded.key is rounded.query and np.all(rounded.query * 2 == np.round(rounded.query * 2))


def test_a_failing_mha_directed_case_is_shrunk(tmp_path):
    # -x: the run stops at the directed failure (without it the search goes on and may
    # report a case of its own)
    report, output = run(tmp_path, "cert", "--impl=mutant:mha_causal_hint_dropped", "--dtype", "float64",
                         "-k", "test_mha_agreement", "-x")
    (record,) = [r for r in report["results"] if r["outcome"] != "skipped"]
    assert record["outcome"] == "failed", output[-3000:]
    assert (record["counterexample"]["L"], record["counterexample"]["S"]) == (1, 1), output[-3000:]
    assert 'from the directed example "is_causal with add_zero_attn, need_weights=False"' in output, output[-3000:]
    assert "failing case:" not in output and "shrunk case: B=1 L=1 S=1" in output, output[-3000:]


def test_flash_passes_cut_the_options_with_the_sizes():
    """A flash case's size passes cut ALiBi slopes and sinks to the heads kept and per-head
    FP8 descales to the batch and kv heads kept; its features stay as written."""
    import numpy as np

    from conformance.calls.flash_cases import FlashCase
    from conformance.directed import shrink

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s) for s in ((2, 3, 4, 2), (2, 5, 2, 2), (2, 5, 2, 2)))
    case = FlashCase(q, k, v, causal=True, window=(1, 0), alibi_slopes=np.ones((2, 4)), sinks=np.arange(4.0),
                     fp8="float8_e4m3fn", q_descale=np.ones((2, 2)), k_descale=np.array([0.5]),
                     v_descale=np.ones((2, 2)))
    batch, heads, *_ = shrink.passes(case)
    (one,) = list(batch(case))
    assert one.B == 1 and one.alibi_slopes.shape == (1, 4) and one.q_descale.shape == (1, 2)
    fewer = list(heads(case))
    assert all(c.N % c.K == 0 and c.sinks.shape == (c.N,) and c.alibi_slopes.shape == (2, c.N)
               and c.v_descale.shape == (2, c.K) and c.k_descale.shape == (1,) for c in fewer)
    assert all(c.causal and c.window == (1, 0) and c.fp8 == "float8_e4m3fn" for c in fewer)


def test_a_failing_flash_directed_case_is_shrunk(tmp_path):
    """The flash level's directed cases are shrunk too, each proposal admitted by the
    property's bounds and the target's claims: the top-left causal mutant from its
    directed example (N = K = 2, S = 3, E = 2) to the plain search's smallest case."""
    report, output = run(tmp_path, "cert", "--impl=mutant:flash_causal_top_left", "--dtype", "float64",
                         "-k", "test_flash_agreement", "-x")
    (record,) = [r for r in report["results"] if r["outcome"] != "skipped"]
    assert record["outcome"] == "failed", output[-3000:]
    got = {d: record["counterexample"][d] for d in ("B", "N", "K", "L", "S", "E", "Ev")}
    assert got == {"B": 1, "N": 1, "K": 1, "L": 1, "S": 2, "E": 1, "Ev": 1}, output[-3000:]
    assert "failing case:" not in output and 'from the directed example "L=1 < S=3' in output, output[-3000:]


def test_a_smaller_case_that_loses_the_cause_is_not_kept(tmp_path):
    """A window's left edge one key short fails a one-key case too, but there every
    window variant gives the same empty row and nothing names the bug: the smallest
    failing case on the way that still confirms the cause is reported, and says so."""
    report, output = run(tmp_path, "cert", "--impl=mutant:flash_window_left_off_by_one", "--dtype", "float64",
                         "-k", "test_window_equivalence", "-x")
    (record,) = [r for r in report["results"] if r["outcome"] != "skipped"]
    assert record["outcome"] == "failed", output[-3000:]
    assert record["counterexample"]["S"] > 1, output[-3000:]
    assert [c["variant"] for c in record["causes"]][:1] == ["flash_window_left_off_by_one"], record["causes"]
    assert record["causes"][0].get("confirmed", True) is not False, record["causes"]
    assert "probable cause: flash_window_left_off_by_one — " in output, output[-3000:]
    assert "passed over: they lose the evidence that names its cause" in output, output[-3000:]


def test_varlen_passes_keep_each_sequence_with_its_own_rows():
    """A varlen case's passes: each sequence alone first (its own query and key rows, its
    row of per-sequence ALiBi slopes and descales), then each left out; lengths cut per
    sequence, to 0 first; E and Ev each shrink (Ev in a pass of its own)."""
    import numpy as np

    from conformance.calls.varlen import VarlenCase
    from conformance.directed import shrink

    q, k, v = np.arange(6 * 2 * 2.0).reshape(6, 2, 2), np.arange(5 * 1 * 2.0).reshape(5, 1, 2), np.ones((5, 1, 3))
    case = VarlenCase(q, k, v, cu_seqlens_q=(0, 1, 3, 6), cu_seqlens_k=(0, 2, 2, 5), alibi_slopes=np.ones((3, 2)))
    sequences, heads, queries, keys, dims, value_dims, values = shrink.passes(case)
    alone = list(sequences(case))
    assert [c.lengths() for c in alone[:3]] == [[(1, 2)], [(2, 0)], [(3, 3)]]
    assert np.array_equal(alone[2].query, q[3:6]) and np.array_equal(alone[2].key, k[2:5])
    assert alone[2].alibi_slopes.shape == (1, 2) and [c.B for c in alone[3:]] == [2, 2, 2]
    assert [c.lengths()[0] for c in queries(case)][:1] == [(0, 2)]
    cut = next(keys(case))
    assert cut.lengths() == [(1, 0), (2, 0), (3, 3)] and cut.cu_seqlens_k == (0, 0, 0, 3)
    assert [c.E for c in dims(case)] == [1] and [c.Ev for c in value_dims(case)] == [1, 2]
    assert {(c.N, c.K) for c in heads(case)} == {(1, 1)}

    def fails(c: VarlenCase) -> bool:  # a bug seen whenever some sequence has queries and no keys
        return any(L > 0 and S == 0 for L, S in c.lengths())

    smallest, _ = shrink.shrink(case, fails)
    assert smallest.lengths() == [(1, 0)] and (smallest.N, smallest.E, smallest.Ev) == (1, 1, 1)


def test_a_failing_varlen_directed_case_is_shrunk(tmp_path):
    """The varlen level's directed cases are shrunk: the neighbour-key mutant (a sequence's
    key slice runs one row into the next) from four heads' worth of sizes to one query
    with no keys beside one empty-query sequence with one key."""
    report, output = run(tmp_path, "cert", "--impl=mutant:varlen_neighbour_key", "--dtype", "float64",
                         "-k", "test_varlen_equivalence", "-x")
    (record,) = [r for r in report["results"] if r["outcome"] != "skipped"]
    assert record["outcome"] == "failed", output[-3000:]
    assert "shrunk case: varlen B=2 N=1 K=1 E=1 Ev=1 cu_seqlens_q=[0, 1, 1] cu_seqlens_k=[0, 0, 1]" in output, \
        output[-3000:]
    assert 'from the directed example "a query whose neighbour\'s first key sits right after its own"' in output \
        and "probable cause: varlen_neighbour_key — " in output, output[-3000:]


def test_mha_cases_shrink_in_heads_and_head_dim_with_their_weights():
    """An MHA case's heads and head dim shrink with the module's weights: the first heads'
    first rows of each projection, the first input and output features, a per-head mask's
    rows of the heads kept, kdim/vdim kept (none becomes a packed module). Cut to its own
    sizes a case is unchanged, and each smaller one runs through the oracle."""
    import numpy as np

    import spec
    from conformance.core.cases import MHACase
    from conformance.directed import shrink_sizes

    gen = np.random.default_rng(0)
    x = gen.standard_normal((4, 2, 6))
    mask = gen.random((2 * 3, 4, 4)) < 0.3
    case = MHACase(spec.MHAParams.random(gen, 6, 3), x, x, x, attn_mask=mask)
    same = shrink_sizes._mha_heads(case, 3, 2)
    args = dict(attn_mask=mask)
    assert np.array_equal(spec.mha_forward(case.params, x, x, x, **args)[0],
                          spec.mha_forward(same.params, same.query, same.key, same.value, **args)[0])
    fewer = shrink_sizes._mha_heads(case, 2, 1)
    assert (fewer.D, fewer.N, fewer.query.shape, fewer.self_attention) == (2, 2, (4, 2, 2), True)
    assert np.array_equal(fewer.attn_mask, mask[[0, 1, 3, 4]])
    assert spec.mha_forward(fewer.params, fewer.query, fewer.key, fewer.value,
                            attn_mask=fewer.attn_mask)[0].shape == (4, 2, 2)
    q, k, v = gen.standard_normal((2, 1, 4)), gen.standard_normal((3, 1, 3)), gen.standard_normal((3, 1, 5))
    cross = MHACase(spec.MHAParams.random(gen, 4, 2, kdim=3, vdim=5), q, k, v)
    one = shrink_sizes._mha_heads(cross, 1, 2)
    assert (one.params.kdim, one.params.vdim, one.key is k, one.query.shape) == (3, 5, True, (2, 1, 2))
    assert shrink_sizes._mha_heads(MHACase(spec.MHAParams.random(gen, 4, 2, kdim=2, vdim=2), q,
                                     k[..., :2], v[..., :2]), 1, 2) is None
