"""Declarations for what real code does: each is a Capabilities field, set by
``--impl-option`` for a plain function (or found by probing), listed, shown on the
certificate and honoured by the strategies and the runner. For each, an implementation
that needs it (``impls_for_declarations.py``) fails without it and certifies with it.

* ``self_attention_lengths`` (L == S only), ``shared_kv`` (key is value),
  ``fully_masked`` per kind of blocking, ``batch_dims=1`` (exactly 4-D inputs);
* ``--xfail-file PATH``: expected failures of any implementation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.reporting.certificate import details
from conformance.calls.call_specs import _call_4d
from conformance.strategies import sdpa_cases
from implementations import registry
from implementations.base import Capabilities, ImplementationError
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]
IMPLS = "tests/runner/impls_for_declarations.py"


def run(*args: str, tmp_path: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "failures"),
               PYTHONPATH=str(ROOT))
    return pytest_process.run(
        [sys.executable, "-m", "pytest", "conformance", "-p", "no:cacheprovider", "-q",
         "--hypothesis-profile=ci", f"--conformance-report={tmp_path}/cert", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env,
    )


def outcomes(tmp_path: Path) -> dict[str, str]:
    cert = json.loads((tmp_path / "cert.json").read_text())
    return {f"{r['property']}[{r['dtype']}]": r["outcome"] for r in cert["results"]}


def resolve(name: str, **options: str):
    return registry.resolve(f"{IMPLS}:{name}", options or None)


# --------------------------------------------------------------------------- the fields


def test_fully_masked_per_kind_is_normalised_hashable_and_read_per_kind():
    caps = Capabilities(fully_masked={"bool": "uniform", "additive": "nan"})
    assert caps.fully_masked == (("bool", "uniform"), ("additive", "nan"), ("causal", "zero"))
    assert caps.fully_masked_policy("additive") == "nan" and caps.fully_masked_policy("causal") == "zero"
    assert caps.fully_masked_text() == "bool:uniform,additive:nan,causal:zero"
    hash(caps)  # the directed examples memoize on capabilities
    assert Capabilities(fully_masked={"bool": "nan", "additive": "nan", "causal": "nan"}).fully_masked == "nan"
    with pytest.raises(ImplementationError, match=r"unknown kinds \['padding'\]"):
        Capabilities(fully_masked={"padding": "nan"})
    with pytest.raises(ImplementationError, match="batch_dims=2"):
        Capabilities(batch_dims=2)


@pytest.mark.parametrize("text, expected", [
    ("nan", "nan"),
    ("bool:uniform,additive:nan", (("bool", "uniform"), ("additive", "nan"), ("causal", "zero"))),
    ("uniform,additive:nan", (("bool", "uniform"), ("additive", "nan"), ("causal", "uniform"))),
])
def test_fully_masked_option_takes_one_policy_or_one_per_kind(text, expected):
    assert resolve("jax_style_attention", fully_masked=text).capabilities.fully_masked == expected


@pytest.mark.parametrize("text", ["bool:sometimes", "mask:nan", "bool:nan,bool:zero", ""])
def test_bad_fully_masked_option_names_the_valid_forms(text):
    with pytest.raises(ImplementationError, match="KIND:POLICY pairs such as bool:uniform,additive:nan"):
        resolve("jax_style_attention", fully_masked=text)


def test_other_options_parse_and_refuse_bad_values():
    caps = resolve("float32_softmax", self_attention_lengths="true", shared_kv="yes", batch_dims="1").capabilities
    assert (caps.self_attention_lengths, caps.shared_kv, caps.batch_dims) == (True, True, 1)
    assert resolve("per_head_kernel", batch_dims="none").capabilities.batch_dims is None
    with pytest.raises(ImplementationError, match="batch_dims=3: bad value"):
        resolve("float32_softmax", batch_dims="3")


def test_probing_finds_each_capability_with_a_note():
    caps = resolve("self_attention").capabilities
    assert caps.self_attention_lengths and caps.causal == "upper_left"
    assert any(n.startswith("self_attention_lengths:") for n in caps.probe_notes)
    assert resolve("per_head_kernel").capabilities.batch_dims == 1


def test_probing_never_turns_a_contract_deviation_into_a_declaration():
    """value ignored is not shared_kv (SDPA's contract uses value), and a fully-masked
    policy that differs per kind or attends blocked keys is not adopted: the note names
    what was seen and the declaration that would express it."""
    caps = resolve("memory_attention").capabilities
    assert not caps.shared_kv and caps.different_v_dim and caps.source("shared_kv") == "contract"
    assert "declare --impl-option shared_kv=true" in caps.probe_note("shared_kv")
    caps = resolve("jax_style_attention").capabilities
    assert caps.fully_masked == "nan" and caps.source("fully_masked") == "contract"
    note = caps.probe_note("fully_masked")
    assert "probed bool:uniform,additive:nan" in note and "not adopted" in note
    assert note.endswith("declare --impl-option fully_masked=bool:uniform,additive:nan")
    declared = resolve("jax_style_attention", fully_masked="bool:uniform,additive:nan").capabilities
    assert declared.source("fully_masked") == "declared" and declared.probe_note("fully_masked") == ""
    plain = resolve("float32_softmax").capabilities
    assert (plain.self_attention_lengths, plain.shared_kv, plain.batch_dims, plain.fully_masked) == \
        (False, False, None, "zero")


def test_not_supported_reasons_name_the_declarations():
    impl = resolve("float32_softmax", self_attention_lengths="true", shared_kv="true")
    reasons = impl.not_supported_reasons({"level": "sdpa", "L": 2, "S": 3, "E": 4, "Ev": 5})
    assert any("L == S only" in r for r in reasons) and any("shared_kv" in r for r in reasons)
    assert impl.not_supported_reasons({"level": "sdpa", "L": 3, "S": 3, "E": 4, "Ev": 4}) == []


def test_describe_listing_and_certificate_show_the_declarations():
    impl = resolve("float32_softmax", self_attention_lengths="true", shared_kv="true", batch_dims="1",
                   fully_masked="bool:uniform,additive:nan")
    text = registry.describe(impl)
    for shown in ("self_attention_lengths=yes", "shared_kv=yes", "batch_dims=1",
                  "fully_masked=bool:uniform,additive:nan,causal:zero"):
        assert shown in text, shown
    from conformance.reporting.certificate import implementation_entry

    entry = implementation_entry(impl, "x", {})
    assert entry["capabilities"]["fully_masked"] == {"bool": "uniform", "additive": "nan", "causal": "zero"}
    json.dumps(entry)
    line = details({"implementation": entry, "results": []})[0]
    assert "fully-masked rows=bool:uniform,additive:nan,causal:zero" in line
    assert "inputs: L == S only, key is value (one tensor), batch_dims=1 (4-D inputs and masks)" in line
    from implementations.registry.describing import _listing_row

    assert "L=S,k=v,4-D" in _listing_row("x", impl)


# --------------------------------------------------------------------------- strategies and calls


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_strategies_draw_equal_lengths_and_shared_values(data):
    caps = Capabilities(self_attention_lengths=True, shared_kv=True, causal="lower_right")
    case = data.draw(sdpa_cases(dtype="float32", caps=caps, fully_masked=True, causal_dead_rows=True))
    assert case.L == case.S and case.E == case.Ev and np.array_equal(case.key, case.value)
    case = data.draw(sdpa_cases(dtype="float32", caps=caps, length_relations=("L=S", "L>S"), shape_budget=4))
    assert case.L == case.S


def test_call_4d_reshapes_inputs_and_masks_and_gives_the_output_back():
    seen = []

    def four_d_only(query, key, value, attn_mask=None, **kwargs):
        seen.append((query.dim(), None if attn_mask is None else tuple(attn_mask.shape)))
        assert query.dim() == 4 and (attn_mask is None or attn_mask.dim() == 4)
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask)

    q, k, v = torch.randn(2, 3, 4, 5, 8), torch.randn(2, 3, 4, 6, 8), torch.randn(2, 3, 4, 6, 8)
    mask = torch.rand(5, 6) < 0.7
    mask[:, 0] = True
    out = _call_4d(four_d_only, q, k, v, attn_mask=mask)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert seen == [(4, (6, 1, 5, 6))] and out.shape == (2, 3, 4, 5, 8)
    torch.testing.assert_close(out, expected)
    out = _call_4d(four_d_only, q[0, 0], k[0, 0], v[0, 0], attn_mask=mask)  # 3-D: a batch of 1
    assert seen[-1] == (4, (1, 1, 5, 6)) and out.shape == (4, 5, 8)


# --------------------------------------------------------------------------- end to end


def test_self_attention_lengths_certifies_and_fails_without_it(tmp_path):
    chosen = ["-k", "forward_agreement or causal_flag_equivalence or small_sizes_sweep", "--dtype=float32"]
    proc = run(f"--impl={IMPLS}:self_attention", *chosen, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    cert = json.loads((tmp_path / "cert.json").read_text())
    sweep = next(r for r in cert["results"] if r["property"] == "small_sizes_sweep")
    assert "L = S in 1..33" in sweep["reason"]
    proc = run(f"--impl={IMPLS}:self_attention", "--impl-option", "self_attention_lengths=false", *chosen,
               tmp_path=tmp_path)
    assert proc.returncode == 1 and outcomes(tmp_path)["forward_agreement[float32]"] == "failed"
    assert "self-attention only" in proc.stdout
    # Without masks only a lower-right flag with L > S could block a whole row: it skips.
    proc = run(f"--impl={IMPLS}:self_attention", "--impl-option", "mask_kinds=none", "--impl-option",
               "causal=lower_right", "-k", "fully_masked_rows and not mha", "--dtype=float32",
               tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    cert = json.loads((tmp_path / "cert.json").read_text())
    assert cert["results"][0]["outcome"] == "skipped" and "L == S only" in cert["results"][0]["reason"]


def test_shared_kv_certifies_gradients_as_dk_plus_dv_and_fails_without_it(tmp_path):
    """Declared shared_kv certifies; undeclared (the contract: value is used), it fails."""
    chosen = ["-k", "forward_agreement or gradient_agreement or value_linearity", "--dtype=float64"]
    proc = run(f"--impl={IMPLS}:memory_attention", "--impl-option", "shared_kv=true", *chosen, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    got = outcomes(tmp_path)
    assert got["gradient_agreement[float64]"] == "passed" and got["value_linearity[float64]"] == "skipped"
    proc = run(f"--impl={IMPLS}:memory_attention", *chosen, tmp_path=tmp_path)
    assert proc.returncode == 1 and outcomes(tmp_path)["forward_agreement[float64]"] == "failed"


def test_fully_masked_policy_per_kind_certifies_where_one_policy_fails(tmp_path):
    chosen = ["-k", "fully_masked_rows and not mha", "--dtype=float32"]
    proc = run(f"--impl={IMPLS}:jax_style_attention", "--impl-option", "fully_masked=bool:uniform,additive:nan",
               *chosen, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    proc = run(f"--impl={IMPLS}:jax_style_attention", "--impl-option", "fully_masked=uniform", *chosen,
               tmp_path=tmp_path)
    assert proc.returncode == 1 and outcomes(tmp_path)["fully_masked_rows[float32]"] == "failed"
    assert "for additive rows" in proc.stdout
    # Undeclared, the probed policy is not adopted: the failure names what the probe saw.
    proc = run(f"--impl={IMPLS}:jax_style_attention", *chosen, tmp_path=tmp_path)
    assert proc.returncode == 1 and outcomes(tmp_path)["fully_masked_rows[float32]"] == "failed"
    [message] = [r["message"] for r in json.loads((tmp_path / "cert.json").read_text())["results"]
                 if r["property"] == "fully_masked_rows"]
    assert "probe: fully_masked: probed bool:uniform,additive:nan" in message, message
    assert "--impl-option fully_masked=bool:uniform,additive:nan" in message


def test_batch_dims_certifies_a_4d_only_kernel_and_fails_without_it(tmp_path):
    chosen = ["-k", "forward_agreement", "--dtype=float32"]
    proc = run(f"--impl={IMPLS}:per_head_kernel", *chosen, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    proc = run(f"--impl={IMPLS}:per_head_kernel", "--impl-option", "batch_dims=none", *chosen,
               tmp_path=tmp_path)
    assert proc.returncode == 1 and outcomes(tmp_path)["forward_agreement[float32]"] == "failed"


@pytest.mark.parametrize("name, levels", [("tile_kernel_impl", {"sdpa", "flash"}), ("tile_flash_impl", {"flash"})])
def test_a_kernel_that_raises_below_its_min_head_dim_certifies_at_every_level(tmp_path, name, levels):
    """A tensor-core kernel declaring min_head_dim=16 raises on E < 16 and is otherwise
    right: every case at every level it has (SDPA, the flash level derived from it, a flash
    callable of its own) is inside the bound, so it certifies with no failure and no error."""
    proc = run(f"--impl={IMPLS}:{name}", "--dtype=float32", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    cert = json.loads((tmp_path / "cert.json").read_text())
    ran = [r for r in cert["results"] if r["outcome"] != "skipped"]
    assert {r["level"] for r in ran} == levels
    assert all(r["outcome"] == "passed" for r in ran), [(r["property"], r["outcome"]) for r in ran]
    assert "flash_agreement" in {r["property"] for r in ran}


# --------------------------------------------------------------------------- --xfail-file

XFAIL = '''
[[xfail]]
property = "*"
match = { dtype = "float64" }
reason = "the softmax runs in float32"
reference = "our issue #1"
'''


def test_xfail_file_excuses_a_known_deviation_of_a_plain_function(tmp_path):
    chosen = [f"--impl={IMPLS}:float32_softmax", "-k", "forward_agreement", "--dtype=float64"]
    proc = run(*chosen, tmp_path=tmp_path)
    assert proc.returncode == 1 and outcomes(tmp_path)["forward_agreement[float64]"] == "failed"
    (tmp_path / "known.toml").write_text(XFAIL)
    proc = run(*chosen, f"--xfail-file={tmp_path}/known.toml", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert outcomes(tmp_path)["forward_agreement[float64]"] == "xfailed"
    cert = json.loads((tmp_path / "cert.json").read_text())
    assert cert["implementation"]["expected_failures"][0]["reference"] == "our issue #1"


@pytest.mark.parametrize("text, message", [
    ("[[xfail]\nproperty = 1", "is not valid TOML"),
    ('[[xfail]]\nproperty = "forward_agreement"', "needs property and reason"),
    ('[[xfail]]\nproperty = "x"\nreason = "r"\nwhy = "w"', "remove ['why']"),
    ('[[xfail]]\nproperty = 3\nreason = "r"', 'property=3 must be a string; write property = "..."'),
    ('[[xfail]]\nproperty = "x"\nreason = "r"\nmatch = 1', "match=1 must be a table"),
    ('[[expected]]\nproperty = "x"', "only [[xfail]] tables"),
])
def test_xfail_file_schema_errors_name_argument_rule_and_fix(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ImplementationError, match="--xfail-file") as info:
        registry.load_expected_failures_file(path)
    assert message in str(info.value)


def test_xfail_file_errors_are_usage_errors(tmp_path):
    proc = run(f"--impl={IMPLS}:float32_softmax", f"--xfail-file={tmp_path}/absent.toml", tmp_path=tmp_path)
    assert proc.returncode == 4 and "--xfail-file" in proc.stderr and "no such file" in proc.stderr
    (tmp_path / "unknown.toml").write_text('[[xfail]]\nproperty = "forward_agreemnt"\nreason = "r"\n')
    proc = run(f"--impl={IMPLS}:float32_softmax", f"--xfail-file={tmp_path}/unknown.toml", tmp_path=tmp_path)
    assert proc.returncode == 4 and "forward_agreemnt" in proc.stderr and "forward_agreement" in proc.stderr
