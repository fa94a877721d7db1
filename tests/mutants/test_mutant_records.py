"""The bug zoo's records are complete and true (fast; no conformance runner).

For every mutant: the record is complete; its documented smallest case gives a
result that differs from a correct float64 reference (torch SDPA / nn.MultiheadAttention
with the same weights), proving the case exposes the bug; and its safe case agrees
with the reference, proving the bug is the only one there. The correct bases the
mutants are built from are checked against torch too.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conformance.core.registry import registered_properties
from spec import variants as V
from implementations.base import Implementation
from implementations.mutants import MUTANTS, Mutant
from implementations.mutants._base import (
    LOWER_RIGHT_CAPABILITIES,
    MHA_CAPABILITIES,
    SDPA_CAPABILITIES,
    HandwrittenMHA,
    LowerRightSDPA,
    ManualBackwardSDPA,
    NaiveSDPA,
    TiledSDPA,
    load_mha_weights,
)
from implementations.mutants.cases import case_attrs, mha_call, sdpa_call
from implementations.mutants.flash.flash_mutants import FLASH_CAPABILITIES

#: The suite's property ids, from the registry (every conformance/test_*.py imported).
PROPERTY_IDS = frozenset(registered_properties())
#: Properties that mutants already name but that are not in the suite yet.
PENDING_PROPERTY_IDS: set[str] = set()
SIZES = ("B", "N", "K", "L", "S", "E", "Ev")
#: The hand-written pitfalls and kernel bugs at the end of docs/KNOWN_BUGS.md.
REQUIRED = {
    "mha_scale_sqrt_embed_dim", "mha_split_heads_view", "mha_merge_without_transpose",
    "mha_missing_contiguous", "mha_no_out_proj", "mask_after_softmax", "mha_mask_eq_zero",
    "dropout_on_masked_logits", "mha_dropout_functional_default",
    "tiled_ragged_tail_dropped", "tiled_no_rescale", "tiled_assumes_contiguous",
    "tiled_bf16_accumulator", "tiled_kv_batch_offset", "tiled_global_max",
}
TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "float16": 3e-2, "bfloat16": 3e-2}
DROPOUT_DRAWS = 4000

def _triton_reason() -> str | None:
    from implementations.builtins.kernels.triton_attention import make_implementation

    return make_implementation().unavailable_reason


_NO_TRITON = _triton_reason()
#: Every mutant; the ones planted in the Triton kernel need triton to run.
ALL = [
    pytest.param(name, marks=pytest.mark.skipif(_NO_TRITON is not None, reason=f"triton: {_NO_TRITON}"))
    if name.startswith("triton_") else name
    for name in sorted(MUTANTS) if MUTANTS[name].level in ("sdpa", "mha")
]  # the varlen / kvcache levels' records: tests/mutants/test_varlen_mutant_records.py
WITH_SAFE = [param for param in ALL if MUTANTS[getattr(param, "values", [param])[0]].safe_case is not None]


# --------------------------------------------------------------------------- helpers


def _close(got: torch.Tensor, want: torch.Tensor, dtype: str) -> bool:
    tol = TOLERANCE[dtype]
    got = got.detach().to(torch.float64)
    want = want.detach().to(torch.float64)
    if got.shape != want.shape:
        return False
    return bool(torch.allclose(got, want, rtol=tol, atol=tol))


def _reference_sdpa(call, *, requires_grad: bool):
    """torch SDPA in float64 on the same stored values (contiguous copies); with learned
    sinks (which torch's SDPA has none of) the handwritten built-in, itself checked against
    spec.sdpa(sinks=) in tests/implementations/test_sdpa_sinks.py."""
    q, k, v = (t.detach().to(torch.float64).contiguous() for t in (call.query, call.key, call.value))
    if requires_grad:
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    kwargs = dict(call.kwargs)
    kwargs.pop("dropout_p", None)
    if "sinks" in kwargs:
        from implementations.builtins.references.handwritten import scaled_dot_product_attention as handwritten

        if call.causal == "lower_right":
            L, S = q.shape[-2], k.shape[-2]
            kwargs["is_causal"] = False
            kwargs["attn_mask"] = torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)
        return handwritten(q, k, v, **kwargs), (q, k, v)
    if call.causal == "lower_right":  # torch's is_causal is upper-left: spell the triangle out
        L, S = q.shape[-2], k.shape[-2]
        kwargs["is_causal"] = False
        kwargs["attn_mask"] = torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.dtype != torch.bool:
        kwargs["attn_mask"] = mask.to(torch.float64)
    return F.scaled_dot_product_attention(q, k, v, **kwargs), (q, k, v)


def _sdpa_results(sdpa, case: dict, seed: int = 0):
    """(output, grads or None) of ``sdpa`` on ``case``; the mean over draws with dropout."""
    call = sdpa_call(case, seed)
    grad = bool(case.get("grad"))
    if case.get("dropout_p"):
        torch.manual_seed(seed)
        outs = [call.run(sdpa)[0].to(torch.float64) for _ in range(DROPOUT_DRAWS)]
        return torch.stack(outs), None
    out, inputs = call.run(sdpa, requires_grad=grad)
    if not grad:
        return out, None
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1),
                           dtype=torch.float64).to(out.dtype)
    grads = torch.autograd.grad(out, inputs, upstream)
    return out, grads


def _sdpa_reference(case: dict, seed: int = 0):
    call = sdpa_call(case, seed)
    grad = bool(case.get("grad"))
    out, inputs = _reference_sdpa(call, requires_grad=grad)
    if not grad:
        return out, None
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1),
                           dtype=torch.float64).to(_dtype_of(case)).to(torch.float64)
    return out, torch.autograd.grad(out, inputs, upstream)


def _reference_sdpa_draws(call, dropout_p: float) -> torch.Tensor:
    """DROPOUT_DRAWS outputs of torch SDPA in float64 with ``dropout_p`` on ``call``'s values."""
    q, k, v = (t.detach().to(torch.float64).contiguous() for t in (call.query, call.key, call.value))
    kwargs = {key: value for key, value in call.kwargs.items() if key != "dropout_p"}
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.dtype != torch.bool:
        kwargs["attn_mask"] = mask.to(torch.float64)
    torch.manual_seed(1)
    return torch.stack([F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, **kwargs)
                        for _ in range(DROPOUT_DRAWS)])


def _same_spread(draws: torch.Tensor, reference: torch.Tensor, scale: float) -> bool:
    """The standard deviations of two sets of SDPA or MHA draws agree within 15% (their
    own sampling error at 4000 draws is a few percent); for SDPA draws (draws, B, N, L, Ev)
    with B >= 2 also those of batch item 0 minus item 1, which one mask shared by the
    batch makes smaller."""
    def spreads(x: torch.Tensor) -> list[torch.Tensor]:
        return [x.std(0)] + ([(x[:, 0] - x[:, 1]).std(0)] if x.dim() == 5 and x.shape[1] >= 2 else [])

    return all(bool(torch.allclose(a, b, rtol=0.15, atol=0.02 * scale))
               for a, b in zip(spreads(draws), spreads(reference), strict=True))


def _dtype_of(case: dict) -> torch.dtype:
    return getattr(torch, case.get("dtype", "float64"))


def _sdpa_agrees(sdpa, case: dict) -> bool:
    """Does ``sdpa`` agree with the float64 reference on ``case`` (output and grads)?"""
    dtype = case.get("dtype", "float64")
    try:
        got, got_grads = _sdpa_results(sdpa, case)
    except (RuntimeError, ValueError, IndexError):
        return False
    want, want_grads = _sdpa_reference(case)
    if case.get("dropout_p"):
        # E[dropout(W) V] = W V: compare the mean of many draws, 10% relative; and their
        # spread with that of torch's dropout on the same call (a dropout that is ignored,
        # shared by every sample or applied to the output keeps the mean).
        scale = float(want.abs().max())
        return (bool(torch.allclose(got.mean(0), want, rtol=0.1, atol=0.05 * scale))
                and _same_spread(got, _reference_sdpa_draws(sdpa_call(case), case["dropout_p"]), scale))
    if not _close(got, want, dtype):
        return False
    if got_grads is not None:
        return all(_close(a, b, dtype) for a, b in zip(got_grads, want_grads, strict=True))
    return True


def _raises(sdpa, case: dict) -> bool:
    call = sdpa_call(case)
    try:
        call.run(sdpa)
    except (RuntimeError, ValueError):
        return True
    return False


def _reference_mha(call, inputs=None):
    module = torch.nn.MultiheadAttention(
        call.params.embed_dim, call.params.num_heads, dropout=call.options["dropout"],
        dtype=torch.float64,
    )
    load_mha_weights(module, call.params)
    module.eval()
    query, key, value = inputs if inputs is not None else (call.query, call.key, call.value)
    out, weights = module(query, key, value, **call.kwargs)
    # torch's MHA gives NaN rows where every key is blocked; the declared policy is
    # "zero": attention output 0, i.e. out_proj.bias after the projection, weights 0.
    nan_rows = torch.isnan(out).any(dim=-1, keepdim=True)
    out = torch.where(nan_rows, module.out_proj.bias.detach().expand_as(out), out)
    if weights is not None:
        weights = torch.nan_to_num(weights, nan=0.0)
    return out, weights


def _reference_mha_draws(call) -> torch.Tensor:
    """DROPOUT_DRAWS train-mode outputs of torch's nn.MultiheadAttention on ``call``."""
    module = torch.nn.MultiheadAttention(
        call.params.embed_dim, call.params.num_heads, dropout=call.options["dropout"],
        dtype=torch.float64,
    )
    load_mha_weights(module, call.params)
    module.train()
    torch.manual_seed(1)
    with torch.no_grad():
        return torch.stack([module(call.query, call.key, call.value, **call.kwargs)[0]
                            for _ in range(DROPOUT_DRAWS)])


def _mha_agrees(implementation: Implementation, case: dict) -> bool:
    call = mha_call(case)
    torch.manual_seed(0)

    def run(inputs=None):
        return call.run(implementation.mha, implementation.load_weights, inputs=inputs)

    try:
        if call.training and call.options["dropout"]:
            # E[train-mode output] = eval output: compare the mean of many calls, 10%
            # of what attention adds to out_proj's bias.
            bias = torch.as_tensor(call.params.out_proj_bias)
            draws = torch.stack([run()[0].detach() for _ in range(DROPOUT_DRAWS)])
            want_out = _reference_mha(call)[0].detach() - bias
            scale = float(want_out.abs().max())
            return (bool(torch.allclose(draws.mean(0) - bias, want_out, rtol=0.1, atol=0.05 * scale))
                    and _same_spread(draws, _reference_mha_draws(call), scale))
        out, weights = run()
        grads = _mha_grads(run, call) if case.get("grad") else None
    except (RuntimeError, ValueError, IndexError):
        return False
    want_out, want_weights = _reference_mha(call)
    if not _close(out, want_out, "float64"):
        return False
    if (weights is None) != (want_weights is None):
        return False
    if weights is not None and not _close(weights, want_weights, "float64"):
        return False
    if grads is not None:
        want_grads = _mha_grads(lambda inputs: _reference_mha(call, inputs=inputs), call)
        return all(_close(a, b, "float64") for a, b in zip(grads, want_grads, strict=True))
    return True


def _mha_grads(run, call):
    """Gradients of Σ c·output (c fixed) with respect to query, key and value."""
    inputs = tuple(t.detach().clone().requires_grad_(True) for t in (call.query, call.key, call.value))
    out, _ = run(inputs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = torch.autograd.grad(out, inputs, upstream, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs, strict=True)]


def _flash_agrees(implementation: Implementation, case: dict) -> bool:
    """Does the flash-level ``implementation`` agree with ``spec.flash`` on ``case`` (output,
    and the LSE with ``lse``, the gradients with ``grad``)? Vocabulary: sizes, ``causal``,
    ``window`` [left, right], ``softcap``, ``alibi`` (slopes per head), ``sinks`` (one per head),
    ``lse``, ``grad``."""
    import spec

    g = torch.Generator().manual_seed(0)
    B, N, K, L, S, E, Ev = (case[d] for d in SIZES)
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64)
               for shape in ((B, L, N, E), (B, S, K, E), (B, S, K, Ev)))
    options = {"causal": bool(case.get("causal")), "window": tuple(case.get("window", (-1, -1))),
               "softcap": float(case.get("softcap", 0.0)),
               "alibi_slopes": None if case.get("alibi") is None else np.array(case["alibi"], dtype=float)}
    kwargs = {"causal": options["causal"], "window_size": options["window"], "softcap": options["softcap"],
              "alibi_slopes": None if options["alibi_slopes"] is None else torch.tensor(case["alibi"])}
    if case.get("sinks") is not None:
        options["sinks"] = np.array(case["sinks"], dtype=float)
        kwargs["sinks"] = torch.tensor(case["sinks"])
    want = spec.flash_attention(q.numpy(), k.numpy(), v.numpy(), return_lse=True, **options)
    inputs = [t.clone().requires_grad_(bool(case.get("grad"))) for t in (q, k, v)]
    got = implementation.flash(*inputs, return_attn_probs=bool(case.get("lse")), **kwargs)
    out = got[0] if case.get("lse") else got
    if not np.allclose(out.detach().numpy(), want.output, atol=1e-9):
        return False
    if case.get("lse") and not np.allclose(got[1].detach().numpy(), want.lse, atol=1e-9):
        return False
    if case.get("grad"):
        upstream = torch.randn(out.shape, generator=g, dtype=torch.float64)
        grads = torch.autograd.grad(out, inputs, upstream)
        expected = spec.flash_attention_vjp(q.numpy(), k.numpy(), v.numpy(), upstream.numpy(), **options)
        return all(np.allclose(a.numpy(), b, atol=1e-9) for a, b in zip(grads, expected, strict=True))
    return True


def _agrees(mutant: Mutant, case: dict) -> bool:
    implementation = mutant.build()
    if mutant.level == "flash":
        return _flash_agrees(implementation, case)
    if mutant.level == "mha":
        return _mha_agrees(implementation, case)
    return _sdpa_agrees(implementation.sdpa, case)


# --------------------------------------------------------------------------- records


def test_zoo_size_and_coverage():
    assert len(MUTANTS) >= 32, f"len(MUTANTS)={len(MUTANTS)}, but should be >= 32"
    rows = {int(n) for m in MUTANTS.values() for n in re.findall(r"docs/KNOWN_BUGS\.md #(\d+)", m.origin)}
    missing = set(range(1, 16)) - rows
    assert not missing, f"docs/KNOWN_BUGS.md rows without a mutant: {sorted(missing)}"
    assert REQUIRED <= set(MUTANTS), f"missing mutants: {sorted(REQUIRED - set(MUTANTS))}"
    assert {m.level for m in MUTANTS.values()} == {"sdpa", "mha", "flash", "varlen", "kvcache", "sharded"}


@pytest.mark.parametrize("name", ALL)
def test_record_is_complete(name):
    mutant = MUTANTS[name]
    assert mutant.name == name
    assert mutant.bug and "\n" not in mutant.bug and len(mutant.bug) < 240, f"bug={mutant.bug!r}"
    assert re.search(r"docs/KNOWN_BUGS\.md #\d+|hand-written|kernel bug|classic|real code: ", mutant.origin), (
        f"origin={mutant.origin!r}, but should name a docs/KNOWN_BUGS.md row, a hand-written "
        "pitfall/classic mistake, a kernel bug, or the real code it is modelled on"
    )
    assert mutant.expected_property in PROPERTY_IDS | PENDING_PROPERTY_IDS, (
        f"expected_property={mutant.expected_property!r}")
    assert mutant.expected_property.startswith("mha_") == (mutant.level == "mha")
    info = registered_properties().get(mutant.expected_property)
    assert info is None or info.level == mutant.level, f"{mutant.expected_property} is {info.level}-level"
    if mutant.expected_cause is not None:                # a spec.variants variant of the mutant's level
        assert mutant.expected_cause in V.VARIANTS, f"expected_cause={mutant.expected_cause!r}"
        assert V.VARIANTS[mutant.expected_cause].level == mutant.level
    for dim in SIZES:
        value = mutant.smallest_case.get(dim)
        assert isinstance(value, int) and value >= 1, f"smallest_case[{dim!r}]={value!r}"
    implementation = mutant.build()
    assert isinstance(implementation, Implementation)
    assert implementation.name == f"mutant:{name}"
    assert implementation.listed is False
    if mutant.level == "flash":
        assert implementation.flash is not None and implementation.sdpa is None and implementation.mha is None
    elif mutant.level == "sdpa":
        assert implementation.sdpa is not None and implementation.mha is None
    else:
        assert implementation.mha is not None and implementation.load_weights is not None


@pytest.mark.parametrize("name", ALL)
def test_smallest_case_is_claimed(name):
    """The exposing case lies inside the mutant's declared capabilities, so the suite
    must run it (an invalid-input case is claimed like any other)."""
    mutant = MUTANTS[name]
    implementation = mutant.build()
    attrs = case_attrs(mutant.smallest_case, mutant.level)
    assert implementation.not_supported_reasons(attrs) == []


@pytest.mark.parametrize("name", ALL)
def test_capabilities_are_the_bases(name):
    """Honest claims: a mutant declares what its base supports, bug included."""
    mutant = MUTANTS[name]
    caps = mutant.build().capabilities
    base = {"sdpa": SDPA_CAPABILITIES, "mha": MHA_CAPABILITIES, "flash": FLASH_CAPABILITIES}[mutant.level]
    if name.startswith("contract_"):
        # Recognised and probed like a bare function: the semantics are the contract's (or
        # the user's declaration), whatever the probe saw of the bug, and the probe said it.
        causal = caps.causal if caps.source("causal") == "declared" else base.causal
        assert (caps.causal, caps.shared_kv, caps.fully_masked) == (causal, False, base.fully_masked)
        assert {caps.source(f) for f in ("causal", "shared_kv")} <= {"contract", "declared"}
        assert caps.probe_notes, "the probe saw nothing of the bug"
        return
    if name.startswith("learner_"):  # probed through the learner level: its correct module's claims
        from implementations.mutants.mha.learner_mutants import control_of

        caps, base = caps.replace(probe_notes=()), control_of(name).capabilities.replace(probe_notes=())
    elif name.startswith("triton_"):  # planted in the Triton kernel: its clean build's claims
        from implementations.builtins.kernels.triton_attention import make_implementation

        base = make_implementation().capabilities
    elif mutant.level == "sdpa" and not caps.dropout:
        base = base.replace(dropout=False)  # the tiled and manual-backward bases have none
    elif mutant.level == "sdpa" and caps.sdpa_sinks:
        base = base.replace(sdpa_sinks=True)  # the sink base (sdpa_sink_mutants.SinkSDPA) takes sinks
    elif isinstance(mutant.build().sdpa, LowerRightSDPA):
        base = LOWER_RIGHT_CAPABILITIES  # is_causal declared (and built) lower-right
    assert caps == base


# --------------------------------------------------------------------------- truth


@pytest.mark.parametrize("name", ALL)
def test_smallest_case_exposes_the_bug(name):
    mutant = MUTANTS[name]
    case = mutant.smallest_case
    if case.get("expect") == "raise":
        assert _raises(NaiveSDPA(), case), "the correct base should raise on this case"
        assert not _raises(mutant.build().sdpa, case), f"{name} raises on {case}"
        return
    assert not _agrees(mutant, case), f"{name} agrees with the reference on its smallest case {case}"


@pytest.mark.parametrize("name", WITH_SAFE)
def test_safe_case_agrees(name):
    mutant = MUTANTS[name]
    assert _agrees(mutant, mutant.safe_case), (
        f"{name} disagrees with the reference on its safe case {mutant.safe_case}: "
        "it has more than one bug"
    )


# --------------------------------------------------------------------------- the bases

ONE = {"B": 1, "N": 1, "K": 1, "L": 1, "S": 1, "E": 1, "Ev": 1}
BASE_CASES = [
    dict(ONE, B=2, N=2, K=2, L=3, S=5, E=4, Ev=3),
    dict(ONE, L=3, S=5, E=2, mask="block_last"),
    dict(ONE, L=2, S=3, mask="additive", grad=True),
    dict(ONE, L=2, S=3, mask="all_blocked"),
    dict(ONE, L=2, S=3, mask="all_blocked", grad=True),
    dict(ONE, L=2, S=3, mask="additive_all_blocked", grad=True),
    dict(ONE, L=5, S=3, causal=True, grad=True),
    dict(ONE, L=2, S=4, causal=True),
    dict(ONE, N=4, K=2, L=2, S=3, E=2, Ev=3, grad=True),
    dict(ONE, S=3, scale=-0.7),
    dict(ONE, S=3, scale=0.0),
    dict(ONE, B=2, N=2, K=2, L=3, S=33, E=2, Ev=2, mask="additive", grad=True),
    dict(ONE, N=2, K=2, L=3, S=17, layout="transposed", grad=True),
    dict(ONE, N=2, K=2, L=2, S=20, values="ascending_keys"),
    dict(ONE, L=2, S=2, dtype="float32", values="wide_rows"),
    dict(ONE, dtype="float32", values="large"),
    dict(ONE, dtype="float16", values="huge"),
    dict(ONE, L=3, S=5, E=3, dtype="bfloat16"),
    dict(ONE, L=3, S=5, E=3, dtype="float16"),
]


@pytest.mark.parametrize("base", [NaiveSDPA, ManualBackwardSDPA, TiledSDPA], ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", BASE_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items() if ONE.get(k) != v))
def test_sdpa_bases_match_torch(base, case):
    assert _sdpa_agrees(base(), case)


@pytest.mark.parametrize("case", [
    dict(ONE, L=5, S=3, causal="lower_right", grad=True),
    dict(ONE, L=2, S=4, causal="lower_right", grad=True),
    dict(ONE, N=2, K=1, L=3, S=3, E=2, Ev=3, causal="lower_right"),
    dict(ONE, L=3, S=5, mask="block_last"),
], ids=["L>S", "L<S", "L=S-gqa", "mask"])
def test_lower_right_base_matches_torch(case):
    """Rows the lower-right flag empties (L > S) give 0, like the explicit mask."""
    assert _sdpa_agrees(LowerRightSDPA(), case)


def test_naive_base_dropout_keeps_the_expectation():
    assert _sdpa_agrees(NaiveSDPA(), dict(ONE, S=2, mask="block_last", dropout_p=0.5))
    assert _sdpa_agrees(NaiveSDPA(), dict(ONE, L=2, S=3, dropout_p=0.3))


@pytest.mark.parametrize(
    "case, should_raise",
    [(dict(ONE, S=3, mask="oversized"), True), (dict(ONE, N=3, K=2), True), (dict(ONE, N=2, K=1), False)],
    ids=["oversized-mask", "gqa-indivisible", "gqa-ok"],
)
def test_naive_base_raises_on_invalid_inputs(case, should_raise):
    assert _raises(NaiveSDPA(), case) == should_raise


MHA_OPTIONS = [
    {},
    {"batch_first": True},
    {"bias": False},
    {"add_bias_kv": True},
    {"add_zero_attn": True},
    {"kdim": 3, "vdim": 5},
]
MHA_FORWARDS = [
    {},
    {"need_weights": False},
    {"average_attn_weights": False},
    {"key_padding_mask": "bool"},
    {"key_padding_mask": "float", "attn_mask": "float"},
    {"attn_mask": "bool3d"},
    {"attn_mask": "causal", "is_causal": True},
    {"attn_mask": "causal", "is_causal": True, "need_weights": False},
    {"unbatched": True, "key_padding_mask": "bool"},
]


def _mha_forward_args(spec, B, N, L, S, D, kdim, vdim, batch_first, g):
    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    unbatched = spec.get("unbatched", False)
    if unbatched:
        q, k, v = randn(L, D), randn(S, kdim), randn(S, vdim)
    elif batch_first:
        q, k, v = randn(B, L, D), randn(B, S, kdim), randn(B, S, vdim)
    else:
        q, k, v = randn(L, B, D), randn(S, B, kdim), randn(S, B, vdim)
    kwargs = {k_: v_ for k_, v_ in spec.items() if k_ in ("need_weights", "average_attn_weights", "is_causal")}
    kpm_shape = (S,) if unbatched else (B, S)
    if spec.get("key_padding_mask") == "bool":
        kwargs["key_padding_mask"] = torch.rand(kpm_shape, generator=g) < 0.3
    elif spec.get("key_padding_mask") == "float":
        kwargs["key_padding_mask"] = torch.where(torch.rand(kpm_shape, generator=g) < 0.3,
                                                 float("-inf"), 0.0).to(torch.float64)
    if spec.get("attn_mask") == "float":
        kwargs["attn_mask"] = randn(L, S)
    elif spec.get("attn_mask") == "bool3d":
        kwargs["attn_mask"] = torch.rand(B * N, L, S, generator=g) < 0.3
    elif spec.get("attn_mask") == "causal":
        kwargs["attn_mask"] = torch.ones(L, S, dtype=torch.bool).triu(1)
    return q, k, v, kwargs


@pytest.mark.parametrize("options", MHA_OPTIONS, ids=lambda o: ",".join(o) or "default")
@pytest.mark.parametrize("forward", MHA_FORWARDS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "plain")
def test_mha_base_matches_torch(options, forward):
    g = torch.Generator().manual_seed(7)
    B, N, L, S, E = 2, 2, 3, 4, 2
    D = N * E
    torch.manual_seed(3)
    reference = torch.nn.MultiheadAttention(D, N, dtype=torch.float64, **options).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    module = HandwrittenMHA(D, N, dtype=torch.float64, **options).eval()
    load_mha_weights(module, _params_of(reference))
    q, k, v, kwargs = _mha_forward_args(forward, B, N, L, S, D, options.get("kdim", D),
                                        options.get("vdim", D), options.get("batch_first", False), g)
    if forward.get("is_causal") and not forward.get("need_weights", True) and (
            options.get("add_zero_attn") or options.get("add_bias_kv")):
        # torch swaps the mask for SDPA's is_causal here (see the pinned test below);
        # the spec applies the mask, so compare with torch's need_weights=True path.
        want_out, _ = reference(q, k, v, **dict(kwargs, need_weights=True))
        want_w = None
    else:
        want_out, want_w = reference(q, k, v, **kwargs)
    got_out, got_w = module(q, k, v, **kwargs)
    finite = ~torch.isnan(want_out)  # torch's NaN rows (fully padded) are policy, not math
    assert got_out.shape == want_out.shape
    assert torch.allclose(got_out[finite], want_out[finite], atol=1e-10)
    assert (got_w is None) == (want_w is None)
    if want_w is not None:
        assert got_w.shape == want_w.shape
        assert torch.allclose(got_w, torch.nan_to_num(want_w, nan=0.0), atol=1e-10)


def _params_of(module):
    from types import SimpleNamespace

    def arr(t):
        return None if t is None else t.detach().numpy()

    return SimpleNamespace(
        **{name: arr(getattr(module, name, None)) for name in
           ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
            "in_proj_bias", "bias_k", "bias_v")},
        out_proj_weight=arr(module.out_proj.weight),
        out_proj_bias=arr(module.out_proj.bias),
    )


def test_mha_base_gradients_match_torch():
    g = torch.Generator().manual_seed(11)
    D, N = 4, 2
    reference = torch.nn.MultiheadAttention(D, N, dtype=torch.float64).eval()
    module = HandwrittenMHA(D, N, dtype=torch.float64).eval()
    load_mha_weights(module, _params_of(reference))
    x = torch.randn(3, 2, D, generator=g, dtype=torch.float64)
    grads = []
    for m in (reference, module):
        xi = x.clone().requires_grad_(True)
        out, _ = m(xi, xi, xi, need_weights=False)
        grads.append(torch.autograd.grad(out.sum(), xi)[0])
    assert torch.allclose(grads[0], grads[1], atol=1e-10)
    assert math.isfinite(float(grads[1].sum()))


@pytest.mark.parametrize("S, exposed", [(1, True), (16, False), (17, True), (32, False), (33, True)])
def test_tail_mutant_shows_exactly_at_lengths_one_mod_16(S, exposed):
    """docs/KNOWN_BUGS.md #9's shape: wrong only for non-contiguous K/V with S ≡ 1 (mod 16)."""
    mutant = MUTANTS["tiled_tail_assumes_contiguous"]
    case = dict(ONE, N=2, K=2, S=S, layout="transposed")
    if S == 1:
        case = dict(ONE, B=2, S=1, layout="stride0")
    assert _agrees(mutant, case) != exposed
    assert _agrees(mutant, dict(case, layout="contiguous"))


def test_torch_mha_causal_hint_blocks_appended_keys():
    """Pinned torch 2.13 behaviour the MHA base deliberately does not copy: with
    add_zero_attn=True, is_causal=True and need_weights=False, nn.MultiheadAttention
    runs SDPA's causal triangle over S + 1 keys and blocks the zero-attention key,
    so the output differs from need_weights=True (which applies the padded mask)."""
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(2, 1, add_zero_attn=True, dtype=torch.float64).eval()
    x = torch.randn(1, 1, 2, dtype=torch.float64)
    mask = torch.zeros(1, 1, dtype=torch.bool)
    with_weights = module(x, x, x, attn_mask=mask, is_causal=True, need_weights=True)[0]
    without = module(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]
    assert not torch.allclose(with_weights, without)
    base = HandwrittenMHA(2, 1, add_zero_attn=True, dtype=torch.float64).eval()
    load_mha_weights(base, _params_of(module))
    assert torch.allclose(base(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0], with_weights)


def test_every_mutant_a_variant_names_expects_that_variant():
    """Where a variant's ``models`` text names a mutant ("bug zoo: NAME"), the mutant's
    ``expected_cause`` is that variant."""
    named = {name: v.id for v in V.VARIANTS.values()
             for name in re.findall(r"\b[a-z0-9_]+\b", v.models.split("bug zoo:", 1)[-1])
             if "bug zoo:" in v.models and name in MUTANTS}
    expected = {name: m.expected_cause for name, m in MUTANTS.items() if m.expected_cause}
    assert named and named == {name: expected.get(name) for name in named}
