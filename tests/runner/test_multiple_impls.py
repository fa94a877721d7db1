"""Several implementations in one run (``--impl=a,b``, ``--impl='mutant:*'``): each is
resolved once, its tests carry its label in their ids, expected failures, isolation,
replay lines and reproducers are its own, ``--impl-exitfirst`` stops one without
stopping the others, and the run prints one certificate with the implementations side
by side (terminal, Markdown, JSON). A run of one implementation keeps its plain ids."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conformance.harness.session import SESSION_KEY, Session, Subject
from conformance.isolation import supervisor as isolation
from conformance.plugin import (
    _NODE_ID,
    _impl_specs,
    _labels,
    _ResultCollector,
    pytest_collection_modifyitems,
)
from conformance.reporting import certificate, merge
from implementations.mutants import MUTANTS
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]
IMPLS = "tests/runner/impls_for_tests.py"
HOSTILE = "tests/runner/hostile_impls.py"


def run(*args: str, tmp_path: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "failures"),
               ATTENTION_CONFORMANCE_STATE=str(tmp_path / "state"))
    env = {k: v for k, v in env.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    return pytest_process.run(
        [sys.executable, "-m", "pytest", "conformance", "-p", "no:cacheprovider", "-q",
         "--hypothesis-profile=ci", f"--conformance-report={tmp_path}/cert", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, check=False,
    )


def comparison(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "cert.json").read_text())


def by_spec(cert: dict) -> dict[str, dict]:
    return {c["implementation"]["spec"]: c for c in cert["certificates"]}


# --------------------------------------------------------------------------- --impl lists and labels


def test_impl_lists_and_globs_expand_in_order_without_repeats():
    assert _impl_specs("sdpa, sdpa-math,handwritten") == ["sdpa", "sdpa-math", "handwritten"]
    assert _impl_specs("sdpa,sdpa") == ["sdpa"]
    zoo = _impl_specs("mutant:*")
    assert zoo == [f"mutant:{name}" for name in sorted(MUTANTS)]
    assert _impl_specs("handwritten,mutant:gqa_*") == ["handwritten"] + sorted(
        f"mutant:{n}" for n in MUTANTS if n.startswith("gqa_"))
    assert {"sdpa", "sdpa-math"} <= set(_impl_specs("sdpa*"))


@pytest.mark.parametrize("raw, words", [
    ("mutant:no_such_*", ["mutant:no_such_*", "matches no registered name", "handwritten"]),
    (",", ["names no implementation"]),
])
def test_impl_list_mistakes_are_usage_errors(raw, words):
    with pytest.raises(pytest.UsageError) as info:
        _impl_specs(raw)
    assert all(word in str(info.value) for word in words), str(info.value)


def test_labels_are_test_id_safe_and_unique():
    assert _labels(["sdpa", "mutant:gqa_tile", "dir/my impl.py:f", "dir/my_impl.py:f"]) == [
        "sdpa", "mutant:gqa_tile", "dir/my_impl.py:f", "dir/my_impl.py:f_2"]


@pytest.mark.parametrize("test_id, label", [
    ("test_forward_agreement[sdpa-float32-cpu]", None),
    ("test_forward_agreement[sdpa-math-sdpa-float32-cpu]", "sdpa-math"),
    ("test_mha_agreement[mutant:mha_no_out_proj-mha-float64-cpu]", "mutant:mha_no_out_proj"),
    ("test_temperature[tests/x.py:f-sdpa-bfloat16-cuda]", "tests/x.py:f"),
    ("test_window_equivalence[mutant:gqa_tile-flash-float16-cpu]", "mutant:gqa_tile"),
    ("test_lse_agreement[flash-float32-cpu]", None),
    ("test_varlen_agreement[varlen-reference-varlen-float64-cpu]", "varlen-reference"),
    ("test_paged_equivalence[x.py:f-kvcache-bfloat16-cuda]", "x.py:f"),
])
def test_node_ids_name_the_implementation(test_id, label):
    m = _NODE_ID.search(f"conformance/test_x.py::{test_id}")
    assert m is not None and m["label"] == label
    assert m["level"] in test_id and m["dtype"].startswith(("float", "bfloat"))


def _config_comparing(*specs: str) -> SimpleNamespace:
    """A config whose session compares ``specs`` (in that --impl order)."""
    session = Session(profile="ci", started=0.0)
    for spec in specs:
        session.add(Subject(spec, impl=None, label=spec))  # type: ignore[arg-type]
    config = SimpleNamespace(stash=pytest.Stash())
    config.stash[SESSION_KEY] = session
    return config


def _item(prop: str, label: str, level: str = "sdpa") -> SimpleNamespace:
    target = SimpleNamespace(label=label, level=level)
    return SimpleNamespace(name=f"{prop}-{label}", callspec=SimpleNamespace(params={"target": target}))


def test_tests_go_one_implementation_after_the_other_in_impl_order():
    config = _config_comparing("zeta", "alpha")
    items = [_item(p, label) for p in ("forward", "temperature") for label in ("alpha", "zeta")]
    pytest_collection_modifyitems(config, items)
    assert [i.name for i in items] == ["forward-zeta", "temperature-zeta", "forward-alpha", "temperature-alpha"]


def test_each_implementation_goes_level_by_level_sdpa_first():
    config = _config_comparing("zeta", "alpha")
    items = [_item(p, label, level) for p, level in (("flash", "flash"), ("mha", "mha"), ("forward", "sdpa"),
                                                    ("kvcache", "kvcache"), ("varlen", "varlen"))
             for label in ("alpha", "zeta")]
    pytest_collection_modifyitems(config, items)
    order = ["forward", "mha", "flash", "varlen", "kvcache"]
    assert [i.name for i in items] == [f"{p}-{label}" for label in ("zeta", "alpha") for p in order]


def test_exitfirst_stops_the_derived_flash_level_too(tmp_path):
    """An SDPA mutant fails at the SDPA level and its derived flash level's tests skip; a
    flash-level mutant stops at its own first failure."""
    sdpa_bug, flash_bug = "mutant:bool_mask_inverted", "mutant:flash_lse_log2"
    proc = run(f"--impl={sdpa_bug},{flash_bug}", "--impl-exitfirst", "--dtype=float64",
               "-k", "forward_agreement or flash_agreement or lse_agreement or split_merge", tmp_path=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:]
    certs = by_spec(comparison(tmp_path))
    for spec, level in ((sdpa_bug, "sdpa"), (flash_bug, "flash")):
        failed = [(r["property"], r["level"]) for r in certs[spec]["results"] if r["outcome"] == "failed"]
        assert len(failed) == 1 and failed[0][1] == level, (spec, failed)
        stopped = [r for r in certs[spec]["results"] if (r["reason"] or "").startswith("--impl-exitfirst")]
        assert stopped, (spec, certs[spec]["results"])
    flash_rows = [r for r in certs[sdpa_bug]["results"] if r["level"] == "flash"]
    assert flash_rows and all(r["outcome"] == "skipped" for r in flash_rows), flash_rows


def test_a_crashed_test_is_charged_to_its_own_implementation(tmp_path, monkeypatch):
    """What the xdist controller sees of a test whose process died: the record made
    from the report names its implementation, and the crash is remembered for it alone."""
    monkeypatch.setenv("ATTENTION_CONFORMANCE_STATE", str(tmp_path))
    session = Session(profile="ci", started=0.0)
    for spec in ("a.py:f", "b.py:g"):
        session.add(Subject(spec, impl=None, label=spec))  # type: ignore[arg-type]
    report = type("Report", (), dict(
        nodeid="conformance/test_sdpa_agreement.py::test_forward_agreement[b.py:g-sdpa-float32-cpu]",
        when="???", failed=True, skipped=False, user_properties=[],
        longreprtext="worker 'gw0' crashed while running 'conformance/...'"))()
    _ResultCollector(session).pytest_runtest_logreport(report)
    [result] = session.results
    assert (result["implementation"], result["property"], result["outcome"]) == ("b.py:g", "forward_agreement",
                                                                               "failed")
    assert isolation.crash_seen("b.py:g") and not isolation.crash_seen("a.py:f")


# --------------------------------------------------------------------------- the certificate


def _result(prop, dtype, outcome="passed", ratio=0.1):
    return {"property": prop, "level": "sdpa", "dtype": dtype, "device": "cpu", "outcome": outcome,
            "examples": 20, "worst_ratio": ratio, "seconds": 1.5, "reason": "", "message": "boom"}


def _one(spec, results):
    return certificate.certificate(
        implementation={"name": spec, "spec": spec, "version": "1", "options": {},
                        "capabilities": {"fully_masked": "zero", "causal": "upper_left", "tf32": False},
                        "expected_failures": []},
        environment={"torch": "2.13.0", "devices": ["cpu"]}, profile="ci",
        seconds=sum(r["seconds"] for r in results), results=results)


def test_comparison_puts_the_implementations_side_by_side_in_every_output(tmp_path):
    cert = certificate.comparison(
        certificates=[_one("zeta", [_result("forward_agreement", "float32"),
                                    _result("temperature", "float32", "failed", 3.0)]),
                      _one("alpha", [_result("forward_agreement", "float32", ratio=0.2)])],
        environment={"torch": "2.13.0", "devices": ["cpu"]}, profile="ci", seconds=12.345)
    assert cert["comparison"] == ["zeta", "alpha"] and cert["seconds"] == 12.35
    columns = [(c["implementation"], c["dtype"]) for c in cert["matrix"]["columns"]]
    assert columns == [("zeta", "float32"), ("alpha", "float32")]  # --impl order, not alphabetical
    assert certificate.title(cert) == "attention-conformance certificate: 2 implementations compared (zeta, alpha)"

    lines = "\n".join(certificate.terminal_lines(cert)).splitlines()
    names, header = lines[1], lines[2]
    assert names.split() == ["zeta", "alpha"] and header.split() == ["property", "level", "float32/cpu", "float32/cpu"]
    assert names.index("zeta") == header.index("float32/cpu")  # a name heads its own columns
    row = next(line for line in lines if line.startswith("temperature"))
    assert "FAIL 3 (20)" in row
    assert "-- zeta (zeta 1) --" in lines and "-- alpha (alpha 1) --" in lines
    assert any(line.startswith("FAIL temperature[sdpa-float32-cpu]") for line in lines)
    assert lines[-2:] == ["zeta: summary: 1 failed, 1 passed", "alpha: summary: 1 passed"]

    md = certificate.markdown(cert)
    assert md.startswith("# attention-conformance certificate: 2 implementations compared")
    assert "| property | level | zeta / cpu / float32 | alpha / cpu / float32 |" in md
    assert md.index("## `zeta`") < md.index("## `alpha`")

    json_path, _ = certificate.write(cert, tmp_path / "cmp")
    named = merge.load_certificates(json_path)  # conformance.reporting.merge reads a comparison too
    assert [name for name, _ in named] == [f"{json_path}[zeta]", f"{json_path}[alpha]"]
    assert merge.main([str(json_path), "--output", str(tmp_path / "matrix")]) == 0
    assert "zeta / cpu / float32" in (tmp_path / "matrix.md").read_text()


# --------------------------------------------------------------------------- end to end


def test_two_implementations_in_one_run(tmp_path):
    """Ids carry the label; the failing implementation's message, saved file, replay line
    and reproducer name it; the passing one is untouched; one certificate compares them."""
    bad = f"{IMPLS}:ignores_scale"
    proc = run(f"--impl=spec,{bad}", "--dtype=float64", "-k", "forward_agreement", "-vv", tmp_path=tmp_path)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    assert "attention-conformance: 2 implementations compared: spec, " + bad in out  # header
    assert f"test_forward_agreement[{bad}-sdpa-float64-cpu] FAILED" in out
    assert "test_forward_agreement[spec-sdpa-float64-cpu] PASSED" in out
    assert f"failed for implementation {bad} on sdpa/float64/cpu" in out
    assert f"attention-conformance certificate: 2 implementations compared (spec, {bad})" in out

    cert = comparison(tmp_path)
    assert cert["comparison"] == ["spec", bad]
    [good], [failed] = ([r for r in by_spec(cert)[spec]["results"] if r["property"] == "forward_agreement"]
                        for spec in ("spec", bad))
    assert good["outcome"] == "passed" and "implementation" not in good
    assert failed["outcome"] == "failed"
    assert Path(failed["failure_file"]).name.startswith("tests_runner_impls_for_tests.py_ignores_scale-")
    assert f"resolve({bad!r})" in failed["reproducer"]
    assert f"replay: pytest conformance --impl={bad} --replay={failed['failure_file']}" in out
    assert (tmp_path / "cert.md").read_text().startswith("# attention-conformance certificate: 2 implementations")

    replayed = run(f"--impl={bad}", "--replay", failed["failure_file"], tmp_path=tmp_path / "replay")
    assert replayed.returncode == 1 and "1 failed" in replayed.stdout, replayed.stdout[-2000:]


def test_expected_failures_and_exitfirst_are_per_implementation(tmp_path):
    """sdpa's expected failure excuses sdpa only; --impl-exitfirst skips the rest of a
    failing implementation's tests and lets the others run to the end."""
    first, second = "mutant:bool_mask_inverted", "mutant:causal_lower_right"
    proc = run(f"--impl=sdpa,{first},{second}", "--impl-exitfirst", "--dtype=float32,float64",
               "-k", "test_forward_agreement or test_output_contract", tmp_path=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:]
    certs = by_spec(comparison(tmp_path))
    sdpa = {(r["property"], r["dtype"]): r["outcome"] for r in certs["sdpa"]["results"]}
    assert sdpa[("forward_agreement", "float32")] == "xfailed" and "failed" not in sdpa.values()
    for spec in (first, second):
        outcomes = [(r["property"], r["outcome"], r["reason"]) for r in certs[spec]["results"]]
        failed = [o for o in outcomes if o[1] == "failed"]
        skipped = [reason for _, o, reason in outcomes if o == "skipped"]
        assert [p for p, _, _ in failed] == ["forward_agreement"] and len(skipped) == 3, outcomes
        assert all(r.startswith(f"--impl-exitfirst: {spec} already failed test_forward_agreement[{spec}-")
                   for r in skipped), skipped


def test_isolation_is_chosen_and_used_per_implementation(tmp_path, monkeypatch):
    """--isolate=auto isolates only the implementation an earlier run saw crash; that one's
    crash fails its own test and the other implementation runs in-process."""
    crashing, correct = f"{HOSTILE}:exits", f"{HOSTILE}:correct"
    monkeypatch.setenv("ATTENTION_CONFORMANCE_STATE", str(tmp_path / "state"))  # what run() uses
    isolation.record_crash(crashing, "an earlier run")
    proc = run(f"--impl={crashing},{correct}", "--dtype=float64", "-k", "forward_agreement", "-v",
               tmp_path=tmp_path)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    header = out[out.index("attention-conformance: 2 implementations"):]
    # Each implementation's header block: its line, capabilities and probe notes, then how it runs.
    assert re.search(rf"{re.escape(crashing)}: exits .*\n(?:    .*\n)+?\s+implementation runs in a worker process", header)
    assert re.search(rf"{re.escape(correct)}: .*\n(?:    .*\n)+?\s+implementation runs in-process", header)
    certs = by_spec(comparison(tmp_path))
    [crashed], [passed] = certs[crashing]["results"], certs[correct]["results"]
    assert crashed["outcome"] == "failed" and crashed["isolated"] and "ended its isolated worker" in crashed["message"]
    assert passed["outcome"] == "passed" and not passed["isolated"]


def test_several_implementations_under_xdist(tmp_path):
    proc = run("--impl=spec,sdpa-math", "--dtype=float64", "-k", "test_temperature or test_output_contract",
               "-n", "2", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    certs = by_spec(comparison(tmp_path))
    for spec in ("spec", "sdpa-math"):
        assert sorted(r["property"] for r in certs[spec]["results"]) == ["output_contract", "temperature"]
        assert {r["outcome"] for r in certs[spec]["results"]} == {"passed"}


def test_one_implementation_keeps_the_plain_ids_and_certificate(tmp_path):
    proc = run("--impl=spec", "--dtype=float64", "-k", "temperature", "-vv", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "test_temperature[sdpa-float64-cpu] PASSED" in proc.stdout
    assert "attention-conformance certificate: spec (" in proc.stdout
    cert = comparison(tmp_path)
    assert "comparison" not in cert and cert["implementation"]["spec"] == "spec"
    assert all("implementation" not in r for r in cert["results"])
