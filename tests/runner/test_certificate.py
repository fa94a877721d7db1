"""The certificate built and rendered from plain data (no pytest run, no implementation)."""

from __future__ import annotations

import json

from conformance.reporting import certificate

CAPS = {"fully_masked": "zero", "causal": "upper_left", "tf32": False}


def result(prop: str, dtype: str, outcome: str = "passed", *, level: str = "sdpa", device: str = "cpu",
           examples: int = 20, worst_ratio: float | None = 0.02, **extra) -> dict:
    r = {"property": prop, "level": level, "dtype": dtype, "device": device, "outcome": outcome,
         "examples": examples, "worst_ratio": worst_ratio, "seconds": 0.5, "reason": "",
         "counterexample": None, "message": "", "failure_file": "", "reproducer": "",
         "xfail_hits": 0, "xfail_reason": "", "first_failure_seconds": None}
    r.update(extra)
    return r


def make(results: list[dict]) -> dict:
    return certificate.certificate(
        implementation={"name": "impl", "spec": "my_impl.py:attn", "version": "1.0", "options": {},
                        "capabilities": CAPS, "mha_capabilities": CAPS, "expected_failures": []},
        environment={"torch": "2.13.0+cpu", "devices": ["cpu"]},
        profile="ci", seconds=12.3456, results=results,
    )


def test_cell_shows_outcome_ratio_and_examples():
    assert certificate.cell(result("p", "float32")) == "PASS 0.02 (20)"
    assert certificate.cell(result("p", "float32", worst_ratio=None, examples=5)) == "PASS - (5)"
    assert certificate.cell(result("p", "float32", "xfailed", worst_ratio=0.0071)) == "xfail 0.0071 (20)"
    assert certificate.cell(result("p", "float32", "stale-xfail")) == "STALE 0.02 (20)"
    assert certificate.cell(result("p", "float32", "failed", examples=0)) == "FAIL"
    assert certificate.cell(result("p", "float32", "skipped", examples=0, worst_ratio=None)) == "skip"
    assert certificate.cell(result("p", "float32", "error")) == "ERROR"


def test_results_are_sorted_and_seconds_rounded():
    cert = make([result("b", "float32"), result("a", "float16"), result("m", "float32", level="mha"),
                 result("a", "float32", device="cuda"), result("a", "float32")])
    keys = [(r["level"], r["property"], r["device"], r["dtype"]) for r in cert["results"]]
    assert keys == sorted(keys)
    assert cert["seconds"] == 12.35


def test_table_has_a_row_per_property_and_a_column_per_target_in_dtype_order():
    cert = make([result("forward_agreement", "float16"), result("forward_agreement", "float64"),
                 result("temperature", "float64", "skipped", examples=0, worst_ratio=None)])
    lines = certificate.render_table(cert).splitlines()
    assert lines[0].split() == ["property", "level", "float64/cpu", "float16/cpu"]
    assert lines[1].split() == ["forward_agreement", "sdpa", "PASS", "0.02", "(20)", "PASS", "0.02", "(20)"]
    assert lines[2].split() == ["temperature", "sdpa", "skip"]  # no float16 result: blank cell
    assert len({len(line) for line in lines}) == 1  # every column padded to its width


def test_markdown_table():
    cert = make([result("forward_agreement", "float32")])
    assert certificate.render_table(cert, markdown=True).splitlines() == [
        "| property | level | float32/cpu |",
        "|---|---|---|",
        "| forward_agreement | sdpa | PASS 0.02 (20) |",
    ]


def test_details_name_failures_expected_failures_stale_entries_and_skips_once():
    cert = make([
        result("forward_agreement", "float32", "failed", examples=7, counterexample={"B": 1, "L": 2},
               failure_file="f.npz", message="line 1\nline 2\nline 3\nline 4"),
        result("gradient_agreement", "float32", "xfailed", examples=10, xfail_hits=1,
               xfail_reason="known (pytorch/pytorch#1)"),
        result("output_contract", "float32", "stale-xfail", reason="no longer fails"),
        result("temperature", "float32", "skipped", reason="custom scale not declared"),
        result("temperature", "float64", "skipped", reason="custom scale not declared"),
    ])
    assert certificate.details(cert) == [
        "declared policies: fully-masked rows=zero, causal flag=upper_left, tf32=False",
        "FAIL forward_agreement[sdpa-float32-cpu]: after 7 examples; shrunk case {'B': 1, 'L': 2}; saved f.npz",
        "    line 1",
        "    line 2",
        "    line 3",
        "expected failure gradient_agreement[sdpa-float32-cpu]: known (pytorch/pytorch#1) (1 of 10 examples)",
        "STALE expected failure output_contract[sdpa-float32-cpu]: no longer fails",
        "skipped (custom scale not declared) e.g. temperature[sdpa-float32-cpu]",
    ]


def test_terminal_lines_and_summary():
    cert = make([result("forward_agreement", "float32"), result("temperature", "float32", "skipped",
                                                                 reason="r", examples=0, worst_ratio=None)])
    assert certificate.title(cert) == "attention-conformance certificate: my_impl.py:attn (impl 1.0)"
    lines = certificate.terminal_lines(cert)
    assert lines[0] == ("profile=ci torch=2.13.0+cpu cell = outcome, worst error/allowed ratio "
                        "(1 = at tolerance), examples run")
    assert lines[1] == certificate.render_table(cert)
    assert lines[-1] == certificate.summary(cert) == "summary: 1 passed, 1 skipped"


def test_write_json_and_markdown(tmp_path):
    cert = make([result("forward_agreement", "float32")])
    json_path, md_path = certificate.write(cert, tmp_path / "sub" / "cert")
    assert json_path == tmp_path / "sub" / "cert.json" and md_path == tmp_path / "sub" / "cert.md"
    assert json.loads(json_path.read_text()) == cert
    md = md_path.read_text()
    assert md.startswith("# attention-conformance certificate: `my_impl.py:attn`\n")
    assert "| forward_agreement | sdpa | PASS 0.02 (20) |" in md
    assert "- declared policies: fully-masked rows=zero" in md


def test_an_entry_for_another_device_is_not_called_never_applied():
    """sdpa.toml holds entries measured on CUDA; a CPU run cannot apply them and does not
    list them, while an entry for the run's own device that excused nothing is listed."""
    entry = {"property": "forward_agreement", "reason": "r", "reference": ""}
    cert = {"implementation": {"expected_failures": [
                dict(entry, match={"device": "cuda", "dtype": ["float16", "bfloat16"]}),
                dict(entry, match={"device": "cpu", "dtype": "float32"}),
                dict(entry, match={"dtype": "bfloat16"})]},
            "results": [{"property": "forward_agreement", "level": "sdpa", "dtype": "float32", "device": "cpu",
                         "outcome": "passed", "expected_failures": []}]}
    lines = certificate.unapplied_expected_failures(cert)
    assert len(lines) == 1 and "'device': 'cpu'" in lines[0], lines
