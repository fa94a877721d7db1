"""FP8 inputs at the flash level: flash-ref agrees with spec.fp8's dequantised oracle; the
bound of ``tolerance.fp8_allowed`` holds for FlashAttention-3's numerics (the zoo's
FlashBase: P rounded to FP8 before P·V) on many cases, both formats and large head dims,
and rejects an output a few percent off; a function naming q_descale/k_descale/v_descale
(FlashAttention-3's signature among them) is recognised and probed for FP8, the dtypes
option declares the formats; the strategy draws exact FP8 cases; each FP8 mutant's
smallest case exposes its bug and its safe case does not."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spec
from conformance.calls.flash import FlashCase, flash_inputs, fp8_allowed_lse, fp8_allowed_output, oracle
from conformance.strategies.flash import flash_cases
from implementations import registry
from implementations.base import Capabilities, ImplementationError
from implementations.mutants import MUTANTS
from implementations.mutants.flash.flash_mutants import FLASH_CAPABILITIES, FlashBase
from implementations.registry.options import parse_options

FORMATS = ("float8_e4m3fn", "float8_e5m2")


def fp8_case(seed: int, fmt: str = "float8_e4m3fn", *, B=2, N=4, K=2, L=3, S=5, E=4, Ev=3, form="per_head",
             causal=False, magnitude=1.0, **changes) -> FlashCase:
    """A FlashCase of q, k, v quantised with amax descales of ``form`` (per_head, per_tensor, none)."""
    rng = np.random.default_rng(seed)
    f = spec.fp8.FORMATS[fmt]
    values = [rng.standard_normal(s) * magnitude for s in ((B, L, N, E), (B, S, K, E), (B, S, K, Ev))]
    arrays, descales = [], []
    for i, x in enumerate(values):
        if form == "none":
            arrays.append(spec.fp8.quantize(x, fmt, saturate=True))
            descales.append(None)
            continue
        if form == "per_tensor":
            d = np.array([np.abs(x).max() / f.max])
            full = d
        else:
            grouped = np.abs(x).reshape(B, x.shape[1], K, x.shape[2] // K, x.shape[3])
            d = grouped.max(axis=(1, 3, 4)) / f.max
            full = np.repeat(d, x.shape[2] // K, axis=1)[:, None, :, None] if i == 0 else d[:, None, :, None]
        d = np.float32(d).astype(np.float64)
        full = np.float32(full).astype(np.float64)
        arrays.append(spec.fp8.quantize(x / full, fmt, saturate=True))
        descales.append(d)
    return FlashCase(*arrays, fp8=fmt, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                     causal=causal, dtype="bfloat16", **changes)


def call_flash(flash, case: FlashCase, *, lse=False):
    tensors = flash_inputs(case)
    kwargs = {"softmax_scale": case.scale, "causal": case.causal, "window_size": case.window,
              "softcap": case.softcap, "return_attn_probs": lse}
    for name in ("q_descale", "k_descale", "v_descale", "sinks", "alibi_slopes"):
        if tensors[name] is not None:
            kwargs[name] = tensors[name]
    got = flash(tensors["q"], tensors["k"], tensors["v"], **kwargs)
    out, lse_t = (got[0], got[1]) if lse else (got, None)
    return out, lse_t


def worst_ratio(flash, case: FlashCase, *, lse=False) -> float:
    out, lse_t = call_flash(flash, case, lse=lse)
    ref = oracle(case)
    got = out.double().numpy()
    allowed = fp8_allowed_output(case, ref, str(out.dtype).removeprefix("torch."))
    rows = ~case.empty_rows()
    ratio = float((np.abs(got - ref.output) / allowed)[:, rows].max())
    if lse:
        finite = np.isfinite(ref.lse)
        lse_ratio = np.abs(lse_t.double().numpy()[finite] - ref.lse[finite]) / fp8_allowed_lse(case, ref, "float32")[finite]
        ratio = max(ratio, float(lse_ratio.max()))
    return ratio


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("form", ["per_head", "per_tensor", "none"])
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (1, 0), "softcap": 1.5},
                                     {"sinks": np.array([0.5, -1.0, 2.0, 0.0])}], ids=["plain", "causal", "window", "sinks"])
def test_flash_ref_agrees_with_the_dequantised_oracle(fmt, form, options):
    case = fp8_case(3, fmt, form=form, L=6, **options)
    out, _ = call_flash(registry.resolve("flash-ref").flash, case)
    assert out.dtype == torch.bfloat16                               # FlashAttention-3's output dtype
    ref = oracle(case).output
    # flash-ref computes in float32: its error is the bfloat16 output's rounding
    np.testing.assert_allclose(out.double().numpy(), ref, atol=1e-6, rtol=2.0 ** -8)


def test_flash_ref_refuses_descales_without_fp8_inputs_and_mixed_formats():
    flash = registry.resolve("flash-ref").flash
    q = torch.randn(1, 2, 2, 4)
    with pytest.raises(ValueError, match="q_descale, k_descale and v_descale are for FP8"):
        flash(q, q, q, q_descale=torch.ones(1))
    with pytest.raises(ValueError, match="FP8 q, k, v must share one format"):
        flash(q.to(torch.float8_e4m3fn), q.to(torch.float8_e5m2), q.to(torch.float8_e4m3fn))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31), fmt=st.sampled_from(FORMATS), form=st.sampled_from(["per_head", "per_tensor", "none"]),
       E=st.sampled_from([1, 4, 16, 64, 128]), S=st.integers(1, 40), magnitude=st.sampled_from([0.1, 1.0, 4.0]),
       causal=st.booleans())
def test_the_fp8_bound_holds_for_flashattention3_numerics(seed, fmt, form, E, S, magnitude, causal):
    """FlashBase rounds P to FP8 (after FlashAttention-3's 2^8 offset) before P·V, sums the
    float32 P, applies v_descale to the float32 output and rounds it to bfloat16: inside
    the bound, with its LSE, for head dims up to 128 and rows of up to 40 keys."""
    case = fp8_case(seed, fmt, form=form, E=E, Ev=E, S=S, L=3, causal=causal, magnitude=magnitude)
    assert worst_ratio(FlashBase(), case, lse=True) < 1.0


def test_the_bound_is_a_few_percent_at_most():
    """Not vacuous: an output 20 % off (a descale of 1.2 applied twice) fails, and the
    bound stays below the 2·2^-4 of rounding P plus a few percent."""
    case = fp8_case(5, "float8_e4m3fn", form="per_tensor", S=8)
    out, _ = call_flash(FlashBase(), case)
    ref = oracle(case)
    allowed = fp8_allowed_output(case, ref, "bfloat16")
    problem_weights = oracle(case.replace(value=np.abs(case.value), v_descale=np.abs(case.v_descale))).output
    assert (allowed <= 0.2 * np.abs(problem_weights) + 1e-3).all()
    off = ref.output * 1.2
    assert (np.abs(off - ref.output) > allowed).any()


def test_fp8_capabilities_options_and_validation():
    assert Capabilities(fp8_dtypes=("float8_e5m2", "float8_e4m3fn")).fp8_dtypes == ("float8_e4m3fn", "float8_e5m2")
    with pytest.raises(ImplementationError, match="8-bit float formats go in fp8_dtypes"):
        Capabilities(dtypes=("float8_e4m3fn",))
    with pytest.raises(ImplementationError, match="fp8_dtypes=.*float8_e4m3"):
        Capabilities(fp8_dtypes=("float8_e4m3",))
    parsed = parse_options({"dtypes": "bfloat16,float8_e4m3fn"})
    assert parsed.common == {"dtypes": ("bfloat16",), "fp8_dtypes": ("float8_e4m3fn",)}
    assert parse_options({"flash.dtypes": "float8_e5m2"}).per_level["flash"] == {"fp8_dtypes": ("float8_e5m2",)}
    impl = registry.resolve("flash-ref", {"fp8_dtypes": "none"})
    assert impl.caps("flash").fp8_dtypes == ()
    assert registry.resolve("flash-ref").caps("flash").fp8_dtypes == FORMATS
    reasons = registry.resolve("flash-ref", {"fp8_dtypes": "float8_e4m3fn"}).not_supported_reasons(
        {"level": "flash", "fp8": "float8_e5m2"})
    assert reasons == ["q, k, v in float8_e5m2 not supported (fp8_dtypes=['float8_e4m3fn'])"]


SOURCE = textwrap.dedent(
    """
    from implementations.builtins.references.flash_reference import flash_attn_func as reference

    def fa3_signature(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                      v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                      pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
        for d in (q_descale, k_descale, v_descale):  # FlashAttention-3: CHECK_SHAPE(d, batch_size, num_heads_k)
            if d is not None and tuple(d.shape) != (q.shape[0], k.shape[2]):
                raise RuntimeError(f"descale must have shape (batch_size, num_heads_k), got {tuple(d.shape)}")
        return reference(q, k, v, softmax_scale=softmax_scale, causal=causal, q_descale=q_descale,
                         k_descale=k_descale, v_descale=v_descale, window_size=window_size, softcap=softcap,
                         return_attn_probs=return_attn_probs)

    def e4m3_only(q, k, v, softmax_scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None):
        if str(q.dtype) == "torch.float8_e5m2":
            raise NotImplementedError("only e4m3")
        return reference(q, k, v, softmax_scale=softmax_scale, causal=causal, q_descale=q_descale,
                         k_descale=k_descale, v_descale=v_descale)

    def reshapes(q, k, v, softmax_scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None):
        # reads each descale as (B, K): a (1,) one passes only where B = K = 1
        q_descale, k_descale, v_descale = (None if d is None else d.reshape(q.shape[0], k.shape[2])
                                           for d in (q_descale, k_descale, v_descale))
        return reference(q, k, v, softmax_scale=softmax_scale, causal=causal, q_descale=q_descale,
                         k_descale=k_descale, v_descale=v_descale)

    def swallows(q, k, v, softmax_scale=None, causal=False, **kwargs):
        return reference(q, k, v, softmax_scale=softmax_scale, causal=causal)
    """
)


def test_descale_arguments_are_recognised_and_probed(tmp_path):
    path = tmp_path / "user_fp8.py"
    path.write_text(SOURCE)
    fa3 = registry.resolve(f"{path}:fa3_signature").caps("flash")
    assert fa3.fp8_dtypes == FORMATS
    assert fa3.fp8_descales == ("none", "per_head")                   # (1,) refused, noted
    assert any(n.startswith("fp8_descales: descales of shape (1,) raised") for n in fa3.probe_notes)
    assert "alibi" not in fa3.flash_features and not fa3.dropout        # FlashAttention-3 has neither
    assert any(n.startswith("dropout: dropout_p=0.5 raised") for n in fa3.probe_notes)
    only = registry.resolve(f"{path}:e4m3_only").caps("flash")
    assert only.fp8_dtypes == ("float8_e4m3fn",)
    assert any(n.startswith("fp8_dtypes: q, k, v in float8_e5m2") for n in only.probe_notes)
    assert registry.resolve(f"{path}:swallows").caps("flash").fp8_dtypes == ()   # **kwargs claims nothing
    # the forms are probed where they differ (K = 2 heads): (1,) read as (B, K) is refused there
    assert registry.resolve(f"{path}:reshapes").caps("flash").fp8_descales == ("none", "per_head")


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.data())
def test_the_strategy_draws_exact_fp8_cases(data):
    case = data.draw(flash_cases(dtype="bfloat16", caps=FLASH_CAPABILITIES.replace(dtypes=("bfloat16",)), fp8=True))
    assert case.fp8 in FORMATS
    for name in ("query", "key", "value"):
        assert spec.fp8.representable(getattr(case, name), case.fp8).all()
    for d in (case.q_descale, case.k_descale, case.v_descale):
        if d is not None:
            assert d.shape in ((1,), (case.B, case.K)) and (d > 0).all()
            np.testing.assert_array_equal(np.float32(d).astype(np.float64), d)   # float32-exact
    spec.flash_attention(case.query, case.key, case.value, **case.options())   # valid per the spec


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.data())
def test_the_strategy_keeps_to_the_declared_descale_forms(data):
    caps = FLASH_CAPABILITIES.replace(fp8_descales=("none", "per_head"))
    case = data.draw(flash_cases(dtype="float32", caps=caps, fp8=True))
    assert case.descale_forms() <= {"none", "per_head"}
    impl = MUTANTS["flash_fp8_k_descale_ignored"].build()
    reasons = impl.not_supported_reasons({"level": "flash", "fp8": "float8_e4m3fn", "descale_forms": {"per_tensor"}})
    assert reasons == []
    narrow = registry.resolve("flash-ref", {"fp8_descales": "per_head"})
    assert narrow.not_supported_reasons({"level": "flash", "fp8": "float8_e4m3fn", "descale_forms": {"per_tensor"}}) == [
        "descales given ['per_tensor'] not supported (fp8_descales=['per_head'])"]


def test_the_strategy_draws_every_format_and_descale_form():
    seen = set()

    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(st.data())
    def draw(data):
        case = data.draw(flash_cases(dtype="float32", caps=FLASH_CAPABILITIES, fp8=True))
        seen.add(case.fp8)
        seen.add(case.descale_form())

    draw()
    assert {"float8_e4m3fn", "float8_e5m2", "per_head", "per_tensor", "none"} <= seen, seen


FP8_MUTANTS = sorted(n for n in MUTANTS if n.startswith("flash_fp8"))


def _record_case(case: dict) -> FlashCase:
    """A record's case as a FlashCase: the sizes, ``fp8``, ``descale`` (per_head: factors
    differing per kv head and between q, k and v; per_tensor: one each)."""
    sizes = {d: case[d] for d in ("B", "N", "K", "L", "S", "E", "Ev")}
    fc = fp8_case(1, case["fp8"], form="none", **sizes, magnitude=3.0)
    B, K = case["B"], case["K"]
    if case.get("descale") == "per_head":
        grid = np.arange(B * K, dtype=np.float64).reshape(B, K)
        fc = fc.replace(q_descale=0.5 + grid, k_descale=0.25 * (1 + grid), v_descale=2.0 + grid)
    elif case.get("descale") == "per_tensor":
        fc = fc.replace(q_descale=np.array([0.5]), k_descale=np.array([4.0]), v_descale=np.array([2.0]))
    return fc


def _agrees(mutant, case: dict) -> bool:
    return worst_ratio(mutant.build().flash, _record_case(case), lse=bool(case.get("lse"))) < 1.0


@pytest.mark.parametrize("name", FP8_MUTANTS)
def test_fp8_mutant_cases_expose_their_bug(name):
    mutant = MUTANTS[name]
    assert mutant.expected_property == "fp8_agreement"
    assert mutant.build().not_supported_reasons({"level": "flash", "fp8": mutant.smallest_case["fp8"]}) == []
    assert not _agrees(mutant, mutant.smallest_case), "the smallest case does not expose the bug"
    assert _agrees(mutant, mutant.safe_case), "the safe case exposes the bug"
