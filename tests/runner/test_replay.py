"""One replay path: the call a property made is what its failure saves, what the
reproducer snippet makes in a fresh interpreter, and what expected failures are
matched against. Also --replay's validation and the seeding of non-Hypothesis draws."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

import conformance
from conformance.calls.mha import upstream_gradient
from conformance.calls.replay import (
    CallLog,
    MHACallSpec,
    SDPACallSpec,
    report_sdpa_call,
)
from conformance.core.cases import MHA_ATTRIBUTES, SDPA_ATTRIBUTES, MHACase, SDPACase
from conformance.core.registry import registered_properties
from conformance.core.target import Target
from conformance.reporting import failures
from implementations.mutants import MUTANTS
from implementations.mutants._base import (
    SDPA_CAPABILITIES,
    NaiveSDPA,
    sdpa_implementation,
)
from implementations.registry import resolve
from tests import pytest_process

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
REPLAY_IMPLS = ROOT / "tests" / "runner" / "impls_for_replay.py"
#: Imported before any in-process run so that pytester's restoring of sys.modules keeps them.
MODULES = [importlib.import_module(m.name) for m in pkgutil.walk_packages(conformance.__path__, "conformance.")]
PROPERTIES = dict(registered_properties())
#: Dtype each property is run in (others: float64).
DTYPES = {"large_logits": "float16", "dropout_expectation": "float32", "mha_dropout_expectation": "float32",
          "mha_output_contract": "float32"}


def killer(prop: str) -> str:
    """An --impl value the property kills: a bug-zoo mutant that names it (not a
    Triton one: slow on a CPU), else the wrong implementation of impls_for_replay."""
    for name, mutant in MUTANTS.items():
        if mutant.expected_property == prop and not name.startswith("triton"):
            return f"mutant:{name}"
    return f"{REPLAY_IMPLS}:{prop}"


def run_snippets(snippets: dict[str, str], cwd: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """Run each snippet, each in a fresh namespace, in one fresh interpreter
    (started in ``cwd``); returns its output (and any exception) by name."""
    driver = (
        "import io, json, sys, contextlib, traceback\n"
        "snippets = json.load(sys.stdin)\n"
        "outputs = {}\n"
        "for name, code in snippets.items():\n"
        "    buffer = io.StringIO()\n"
        "    with contextlib.redirect_stdout(buffer):\n"
        "        try:\n"
        "            exec(compile(code, name, 'exec'), {'__name__': '__main__'})\n"
        "        except BaseException:\n"
        "            buffer.write('SNIPPET RAISED\\n' + traceback.format_exc())\n"
        "    outputs[name] = buffer.getvalue()\n"
        "sys.__stdout__.write(json.dumps(outputs))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    proc = subprocess.run([sys.executable, "-c", driver], input=json.dumps(snippets), cwd=cwd,
                          capture_output=True, text=True, timeout=900, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def restore_profile():
    settings.register_profile("_outer_replay", parent=settings.default)
    yield
    settings.load_profile("_outer_replay")


def conformance_run(pytester, *args: str):
    return pytester.runpytest_inprocess(str(ROOT / "conformance"), f"--rootdir={ROOT}", "-p", "no:cacheprovider",
                                        *args)


def inprocess_run(cwd: Path, *args: str) -> int:
    """One conformance run in this process (the modules are imported already:
    each run costs only its examples), started in ``cwd``."""
    old = Path.cwd()
    os.chdir(cwd)
    try:
        return pytest.main([str(ROOT / "conformance"), f"--rootdir={ROOT}", "-p", "no:cacheprovider", "-q",
                            *args])
    finally:
        os.chdir(old)


@pytest.fixture(scope="module")
def reproduced(tmp_path_factory, restore_profile):
    """For every property: the result of a ci run of an implementation it kills
    (that property alone), and what its printed reproducer shows when run."""
    workdir = tmp_path_factory.mktemp("reproduced")
    results = {}
    for prop in PROPERTIES:
        report = workdir / f"{prop}-cert"
        inprocess_run(workdir, f"--impl={killer(prop)}", f"--dtype={DTYPES.get(prop, 'float64')}",
                      "-k", f"test_{prop}", "-x", "--hypothesis-profile=ci", f"--conformance-report={report}")
        cert = json.loads(Path(f"{report}.json").read_text())
        failed = [r for r in cert["results"] if r["property"] == prop and r["outcome"] == "failed"]
        results[prop] = failed[0] if failed else None
    snippets = {prop: r["reproducer"] for prop, r in results.items() if r and r["reproducer"]}
    return results, run_snippets(snippets, workdir)


@pytest.mark.slow
def test_every_property_reproducer_shows_the_failure_in_a_fresh_interpreter(reproduced):
    """One test for all properties (their runs share one process and one interpreter for
    the reproducers, ~90 s; split over xdist workers, each would pay for all of them)."""
    results, outputs = reproduced
    problems = []
    for prop in sorted(PROPERTIES):
        result = results[prop]
        if result is None:
            problems.append(f"{prop}: {killer(prop)} was not killed by {prop} under ci")
            continue
        output = outputs.get(prop, "")
        if "SNIPPET RAISED" in output:
            problems.append(f"{prop}: the reproducer raised:\n{output}")
        elif "FAILS: " not in output or "=> this call shows the failure" not in output:
            problems.append(f"{prop}: the reproducer does not show the failure:\n{result['reproducer']}\n--- "
                            f"it printed:\n{output}")
    assert not problems, "\n\n".join(problems)


# -- item by item, on single runs --------------------------------------------------


def test_mha_reproducer_runs_and_shows_the_mismatch(pytester, restore_profile):
    conformance_run(pytester, "--impl=mutant:mha_no_out_proj", "-k", "mha_agreement", "-x",
                    "--hypothesis-profile=ci", f"--conformance-report={pytester.path / 'cert'}")
    [r] = json.loads((pytester.path / "cert.json").read_text())["results"]
    assert r["outcome"] == "failed"
    repro = subprocess.run([sys.executable, "-c", r["reproducer"]], cwd=pytester.path, capture_output=True,
                           text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)), check=False)
    assert repro.returncode == 0, repro.stderr
    assert "FAILS: module output values mismatch" in repro.stdout
    diff = float(repro.stdout.split("max |out - oracle| = ")[1].split()[0])
    assert diff > 1e-3
    # The certificate's FAIL cell shows the failing example's ratio, not "-" or 0.
    assert r["worst_ratio"] is not None and r["worst_ratio"] > 1


def test_notes_name_the_section_and_the_called_case(pytester, restore_profile):
    result = conformance_run(pytester, "--impl=mutant:mask_after_softmax", "-k", "weights_are_distributions",
                             "--dtype=float64", "-x", "--hypothesis-profile=ci")
    out = result.stdout.str()
    assert "property weights_are_distributions (spec.sdpa (weights)) failed" in out
    # The property calls the V = identity probe (Ev = S), not the drawn case.
    shrunk = re.search(r"^shrunk case: (.*)$", out, re.MULTILINE).group(1)
    called = re.search(r"^called: (.*)$", out, re.MULTILINE).group(1)
    assert re.search(r"S=2 E=\d+ Ev=\d+", shrunk) and "Ev=2 " in called and "is_causal=True" in called
    assert shrunk != called.split(";")[0]
    # The failure reads as a report: the message, then where the property raised it; no
    # frame of the runner (nor its source) unless --tb=long asks for the traceback.
    assert "(raised in test_sdpa_invariants.py:" in out
    assert not re.findall(r"^\S*conformance/(\w+)\.py:\d+: ", out, re.MULTILINE)
    assert "def one_example" not in out


def test_tb_long_shows_the_runners_frames(pytester, restore_profile):
    result = conformance_run(pytester, "--impl=mutant:mask_after_softmax", "-k", "weights_are_distributions",
                             "--dtype=float64", "-x", "--hypothesis-profile=ci", "--tb=long")
    out = result.stdout.str()
    frames = re.findall(r"^\S*conformance/(\w+)\.py:\d+: ", out, re.MULTILINE)
    assert frames and set(frames) <= {"runner", "test_sdpa_invariants"}, frames
    assert "raised in test_sdpa_invariants.py" not in out


def test_causal_case_with_a_bool_mask_is_reproduced_as_called():
    """The runner folds causality into the mask when a mask comes with it; the
    zoo's correct control refuses is_causal=True with a mask, and the reproducer
    makes the folded call, so the control agrees with the oracle."""
    control = sdpa_implementation("control", NaiveSDPA(), SDPA_CAPABILITIES, "correct")
    rng = np.random.default_rng(0)
    case = SDPACase(rng.standard_normal((1, 1, 2, 2)), rng.standard_normal((1, 1, 3, 2)),
                    rng.standard_normal((1, 1, 3, 2)), attend_mask=np.array([[True, True, False]] * 2),
                    causal="upper_left")
    from conformance.calls.sdpa import uses_causal_flag

    call = SDPACallSpec(case, is_causal=uses_causal_flag(Target(control, "sdpa", "float64", "cpu"), case))
    assert not call.is_causal and call.passed_case.causal is None
    snippet = failures.reproducer(call, "mutant:fully_masked_nan", None, {})
    assert "is_causal" not in snippet.split("call = ")[1] and "causal='upper_left'" in snippet
    report = report_sdpa_call(control, call)
    assert not report.shows_failure, report.text()


def test_large_logits_reproducer_makes_the_large_logits_call(pytester, restore_profile):
    conformance_run(pytester, "--impl=mutant:logits_in_input_dtype", "-k", "large_logits", "-x",
                    "--dtype=float16", "--hypothesis-profile=ci", f"--conformance-report={pytester.path / 'cert'}")
    [r] = json.loads((pytester.path / "cert.json").read_text())["results"]
    assert r["outcome"] == "failed" and r["called"] is not None
    assert r["called"]["case"]["scale"] == 1 / 64  # the transformed case, not the drawn one
    outputs = run_snippets({"large": r["reproducer"]}, pytester.path)
    assert "FAILS: " in outputs["large"] and "max |out - oracle| = 0.0\n" not in outputs["large"]


def test_invalid_inputs_reproducer_makes_the_invalid_call(pytester, restore_profile):
    conformance_run(pytester, "--impl=mutant:gqa_indivisible_accepted", "-k", "invalid_inputs_raise", "-x",
                    "--dtype=float64", "--hypothesis-profile=ci", f"--conformance-report={pytester.path / 'cert'}")
    [r] = json.loads((pytester.path / "cert.json").read_text())["results"]
    assert r["outcome"] == "failed"
    assert r["called"]["case"]["K"] == r["called"]["case"]["N"] + 1
    outputs = run_snippets({"invalid": r["reproducer"]}, pytester.path)
    assert "the spec calls this input invalid" in outputs["invalid"]
    assert "FAILS: returned a result" in outputs["invalid"]


# -- saved calls round trip ---------------------------------------------------------


def _mha_case(self_attention: bool = True) -> MHACase:
    import spec

    rng = np.random.default_rng(3)
    params = spec.MHAParams.random(rng, 4, 2)
    x = rng.standard_normal((3, 2, 4))
    other = rng.standard_normal((3, 2, 4))
    return MHACase(params, x, x if self_attention else other, x if self_attention else other,
                   key_padding_mask=np.array([[False, False, True], [True, True, True]]))


def test_saved_call_round_trips_with_self_attention_identity(tmp_path):
    case = _mha_case()
    call = MHACallSpec(case, dropout=0.5, training=True, grad=True, grad_output=upstream_gradient(case),
                       dropout_seed=12, samples=1)
    path = failures.save_case(case, tmp_path / "c.npz", call=call, property="mha_agreement",
                              target="mha-float64-cpu")
    loaded, _ = failures.load_case(path)
    assert loaded.key is loaded.query and loaded.value is loaded.query
    back = failures.load_call(path)
    assert back.case.key is back.case.query and back.attrs() == call.attrs()
    assert np.array_equal(back.grad_output, call.grad_output) and back.dropout_seed == 12


def _kvcache_case():
    from conformance.calls.kvcache import KVCacheCase

    rng = np.random.default_rng(5)
    return KVCacheCase(rng.standard_normal((2, 1, 2, 3)), rng.standard_normal((2, 4, 1, 3)),
                       rng.standard_normal((2, 4, 1, 2)), cache_seqlens=(1, 2), k_new=rng.standard_normal((2, 2, 1, 3)),
                       v_new=rng.standard_normal((2, 2, 1, 2)), causal=True, scale=0.5, page_size=2,
                       page_order=(3, 0, 4, 1, 2))


def test_kvcache_call_leaves_the_case_as_it_was_and_round_trips(tmp_path):
    """The call writes the new keys into the caches in place: into fresh tensors, so the
    case (what a failure saves, what --replay and the reproducer start from) keeps the
    caches as they were before it; the saved call is the one made (contiguous here)."""
    from conformance.calls.kvcache import (
        KVCacheCallSpec,
        report_kvcache_call,
        run_kvcache,
    )

    case = _kvcache_case()
    before = case.k_cache.copy(), case.v_cache.copy()
    target = Target(resolve("varlen-reference"), "kvcache", "float64", "cpu", log=CallLog())
    after = run_kvcache(target, case, paged=False)
    assert not np.array_equal(after.k_cache, before[0])  # the call appended, in place
    assert np.array_equal(case.k_cache, before[0]) and np.array_equal(case.v_cache, before[1])
    [call] = target.log.calls
    path = failures.save_case(case, tmp_path / "kv.npz", call=call, property="kvcache_agreement",
                              target="kvcache-float64-cpu")
    loaded, meta = failures.load_case(path)
    assert meta["kind"] == "kvcache" and loaded.describe() == case.describe()
    failures.validate_saved(loaded, meta, registered_properties())
    back = failures.load_call(path)
    assert isinstance(back, KVCacheCallSpec) and back.paged is False and back.attrs() == call.attrs()
    for name in ("query", "k_cache", "v_cache", "k_new", "v_new"):
        assert np.array_equal(getattr(back.case, name), getattr(case, name)), name
    assert not report_kvcache_call(target.impl, back).shows_failure
    assert report_kvcache_call(resolve("mutant:kvcache_append_at_start"), back).shows_failure


def test_replay_of_a_saved_kvcache_case_reruns_its_property(pytester, tmp_path, restore_profile):
    path = failures.save_case(_kvcache_case(), tmp_path / "kv.npz", property="kvcache_equivalence",
                              target="kvcache-float64-cpu")
    result = conformance_run(pytester, "--impl=mutant:kvcache_append_at_start", f"--replay={path}")
    out = result.stdout.str()
    assert result.ret == 1 and "1 failed" in out, out[-3000:]
    assert "show_kvcache_call(resolve('mutant:kvcache_append_at_start'), call)" in out
    assert "k_cache after the call" in out
    assert conformance_run(pytester, "--impl=varlen-reference", f"--replay={path}").ret == 0


def _cache_options_case():
    """A kvcache case with every cache option: rotary tables, cache_batch_idx over a
    four-row cache, cache_leftpad and num_splits."""
    from conformance.calls.kvcache import KVCacheCase

    rng = np.random.default_rng(7)
    angle = rng.uniform(0, 2 * np.pi, (6, 2))                          # rotary_dim 4: two pairs
    return KVCacheCase(rng.standard_normal((2, 2, 2, 4)), rng.standard_normal((4, 5, 1, 4)),
                       rng.standard_normal((4, 5, 1, 2)), cache_seqlens=(1, 3), k_new=rng.standard_normal((2, 1, 1, 4)),
                       v_new=rng.standard_normal((2, 1, 1, 2)), causal=True, rotary_cos=np.cos(angle),
                       rotary_sin=np.sin(angle), rotary_interleaved=False, cache_batch_idx=(3, 1),
                       cache_leftpad=(0, 2), num_splits=2)


def test_a_kvcache_call_with_the_cache_options_round_trips(tmp_path):
    """Rotary tables, cache_batch_idx, cache_leftpad and num_splits are saved with the case
    and the call, rebuilt by load_call, and the rebuilt call tells the reference (agrees)
    from a mutant of each option (shows a failure)."""
    from conformance.calls.kvcache import KVCacheCallSpec, report_kvcache_call, run_kvcache

    case = _cache_options_case()
    target = Target(resolve("varlen-reference"), "kvcache", "float64", "cpu", log=CallLog())
    run_kvcache(target, case, lse=True)
    [call] = target.log.calls
    path = failures.save_case(case, tmp_path / "kv.npz", call=call, property="kvcache_rotary_agreement",
                              target="kvcache-float64-cpu")
    loaded, meta = failures.load_case(path)
    assert loaded.describe() == case.describe() and "cache_batch_idx=[3, 1] B_cache=4" in loaded.describe()
    failures.validate_saved(loaded, meta, registered_properties())
    back = failures.load_call(path)
    assert isinstance(back, KVCacheCallSpec) and back.lse and back.attrs() == call.attrs()
    assert back.attrs()["kvcache_features"] == {"rotary", "cache_batch_idx", "cache_leftpad", "num_splits", "lse"}
    for name in ("rotary_cos", "rotary_sin"):
        assert np.array_equal(getattr(back.case, name), getattr(case, name)), name
    assert "rotary_interleaved=False" in back.arguments() and "num_splits=2" in back.arguments()
    assert not report_kvcache_call(target.impl, back).shows_failure
    for mutant in ("kvcache_rotary_interleave_swapped", "kvcache_batch_idx_ignored_on_read",
                   "kvcache_leftpad_ignored", "kvcache_split_merge_without_rescale"):
        assert report_kvcache_call(resolve(f"mutant:{mutant}"), back).shows_failure, mutant


def test_varlen_call_round_trips_and_a_bad_saved_case_is_refused(tmp_path):
    from conformance.calls.varlen import VarlenCallSpec, VarlenCase

    rng = np.random.default_rng(6)
    case = VarlenCase(rng.standard_normal((3, 2, 2)), rng.standard_normal((4, 1, 2)), rng.standard_normal((4, 1, 1)),
                      cu_seqlens_q=(0, 0, 3), cu_seqlens_k=(0, 1, 4), causal=True)
    call = VarlenCallSpec(case)
    path = failures.save_case(case, tmp_path / "v.npz", call=call, property="varlen_agreement",
                              target="varlen-float64-cpu")
    back = failures.load_call(path)
    assert back.describe() == call.describe() and np.array_equal(back.case.value, case.value)
    loaded, meta = failures.load_case(path)
    failures.validate_saved(loaded, meta, registered_properties())
    with pytest.raises(ValueError, match="not a valid varlen case"):
        failures.validate_saved(loaded.replace(cu_seqlens_k=(0, 1, 5)), meta, registered_properties())


# -- seeds: the same in every process ---------------------------------------------


def test_upstream_gradient_and_dropout_seed_do_not_depend_on_the_hash_seed():
    code = ("import hashlib, numpy as np\n"
            "from tests.runner.test_replay import _mha_case\n"
            "from conformance.calls.mha import upstream_gradient\n"
            "from conformance.calls.replay import mha_content_seed, content_seed\n"
            "case = _mha_case()\n"
            "print(hashlib.sha1(upstream_gradient(case).tobytes()).hexdigest(), mha_content_seed(case, 'dropout'),"
            " content_seed('dropout', case.query))\n")
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED=seed)
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env=env, check=False)
        assert proc.returncode == 0, proc.stderr
        outs.append(proc.stdout)
    assert outs[0] == outs[1]


@pytest.mark.slow
def test_ci_worst_ratios_of_random_properties_are_the_same_across_runs(tmp_path):
    ratios = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED=seed,
                   ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "failures"))
        pytest_process.run([sys.executable, "-m", "pytest", "conformance", "-p", "no:cacheprovider", "-q",
                        "--impl=handwritten", "--dtype=float32", "--hypothesis-profile=ci",
                        "-k", "dropout_expectation or mha_gradients",
                        f"--conformance-report={tmp_path / seed}"], cwd=ROOT, env=env, capture_output=True,
                       timeout=900, check=True)
        cert = json.loads((tmp_path / f"{seed}.json").read_text())
        ratios.append({r["property"]: r["worst_ratio"] for r in cert["results"] if r["outcome"] == "passed"})
    assert set(ratios[0]) == {"dropout_expectation", "mha_dropout_expectation", "mha_gradients"}
    assert ratios[0] == ratios[1]


# -- call attributes ----------------------------------------------------------------


def test_call_attributes_are_the_declared_ones_and_set_for_real():
    rng = np.random.default_rng(1)
    case = SDPACase(rng.standard_normal((1, 1, 2, 3)), rng.standard_normal((1, 1, 2, 3)),
                    rng.standard_normal((1, 1, 2, 3)))
    sdpa = SDPACallSpec(case, dropout_p=0.25, grad_output=np.ones((1, 1, 2, 3)))
    assert set(sdpa.attrs()) == SDPA_ATTRIBUTES
    assert sdpa.attrs()["grad"] is True and sdpa.attrs()["dropout_p"] == 0.25
    mha = MHACallSpec(_mha_case(), dropout=0.5, training=True, grad=True)
    assert set(mha.attrs()) == MHA_ATTRIBUTES
    attrs = mha.attrs()
    assert (attrs["grad"], attrs["dropout_p"], attrs["training"], attrs["self_attention"]) == (True, 0.5, True, True)
    from conformance.calls.kvcache import KVCACHE_ATTRIBUTES, KVCacheCallSpec
    from conformance.calls.varlen import VARLEN_ATTRIBUTES, VarlenCallSpec, VarlenCase

    varlen = VarlenCase(*(rng.standard_normal((2, 1, 2)) for _ in range(3)), cu_seqlens_q=(0, 2), cu_seqlens_k=(0, 2))
    assert set(VarlenCallSpec(varlen).attrs()) == VARLEN_ATTRIBUTES
    kv = KVCacheCallSpec(_kvcache_case(), paged=False)
    assert set(kv.attrs()) == KVCACHE_ATTRIBUTES and kv.attrs()["kv_paged"] is False


# -- --replay validation ---------------------------------------------------------------


def _saved(tmp_path: Path, **meta) -> Path:
    rng = np.random.default_rng(0)
    case = SDPACase(*(rng.standard_normal((1, 1, 2, 3)) for _ in range(3)))
    meta = {"property": "forward_agreement", "target": "sdpa-float64-cpu", **meta}
    return failures.save_case(case, tmp_path / "case.npz", **meta)


@pytest.mark.parametrize("damage, message", [
    ("truncated", "not a readable .npz file"),
    ("unknown_property", "property='forward_agreemnt' is not a property of this suite; known: "),
    ("inconsistent_shapes", "not a valid sdpa case"),
    ("wrong_target", "target='mha-float64-cpu', but should be sdpa-<dtype>-<device>"),
])
def test_replay_of_a_bad_file_is_a_one_line_usage_error(pytester, tmp_path, restore_profile, damage, message):
    path = _saved(tmp_path, property="forward_agreemnt" if damage == "unknown_property" else "forward_agreement",
                  target="mha-float64-cpu" if damage == "wrong_target" else "sdpa-float64-cpu")
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    if damage == "inconsistent_shapes":
        with np.load(path) as data:
            arrays = dict(data)
        arrays["key"] = arrays["key"][..., :2]  # E = 2 keys against E = 3 queries
        np.savez(path, **arrays)
    result = conformance_run(pytester, "--impl=spec", f"--replay={path}", "--hypothesis-profile=ci")
    err = result.stderr.str()
    assert result.ret == 4 and "INTERNALERROR" not in err + result.stdout.str()
    assert message in err and f"--replay {path}: cannot replay it:" in err
    if damage == "unknown_property":
        assert "forward_agreement" in err.split("known: ")[1]


# -- the Hypothesis database: one key per property x target -----------------------------


def test_a_failure_found_under_dev_is_retried_first_by_the_next_run(tmp_path):
    impls = ROOT / "tests" / "runner" / "impls_for_tests.py"
    env = dict(os.environ, PYTHONPATH=str(ROOT), ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "f"))
    results = []
    for attempt in ("first", "second"):
        pytest_process.run([sys.executable, "-m", "pytest", str(ROOT / "conformance"), "-p", "no:cacheprovider", "-q",
                        f"--impl={impls}:ignores_scale", "--dtype=float64", "-k", "temperature or forward_agreement",
                        f"--conformance-report={tmp_path / attempt}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False)
        results.append({r["property"]: r for r in json.loads((tmp_path / f"{attempt}.json").read_text())["results"]})
    for prop in ("temperature", "forward_agreement"):
        assert results[0][prop]["outcome"] == results[1][prop]["outcome"] == "failed"
        # The saved failure is replayed before any new draw (directed examples, which
        # are deterministic, still run first: a failure among them is found at once).
        assert results[1][prop]["examples"] <= results[0][prop]["examples"], prop
        assert results[1][prop]["examples"] <= 10, prop


def test_database_keys_are_stable_and_distinct():
    from types import SimpleNamespace

    from conformance.harness.runner import _database_key

    impl = SimpleNamespace(name="x")
    session = SimpleNamespace(impl_spec="sdpa", options={})
    key = _database_key(session, "forward_agreement", Target(impl, "sdpa", "float32", "cpu"))
    assert key == _database_key(session, "forward_agreement", Target(impl, "sdpa", "float32", "cpu"))
    others = {_database_key(session, "temperature", Target(impl, "sdpa", "float32", "cpu")),
              _database_key(session, "forward_agreement", Target(impl, "sdpa", "float16", "cpu")),
              _database_key(SimpleNamespace(impl_spec="sdpa-math", options={}), "forward_agreement",
                            Target(impl, "sdpa", "float32", "cpu"))}
    assert key not in others and len(others) == 3
