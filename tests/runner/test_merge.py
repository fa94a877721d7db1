"""conformance.reporting.merge on plain certificate data: the matrix, merging agreeing results,
skips beside runs, conflicts reported (never overwritten), GPUs told apart, the
command line."""

from __future__ import annotations

import json

import pytest

from conformance.reporting.merge import (
    CertificateError,
    load_certificate,
    main,
    merge,
    render_markdown,
    to_json,
)


def result(prop, dtype, outcome="passed", *, device="cpu", level="sdpa", examples=20, ratio=0.1):
    return {"property": prop, "level": level, "dtype": dtype, "device": device, "outcome": outcome,
            "examples": examples, "worst_ratio": ratio, "reason": ""}


def certificate(spec, results, **environment):
    return {"implementation": {"name": spec, "spec": spec, "version": "1"}, "profile": "ci",
            "environment": {"platform": "Linux", "torch": "2.13.0", **environment},
            "results": results}


def cell(merged, prop, column, level="sdpa"):
    return merged.cells[((level, prop), column)]


def test_matrix_of_implementations_devices_dtypes():
    merged = merge([
        certificate("sdpa", [result("forward_agreement", "float32"), result("forward_agreement", "float16")]),
        certificate("jax", [result("forward_agreement", "float32", "xfailed"),
                            result("temperature", "float64")]),
    ])
    assert merged.columns == [("jax", "cpu", "float64"), ("jax", "cpu", "float32"),
                              ("sdpa", "cpu", "float32"), ("sdpa", "cpu", "float16")]
    assert merged.rows == [("sdpa", "forward_agreement"), ("sdpa", "temperature")]
    assert cell(merged, "forward_agreement", ("jax", "cpu", "float32")).outcome == "xfailed"
    assert ((("sdpa", "temperature"), ("sdpa", "cpu", "float32")) not in merged.cells)
    markdown = render_markdown(merged)
    assert "| property | level | jax / cpu / float64 | jax / cpu / float32 |" in markdown
    assert "| temperature | sdpa | PASS 0.1 (20) |  |  |  |" in markdown
    assert "None: every cell's certificates agree." in markdown


def test_agreeing_results_merge_examples_and_worst_ratio():
    merged = merge([certificate("sdpa", [result("forward_agreement", "float32", ratio=0.1)]),
                    certificate("sdpa", [result("forward_agreement", "float32", ratio=0.3, examples=40)])])
    merged_cell = cell(merged, "forward_agreement", ("sdpa", "cpu", "float32"))
    assert (merged_cell.outcome, merged_cell.examples, merged_cell.worst_ratio) == ("passed", 60, 0.3)
    assert not merged.conflicts
    assert "PASS 0.3 (60)" in render_markdown(merged)


def test_a_skip_gives_way_to_a_result_that_ran():
    merged = merge([certificate("sdpa", [result("forward_agreement", "float32", "skipped", device="cuda")]),
                    certificate("sdpa", [result("forward_agreement", "float32", "failed", device="cuda")])])
    assert cell(merged, "forward_agreement", ("sdpa", "cuda", "float32")).outcome == "failed"
    assert not merged.conflicts
    only_skips = merge([certificate("sdpa", [result("temperature", "float32", "skipped")])] * 2)
    assert cell(only_skips, "temperature", ("sdpa", "cpu", "float32")).outcome == "skipped"


def test_conflicts_are_reported_not_overwritten():
    certs = [certificate("sdpa", [result("forward_agreement", "float16", "passed", ratio=0.2)]),
             certificate("sdpa", [result("forward_agreement", "float16", "failed", ratio=3.0)]),
             certificate("sdpa", [result("forward_agreement", "float16", "passed", ratio=0.4)])]
    merged = merge(certs, names=["a.json", "b.json", "c.json"])
    ((row, column, conflicted),) = merged.conflicts
    assert (row, column) == (("sdpa", "forward_agreement"), ("sdpa", "cpu", "float16"))
    assert [r.outcome for r in conflicted.results] == ["passed", "failed", "passed"]
    markdown = render_markdown(merged)
    assert "| forward_agreement | sdpa | CONFLICT |" in markdown
    assert ("- forward_agreement [sdpa] on sdpa / cpu / float16: a.json: PASS 0.2 (20); "
            "b.json: FAIL 3 (20); c.json: PASS 0.4 (20)") in markdown
    data = to_json(merged)
    assert data["rows"][0]["cells"][0]["outcome"] == "conflict"
    assert [r["outcome"] for r in data["conflicts"][0]["results"]] == ["passed", "failed", "passed"]
    json.dumps(data)  # plain data


def test_gpu_models_get_columns_of_their_own():
    merged = merge([
        certificate("triton", [result("forward_agreement", "float16", device="cuda")],
                    cuda_device_name="NVIDIA H100"),
        certificate("triton", [result("forward_agreement", "float16", "failed", device="cuda")],
                    cuda_device_name="NVIDIA A100"),
        certificate("triton", [result("forward_agreement", "float16", device="cpu")],
                    cuda_device_name="NVIDIA A100"),
    ])
    assert merged.columns == [("triton", "cpu", "float16"), ("triton", "cuda (NVIDIA A100)", "float16"),
                              ("triton", "cuda (NVIDIA H100)", "float16")]
    assert not merged.conflicts


def test_the_implementation_name_stands_in_for_a_missing_spec():
    cert = certificate("x", [result("temperature", "float32")])
    cert["implementation"] = {"name": "handwritten"}
    assert merge([cert]).columns == [("handwritten", "cpu", "float32")]


@pytest.mark.parametrize("bad, message", [
    ({"results": "no"}, "no 'results' list"),
    ({"results": [], "implementation": {}}, "neither 'spec' nor 'name'"),
    ({"results": [{"property": "p"}], "implementation": {"name": "x"}}, r"results\[0\] lacks"),
])
def test_malformed_certificates_are_named(bad, message):
    with pytest.raises(CertificateError, match=message):
        merge([bad])


def test_command_line_writes_markdown_and_json(tmp_path, capsys):
    paths = []
    for name, outcome in (("one", "passed"), ("two", "failed")):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(certificate("sdpa", [result("temperature", "float32", outcome)])))
        paths.append(str(path))
    assert main([paths[0]]) == 0
    assert "| temperature | sdpa | PASS 0.1 (20) |" in capsys.readouterr().out
    out = tmp_path / "out" / "merged"
    assert main([*paths, "--output", str(out)]) == 1  # a conflict
    assert "1 conflicts" in capsys.readouterr().out
    assert "CONFLICT" in (tmp_path / "out" / "merged.md").read_text()
    data = json.loads((tmp_path / "out" / "merged.json").read_text())
    assert [c["path"] for c in data["certificates"]] == paths


def test_command_line_rejects_unreadable_input(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    assert main([str(tmp_path / "bad.json")]) == 2
    assert "cannot read a certificate" in capsys.readouterr().err
    with pytest.raises(CertificateError, match="cannot read"):
        load_certificate(tmp_path / "missing.json")
