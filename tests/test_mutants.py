"""The conformance suite fails every mutant of the bug zoo, names its bug, and passes the
correct built-ins.

Each test runs the runner as a subprocess under the ``ci`` profile with
``--conformance-report PATH`` and reads ``PATH.json`` (docs/CONTRACTS.md). The zoo is
certified a chunk of mutants at a time, in one pytest process per chunk
(``--impl=mutant:a,mutant:b,... --impl-exitfirst``: start-up is paid once, and each
mutant stops at its own first failure, as ``-x`` stops a run of one), and each mutant's
certificate is read from the comparison JSON. Slow: a few minutes for the zoo, up to
5 minutes for a correct implementation (the Triton and JAX built-ins one dtype per
process); ``-n 2`` runs the chunks side by side.

One run per chunk asks three things of each mutant: some property kills it, not by a
crash, and, where its record has an ``expected_cause``, the diagnosis names that cause
first on its first failure (docs/DIAGNOSIS.md). So that the first failure is the level's
own: the mutants of the SDPA, MHA and sharded levels run without the FlashAttention
levels' files and with ``derived_flash=false`` (a flash level derived from an SDPA
mutant, collected first, would fail first on what is an SDPA bug, and its variant is an
SDPA one); the mutants of the flash, varlen and kvcache levels run in chunks of their
own with those files. A kill by a subset of the suite is a kill by the whole of it.

Every mutant is also run with its record's ``expected_property`` alone (a ``-k`` term
per mutant, ``test_<property>[mutant:NAME-``: that property must kill it on its own, so
no property is only ever a back-up for another). A mutant whose expected property is
not a property of the suite fails, naming it.

A mutant that survives is a missing strategy or property in the suite, not a reason
to weaken the mutant: the failure message names the property expected to catch it.
A correct implementation's certificate also has no diagnosis (no ``causes``).
``pytest conformance --impl=mutant:NAME -x`` certifies one mutant alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from implementations.mutants import MUTANTS
from implementations.mutants.controls import CONTROLS
from implementations.mutants.mha.learner_mutants import LEARNER_CONTROLS
from implementations.mutants.sdpa.contract_mutants import CONTRACT_CONTROLS
from spec.variants import FLASH_FAMILY
from tests import pytest_process

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
#: Correct built-ins (registry names) and the zoo's own correct bases (module:attr).
CORRECT = ["spec", "handwritten", "sdpa", "sdpa-math", "torch-mha", "flash-ref", "triton", "jax", "varlen-reference",
           "ring", "ulysses", "torch-cp"] + [
    f"implementations.mutants.controls:{name}" for name in CONTROLS
] + [  # bare functions with a declared non-default convention (--impl-option)
    f"implementations.mutants.sdpa.contract_mutants:{name}" for name in CONTRACT_CONTROLS
] + [  # hand-written modules, recognised through the learner level with no adapter
    f"implementations.mutants.mha.learner_mutants:{name}" for name in LEARNER_CONTROLS
]
TIMEOUT_S = 1800
def _family(name: str) -> bool:
    """A mutant of the FlashAttention levels (run with those levels' test files collected)."""
    return MUTANTS[name].level in FLASH_FAMILY


#: The zoo in chunks, one pytest process each (a few, so that ``-n 2`` can share them
#: out): the SDPA, MHA and sharded mutants, the FlashAttention levels' mutants with their
#: files, and the Triton mutants (minutes each under the interpreter) apart.
_PLAIN = sorted(n for n in MUTANTS if not n.startswith("triton_") and not _family(n))
_FAMILY = sorted(n for n in MUTANTS if not n.startswith("triton_") and _family(n))
_TRITON = sorted(n for n in MUTANTS if n.startswith("triton_"))
CHUNKS = {name: names for name, names in (
    [(f"zoo{i}", _PLAIN[i::3]) for i in range(3)]
    + [(f"family{i}", _FAMILY[i::3]) for i in range(3)]
    + [("triton", [n for n in _TRITON if not _family(n)]), ("triton_flash", [n for n in _TRITON if _family(n)])]
) if names}
#: Mutants whose bug two variants explain equally on every case the diagnosis can
#: gather: the honest verdict is "unknown — closest, not confirmed" listing both.
#: logits_in_input_dtype computes q·kᵀ in float16; low_precision_accumulation does that
#: too (and sums in float16, which the tolerance rule cannot see on these cases).
#: The expected-property runs select a few tests per mutant (``-k``): one process per
#: kind of mutant is enough.
ALONE_CHUNKS = {name: names for name, names in (("zoo", _PLAIN), ("family", _FAMILY), ("triton", _TRITON)) if names}
#: (logits_in_input_dtype was one until its directed case shrank to E = 1: one product,
#: no float16 sum, and float16_overflow alone explains it.)
HONEST_TIES: dict[str, set[str]] = {}
#: Built-ins whose ``ci`` certification takes minutes (the Triton interpreter; JAX's
#: compilations) are certified one dtype per process, so ``-n 2`` shares them out.
BY_DTYPE = {"triton": ("float64", "float32", "float16", "bfloat16"),
            "jax": ("float64", "float32", "float16", "bfloat16")}


def registered_properties() -> set[str]:
    """Property ids the suite defines (the runner's registry: every ``conformance/test_*.py``)."""
    from conformance.core.registry import registered_properties as registry

    return set(registry())


def _require_expected_properties(names: list[str]) -> None:
    known = registered_properties()
    unknown = [f"{name}'s expected property {MUTANTS[name].expected_property!r}" for name in names
               if MUTANTS[name].expected_property not in known]
    if unknown:
        pytest.fail("not a property of the suite: " + "; ".join(unknown))


def run_conformance(impls: list[str], workdir: Path, *, stop_at_first_failure: bool,
                    keyword: str | None = None, dtype: str | None = None,
                    options: tuple[str, ...] = ()) -> tuple[int, dict, str]:
    """Run the suite on ``impls`` in ``workdir`` (only the tests ``keyword`` selects, as
    ``-k``; ``options`` added to the command line); (exit code, JSON report, the whole
    output). Several implementations give a comparison report;
    ``stop_at_first_failure`` stops each at its own first failure."""
    report = workdir / "report"
    cmd = [
        sys.executable, "-m", "pytest", str(ROOT / "conformance"), "--impl=" + ",".join(impls),
        "--hypothesis-profile=ci", "-q", "-p", "no:cacheprovider",
        "--conformance-report", str(report), *options,
    ]
    if stop_at_first_failure:
        cmd.append("--impl-exitfirst")
    if keyword is not None:
        cmd += ["-k", keyword]
    if dtype is not None:
        cmd.append("--dtype=" + dtype)
    # The outer pytest (maybe an xdist worker) must not leak its settings into the run.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    env["ATTENTION_CONFORMANCE_FAILURES"] = str(workdir / "failures")
    proc = pytest_process.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    output = proc.stdout + proc.stderr
    json_path = report.with_suffix(".json")
    if not json_path.exists():
        pytest.fail(f"no report {json_path} written (exit code {proc.returncode}):\n{output[-4000:]}")
    return proc.returncode, json.loads(json_path.read_text()), output


def level_options(*, family: bool) -> tuple[str, ...]:
    """The options of a run whose first failure must be its own level's: no derived flash
    level, and, unless ``family`` (code of the FlashAttention levels), none of those levels'
    test files (the module docstring)."""
    ignored = () if family else ("--ignore", str(ROOT / "conformance" / "test_flash.py"),
                                 "--ignore", str(ROOT / "conformance" / "test_varlen.py"))
    return ("--impl-option", "derived_flash=false", *ignored)


def zoo_options(names: list[str]) -> tuple[str, ...]:
    """:func:`level_options` of a run of the mutants ``names``."""
    return level_options(family=any(_family(n) for n in names))


def certificates_by_mutant(report: dict, names: list[str]) -> dict[str, dict]:
    """Each mutant's certificate in a report (a comparison, or one mutant's certificate)."""
    certificates = report["certificates"] if "comparison" in report else [report]
    found = {c["implementation"]["spec"].removeprefix("mutant:"): c for c in certificates}
    missing = sorted(set(names) - set(found))
    assert not missing, f"no certificate for {missing}"
    return found


def _chunk(chunk: str, chunks: dict[str, list[str]] = CHUNKS) -> list[str]:
    names = chunks[chunk]
    _require_expected_properties(names)
    if chunk.startswith("triton"):
        _require_builtin("triton")
    return names


@pytest.mark.parametrize("chunk", sorted(CHUNKS))
def test_every_mutant_is_killed_and_its_bug_named(chunk, tmp_path):
    names = _chunk(chunk)
    code, report, output = run_conformance([f"mutant:{n}" for n in names], tmp_path,
                                           stop_at_first_failure=True, options=zoo_options(names))
    assert code == 1, f"exit code {code} (1: some test failed, as every mutant must):\n{output[-4000:]}"
    survivors, misnamed = [], []
    for name, cert in certificates_by_mutant(report, names).items():
        mutant = MUTANTS[name]
        failed = [r for r in cert["results"] if r["outcome"] == "failed"]
        if not failed:
            errors = [f"{r['property']}[{r['dtype']}]: {r['message'][:200]}"
                      for r in cert["results"] if r["outcome"] == "error"]
            survivors.append(f"mutant {name} survived the ci profile: {mutant.bug}. Expected "
                             f"{mutant.expected_property} to catch it on {mutant.smallest_case}."
                             + (f" Errors: {errors}" if errors else ""))
        elif name not in RAISES_BY_DESIGN and RAISED in failed[0].get("message", ""):
            survivors.append(f"mutant {name} was killed by a crash, not by its bug: {failed[0]['property']}"
                             f"[{failed[0]['dtype']}]: {failed[0]['message'][:300]}")
        elif mutant.expected_cause:
            misnamed += diagnosis_problems(name, cert, failed[0], output)
    assert not survivors + misnamed, "\n".join(survivors + misnamed) + f"\n{output[-4000:]}"


def diagnosis_problems(name: str, cert: dict, first: dict, output: str) -> list[str]:
    """What is wrong with the diagnosis of a mutant's first failure ``first`` (its record's
    ``expected_cause`` named first and confirmed, on the certificate and in the output)."""
    mutant = MUTANTS[name]
    causes = first["causes"]
    named = [c["variant"] for c in causes]
    if name in HONEST_TIES:
        closest = {c["variant"] for c in causes if not c.get("confirmed", True)}
        if any(c.get("confirmed", True) for c in causes) or not HONEST_TIES[name] <= closest:
            return [f"{name}: expected unknown with {sorted(HONEST_TIES[name])} closest, got {causes}"]
        return []
    if not named or named[0] != mutant.expected_cause or causes[0].get("confirmed") is False:
        return [f"{name} ({mutant.bug}) failed {first['property']}[{first['dtype']}]; the diagnosis "
                f"named {named or 'nothing'}, expected {mutant.expected_cause} first"]
    if not cert["causes"] or cert["causes"][0]["variant"] != mutant.expected_cause:
        return [f"{name}: the certificate's causes {cert['causes']} do not start with {mutant.expected_cause}"]
    if f"probable cause: {mutant.expected_cause} — " not in output:
        return [f"{name}: no 'probable cause: {mutant.expected_cause} — ' line in the output"]
    return []


#: What the runner says of a call that raised on a case the implementation claims.
RAISED = "raised on a case it claims to support"
#: Mutants whose bug is to raise (an in-place write into a leaf that requires grad): a
#: crash kills any other mutant only by accident (a signature out of step with its base).
RAISES_BY_DESIGN = {"query_scaled_in_place"}


def expected_keyword(names: list[str]) -> str:
    """``-k`` selecting, for each mutant, its expected property's tests alone."""
    return " or ".join(f"test_{MUTANTS[n].expected_property}[mutant:{n}-" for n in names)


@pytest.mark.parametrize("chunk", sorted(ALONE_CHUNKS))
def test_expected_property_alone_kills_each_mutant(chunk, tmp_path):
    names = _chunk(chunk, ALONE_CHUNKS)
    code, report, output = run_conformance([f"mutant:{n}" for n in names], tmp_path, stop_at_first_failure=True,
                                           keyword=expected_keyword(names), options=zoo_options(names))
    assert code == 1, f"exit code {code} (1: some test failed, as every mutant must):\n{output[-4000:]}"
    problems = []
    for name, cert in certificates_by_mutant(report, names).items():
        mutant = MUTANTS[name]
        ran = {r["property"] for r in cert["results"]}
        if ran != {mutant.expected_property}:
            problems.append(f"{name}: -k selected {sorted(ran)}, not {mutant.expected_property} alone")
        elif not any(r["outcome"] == "failed" for r in cert["results"]):
            problems.append(f"{mutant.expected_property} alone does not kill mutant {name} under ci: "
                            f"{mutant.bug}. Its smallest case is {mutant.smallest_case}.")
    assert not problems, "\n".join(problems) + f"\n{output[-4000:]}"


def _require_builtin(name: str) -> None:
    """Skip, with the reason, where the built-in cannot run (the runner would skip it)."""
    if name == "triton":
        found = importlib.util.find_spec("triton")
        if found is None or found.origin is None:  # no origin: a folder named triton, not the package
            pytest.skip("triton is not installed (pip install -e '.[triton]')")
    from implementations.registry import resolve

    impl = resolve(name)
    if not impl.available:
        pytest.skip(f"{name} unavailable: {impl.unavailable_reason}")


#: Certified only in the release tier (``pytest --release-tier``, docs/SPEED.md): the
#: dtypes of the slow built-ins (the Triton interpreter, JAX's compilations) beyond the
#: one the test command certifies each in. float32 exercises every path of both; the
#: other dtypes are their tolerances and 16-bit emulation, a minute or more each.
RELEASE_ONLY = {("triton", "float64"), ("triton", "float16"), ("triton", "bfloat16"),
                ("jax", "float64"), ("jax", "float16"), ("jax", "bfloat16")}


def _correct_params() -> list:
    return [pytest.param(impl, dtype, marks=[pytest.mark.release] if (impl, dtype) in RELEASE_ONLY else [])
            for impl in CORRECT for dtype in BY_DTYPE.get(impl, [None])]


@pytest.mark.parametrize("impl,dtype", _correct_params(), ids=lambda v: v if v is not None else "declared")
def test_correct_implementation_passes(impl, dtype, tmp_path):
    if impl in ("triton", "jax"):
        _require_builtin(impl)
    code, report, output = run_conformance([impl], tmp_path, stop_at_first_failure=False, dtype=dtype)
    bad = [
        f"{r['property']}[{r['level']}-{r['dtype']}]: {r['outcome']} {r.get('message', '')[:300]}"
        for r in report["results"] if r["outcome"] in ("failed", "error", "stale-xfail")
    ]
    assert code == 0 and not bad, f"{impl} should pass (exit code {code}):\n" + "\n".join(bad) + f"\n{output[-4000:]}"
    diagnosed = [f"{r['property']}[{r['level']}-{r['dtype']}]: {r['causes']}" for r in report["results"] if r.get("causes")]
    assert report["causes"] == [] and not diagnosed, f"{impl} was given a diagnosis:\n" + "\n".join(diagnosed)
