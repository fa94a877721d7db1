"""The naming rule of the diagnosis (docs/DIAGNOSIS.md, "When a cause is named"): a
variant is named only when it explains the failing call on more than NaN positions (or
another case confirms it) and fits strictly more cases than every other candidate; else
the cause is unknown with the closest candidates listed. Also: declaration hints, the
implementation's own fully-masked policy, the built-ins' known deviations, and derived
cases that stay inside the declarations. Fast: no pytest subprocess."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from conformance.calls.sdpa import run_sdpa
from conformance.core.cases import SDPACase
from conformance.core.registry import Record
from conformance.core.target import Target
from conformance.diagnosis import diagnose as diagnosis
from implementations.base import Capabilities, Implementation
from implementations.registry.expected_failures import XFAIL_DIR
from tests.diagnosis.impls_for_diagnosis import my_sdpa


class Planted:
    """An SDPA function (torch's, float64) with one planted bug; counts its calls."""

    def __init__(self, bug: str) -> None:
        self.bug, self.calls = bug, 0

    def __call__(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        self.calls += 1
        if self.bug == "nan_rows" and attn_mask is not None:           # NaN where a row is fully masked
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
            empty = ~attn_mask.any(dim=-1, keepdim=True)
            return torch.where(empty, torch.full_like(out, float("nan")), out)
        if self.bug == "nan_unmodelled":       # NaN empty rows on one shape, else NaN everywhere
            if tuple(q.shape) == (1, 1, 2, 2) and k.shape[-2] == 3 and scale is None:
                self.bug = "nan_rows"
                try:
                    return self(q, k, v, attn_mask=attn_mask, scale=scale)
                finally:
                    self.bug, self.calls = "nan_unmodelled", self.calls - 1
            return torch.full((*q.shape[:-1], v.shape[-1]), float("nan"), dtype=q.dtype)
        if self.bug == "inverted_plain_softmax":                       # True = blocked, NaN for empty rows
            scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
            scores = scores.masked_fill(attn_mask, float("-inf"))
            return torch.softmax(scores, dim=-1) @ v
        if self.bug == "lower_right" and is_causal:
            L, S = q.shape[-2], k.shape[-2]
            keep = torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)
        if self.bug == "inverted" and attn_mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=~attn_mask, scale=scale)
        if self.bug == "zeros":                                        # a zeroed buffer never written
            return torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=q.dtype)
        if self.bug == "drop_ragged":                # reads S // 16 full key blocks only (nothing when S < 16)
            full = k.shape[-2] // 16 * 16
            if full == 0:
                return torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=q.dtype)
            causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril() if is_causal else None
            mask = attn_mask if causal is None else causal if attn_mask is None else attn_mask & causal
            mask = mask[..., :full] if mask is not None else None
            return F.scaled_dot_product_attention(q, k[..., :full, :], v[..., :full, :], attn_mask=mask, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def target_of(fn, **caps) -> Target:
    impl = Implementation(name="planted", capabilities=Capabilities(dtypes=("float64",), **caps), sdpa=fn)
    return Target(impl, "sdpa", "float64", "cpu")


def case_of(seed: int = 0, *, B: int = 1, L: int = 2, S: int = 3, **fields) -> SDPACase:
    rng = np.random.default_rng(seed)
    return SDPACase(rng.normal(size=(B, 1, L, 2)), rng.normal(size=(B, 1, S, 2)), rng.normal(size=(B, 1, S, 2)),
                    **fields)


def masked_case(seed: int = 0, *, empty_row: int | None = 1, L: int = 2, S: int = 3) -> SDPACase:
    mask = np.ones((1, 1, L, S), dtype=bool)
    mask[..., 0, -1] = False
    if empty_row is not None:
        mask[..., empty_row, :] = False
    return case_of(seed, L=L, S=S, attend_mask=mask)


def diagnosed(target: Target, case: SDPACase, prop: str = "forward_agreement") -> diagnosis.Verdict:
    record = Record(prop, "sdpa", target.dtype, "cpu", outcome="failed")
    record.failing_case = case
    diagnosis.start_example(case)
    run_sdpa(target, case)
    return diagnosis.diagnose(target, record)


# --------------------------------------------------------------------------- NaN-only agreement


def test_nan_only_agreement_is_named_once_a_case_where_it_predicts_nan_confirms_it():
    fn = Planted("nan_rows")
    verdict = diagnosed(target_of(fn), masked_case())
    first = verdict.causes[0]
    assert first["variant"] == "fully_masked_nan" and first["confirmed"] and not first["finite_evidence"]
    assert first["telling"] >= 1                                  # a case where the output is wrong, too
    assert verdict.line.startswith("probable cause: fully_masked_nan — ")
    # S <= 16: a NaN first key block is a NaN fully masked row; the derived cases told them apart
    assert "first_block_nan" in [c["variant"] for c in verdict.causes[1:]]
    assert 1 < fn.calls <= 1 + diagnosis.MAX_DISCRIMINATING


def test_nan_only_agreement_that_no_other_case_confirms_is_unknown():
    # NaN fully masked rows on the failing case's shape only, NaN everywhere on any other:
    # no variant models that, and no other case confirms the NaN-only match
    fn = Planted("nan_unmodelled")
    verdict = diagnosed(target_of(fn), masked_case())
    assert not any(c["confirmed"] for c in verdict.causes)
    # neither fits a derived case: the NaN of fully masked rows and of a NaN first key
    # block stay apart only on the evidence that never came
    assert verdict.line.startswith("probable cause: unknown — closest, not confirmed: fully_masked_nan, "
                                   "first_block_nan")
    assert "no case gathered tells them apart" in verdict.line
    record = {"outcome": "failed", "causes": verdict.causes, "property": "p", "dtype": "float64", "device": "cpu"}
    assert diagnosis.cause_groups([record])[0]["variant"] == "unknown"
    assert diagnosis.cause_line(record).startswith("probable cause: unknown (closest, not confirmed: ")


def test_the_rule_on_a_nan_only_match_fails_without_it():
    # the broken rule (any match named) would name a kernel mechanism for any NaN
    from conformance.diagnosis.diagnose import Verdict, _named

    weak = dict(diagnosis._cause("first_block_nan", 0.0, None), finite_evidence=False, fitted=0, telling=0)
    assert not _named(Verdict([weak], "")).causes[0]["confirmed"]
    strong = dict(weak, finite_evidence=True)
    assert _named(Verdict([strong], "")).causes[0]["confirmed"]
    confirmed = dict(weak, fitted=1, telling=1)
    assert _named(Verdict([confirmed], "")).causes[0]["confirmed"]
    # NaN fully masked rows are the behaviour fully_masked_nan names, not a guess from NaN
    policy = dict(diagnosis._cause("fully_masked_nan", 0.0, None), finite_evidence=False, fitted=0, telling=0)
    assert _named(Verdict([policy], "")).causes[0]["confirmed"]


# --------------------------------------------------------------------------- zero-only agreement


def test_zero_only_agreement_is_confirmed_where_the_variant_reads_some_keys():
    # S < 16: a dropped ragged block reads no key (zeros, as many bugs give); the derived
    # case one key block longer (S + 16) is where it predicts a nonzero wrong output
    fn = Planted("drop_ragged")
    verdict = diagnosed(target_of(fn), case_of(causal="upper_left", L=1, S=2))
    first = verdict.causes[0]
    assert first["variant"] == "ragged_tail_dropped" and first["confirmed"] and not first["finite_evidence"]
    assert first["telling"] >= 1
    assert verdict.line.startswith("probable cause: ragged_tail_dropped — ")


def test_an_output_of_zeros_is_not_named_after_a_variant_that_reads_no_key():
    # a buffer never written (or a stale cached one) fits every variant that reads no key
    # on a short case; none fits the longer case, where they read some
    fn = Planted("zeros")
    verdict = diagnosed(target_of(fn), case_of(causal="upper_left", L=1, S=2))
    assert not any(c["confirmed"] for c in verdict.causes), verdict.causes
    assert verdict.line.startswith("probable cause: unknown"), verdict.line


def test_the_rule_on_a_zero_only_match_fails_without_it():
    # finite_evidence is False when the variant differs from the oracle only by zeros
    from conformance.diagnosis.problems import problem_of
    from spec import variants as V

    target = target_of(Planted("zeros"))
    case = case_of(causal="upper_left", L=1, S=2)
    diagnosis.start_example(case)
    run_sdpa(target, case)
    call = diagnosis._EXAMPLE.get().calls[-1]
    problem, observed, allowed = problem_of(target, call)
    assert V.variant_fit(observed, problem, "ragged_tail_dropped", allowed) <= 1.0  # it explains the zeros
    assert not V.finite_evidence(observed, problem, "ragged_tail_dropped", allowed)


# --------------------------------------------------------------------------- ties


def test_a_tie_no_case_breaks_is_unknown_with_the_closest_listed(monkeypatch):
    import conformance.diagnosis.diagnose as D

    monkeypatch.setattr(D, "_discriminating_calls", lambda *args: [])   # no evidence gathered
    fn = Planted("lower_right")
    verdict = diagnosed(target_of(fn), case_of(2, L=1, S=2, causal="upper_left"))
    assert not any(c["confirmed"] for c in verdict.causes)
    assert verdict.line.startswith("probable cause: unknown — closest, not confirmed: causal_ignored_when_L1, "
                                   "causal_ignored, causal_lower_right")


def test_a_tie_a_derived_case_breaks_names_one_with_its_declaration():
    fn = Planted("lower_right")
    verdict = diagnosed(target_of(fn), case_of(2, L=1, S=2, causal="upper_left"))
    first = verdict.causes[0]
    assert first["variant"] == "causal_lower_right" and first["confirmed"]
    assert [c["confirmed"] for c in verdict.causes[1:]] == [False] * (len(verdict.causes) - 1)
    assert "if this is intended, declare --impl-option causal=lower_right" in verdict.line
    assert "fewer other cases: causal_ignored" in verdict.line


# --------------------------------------------------------------------------- hints and policies


def test_an_inverted_sdpa_bool_mask_says_it_has_no_declaration():
    verdict = diagnosed(target_of(Planted("inverted")), masked_case(empty_row=None))
    assert verdict.causes[0]["variant"] == "mask_inverted" and verdict.causes[0]["confirmed"]
    assert "has no declaration" in verdict.line and "--impl-option" not in verdict.line


def test_an_inverted_mask_is_computed_under_the_implementations_own_policy():
    # the inverted mask empties row 0 (it attends keys 0 and 1 of 3: inverted, key 2 only... and
    # row 1 attends every key: inverted, none); the implementation's empty rows are NaN
    for declared in ({"bool": "nan", "additive": "zero", "causal": "zero"}, "unspecified"):
        target = target_of(Planted("inverted_plain_softmax"), fully_masked=declared)
        mask = np.ones((1, 1, 2, 3), dtype=bool)
        mask[..., 0, -1] = False
        verdict = diagnosed(target, case_of(5, attend_mask=mask))
        assert verdict.causes and verdict.causes[0]["variant"] == "mask_inverted", (declared, verdict.line)
        assert verdict.causes[0]["confirmed"]


# --------------------------------------------------------------------------- known deviations


def test_a_plain_sdpa_wrapper_is_told_which_known_deviation_it_inherits():
    target = Target(Implementation(name="my-sdpa", capabilities=Capabilities(), sdpa=my_sdpa),
                    "sdpa", "float64", "cpu")
    case = case_of(7, L=3, S=3, causal="upper_left", scale=-0.5)
    verdict = diagnosed(target, case)
    first = verdict.causes[0]
    assert first["variant"] == "causal_before_scale" and first["confirmed"]
    known = first["known_deviation"]
    assert known["name"] == "sdpa" and known["path"] == str(XFAIL_DIR / "sdpa.toml")
    assert "known deviation of the built-in `sdpa`" in verdict.line
    assert f"--xfail-file {XFAIL_DIR / 'sdpa.toml'}" in verdict.line
    # with a positive scale the wrapper is right: nothing to diagnose, no deviation claimed
    right = diagnosed(target, case.replace(scale=0.5))
    assert right.causes == [] and "known deviation" not in right.line


def _numpy_causal_before_scale(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """NumPy attention that blocks causally *before* scaling (-inf * scale): the CPU SDPA
    kernel's own deviation (sdpa.toml), written in another framework."""
    scale = 1 / np.sqrt(query.shape[-1]) if scale is None else scale
    logits = np.einsum("...le,...se->...ls", query, key)
    if is_causal:
        logits = np.where(np.tril(np.ones(logits.shape[-2:], bool)), logits, -np.inf)
    with np.errstate(invalid="ignore"):
        logits = logits * scale
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights = weights / weights.sum(-1, keepdims=True)
    return np.einsum("...ls,...se->...le", weights, value)


def test_a_bridged_framework_is_not_told_about_torchs_deviations():
    """The bridge's plumbing imports torch, the NumPy code it runs does not: a failure that
    matches a torch built-in's known deviation is named by its variant alone (a Keras
    layer on the tensorflow backend was told about nn.MultiheadAttention's deviation)."""
    from implementations.bridge import make_bridge

    bridged = make_bridge(_numpy_causal_before_scale, "numpy")
    target = Target(Implementation(name="np-sdpa", capabilities=Capabilities(), sdpa=bridged), "sdpa", "float64", "cpu")
    verdict = diagnosed(target, case_of(7, L=3, S=3, causal="upper_left", scale=-0.5))
    assert verdict.causes and verdict.causes[0]["variant"] == "causal_before_scale", verdict.line
    assert "known_deviation" not in verdict.causes[0] and "known deviation" not in verdict.line


def test_a_known_deviation_is_not_claimed_for_a_failure_outside_its_match():
    # a float64 failure is inside JAX's broad "*" entry (dtype = float64) but that entry
    # names no failure; and a torch wrapper is not told about JAX's deviations
    verdict = diagnosed(target_of(Planted("inverted")), masked_case(empty_row=None))
    assert "known_deviation" not in verdict.causes[0] and "known deviation" not in verdict.line


# --------------------------------------------------------------------------- declarations respected


def test_derived_cases_stay_inside_the_declared_sizes():
    fn = Planted("lower_right")
    target = target_of(fn, max_seq_len=3)
    seen: list[tuple[int, int]] = []
    real = fn.__call__

    def recording(q, k, v, **kwargs):
        seen.append((q.shape[-2], k.shape[-2]))
        return real(q, k, v, **kwargs)

    target = target_of(recording, max_seq_len=3)
    diagnosed(target, case_of(2, L=1, S=3, causal="upper_left"))
    assert len(seen) >= 2 and all(L <= 3 and S <= 3 for L, S in seen), seen


def test_derived_cases_keep_shared_keys_and_values_shared():
    from conformance.diagnosis.ties import _derived_cases

    base = case_of(3, L=2, S=3)
    shared = base.replace(value=base.key)
    derived = _derived_cases(shared)
    assert derived and all(np.array_equal(c.key, c.value) for _, c in derived)
    assert not all(np.array_equal(c.key, c.value) for _, c in _derived_cases(base))


def test_a_finite_mask_fill_is_named_and_not_an_inverted_mask():
    from spec.emulate import round_to

    def filled(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
        s = s + torch.where(attn_mask, torch.zeros((), dtype=s.dtype), torch.tensor(-1e4, dtype=s.dtype))
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v           # BERT's (1 - mask) * -10000

    target = Target(Implementation(name="fill", capabilities=Capabilities(dtypes=("float16",)), sdpa=filled),
                    "sdpa", "float16", "cpu")
    mask = np.ones((1, 1, 3, 4), dtype=bool)
    mask[..., 1, :] = False                                       # row 1 fully blocked
    mask[..., 0, 2:] = False
    case = case_of(1, L=3, S=4, attend_mask=mask)
    case = case.replace(query=round_to(3 * case.query, "float16"), key=round_to(3 * case.key, "float16"),
                        value=round_to(case.value, "float16"), dtype="float16")
    verdict = diagnosed(target, case)
    assert verdict.causes[0]["variant"] == "mask_fill_1e4" and verdict.causes[0]["confirmed"], verdict.line
    assert "mask_inverted" not in [c["variant"] for c in verdict.causes]


def test_a_fill_that_cancels_out_is_named_and_not_an_inverted_mask():
    # Keras' dot_product_attention: blocked keys get -0.7 * 65500 in float16, added by SDPA in
    # float32, so a fully blocked row attends every key (the fill cancels). On a case whose
    # only masked row is fully blocked, an inverted mask predicts the same; one more query
    # (its mask entries attend) is right here and fully blocked under the inverted mask.
    from spec.emulate import round_to

    def keras_like(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        bias = torch.where(attn_mask, torch.zeros((), dtype=q.dtype), torch.tensor(-0.7 * 65500.0, dtype=q.dtype))
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias.float(),
                                              scale=scale).to(q.dtype)

    target = Target(Implementation(name="keras-like", capabilities=Capabilities(dtypes=("float16",)),
                                   sdpa=keras_like), "sdpa", "float16", "cpu")
    case = case_of(2, L=1, S=2, attend_mask=np.zeros((1, 1, 1, 2), dtype=bool))   # one row, fully blocked
    case = case.replace(query=round_to(case.query, "float16"), key=round_to(case.key, "float16"),
                        value=round_to(case.value, "float16"), dtype="float16")
    verdict = diagnosed(target, case, prop="fully_masked_rows")
    first = verdict.causes[0]
    assert first["variant"] == "mask_fill_cancels" and first["confirmed"], verdict.line
    assert "mask_inverted" in [c["variant"] for c in verdict.causes[1:]]       # the tie the derived case broke


def test_the_sharded_derived_case_can_confirm_a_merge_without_the_max():
    """A merge without the running max is NaN-only evidence on an overflowing case; the
    derived case (every logit far below 0) is where it predicts finite wrong rows, in every
    layout and causal setting, and where the correct merge stays within the tolerance."""
    from conformance.diagnosis.ties import _could_confirm, _sharded_derived_cases
    from conformance.sharded.cases import ShardedCase
    from spec import variants as V

    rng = np.random.default_rng(3)
    for dtype in ("float64", "float32", "bfloat16", "float16"):
        for layout, causal, L, world in (("contiguous", False, 4, 2), ("zigzag", True, 8, 2), ("contiguous", True, 6, 3)):
            case = ShardedCase(rng.standard_normal((1, 2, L, 4)), rng.standard_normal((1, 2, L, 4)),
                               rng.standard_normal((1, 2, L, 4)), world_size=world, layout=layout, causal=causal,
                               dtype=dtype)
            (_, derived), = _sharded_derived_cases(case)
            problem = V.ShardedProblem.from_case(derived)
            assert _could_confirm(problem, "sharded_merge_no_max"), (dtype, layout, causal)
            assert np.isfinite(V.reference(problem).output).all()


def test_a_bridged_layer_on_torch_is_offered_torchs_kernel_deviations_but_not_nn_multiheadattentions():
    """Keras' MultiHeadAttention on the torch backend calls torch's kernels, not
    nn.MultiheadAttention's code: torch-mha's known deviations are not its own."""
    from types import SimpleNamespace

    from conformance.diagnosis.deviations import _offered

    framework = SimpleNamespace(package="keras", native_torch=True)
    layer = SimpleNamespace(framework=framework)
    target = SimpleNamespace(impl=SimpleNamespace(sdpa=None, mha=layer, flash=None))
    found = [("sdpa", None, None), ("torch-mha", None, None), ("jax", None, None)]
    libraries = {"sdpa": "torch", "torch-mha": "torch", "jax": "jax"}
    assert [name for name, _, _ in _offered(found, target, libraries)] == ["sdpa"]
    plain = SimpleNamespace(impl=SimpleNamespace(sdpa=None, mha=torch.nn.MultiheadAttention, flash=None))
    assert "torch-mha" in [name for name, _, _ in _offered(found, plain, libraries)]
