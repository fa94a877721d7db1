"""transformers' attention interface with no adapter (implementations/registry/interface_recognition.py).

In process: how ``fn(module, query, key, value, attention_mask, scaling=, dropout=)`` is
recognised and called (the module stub, the mask forms transformers builds, GQA, the
(B, L, N, Ev) output turned back), checked against the float64 oracle; each deviation listed
in implementations/xfail/libraries/transformers-eager.toml re-measured, so a fix upstream fails here.
As subprocesses under ``ci``: transformers' sdpa and eager backends certify with their
attached files, and each mutant in the interface's signature
(framework_modules/transformers_interface.py) fails its expected property with its
expected cause named first. Tests of transformers itself skip where it is not installed
(pip install 'attention-conformance[transformers]'); the kernels in framework_modules need
torch only."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import spec
from implementations import registry
from implementations.base import ImplementationError
from implementations.registry.expected_failures import LIBRARY_XFAIL_DIR
from implementations.registry.interface_recognition import InterfaceSDPA
from tests.implementations.test_framework_bridge import MODULES, ROOT, certify, installed, outcomes, tensors

KERNELS = MODULES / "transformers_interface.py"
SDPA = "transformers.integrations.sdpa_attention:sdpa_attention_forward"
EAGER = "transformers.models.llama.modeling_llama:eager_attention_forward"
needs_transformers = pytest.mark.skipif(
    not installed("transformers"), reason="transformers is not installed (pip install 'attention-conformance[transformers]')")


def oracle(q, k, v, **kw):
    return spec.sdpa(q.double().numpy(), k.double().numpy(), v.double().numpy(), **kw)


def interface(fn, form="additive"):
    return InterfaceSDPA(fn, form, frozenset({"scaling", "dropout"}))


# --------------------------------------------------------------------------- the adapter


def test_a_kernel_in_the_interface_signature_is_recognised_and_computes_sdpa():
    impl = registry.resolve(f"{KERNELS}:attention_forward")
    caps = impl.capabilities
    assert caps.causal == "lower_right" and caps.source("causal") == "contract"
    assert caps.gqa and caps.custom_scale and caps.autograd and {"bool", "additive"} <= caps.mask_kinds
    assert any("mask form additive" in n for n in caps.probe_notes)
    assert impl.expected_failures == ()  # transformers' files are for transformers' own functions
    q, k, v = tensors((2, 4, 3, 5), (2, 2, 6, 5), (2, 2, 6, 3), dtype=torch.float64)
    attend = torch.rand(4, 3, 6, generator=torch.Generator().manual_seed(1)) < 0.6
    attend[..., 0] = True
    got = impl.sdpa(q, k, v, attn_mask=attend, is_causal=True, scale=-0.4, enable_gqa=True)
    kv = [x.repeat_interleave(2, dim=1) for x in (k, v)]
    want = oracle(q, *kv, attend_mask=attend.numpy(), causal="lower_right", scale=-0.4).output
    assert got.shape == (2, 4, 3, 3)
    np.testing.assert_allclose(got.numpy(), want, atol=1e-12)


def test_the_masks_are_built_in_transformers_forms():
    seen = {}

    def kernel(module, query, key, value, attention_mask, scaling=None, dropout=0.0):
        seen.update(mask=attention_mask, causal=module.is_causal, groups=module.num_key_value_groups,
                    training=module.training, scaling=scaling)
        return torch.zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None

    q, k, v = tensors((1, 2, 2, 4), (1, 1, 3, 4), (1, 1, 3, 4))
    interface(kernel)(q, k, v, is_causal=True, enable_gqa=True, dropout_p=0.5)
    mask = seen["mask"]
    fill = torch.finfo(torch.float32).min
    assert mask.shape == (1, 1, 2, 3) and mask.dtype == torch.float32
    assert mask[0, 0].tolist() == [[0.0, 0.0, fill], [0.0, 0.0, 0.0]]  # lower-right: query i at S - L + i
    assert seen["causal"] is True and seen["groups"] == 2 and seen["training"] and seen["scaling"] == 0.5
    as_bool = interface(kernel, "bool")
    as_bool(q, k, v, is_causal=True, enable_gqa=True)
    assert seen["mask"].dtype == torch.bool and seen["mask"][0, 0].tolist() == [[True, True, False], [True] * 3]
    as_bool(q[:, :, :1], k, v, is_causal=True, enable_gqa=True)
    assert seen["mask"] is None and seen["causal"]  # L == 1: sdpa_mask skips it, is_causal carries it
    per_head = torch.ones(1, 2, 2, 3, dtype=torch.bool)
    as_bool(q, k, v, attn_mask=per_head, enable_gqa=True)
    assert seen["mask"].shape == (1, 2, 2, 3)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        as_bool(q, k, v)


def test_a_wrong_output_layout_is_named():
    def heads_first(module, query, key, value, attention_mask, scaling=None, dropout=0.0):
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scaling), None

    q, k, v = tensors((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4))
    with pytest.raises(TypeError, match=r"output \(B, L, N, Ev\)"):
        interface(heads_first)(q, k, v)


def test_interface_options_are_checked():
    with pytest.raises(ImplementationError, match="interface_mask=bitmap: unknown mask form"):
        registry.resolve(f"{KERNELS}:attention_forward", options={"interface_mask": "bitmap"})
    with pytest.raises(ImplementationError, match="layout"):
        registry.resolve(f"{KERNELS}:attention_forward", options={"layout": "BLNE"})
    impl = registry.resolve(f"{KERNELS}:attention_forward", options={"interface_mask": "bool"})
    assert any("mask form bool (declared)" in n for n in impl.capabilities.probe_notes)


def test_shipped_expected_failures_files_are_named_by_a_short_form():
    assert registry.load_expected_failures_file("keras-mha")
    assert registry.load_expected_failures_file("transformers-eager")
    with pytest.raises(ImplementationError, match=r"short name of a file shipped there \(.*keras-mha"):
        registry.load_expected_failures_file("keras-mhaa")


def test_torch_bfloat16_batched_matmul_spreads_a_nan_row():
    """The cause of transformers-eager.toml's bfloat16 forward_agreement entry: torch's CPU
    bfloat16 batched matmul may let one NaN row of the weights reach a neighbouring output
    row. Whether it does depends on the CPU's matmul kernels (one machine spread row 28's
    NaN into row 27 at L = 33; another spreads none), so the entry is intermittent and this
    checks, where some shape of a spread shows it, that float32 never does."""
    entry = next(e for e in registry.load_expected_failures("transformers-eager", LIBRARY_XFAIL_DIR)
                 if e.match.get("dtype") == "bfloat16" and e.match.get("fully_masked_rows"))
    assert entry.intermittent      # its covered cases pass where the kernels keep the NaN row to itself
    shown = []
    for L, row in ((33, 28), (17, 12), (65, 60)):
        torch.manual_seed(0)
        weights = torch.rand(3, 2, L, 3).to(torch.bfloat16)
        weights[:, :, row] = float("nan")
        values = torch.randn(3, 2, 3, 7)
        spread = torch.isnan(weights @ values.to(torch.bfloat16))[..., [r for r in range(L) if r != row], :].any()
        if spread:
            shown.append((L, row))
            others = torch.isnan(weights.float() @ values)[..., [r for r in range(L) if r != row], :]
            assert not others.any(), f"float32 spreads the NaN row too at L={L}"  # bfloat16 only
    if not shown:
        pytest.skip("this CPU's bfloat16 batched matmul keeps each NaN row to itself (machine-dependent; "
                    "the transformers-eager entry is intermittent)")


# --------------------------------------------------------------------------- transformers itself


@needs_transformers
def test_transformers_backends_are_recognised_with_their_forms_and_files():
    sdpa, eager = registry.resolve(SDPA), registry.resolve(EAGER)
    assert any("mask form bool" in n for n in sdpa.capabilities.probe_notes)
    assert any("mask form additive" in n for n in eager.capabilities.probe_notes)
    assert sdpa.version.startswith("transformers ") and sdpa.capabilities.causal == "lower_right"
    assert {e.reason for e in sdpa.expected_failures} == {e.reason for e in registry.load_expected_failures("sdpa")}
    assert eager.expected_failures == registry.load_expected_failures("transformers-eager", LIBRARY_XFAIL_DIR)
    q, k, v = tensors((2, 4, 1, 8), (2, 2, 5, 8), (2, 2, 5, 8), dtype=torch.float64)
    kv = [x.repeat_interleave(2, dim=1) for x in (k, v)]
    # L = 1 with GQA and a mask: sdpa_attention_forward packs the heads as queries (pack_gqa)
    attend = torch.tensor([True, False, True, True, False])
    got = sdpa.sdpa(q, k, v, attn_mask=attend, is_causal=True, enable_gqa=True)
    want = oracle(q, *kv, attend_mask=attend.numpy(), causal="lower_right").output
    np.testing.assert_allclose(got.numpy(), want, atol=1e-12)


@needs_transformers
def test_eager_returns_the_weights_of_the_softmax():
    from transformers.models.llama.modeling_llama import eager_attention_forward

    seen = {}

    def keep(module, *args, **kwargs):
        out, seen["weights"] = eager_attention_forward(module, *args, **kwargs)
        return out, seen["weights"]

    q, k, v = tensors((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4))
    mask = torch.randn(3, 5, generator=torch.Generator().manual_seed(2))
    interface(keep)(q, k, v, attn_mask=mask, is_causal=True)
    want = oracle(q, k, v, additive_mask=mask.double().numpy(), causal="lower_right").weights
    assert seen["weights"].shape == (1, 2, 3, 5)
    np.testing.assert_allclose(seen["weights"].double().numpy(), want, atol=1e-6)


@needs_transformers
def test_eager_deviations_are_still_there():
    """Each entry of transformers-eager.toml, re-measured: if transformers changes, drop it."""
    impl = registry.resolve(EAGER)
    q, k, v = tensors((1, 1, 3, 4), (1, 1, 3, 4), (1, 1, 3, 4), dtype=torch.float64)
    error = np.abs(impl.sdpa(q, k, v).numpy() - oracle(q, k, v).output).max()
    assert 1e-12 < error < 1e-5  # float32 softmax under float64
    q, k, v = (x.float() for x in (q, k, v))
    attend = torch.ones(3, 3, dtype=torch.bool)
    attend[0] = False
    row = impl.sdpa(q, k, v, attn_mask=attend)[0, 0, 0]
    torch.testing.assert_close(row, v[0, 0].mean(dim=0), atol=1e-6, rtol=0)  # finfo.min fill: uniform
    blocked = torch.zeros(3, 3).masked_fill(~attend, float("-inf"))
    assert torch.isnan(impl.sdpa(q, k, v, attn_mask=blocked)[0, 0, 0]).all()  # -inf: NaN
    # float64's finfo.min is -inf in the float32 softmax: there the bool-masked row is NaN too
    assert torch.isnan(impl.sdpa(q.double(), k.double(), v.double(), attn_mask=attend)[0, 0, 0]).all()
    big = torch.full((1, 1, 1, 4), 200.0, dtype=torch.float16)  # q·kᵀ = 160000 > 65504
    out = impl.sdpa(big, big, big.clone(), scale=2.0 ** -10)
    assert not torch.isfinite(out).all()  # the scaled logit, 156, is representable


# --------------------------------------------------------------------------- certificates


@pytest.mark.slow
@needs_transformers
@pytest.mark.parametrize("spec_", [SDPA, EAGER], ids=["sdpa", "eager"])
def test_transformers_backends_certify_with_their_deviations(tmp_path, spec_):
    code, report, output = certify(spec_, tmp_path)
    assert code == 0, output
    got = outcomes(report)
    for dtype in ("float32", "float16", "bfloat16"):
        for prop in ("gqa_equivalence", "causal_flag_equivalence", "bool_additive_equivalence", "temperature"):
            assert got[(prop, dtype)] == "passed", (prop, dtype, output)
    if spec_ == EAGER:
        assert got[("forward_agreement", "float64")] == "xfailed", output


@pytest.mark.slow
@pytest.mark.parametrize("mutant", ["gqa_tiled", "scaling_ignored", "mask_after_softmax", "float_mask_as_bool"])
def test_interface_mutants_fail_with_their_named_causes(tmp_path, mutant):
    import importlib.util

    found = importlib.util.spec_from_file_location("transformers_interface_kernels", KERNELS)
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    prop, cause, _ = module.MUTANTS[mutant]
    code, report, output = certify(f"{KERNELS}:{mutant}", tmp_path, "--dtype=float32", "-k", prop)
    assert code == 1, output
    failed = next(r for r in report["results"] if r["property"] == prop)
    assert failed["outcome"] == "failed", output
    assert failed["causes"] and failed["causes"][0]["variant"] == cause, json.dumps(failed["causes"])[:2000]


@pytest.mark.slow
def test_the_correct_interface_kernel_passes_where_the_mutants_fail(tmp_path):
    props = "gqa_equivalence or temperature or weights_are_distributions or forward_agreement"
    code, report, output = certify(f"{KERNELS}:attention_forward", tmp_path, "--dtype=float32", "-k", props)
    assert code == 0, output


@pytest.mark.slow
def test_the_example_kernel_certifies_with_no_declaration(tmp_path):
    """examples/frameworks/transformers_kernel.py: four dtypes under ``ci``, nothing declared
    (its empty rows are NaN for every kind of blocking, which the probe adopts)."""
    example = ROOT / "examples" / "frameworks" / "transformers_kernel.py"
    code, report, output = certify(f"{example}:attention_forward", tmp_path)
    assert code == 0, output
    got = outcomes(report)
    for dtype in ("float64", "float32", "float16", "bfloat16"):
        assert got[("forward_agreement", dtype)] == "passed", (dtype, output)
    assert got[("large_logits", "float16")] == "passed", output
