"""Expected failures: validated against the property ids and case attributes,
matched against the cases a property called, judged stale only on evidence,
reported when they never apply."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

import conformance
from conformance.calls.mha import build, run_mha
from conformance.calls.replay import CallLog
from conformance.calls.sdpa import check_gradients, run_sdpa
from conformance.core.cases import SDPACase
from conformance.core.expectations import ExpectedFailureLedger, entry_errors
from conformance.core.registry import registered_properties
from conformance.core.target import Target
from conformance.reporting import certificate, failures
from implementations.base import ExpectedFailure, ImplementationError
from implementations.registry import load_expected_failures_file, resolve
from tests import pytest_process

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
IMPLS = ROOT / "tests" / "runner" / "impls_for_replay.py"
MODULES = [importlib.import_module(m.name) for m in pkgutil.walk_packages(conformance.__path__, "conformance.")]


@pytest.fixture
def restore_hypothesis_profile():
    settings.register_profile("_outer_expected", parent=settings.default)
    yield
    settings.load_profile("_outer_expected")


def run(pytester, *args: str):
    return pytester.runpytest_inprocess(str(ROOT / "conformance"), f"--rootdir={ROOT}", "-p", "no:cacheprovider",
                                        "--hypothesis-profile=ci", *args)


# -- validation ---------------------------------------------------------------------


def test_entry_errors_name_the_typo_and_the_valid_choices():
    properties = registered_properties()
    [error] = entry_errors([ExpectedFailure("forward_agreemnt", "typo")], properties)
    assert "'forward_agreemnt' is not a property id" in error and "did you mean 'forward_agreement'" in error
    assert "mha_output_contract" in error  # the valid ones are listed
    [error] = entry_errors([ExpectedFailure("forward_agreement", "typo", {"scal_sign": "zero"})], properties)
    assert "match key 'scal_sign'" in error and "did you mean 'scale_sign'" in error and "different_v_dim" in error
    # An MHA-only attribute is not an SDPA property's; a wildcard takes either level's.
    assert entry_errors([ExpectedFailure("forward_agreement", "x", {"need_weights": True})], properties)
    assert not entry_errors([ExpectedFailure("*", "x", {"need_weights": True, "scale_sign": "zero"})], properties)
    assert not entry_errors([ExpectedFailure("mha_agreement", "x", {"grad": False, "training": True,
                                                                    "dropout_p": 0.5})], properties)


def test_entry_errors_check_match_keys_at_the_varlen_and_kvcache_levels():
    properties = registered_properties()
    [error] = entry_errors([ExpectedFailure("paged_equivalence", "typo", {"kv_pagd": True})], properties)
    assert "match key 'kv_pagd'" in error and "of level kvcache" in error and "did you mean 'kv_paged'" in error
    [error] = entry_errors([ExpectedFailure("varlen_agreement", "kvcache only", {"kv_append": True})], properties)
    assert "match key 'kv_append'" in error and "of level varlen" in error
    assert not entry_errors([ExpectedFailure("kvcache_equivalence", "x", {"kv_append": False, "gqa": True}),
                             ExpectedFailure("varlen_equivalence", "x", {"causal": "lower_right", "B": 2})],
                            properties)


def test_every_builtin_expected_failures_file_is_valid():
    properties = registered_properties()
    for name in ("sdpa", "sdpa-flash", "torch-mha"):
        assert entry_errors(resolve(name).expected_failures, properties) == [], name


@pytest.mark.parametrize("attr, message", [
    ("typo_property", "'forward_agreemnt' is not a property id"),
    ("typo_match", "match key 'scal_sign' is not a case attribute"),
])
def test_a_typo_in_an_expected_failure_is_a_usage_error(pytester, restore_hypothesis_profile, attr, message):
    result = run(pytester, f"--impl={IMPLS}:{attr}", "-k", "forward_agreement")
    assert result.ret == 4
    assert message in result.stderr.str()


# -- what entries are matched against -------------------------------------------------


def test_called_attributes_say_grad_dropout_and_training_for_real():
    impl = resolve("handwritten")
    rng = np.random.default_rng(0)
    case = SDPACase(*(rng.standard_normal((1, 1, 2, 2)) for _ in range(3)))
    target = Target(impl, "sdpa", "float64", "cpu", log=CallLog())
    check_gradients(target, case)
    run_sdpa(target, case, dropout_p=0.5)
    grads, dropped = (call.attrs() for call in target.log.calls)
    assert (grads["grad"], grads["dropout_p"]) == (True, 0.0)
    assert (dropped["grad"], dropped["dropout_p"]) == (False, 0.5)
    from tests.runner.test_replay import _mha_case

    mha_case = _mha_case()
    target = Target(impl, "mha", "float64", "cpu", log=CallLog())
    run_mha(target, mha_case, build(target, mha_case, dropout=0.25, training=True))
    run_mha(target, mha_case, requires_grad=True)
    trained, with_grad = (call.attrs() for call in target.log.calls)
    assert (trained["training"], trained["dropout_p"], trained["grad"]) == (True, 0.25, False)
    assert (with_grad["training"], with_grad["grad"]) == (False, True)


def test_kvcache_call_attributes_say_whether_the_call_was_paged():
    """paged_equivalence calls a paged case twice: paged and contiguous; each call's
    kv_paged is how it handed the caches over, not what the case has."""
    from conformance.calls.kvcache import KVCacheCase, run_kvcache

    rng = np.random.default_rng(0)
    case = KVCacheCase(rng.standard_normal((1, 1, 1, 1)), rng.standard_normal((1, 2, 1, 1)),
                       rng.standard_normal((1, 2, 1, 1)), cache_seqlens=(1,), k_new=rng.standard_normal((1, 1, 1, 1)),
                       v_new=rng.standard_normal((1, 1, 1, 1)), page_size=1, page_order=(2, 0, 1))
    target = Target(resolve("varlen-reference"), "kvcache", "float64", "cpu", log=CallLog())
    run_kvcache(target, case, paged=True)
    run_kvcache(target, case, paged=False)
    paged, contiguous = (call.attrs() for call in target.log.calls)
    assert (paged["kv_paged"], contiguous["kv_paged"]) == (True, False)
    assert paged["kv_append"] is contiguous["kv_append"] is True


def test_expected_failure_is_matched_against_the_called_case(pytester, tmp_path, restore_hypothesis_profile):
    """sdpa's known NaN (is_causal with scale <= 0 on the flash kernel, E == Ev) shows
    in weights_are_distributions on a drawn case with Ev != E: the property calls
    the V = identity probe, whose Ev = S = E."""
    rng = np.random.default_rng(0)
    case = SDPACase(rng.standard_normal((1, 1, 1, 2)).astype(np.float32).astype(np.float64),
                    rng.standard_normal((1, 1, 2, 2)).astype(np.float32).astype(np.float64),
                    rng.standard_normal((1, 1, 2, 1)).astype(np.float32).astype(np.float64),
                    causal="upper_left", scale=0.0, dtype="float32")
    saved = failures.save_case(case, tmp_path / "case.npz", property="weights_are_distributions",
                               impl="sdpa", target="sdpa-float32-cpu")
    result = run(pytester, "--impl=sdpa", f"--replay={saved}", f"--conformance-report={tmp_path / 'cert'}")
    assert result.ret == 0, result.stdout.str()[-3000:]
    [r] = [r for r in json.loads((tmp_path / "cert.json").read_text())["results"] if r["outcome"] != "skipped"]
    assert (r["property"], r["outcome"], r["xfail_hits"]) == ("weights_are_distributions", "xfailed", 1)


# -- stale and never applied -----------------------------------------------------------


def test_stale_needs_covered_calls_that_passed():
    entry = ExpectedFailure("p", "only with grad", {"grad": True})
    ledger = ExpectedFailureLedger([entry], "p")
    ledger.passed([{"grad": False}, {"grad": False}])  # the entry's cases were not called
    assert ledger.stale() == []
    ledger.passed([{"grad": False}, {"grad": True}])  # one call was one of its cases, and passed
    assert ledger.stale() == [(entry, 1)]
    assert ledger.excuse([{"grad": True}]) is entry and ledger.stale() == []
    assert ledger.summary() == [{"entry": 0, "hits": 1, "covered_passes": 1}]


def test_an_intermittent_entry_is_never_stale(tmp_path):
    """A deviation whose sizes depend on the machine (intermittent = true) may pass on
    every case it covers: that is no evidence against it."""
    entry = ExpectedFailure("p", "on some machines", {"grad": True}, intermittent=True)
    ledger = ExpectedFailureLedger([entry], "p")
    ledger.passed([{"grad": True}])
    assert ledger.stale() == [] and ledger.summary() == [{"entry": 0, "hits": 0, "covered_passes": 1}]
    path = tmp_path / "x.toml"
    path.write_text('[[xfail]]\nproperty = "p"\nreason = "r"\nintermittent = true\n')
    assert load_expected_failures_file(path)[0].intermittent
    path.write_text('[[xfail]]\nproperty = "p"\nreason = "r"\nintermittent = "yes"\n')
    with pytest.raises(ImplementationError, match="intermittent='yes' must be a boolean"):
        load_expected_failures_file(path)


def test_torch_mha_fast_path_entry_is_not_reported_stale_under_dev(tmp_path):
    """The fast path runs only with autograd off: forward-only module calls run
    under torch.no_grad() (call attribute grad=False), so the suite reaches it in
    every dtype, and the entry matches exactly its conditions."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "f"))
    proc = pytest_process.run([sys.executable, "-m", "pytest", str(ROOT / "conformance"), "-p", "no:cacheprovider",
                           "-q", "--impl=torch-mha", "-k", "mha_fully_masked_rows",
                           f"--conformance-report={tmp_path / 'cert'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    results = json.loads((tmp_path / "cert.json").read_text())["results"]
    assert {r["outcome"] for r in results} <= {"passed", "xfailed"}, [
        (r["dtype"], r["outcome"], r["reason"]) for r in results]


def test_never_applied_expected_failures_are_reported():
    cert = {"implementation": {"expected_failures": [
                {"property": "forward_agreement", "match": {"scale_sign": "negative"}, "reason": "never fails",
                 "reference": ""},
                {"property": "temperature", "match": {}, "reason": "its property did not run", "reference": ""},
                {"property": "forward_agreement", "match": {}, "reason": "hit", "reference": ""}]},
            "results": [{"property": "forward_agreement", "outcome": "xfailed",
                         "expected_failures": [{"entry": 0, "hits": 0, "covered_passes": 3},
                                               {"entry": 2, "hits": 2, "covered_passes": 0}]},
                        {"property": "temperature", "outcome": "skipped", "expected_failures": []}]}
    [line] = certificate.unapplied_expected_failures(cert)
    assert line.startswith("expected failure never applied: property=forward_agreement")
    assert "never fails" in line and "3 covered example(s) passed" in line


def test_never_applied_line_on_the_certificate(pytester, restore_hypothesis_profile):
    result = run(pytester, f"--impl={IMPLS}:never_applies", "--dtype=float64", "-k", "forward_agreement")
    assert result.ret == 0
    assert "expected failure never applied: property=forward_agreement" in result.stdout.str()


def test_fail_cell_shows_the_failing_examples_ratio():
    r = {"outcome": "failed", "examples": 4, "worst_ratio": 3.2e12}
    assert certificate.cell(r) == "FAIL 3.2e+12 (4)"
    assert certificate.cell(dict(r, worst_ratio=None)) == "FAIL - (4)"
