"""The diagnosis on its own (fast; no pytest subprocess): which output it reads, when it
calls the implementation, that it never masks a failure, and the certificate's cause table."""

from __future__ import annotations

import numpy as np
import pytest
import torch.nn.functional as F

from conformance.calls.sdpa import run_sdpa
from conformance.core.cases import SDPACase
from conformance.core.registry import Record
from conformance.core.target import ImplementationRaised, Target
from conformance.diagnosis import diagnose as diagnosis
from conformance.reporting import certificate
from implementations.base import Capabilities, Implementation


class Counted:
    """An SDPA function that counts its calls; ``ignore_scale``/``lower_right`` plant a bug."""

    def __init__(self, *, ignore_scale: bool = False, lower_right: bool = False) -> None:
        self.calls, self.ignore_scale, self.lower_right = 0, ignore_scale, lower_right

    def __call__(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        self.calls += 1
        if is_causal and self.lower_right:
            L, S = q.shape[-2], k.shape[-2]
            attn_mask = q.new_ones(L, S, dtype=bool).tril(diagonal=S - L)
            is_causal = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=None if self.ignore_scale else scale)


def target_of(fn: Counted) -> Target:
    impl = Implementation(name="counted", capabilities=Capabilities(dtypes=("float64",)), sdpa=fn)
    return Target(impl, "sdpa", "float64", "cpu")


def case_of(seed: int = 0, *, L: int = 2, S: int = 3, **fields) -> SDPACase:
    rng = np.random.default_rng(seed)
    return SDPACase(rng.normal(size=(1, 1, L, 2)), rng.normal(size=(1, 1, S, 2)), rng.normal(size=(1, 1, S, 2)),
                    **fields)


def failed_record(case: SDPACase) -> Record:
    record = Record("forward_agreement", "sdpa", "float64", "cpu", outcome="failed")
    record.failing_case = case
    return record


def test_the_failing_calls_output_is_ranked_without_calling_again():
    fn = Counted(ignore_scale=True)
    target, case = target_of(fn), case_of(scale=0.25)
    diagnosis.start_example(case)
    run_sdpa(target, case)                                      # what the property did
    verdict = diagnosis.diagnose(target, failed_record(case))
    assert fn.calls == 1
    assert verdict.causes[0]["variant"] == "scale_arg_ignored"
    assert verdict.line.startswith("probable cause: scale_arg_ignored — an explicit scale is ignored")


def test_without_an_observed_output_the_implementation_is_called_once():
    fn = Counted(ignore_scale=True)
    target, case = target_of(fn), case_of(scale=0.25)
    diagnosis.start_example(case)                               # the property made no observable call
    verdict = diagnosis.diagnose(target, failed_record(case))
    assert fn.calls == 1 and verdict.causes[0]["variant"] == "scale_arg_ignored"


def test_an_implementation_that_raised_is_not_called_again():
    fn = Counted()
    target, case = target_of(fn), case_of()
    diagnosis.start_example(case)
    verdict = diagnosis.diagnose(target, failed_record(case), ImplementationRaised("kernel launch failed"))
    assert fn.calls == 0 and verdict.causes == []
    assert verdict.line.startswith("probable cause: unknown — the implementation raised")


def test_an_output_that_agrees_with_the_oracle_names_no_cause():
    fn = Counted()
    target, case = target_of(fn), case_of(scale=0.25)
    diagnosis.start_example(case)
    run_sdpa(target, case)
    verdict = diagnosis.diagnose(target, failed_record(case))
    assert verdict.causes == [] and "agrees with the oracle" in verdict.line


def test_a_diagnosis_error_never_masks_the_failure():
    target, record = target_of(Counted()), failed_record(object())    # not a case: the diagnosis breaks
    diagnosis.start_example(record.failing_case)
    exc = AssertionError("output values mismatch")
    diagnosis.annotate(exc, target, record)
    assert record.causes == []
    assert exc.__notes__[-1].startswith("probable cause: (diagnosis failed: ")


def test_variants_tied_on_the_shrunk_case_are_ordered_by_the_first_failing_case():
    fn = Counted(lower_right=True)
    target = target_of(fn)
    record = failed_record(None)
    unshrunk, shrunk = case_of(1, L=3, S=5, causal="upper_left"), case_of(2, L=1, S=2, causal="upper_left")
    for case in (unshrunk, shrunk):                             # the runner: each example, then its failure
        diagnosis.start_example(case, record)
        run_sdpa(target, case)
        record.failing_case = case
    verdict = diagnosis.diagnose(target, record)
    named = [c["variant"] for c in verdict.causes]
    # with one query, ignoring the flag and aligning it lower-right attend the same keys
    assert named[0] == "causal_lower_right" and {"causal_ignored", "causal_ignored_when_L1"} <= set(named)
    assert "before shrinking" in verdict.line


def test_variants_tied_on_an_unshrunk_case_are_told_apart_on_a_discriminating_case():
    # A directed example is not shrunk, so there is no earlier failing case to consult:
    # with one query, ignoring the flag and aligning it lower-right attend the same keys.
    fn = Counted(lower_right=True)
    target, case = target_of(fn), case_of(2, L=1, S=2, causal="upper_left")
    diagnosis.start_example(case)
    run_sdpa(target, case)
    verdict = diagnosis.diagnose(target, failed_record(case))
    named = [c["variant"] for c in verdict.causes]
    assert named[0] == "causal_lower_right" and {"causal_ignored", "causal_ignored_when_L1"} <= set(named)
    assert "discriminating case (B=1, L=2, S=3)" in verdict.causes[0]["note"]
    assert not verdict.causes[1]["note"]                       # the others do not fit it
    assert 1 < fn.calls <= 1 + diagnosis.MAX_DISCRIMINATING


def test_an_ignored_scale_of_zero_is_told_apart_from_a_falsy_one():
    # scale=0: `scale or default` and a dropped scale= both use the default scale
    fn = Counted(ignore_scale=True)
    target, case = target_of(fn), case_of(3, L=1, S=2, scale=0.0)
    diagnosis.start_example(case)
    run_sdpa(target, case)
    verdict = diagnosis.diagnose(target, failed_record(case))
    assert [c["variant"] for c in verdict.causes][:2] == ["scale_arg_ignored", "scale_zero_falsy"]
    assert verdict.causes[0]["note"].startswith("also fits a discriminating case (scale=")


def test_a_single_cause_calls_nothing_more():
    fn = Counted(ignore_scale=True)
    target, case = target_of(fn), case_of(scale=0.25)
    diagnosis.start_example(case)
    run_sdpa(target, case)
    verdict = diagnosis.diagnose(target, failed_record(case))
    assert [c["variant"] for c in verdict.causes] == ["scale_arg_ignored"] and fn.calls == 1


def test_dropout_on_in_eval_mode_shows_under_another_seed():
    # The runner seeds dropout from the case's contents: two eval-mode calls on the same
    # inputs agree even when the module drops weights; the recall reseeds the generator.
    from conformance.calls.mha import build, run_mha
    from conformance.directed.examples import mha_directed
    from implementations.registry import resolve

    target = Target(resolve("mutant:mha_dropout_in_eval"), "mha", "float64", "cpu")
    case = mha_directed(target)[0]
    module = build(target, case, dropout=0.5)
    diagnosis.start_example(case)
    first, second = run_mha(target, case, module), run_mha(target, case, module)
    assert np.array_equal(first.output, second.output)         # one seed: no sign of randomness
    record = Record("mha_eval_determinism", "mha", "float64", "cpu", outcome="failed")
    record.failing_case = case
    verdict = diagnosis.diagnose(target, record)
    assert [c["variant"] for c in verdict.causes] == ["mha_dropout_in_eval"]


def test_variants_are_partitioned_by_output_and_fitted_where_they_do_not_apply():
    from spec import variants as V

    rng = np.random.default_rng(4)
    q, k, v = rng.normal(size=(1, 1, 1, 4)), rng.normal(size=(1, 1, 2, 4)), rng.normal(size=(1, 1, 2, 4))
    tied = ["causal_ignored_when_L1", "causal_ignored", "causal_lower_right"]
    one_query = V.SDPAProblem(q, k, v, causal="upper_left")
    assert V.partition(one_query, tied) == [tied]
    q2 = np.concatenate([q, rng.normal(size=(1, 1, 1, 4))], axis=2)
    k2, v2 = (np.concatenate([x, rng.normal(size=(1, 1, 1, 4))], axis=2) for x in (k, v))
    two_queries = V.SDPAProblem(q2, k2, v2, causal="upper_left")
    assert V.partition(two_queries, tied) == [[t] for t in tied]
    observed = V.VARIANTS["causal_lower_right"].compute(two_queries).output
    assert V.variant_fit(observed, two_queries, "causal_lower_right") == 0.0
    assert V.variant_fit(observed, two_queries, "causal_ignored") > 1.0
    # where a variant does not apply it predicts the correct output
    no_flag = V.SDPAProblem(q, k, v)
    assert not V.VARIANTS["causal_lower_right"].applies(no_flag)
    assert V.variant_fit(V.reference(no_flag).output, no_flag, "causal_lower_right") <= 1.0


def result(prop: str, dtype: str, causes: list | None, outcome: str = "failed", device: str = "cpu") -> dict:
    r = {"property": prop, "level": "sdpa", "dtype": dtype, "device": device, "outcome": outcome,
         "examples": 20, "worst_ratio": None, "seconds": 0.1, "reason": "", "counterexample": None,
         "message": "values mismatch", "failure_file": "f.npz", "reproducer": "", "xfail_hits": 0,
         "xfail_reason": "", "first_failure_seconds": None}
    if causes is not None:
        r["causes"] = causes
    return r


def cause(variant: str, relative: float | None = 1.2e-7) -> dict:
    return {"variant": variant, "summary": f"what {variant} does", "fit": 0.01, "relative_error": relative,
            "note": ""}


def test_failures_are_grouped_by_their_first_cause():
    results = [result("forward_agreement", "float64", [cause("softmax_float32", 8e-8)]),
               result("key_permutation", "float64", [cause("softmax_float32", 1.1e-7), cause("unscaled")]),
               result("convex_hull", "float32", []),
               result("output_contract", "float64", None),                # no diagnosis recorded: not counted
               result("temperature", "float64", [], outcome="passed")]
    groups = diagnosis.cause_groups(results)
    assert [(g["variant"], g["count"], g["properties"], g["dtypes"]) for g in groups] == [
        ("softmax_float32", 2, ["forward_agreement", "key_permutation"], ["float64"]),
        ("unknown", 1, ["convex_hull"], ["float32"])]
    assert groups[0]["summary"] == "what softmax_float32 does" and groups[0]["devices"] == ["cpu"]
    cert = {"causes": groups}
    lines = diagnosis.cause_lines(cert)
    assert lines[1] == ("  softmax_float32: 2 failures (float64 only; relative error ~1e-7) — "
                        "what softmax_float32 does")
    assert lines[2].split() == ["forward_agreement,", "key_permutation"]
    assert lines[3].startswith("  unknown: 1 failure (float32 only) — ")
    assert "| `softmax_float32` | 2 | float64 only; relative error ~1e-7 |" in "\n".join(diagnosis.cause_markdown(cert))


def test_certificate_carries_the_causes_and_shows_them():
    results = [result("forward_agreement", "float64", [cause("gqa_tiled", 0.8)]),
               result("forward_agreement", "float32", [cause("gqa_tiled", 0.9)])]
    cert = certificate.certificate(
        implementation={"name": "impl", "spec": "impl.py:attn", "version": "1", "options": {},
                        "capabilities": {"fully_masked": "zero", "causal": "upper_left", "tf32": False},
                        "mha_capabilities": {}, "expected_failures": []},
        environment={"torch": "2", "devices": ["cpu"]}, profile="ci", seconds=1.0, results=results)
    assert [g["variant"] for g in cert["causes"]] == ["gqa_tiled"] and cert["causes"][0]["count"] == 2
    text = "\n".join(certificate.terminal_lines(cert))
    assert "    probable cause: gqa_tiled" in text
    assert "gqa_tiled: 2 failures (float64, float32; relative error ~1e0)" in text
    assert "## Probable causes" in certificate.markdown(cert)


def test_a_passing_certificate_has_no_causes():
    cert = certificate.certificate(
        implementation={"name": "impl", "spec": "impl", "version": "1", "options": {},
                        "capabilities": {"fully_masked": "zero", "causal": None, "tf32": False},
                        "mha_capabilities": {}, "expected_failures": []},
        environment={"torch": "2", "devices": ["cpu"]}, profile="ci", seconds=1.0,
        results=[result("forward_agreement", "float64", [], outcome="passed")])
    assert cert["causes"] == [] and diagnosis.cause_lines(cert) == []
    assert "Probable causes" not in certificate.markdown(cert)


@pytest.mark.parametrize("value, text", [(1.2e-7, "1e-7"), (8e-8, "1e-7"), (0.9, "1e0"), (0.0, "0")])
def test_orders_of_magnitude(value, text):
    assert diagnosis._order(value) == text


@pytest.mark.parametrize("module, cause", [("ScaledByModelDim", "mha_scale_model_dim"),
                                           ("ViewWithoutTranspose", "mha_heads_split_without_transpose")])
def test_a_uniform_fully_masked_row_does_not_hide_the_cause(module, cause):
    # A -1e9 mask fill gives a blocked row uniform weights (the probed policy); the
    # diagnosis bounds those rows as the property does (what the row sums), not as rows
    # of zeros (a bound of ~0 that rounding alone exceeds, so no variant fitted).
    from conformance.calls.mha import build, run_mha
    from conformance.directed.examples import mha_directed
    from implementations.registry import resolve

    impl = resolve(f"tests/implementations/learner_modules/tutorial_mistakes.py:{module}")
    target = Target(impl, "mha", "float64", "cpu")
    assert target.caps.fully_masked_policy("bool") == "uniform"
    case = next(c for c in mha_directed(target) if "fully_masked:forced" in c.notes)
    diagnosis.start_example(case)
    run_mha(target, case, build(target, case))
    record = Record("mha_agreement", "mha", "float64", "cpu", outcome="failed")
    record.failing_case = case
    verdict = diagnosis.diagnose(target, record)
    assert verdict.causes and verdict.causes[0]["variant"] == cause and verdict.causes[0]["confirmed"], verdict.line
