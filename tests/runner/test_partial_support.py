"""Partial support as declarations: each implementation of ``partial_support_impls.py``
(SDPA level) and ``tests/implementations/declared_kernels.py`` (flash kernels with the
limits of real tiled kernels, plain functions with flash_attn_func's signature) fails its
certificate without its declaration and certifies with it, no adapter; probe calls are
built inside the declarations; a failing first call names the declaration that lets it
run; a declaration that claims what a probe saw fail is refused; the certificate lists
the declarations and shows only the levels that ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.strategies import sdpa_cases
from implementations import registry
from implementations.base import Capabilities, ImplementationError
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]
IMPLS = "tests/runner/partial_support_impls.py"
KERNELS = "tests/implementations/declared_kernels.py"


def run(impl: str, *args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "failures"), PYTHONPATH=str(ROOT))
    return pytest_process.run(
        [sys.executable, "-m", "pytest", "conformance", "-p", "no:cacheprovider", "-q",
         "--hypothesis-profile=ci", f"--conformance-report={tmp_path}/cert", f"--impl={impl}", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)


def options(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--impl-option", pair)]


def results(tmp_path: Path) -> dict[str, str]:
    cert = json.loads((tmp_path / "cert.json").read_text())
    return {f"{r['property']}[{r['level']}-{r['dtype']}]": r["outcome"] for r in cert["results"]}


# --------------------------------------------------------------------------- flash kernels, no adapter

FLASH_KERNELS = {
    "tiled_16bit": ("dtypes=float16,bfloat16", "min_head_dim=16", "seq_multiple=16"),
    "head_dims_64": ("dtypes=float16,bfloat16", "head_dims=64,96,128", "seq_multiple=16"),
    "causal_only": ("causal_only=true",),
}


@pytest.mark.parametrize("name", list(FLASH_KERNELS))
def test_a_flash_kernel_with_tile_limits_certifies_with_declarations_only(name, tmp_path):
    declared = FLASH_KERNELS[name]
    proc = run(f"{KERNELS}:{name}", tmp_path=tmp_path)
    assert proc.returncode != 0, proc.stdout[-2000:]
    said = proc.stdout + proc.stderr
    assert "the first call, a plain float32 call with E=4, L=2, S=3" in said, said[-3000:]
    for pair in declared:  # the message names the declarations under which a call runs
        if not pair.startswith("head_dims"):
            assert f"--impl-option {pair.replace('=64,96,128', '')}" in said or pair in said, (pair, said[-3000:])
    proc = run(f"{KERNELS}:{name}", *options(*declared), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    got = results(tmp_path)
    passed = [key for key, outcome in got.items() if outcome == "passed"]
    assert {key.split("[")[0] for key in passed} >= {"flash_agreement", "flash_gradients", "lse_agreement"}
    assert all(key.split("[")[1].startswith("flash") for key in passed)
    # The certificate's table has the flash level only; the declarations are listed.
    table = proc.stdout.split("policies:")[0]
    assert " flash " in table and " sdpa " not in table and " mha " not in table
    assert "levels not run (every property skipped" in proc.stdout
    if name != "causal_only":
        assert "L and S multiples of 16" in proc.stdout
        assert {key.split("-")[1].rstrip("]") for key in passed} == {"float16", "bfloat16"}
    else:
        assert "causal calls only" in proc.stdout


def test_probe_calls_are_built_inside_the_declarations():
    impl = registry.resolve(f"{KERNELS}:head_dims_64",
                            {"dtypes": "float16,bfloat16", "head_dims": "64,96,128", "seq_multiple": "16"})
    caps = impl.caps("flash")
    assert caps.dtypes == ("float16", "bfloat16") and caps.head_dims == (64, 96, 128)
    assert caps.seq_multiple == 16 and caps.causal == "lower_right" and caps.gqa and caps.different_v_dim
    assert caps.fully_masked == "zero" and "lse" in caps.flash_features
    assert any("query length 32, key length 16" in n for n in caps.probe_notes)  # L = 2 x 16 > S = 16
    causal = registry.resolve(f"{KERNELS}:causal_only", {"causal_only": "true"}).caps("flash")
    assert causal.causal_only and causal.causal == "lower_right" and causal.autograd


def test_a_failing_first_call_names_the_declarations_that_let_it_run():
    with pytest.raises(ImplementationError) as raised:
        registry.resolve(f"{KERNELS}:tiled_16bit", {"dtypes": "float16,bfloat16"})
    message = str(raised.value)
    assert "the first call, a plain float16 call with E=4, L=2, S=3" in message
    assert "--impl-option min_head_dim=16 --impl-option seq_multiple=16" in message
    assert "dtypes=" not in message.split("runs:")[1]  # already declared: not proposed again
    with pytest.raises(ImplementationError, match=r"declare --impl-option head_dims=|min_head_dim=16"):
        registry.resolve(f"{IMPLS}:head_dims_8_16")


def test_a_declaration_claiming_what_the_probe_saw_fail_is_refused():
    with pytest.raises(ImplementationError, match=r"mask_kinds=additive,bool,none declares the mask kinds "
                                                  r"\['bool'\].*probe saw them fail"):
        registry.resolve(f"{IMPLS}:no_bool_masks", {"mask_kinds": "none,bool,additive"})
    assert registry.resolve(f"{IMPLS}:no_bool_masks").caps("sdpa").mask_kinds == {"none", "additive"}


def test_new_declarations_parse_check_and_narrow_what_is_supported():
    impl = registry.resolve("sdpa", {"head_dims": "16,8", "seq_multiple": "4", "positive_scale": "true",
                                     "float64.mask_kinds": "none,bool", "flash.head_dims": "16"})
    caps = impl.caps("sdpa")
    assert caps.head_dims == (8, 16) and caps.seq_multiple == 4 and caps.positive_scale
    assert caps.for_dtype("float64").mask_kinds == {"none", "bool"} and "additive" in caps.mask_kinds
    assert impl.caps("flash").head_dims == (16,) and impl.flash is not None  # the derived level only
    reasons = impl.not_supported_reasons({"level": "sdpa", "dtype": "float64", "mask_kind": "additive",
                                          "E": 12, "L": 6, "S": 8, "scale": -0.5})
    assert reasons == ["mask_kind='additive' not in declared ['bool', 'none'] in float64",
                       "scale=-0.5 <= 0 but positive_scale declares scale > 0 only",
                       "E=12 not in head_dims=[8, 16]", "L=6 is not a multiple of seq_multiple=4"]
    for bad, match in (({"head_dims": "0,8"}, "head_dims"), ({"float64.causal": "none"}, "cannot differ per dtype"),
                       ({"flsh.dtypes": "float32"}, "neither a level"), ({"seq_multiple": "x"}, "seq_multiple")):
        with pytest.raises(ImplementationError, match=match):
            registry.resolve("sdpa", bad)
    with pytest.raises(ImplementationError, match="causal_only=True but causal=None"):
        Capabilities(causal=None, causal_only=True)
    block = registry.resolve("sdpa", {"seq_block": "128"})
    assert block.caps("sdpa").seq_block == 128
    assert block.not_supported_reasons({"level": "sdpa", "L": 100, "S": 256}) == []
    assert block.not_supported_reasons({"level": "sdpa", "L": 129, "S": 64}) == [
        "L=129 is above seq_block=128 and not a multiple of it"]
    for bad in ({"seq_block": 1}, {"seq_block": True}, {"seq_block": 16, "seq_multiple": 4}):
        with pytest.raises(ImplementationError, match="seq_block"):
            Capabilities(**bad)


# --------------------------------------------------------------------------- SDPA-level partial support

SDPA_CASES = {
    # name: (declarations, -k, dtype, the property that fails without them)
    "positive_scale_only": (("positive_scale=true",), "forward_agreement or temperature", "float64",
                            "forward_agreement"),
    "float64_without_float_masks": (("float64.mask_kinds=none,bool",),
                                    "forward_agreement or convex_hull or bool_additive_equivalence", "float64",
                                    "forward_agreement"),
    "head_dims_8_16": (("head_dims=8,16",), "forward_agreement or gradient_agreement or weights_are_distributions",
                       "float64", None),
    "causal_only": (("causal_only=true",), "forward_agreement or gradient_agreement", "float64", None),
    "blocks_of_4": (("seq_multiple=4",), "forward_agreement or gradient_agreement or small_sizes_sweep",
                    "float64", None),
    "up_to_8_or_multiples": (("seq_block=8",), "forward_agreement or small_sizes_sweep or long_sizes_sweep",
                             "float64", "small_sizes_sweep"),
}


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_draws_under_a_block_declaration_stay_inside_one_block(data):
    case = data.draw(sdpa_cases(dtype="float64", caps=Capabilities(seq_block=8), max_L=40, max_S=40))
    assert case.L <= 8 and case.S <= 8


@pytest.mark.slow
def test_a_kernel_wrong_past_its_block_fails_under_its_block_declaration(tmp_path):
    """seq_block=8 keeps random draws inside one block; the sweeps visit the multiples,
    where a kernel that drops its last block of keys is wrong."""
    args = ("-k", "(forward_agreement or small_sizes_sweep or long_sizes_sweep) and not mha and not flash",
            "--dtype=float64", *options("seq_block=8"))
    proc = run(f"{IMPLS}:one_block_past_8", *args, tmp_path=tmp_path)
    outcome = results(tmp_path)
    assert outcome["forward_agreement[sdpa-float64]"] == "passed", proc.stdout[-3000:]
    assert outcome["small_sizes_sweep[sdpa-float64]"] == "failed", proc.stdout[-3000:]
    assert outcome["long_sizes_sweep[sdpa-float64]"] == "failed", proc.stdout[-3000:]
    assert "L and S <= 8 or multiples of 8" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize("name", list(SDPA_CASES))
def test_partial_support_fails_without_its_declaration_and_certifies_with_it(name, tmp_path):
    declared, chosen, dtype, failing = SDPA_CASES[name]
    args = ("-k", f"({chosen}) and not mha and not flash", f"--dtype={dtype}")
    proc = run(f"{IMPLS}:{name}", *args, tmp_path=tmp_path)
    assert proc.returncode != 0, proc.stdout[-3000:]
    if failing is not None:  # runs, and fails where it is not declared
        assert results(tmp_path)[f"{failing}[sdpa-{dtype}]"] == "failed"
    else:  # its first call raises: a usage error naming the declaration
        assert declared[0].split("=")[0] + "=" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    proc = run(f"{IMPLS}:{name}", *options(*declared), *args, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "passed" in results(tmp_path).values()


def test_a_fully_masked_policy_may_differ_per_dtype_and_is_shown_as_declared():
    """Haiku-style: float16's fully-masked rows NaN, the other dtypes' zero (a policy per
    dtype was refused, and the certificate called every per-dtype value probed)."""
    from conformance.reporting.certificate import _capabilities, per_dtype

    impl = registry.resolve("handwritten", {"float16.fully_masked": "nan",
                                            "bfloat16.fully_masked": "bool:uniform,additive:nan,causal:zero"})
    caps = impl.capabilities
    assert caps.for_dtype("float16").fully_masked == "nan" and caps.for_dtype("float32").fully_masked == "zero"
    assert caps.for_dtype("bfloat16").fully_masked_policies == {"bool": "uniform", "additive": "nan", "causal": "zero"}
    line = per_dtype(_capabilities(caps), {"options": {"float16.fully_masked": "nan"}, "declaration": None})
    assert "float16: fully_masked=nan (declared)" in line and "bfloat16: fully_masked=" in line, line
    assert "(probed)" in line      # bfloat16's was not named in these options


# --------------------------------------------------------------------------- limits of the backward alone


def test_a_backward_limit_parses_checks_and_narrows_gradients_only():
    """``backward_seq_multiple=4``: any length forward, gradients only at multiples of 4;
    the gradient properties draw such lengths (inside one block under seq_block)."""
    from conformance.core.registry import registered_properties
    from conformance.core.target import Target
    from conformance.directed.helpers import backward_target
    from implementations.capabilities import backward_allowed, backward_lengths

    impl = registry.resolve("sdpa", {"backward_seq_multiple": "4"})
    caps = impl.caps("sdpa")
    assert caps.backward_seq_multiple == 4 and impl.caps("flash").backward_seq_multiple == 4
    assert impl.not_supported_reasons({"level": "sdpa", "L": 6, "S": 8}) == []          # forward: any length
    assert impl.not_supported_reasons({"level": "sdpa", "L": 6, "S": 8, "grad": True}) == [
        "gradients with L=6, not a multiple of backward_seq_multiple=4"]
    assert backward_allowed(caps, 4, 8) and not backward_allowed(caps, 4, 6) and backward_allowed(Capabilities(), 3)
    assert backward_lengths(Capabilities(seq_block=16, backward_seq_multiple=4)).max_seq_len == 16
    assert backward_lengths(Capabilities()) == Capabilities()
    for bad in ({"backward_seq_multiple": 1}, {"backward_seq_multiple": True},
                {"backward_seq_multiple": 8, "max_seq_len": 4}):
        with pytest.raises(ImplementationError, match="backward_seq_multiple"):
            Capabilities(**bad)
    target = Target(impl, "sdpa", "float64", "cpu")
    assert backward_target(Target(registry.resolve("sdpa"), "sdpa", "float64", "cpu")).impl.capabilities.seq_multiple is None
    info = registered_properties()["gradient_agreement"]
    cases = [c for c in info.directed(target)]
    assert cases and all(c.L % 4 == 0 and c.S % 4 == 0 for c in cases)

    @settings(max_examples=30, deadline=None)
    @given(data=st.data())
    def drawn(data):
        case = data.draw(info.cases(target))
        assert case.L % 4 == 0 and case.S % 4 == 0

    drawn()


@pytest.mark.slow
def test_a_backward_only_limit_turns_autograd_off_only_where_it_applies(tmp_path):
    """A kernel whose forward takes any length and whose backward raises unless L and S are
    multiples of 4: undeclared, its backward fails the probe and every gradient property is
    skipped; declared, gradients are checked at the multiples (and a kernel with gradients
    twice too large there fails, shrunk to L = S = 4)."""
    args = ("-k", "(gradient_agreement or fully_masked_rows or flash_gradients) and not mha", "--dtype=float64")
    run(f"{IMPLS}:backward_blocks_of_4", *args, tmp_path=tmp_path)
    assert results(tmp_path)["gradient_agreement[sdpa-float64]"] == "skipped"
    proc = run(f"{IMPLS}:backward_blocks_of_4", *args, *options("backward_seq_multiple=4"), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    got = results(tmp_path)
    assert got["gradient_agreement[sdpa-float64]"] == got["flash_gradients[flash-float64]"] == "passed"
    assert "gradients where L and S are multiples of 4" in proc.stdout, proc.stdout[-3000:]
    proc = run(f"{IMPLS}:backward_blocks_of_4_doubled", *args, *options("backward_seq_multiple=4"), tmp_path=tmp_path)
    assert results(tmp_path)["gradient_agreement[sdpa-float64]"] == "failed"
    assert "'L': 4, 'S': 4" in proc.stdout, proc.stdout[-3000:]
