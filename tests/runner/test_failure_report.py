"""Every failure message true, minimal and in the report's own form (issue 42): a failing
directed case is shrunk and names its origin; the reproducer's values carry no more
digits than they need; a certificate cell agrees with its failure's message; no
Hypothesis dump; a claim names its source and the declaration that withdraws it; the
suite's own error is an ERROR naming the suite's frame; numpy's float warnings stay out
of the output; the diagnosis never says "every output agrees" under a mismatch."""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from conformance.calls.sdpa import run_sdpa
from conformance.core.compare import PropertyFailure
from conformance.core.registry import Record
from conformance.diagnosis import diagnose as diagnosis
from conformance.harness.checking import check_example
from conformance.harness.session import Session
from conformance.reporting.failure_choice import cell_disagreements
from conformance.reporting.reproducer import _literal
from tests.diagnosis.test_diagnosis_unit import Counted, case_of, target_of
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]
IMPLS = "tests/runner/impls_for_reports.py"


def run(tmp_path: Path, *args: str) -> tuple[list[dict], str]:
    env = dict(os.environ, ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "failures"),
               ATTENTION_CONFORMANCE_STATE=str(tmp_path / "state"))
    env = {k: v for k, v in env.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    proc = pytest_process.run(
        [sys.executable, "-m", "pytest", "conformance", "-p", "no:cacheprovider", "-q",
         "--hypothesis-profile=ci", f"--conformance-report={tmp_path}/cert", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env, check=False,
    )
    output = proc.stdout + proc.stderr
    report = tmp_path / "cert.json"
    assert report.exists(), output[-3000:]
    return json.loads(report.read_text())["results"], output


def _failed(results: list[dict]) -> list[dict]:
    return [r for r in results if r["outcome"] in ("failed", "error")]


def _numbers(snippet: str) -> list[str]:
    """The numeric literals of a reproducer's arrays."""
    arrays = "\n".join(re.findall(r"np\.array\((.*?)\)(?:  #|$)", snippet, flags=re.S))
    return re.findall(r"-?\d+\.?\d*(?:e[-+]?\d+)?", arrays)


def test_a_failing_directed_case_is_shrunk_and_names_the_example_it_started_from(tmp_path):
    # gqa_tile fails the grouped-query directed example (L=2 S=3 E=4, values near 1e-31)
    # as surely with L = S = E = 1 and values of a half
    results, output = run(tmp_path, "--impl=mutant:gqa_tile", "-x", "--dtype", "float64")
    (failed,) = _failed(results)
    sizes = {k: failed["counterexample"][k] for k in ("B", "N", "K", "L", "S", "E", "Ev")}
    assert sizes == {"B": 1, "N": 4, "K": 2, "L": 1, "S": 1, "E": 1, "Ev": 1}, output[-3000:]
    assert failed["counterexample"]["regime"] == "normal"
    assert 'from the directed example "grouped-query attention (N=4, K=2)"' in output, output[-3000:]
    numbers = _numbers(failed["reproducer"])
    assert numbers and all(len(re.sub(r"[-.]|e.*", "", n).strip("0")) <= 3 for n in numbers), numbers


def test_the_reproducer_writes_a_float32_value_in_its_own_shortest_digits():
    values = np.float32([0.1, -2.7, 1e-3]).astype(np.float64)
    text = _literal(values)
    assert "00000001" not in text and "99999" not in text, text  # not float64's expansions
    assert "dtype=np.float32" in text
    assert eval(text, {"np": np}).tolist() == values.tolist()  # read back exactly
    assert _literal(np.array([0.25, -1.0])) == "np.array([ 0.25, -1.  ])"


def test_every_failed_cell_agrees_with_its_failure_message(tmp_path):
    # a float32 softmax in float64: the sweep's message says worst error/allowed 5.4e5,
    # and its cell read FAIL 0 (1)
    results, output = run(tmp_path, "--impl=mutant:softmax_in_float32", "--dtype", "float64",
                          "-k", "small_sizes_sweep or forward_agreement")
    failed = _failed(results)
    assert len(failed) == 2, output[-3000:]
    assert cell_disagreements(results) == []
    assert all(r["worst_ratio"] is not None and r["worst_ratio"] > 1 for r in failed)


def test_cell_disagreements_finds_a_cell_that_contradicts_its_message():
    result = {"property": "p", "level": "sdpa", "dtype": "float64", "device": "cpu", "outcome": "failed",
              "worst_ratio": 0.0, "message": "x\n  worst error/allowed = 2.70e+05 at (0, 0, 0, 0): ..."}
    assert len(cell_disagreements([result])) == 1
    assert cell_disagreements([dict(result, worst_ratio=2.7e5)]) == []


def test_a_failure_the_search_found_carries_the_report_and_no_hypothesis_dump(tmp_path):
    results, output = run(tmp_path, f"--impl={IMPLS}:wrong_for_three_batches", "--dtype", "float64",
                          "-k", "forward_agreement")
    (failed,) = _failed(results)
    assert failed["counterexample"]["B"] == 3
    for dump in ("Falsifying example", "Failing test case", "Draw 1", "reproduce_failure", "These lines were"):
        assert dump not in output, output[-3000:]
    for part in ("shrunk case:", "saved:", "replay:", "reproducer (paste into python", "probable cause:"):
        assert part in output, output[-3000:]


def test_a_claimed_feature_names_the_signature_parameter_and_the_declaration_that_withdraws_it(tmp_path):
    results, output = run(tmp_path, f"--impl={IMPLS}:kvcache_without_rotary", "-x")
    (failed,) = _failed(results)
    assert "raised on a case it claims to support" in failed["message"]
    assert "rotary: claimed by the signature's parameters `rotary_cos`, `rotary_sin`" in output, output[-3000:]
    assert ("declare --impl-option kvcache_features=alibi,cache_batch_idx,cache_leftpad,lse,num_splits,"
            "softcap,window") in output


def test_an_error_raised_in_the_suites_own_code_is_an_error_naming_its_frame(tmp_path):
    results, output = run(tmp_path, f"--impl={IMPLS}:bridge_breaks", "--dtype", "float64",
                          "-k", "forward_agreement")
    (broke,) = _failed(results)
    assert broke["outcome"] == "error", output[-3000:]
    assert "the suite itself broke" in broke["message"]
    assert "implementations/bridge/sdpa.py:2 in read_sublayer" in output
    assert "forward_agreement  sdpa   ERROR" in output


def test_a_checks_numpy_float_warnings_stay_out_of_the_output():
    target = target_of(Counted())
    session = Session(profile="ci", started=0.0, impl=target.impl, impl_spec="counted")

    def check(target, case):
        return float(np.float16(np.float64(1e6)) - np.inf + np.inf)  # overflow, then inf - inf

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_example(session, "forward_agreement", check, target, case_of())


def test_the_diagnosis_never_says_every_output_agrees_under_a_mismatch():
    target, case = target_of(Counted()), case_of()
    diagnosis.start_example(case)
    run_sdpa(target, case)  # a right output: within the diagnosis' tolerance
    record = Record("small_sizes_sweep", "sdpa", "float64", "cpu", outcome="failed")
    record.failing_case = case
    verdict = diagnosis.diagnose(target, record, PropertyFailure("values mismatch", ratio=2.0))
    assert "agrees with the oracle" not in verdict.line, verdict.line
    assert "worst error/allowed 2" in verdict.line


def test_a_failure_at_the_derived_flash_level_is_diagnosed_by_the_sdpa_levels_variants(tmp_path):
    # an SDPA callable that subtracts its float mask fails alibi_equivalence at the flash
    # level derived from it (ALiBi reaches it as an additive mask): the cause is the SDPA
    # level's additive_mask_subtracted, not a flash bug about ALiBi
    results, output = run(tmp_path, f"--impl={IMPLS}:mask_subtracted", "--dtype", "float64",
                          "-k", "alibi_equivalence")
    (failed,) = _failed(results)
    assert failed["causes"][0]["variant"] == "additive_mask_subtracted", output[-3000:]
    assert "probable cause: additive_mask_subtracted" in output and "through the derivation" in output
    assert "flash_alibi_upper_left" not in output


def test_an_error_a_c_function_raised_under_the_suites_call_is_the_implementations():
    # the registry's wrapper calling torch's SDPA (a C function, no Python frame of its own):
    # its error is the implementation's, even though the innermost Python frame is the suite's
    from conformance.harness.suite_errors import suite_frame

    namespace: dict = {}
    bridge = str(ROOT / "implementations" / "bridge" / "sdpa.py")
    exec(compile("def call(f):\n    return f()\ndef read(x):\n    return x.query_dense\n", bridge, "exec"),
         namespace)
    errors = []
    for fn, argument in ((namespace["call"], functools.partial(int, "x")), (namespace["read"], object())):
        try:
            fn(argument)
        except Exception as err:  # noqa: BLE001 - what each raised
            errors.append(err)
    c_callee, own = errors
    assert suite_frame(c_callee) is None
    assert suite_frame(own) == "implementations/bridge/sdpa.py:4 in read"


def test_mismatched_values_are_shown_with_the_digits_that_tell_them_apart():
    """A float32 value compared in float64 is not printed with 17 digits of conversion noise."""
    from conformance.core.compare import PropertyFailure, compare_values, distinct_digits

    assert distinct_digits(-2.0, 1.0) == ("-2", "1")
    got, want = distinct_digits(1.2345678, 1.2345679)
    assert (got, want) == ("1.2345678", "1.2345679")
    with pytest.raises(PropertyFailure) as info:
        compare_values("output", np.array([float(np.float32(1.304))]), np.array([0.9470809631292422]),
                       allowed=1e-6)
    assert "got 1.304, but should be 0.9471" in str(info.value)


def test_a_directed_case_reported_as_written_is_not_called_shrunk():
    from types import SimpleNamespace

    from conformance.reporting.failure_choice import case_label

    assert case_label(SimpleNamespace(directed_origin=None)) == "shrunk case"
    assert case_label(SimpleNamespace(directed_origin={"shrunk": True})) == "shrunk case"
    assert case_label(SimpleNamespace(directed_origin={"shrunk": False})) == "failing case"


def test_a_policy_message_says_where_the_policy_came_from():
    """A fully-masked-row failure says "declared" only for a declared policy (a probed
    one was called declared)."""
    import numpy as np
    import pytest

    from conformance.calls.sdpa import check_fully_masked_policy
    from conformance.core.cases import SDPACase
    from conformance.core.compare import PropertyFailure
    from conformance.core.target import Target
    from implementations.base import Capabilities, Implementation

    q = k = v = np.ones((1, 1, 1, 2))
    case = SDPACase(q, k, v, attend_mask=np.zeros((1, 1), dtype=bool))
    bad = np.ones((1, 1, 1, 2))
    for sources, words in (({}, "declared fully_masked='zero'"),
                           ({"fully_masked": "probed"}, "probed fully_masked='zero'"),
                           ({"fully_masked": "contract"}, "the contract's fully_masked='zero'")):
        caps = Capabilities(fully_masked="zero", sources=sources)
        target = Target(Implementation(name="x", capabilities=caps, sdpa=lambda *a, **k: None), "sdpa", "float64", "cpu")
        with pytest.raises(PropertyFailure, match=words):
            check_fully_masked_policy(target, case, bad)


def test_a_smaller_directed_failure_keeps_the_search_failures_of_other_kinds():
    """A directed failure smaller than the search's is reported first; the search's failures
    of another kind stay beside it (two stories stay two), those of its kind are dropped
    (larger cases of the same failure); a single search failure leaves the directed alone."""
    from conformance.core.compare import PropertyFailure
    from conformance.core.target import ImplementationRaised
    from conformance.reporting.failure_choice import beside_directed, first_failure

    directed, mismatch, raised = PropertyFailure("directed"), PropertyFailure("mismatch"), ImplementationRaised("x")
    for failure, case in ((directed, "small"), (mismatch, "large"), (raised, "one rank")):
        failure.conformance_case = case
    both = beside_directed(directed, ExceptionGroup("2 distinct failures", [mismatch, raised]))
    assert isinstance(both, ExceptionGroup) and list(both.exceptions) == [directed, raised]
    assert first_failure(both) == (directed, "small")
    assert beside_directed(directed, ExceptionGroup("2 distinct failures", [mismatch, mismatch])) is directed
    assert beside_directed(directed, mismatch) is directed
    assert beside_directed(directed, None) is directed
