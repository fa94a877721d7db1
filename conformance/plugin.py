"""pytest plugin of the conformance runner (loaded by the root ``conftest.py``).

Options (group "attention-conformance"): ``--impl`` (required to run
``conformance/``; ``--impl=list`` lists the built-ins; several, comma-separated or
a glob such as ``mutant:*``, are certified side by side), ``--impl-exitfirst``
(stop certifying an implementation at its first failure), ``--impl-option
key=value`` (repeatable: override a declared capability), ``--device``
(cpu, cuda, all), ``--dtype`` (comma-separated subset), ``--conformance-report
PATH`` (writes PATH.json and PATH.md), ``--replay FILE`` (re-run one saved
failing case), ``--example-timeout SECONDS`` and ``--isolate auto|always|never``
(run the implementation in a worker process, ``conformance.isolation.supervisor``).
Hypothesis profiles: ``dev`` (default), ``ci`` (derandomized, CI-sized) and
``thorough``. Every option is checked in ``pytest_configure`` (the report path
included), so a bad one is a one-line usage error before any test runs.

Every test pytest runs has a result on the certificate: one that crashed its
process (xdist reports it) or errored outside the property's code gets a ``failed``
or ``error`` result from its report.

A run of several implementations resolves each once and parametrizes every property
test over each one's targets (ids ``[sdpa-math-sdpa-float32-cpu]``: the implementation's
label first; a run of one keeps ``[sdpa-float32-cpu]``); its certificate is a comparison
(``conformance.reporting.certificate.comparison``).

The options and what the property tests record live on one
``conformance.harness.session.Session`` in ``config.stash``; the records of every
xdist worker reach the controller's session through the reports, and the
certificate is built from them by ``conformance.reporting.certificate``.

The hooks are here (pytest finds them in this module); what they call lives by job:
``conformance.harness.subjects`` reads ``--impl`` and resolves each implementation (isolated or
not), ``conformance.harness.reporting`` writes the header, the environment and the certificate.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from conformance.core.options import NAMESPACED_OPTIONS, pytest_addoption  # noqa: F401 - pytest's hook, found here
from conformance.harness import directed_first, reporting, subjects
from conformance.harness.ordering import LEVEL_ORDER, property_rank
from conformance.harness.results import (  # noqa: F401 - tests read them here
    _NODE_ID,
    _label_of,
    _ResultCollector,
    _target_of,
)
from conformance.harness.session import SESSION_KEY, Session, session_of
from implementations.base import ALL_DTYPES

__all__ = ["PROFILES", "conformance_session"]

PROFILES = {
    "dev": dict(max_examples=30, deadline=None),
    "ci": dict(max_examples=20, deadline=None, derandomize=True, database=None, print_blob=True),
    "thorough": dict(max_examples=300, deadline=None),
}
for _name, _kwargs in PROFILES.items():
    settings.register_profile(
        _name, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much], **_kwargs
    )

_CONFORMANCE_DIR = Path(__file__).resolve().parent
#: Their names here before ``conformance.harness.subjects`` held them (tests import them from here).
_impl_specs, _labels = subjects.impl_specs, subjects.labels


def _parse_options(raw: list[str]) -> dict[str, str]:
    options = {}
    for item in raw:
        if "=" not in item:
            raise pytest.UsageError(
                f"--impl-option {item!r} is not KEY=VALUE; write e.g. --impl-option causal=lower_right"
            )
        key, value = item.split("=", 1)
        options[key.strip()] = value.strip()
    return options


def _dtypes(config: pytest.Config) -> list[str] | None:
    raw = config.getoption("conformance_dtype")
    if raw is None:
        return None
    dtypes = [d.strip() for d in raw.split(",") if d.strip()]
    if not dtypes:
        raise pytest.UsageError(
            f"--dtype={raw!r} names no dtype; give a comma-separated subset of {', '.join(ALL_DTYPES)}, "
            "or leave --dtype out to run every declared dtype"
        )
    bad = [d for d in dtypes if d not in ALL_DTYPES]
    if bad:
        raise pytest.UsageError(
            f"--dtype={raw} contains {bad}; choose from {', '.join(ALL_DTYPES)} (comma-separated)"
        )
    return dtypes


def pytest_configure(config: pytest.Config) -> None:
    global _FROZEN
    if _FROZEN:  # an earlier run in this process froze the heap as it ended (_freeze_heap)
        gc.unfreeze()
        _FROZEN = False
    profile = config.getoption("hypothesis_profile", None) or "dev"
    if profile in PROFILES:
        settings.load_profile(profile)
    session = Session(profile=profile, started=time.time())
    config.stash[SESSION_KEY] = session
    impl_spec = config.getoption("impl")
    if not impl_spec:
        if _selects_conformance(config):
            raise pytest.UsageError(
                "the conformance suite needs --impl=NAME (a registered name, module:attr, "
                "path/to/file.py:attr or mutant:NAME); see `pytest conformance --impl=list`"
            )
        return
    from conformance.isolation import crash_markers
    from implementations import registry

    # SIGTERM and Ctrl-C end the run cleanly and are not counted as crashes.
    config.stash[_RESTORE_SIGNALS] = crash_markers.catch_interrupts()
    if impl_spec == "list":
        print(registry.listing(), flush=True)
        pytest.exit("listed the registered implementations (--impl=list)", returncode=0)
    specs = subjects.impl_specs(impl_spec)
    options = _parse_options(config.getoption("impl_option"))
    timeout = _example_timeout(config)
    session.dtypes = _dtypes(config)
    session.exitfirst = config.getoption("impl_exitfirst")
    session.torch_threads = _set_torch_threads(config.getoption("conformance_torch_threads"))
    report_path = config.getoption("conformance_report")
    if report_path and not hasattr(config, "workerinput"):
        reporting.check_writable(report_path)
    from conformance.core.registry import registered_properties

    properties = registered_properties()
    labels = subjects.labels(specs) if len(specs) > 1 else [""]
    for spec, label in zip(specs, labels, strict=True):
        subject = subjects.resolve_subject(config, spec, label, options, timeout, properties)
        if len(specs) > 1 and subject.isolation is not None:
            subject.isolation.close()  # started again on its first check: one worker at a time
        session.add(subject)
    subjects.write_declaration(config, list(session.subjects.values()))
    if config.getoption("conformance_device") in ("cuda", "all"):
        from conformance.core.devices import pin_cuda_device

        pin_cuda_device(getattr(config, "workerinput", {}).get("workerid"))
    replay_path = config.getoption("conformance_replay")
    if replay_path:
        from conformance.reporting import failures

        try:
            case, meta = failures.load_case(replay_path)
            failures.validate_saved(case, meta, properties)
        except ValueError as err:
            raise pytest.UsageError(f"--replay {replay_path}: cannot replay it: {err}") from None
        session.replay = failures.Replay(meta["property"], meta["target"], case)
    config.pluginmanager.register(_ResultCollector(session), "conformance-results")


def _set_torch_threads(threads: int) -> int:
    """Set torch's intra-op thread count (``--torch-threads``); the count in effect."""
    import torch

    if threads < 0:
        raise pytest.UsageError(f"--torch-threads={threads} must be >= 0 (0 leaves torch's setting)")
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def _example_timeout(config: pytest.Config) -> float:
    timeout = config.getoption("conformance_example_timeout")
    if not timeout >= 0:  # negative or NaN
        raise pytest.UsageError(
            f"--example-timeout={timeout:g} must be >= 0 seconds (0 means no limit)"
        )
    return timeout


@pytest.fixture(scope="session")
def conformance_session(request: pytest.FixtureRequest) -> Session:
    """This run's :class:`~conformance.harness.session.Session` (every property test takes it)."""
    session = session_of(request.config)
    assert session is not None, "conformance.plugin was not configured"
    return session


def _selects_conformance(config: pytest.Config) -> bool:
    for arg in config.args:
        path = Path(str(arg).split("::", 1)[0]).resolve()
        if path == _CONFORMANCE_DIR or _CONFORMANCE_DIR in path.parents:
            return True
    return False


def _targets(config: pytest.Config, level: str) -> list[Any]:
    """Every implementation's targets at ``level``, in --impl order, then device, then dtype."""
    from conformance.core.target import Target

    session = session_of(config)
    timeout = config.getoption("conformance_example_timeout")
    targets = []
    for subject in session.subjects.values():
        dtypes = session.dtypes or list(subject.impl.caps(level).dtypes) or ["float32"]
        targets += [Target(subject.impl, level, dtype, device, timeout, subject.shape_budget,
                           label=subject.label)
                    for device in subjects.devices(config) for dtype in dtypes]
    return targets


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "target" not in metafunc.fixturenames:
        return
    session = session_of(metafunc.config)
    if session is None or session.impl is None:
        raise pytest.UsageError(
            "the conformance suite needs --impl=NAME (a registered name, module:attr, "
            "path/to/file.py:attr or mutant:NAME); see `pytest conformance --impl=list`"
        )
    level = getattr(metafunc.function, "conformance_level", "sdpa")
    targets = _targets(metafunc.config, level)
    metafunc.parametrize("target", targets, ids=[t.test_id for t in targets])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each implementation's properties level by level (:data:`LEVEL_ORDER`), each level's
    in the measured order of kill power per second (``conformance.harness.ordering``); a run of
    several implementations goes one implementation after the other (in --impl order).
    Other tests keep their place, before the first level's properties."""
    session = session_of(config)
    if session is None:
        return
    order = {label: rank for rank, label in enumerate(session.subjects)} if session.compares else {}
    position = {id(item): index for index, item in enumerate(items)}

    def key(item: pytest.Item) -> tuple[int, int, int, int]:
        target = _target_of(item)
        impl_rank = order.get(getattr(target, "label", "") or "", -1) if order else 0
        level = getattr(target, "level", "")
        level_rank = LEVEL_ORDER.get(level, 0)
        prop = getattr(getattr(item, "function", None), "conformance_property", None)
        prop_rank = property_rank(level, prop) if prop is not None and level else -1
        return impl_rank, level_rank, prop_rank, position[id(item)]

    items.sort(key=key)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    """A run that stops at its first failure checks every property's directed cases
    first (``conformance.harness.directed_first``); then pytest's own loop runs the tests."""
    config = session.config
    if session.testsfailed or config.option.collectonly or not directed_first.enabled(config):
        return
    directed_first.run(session.items, config)


def pytest_report_header(config: pytest.Config) -> list[str]:
    return reporting.header_lines(config)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]):
    outcome = yield
    report = outcome.get_result()
    _as_report(item, call, report)
    prop = getattr(getattr(item, "function", None), "conformance_property", None)
    session = session_of(item.config)
    if prop is None or session is None:
        return
    record = session.current
    if record is None or record.property != prop:
        return
    if report.when == "call" or (report.when == "setup" and report.skipped):
        if report.failed and record.outcome != "failed":
            record.outcome = "error"
            record.message = str(call.excinfo.value)[:4000] if call.excinfo else ""
        if report.skipped and record.outcome == "passed":
            record.outcome = "skipped"
            if call.excinfo is not None:
                record.reason = str(call.excinfo.value.msg if hasattr(call.excinfo.value, "msg") else call.excinfo.value)
        if record.outcome == "xfailed" and report.passed:
            report.outcome = "skipped"
            report.wasxfail = record.xfail_reason
        result = record.as_dict()
        if session.compares:
            result["implementation"] = item.callspec.params["target"].label  # type: ignore[attr-defined]
        report.user_properties.append(("conformance", result))
        session.current = None


def _as_report(item: pytest.Item, call: pytest.CallInfo[Any], report: pytest.TestReport) -> None:
    """A property's failure reads as a report: its message (mismatch, probable cause, case,
    saved file, replay line, reproducer) and where the property raised it, without the
    runner's own frames, which pytest would print first (about 100 lines); ``--tb=long``
    (or any style other than the default) shows the whole traceback."""
    from conformance.core.compare import PropertyFailure

    if (report.when != "call" or not report.failed or call.excinfo is None
            or not isinstance(call.excinfo.value, PropertyFailure)
            or item.config.getoption("tbstyle", "auto") != "auto"):
        return
    error = call.excinfo.value
    # Where the property raised it: its own module's frame (the checks it calls are below).
    entries = [e for e in call.excinfo.traceback if Path(str(e.path)).name.startswith("test_")]
    entry = (entries or list(call.excinfo.traceback))[-1]
    where = f"{Path(str(entry.path)).name}:{entry.lineno + 1}"
    text = "\n".join([str(error), *getattr(error, "__notes__", ())])
    report.longrepr = f"{text}\n\n(raised in {where}; the runner's frames: --tb=long)"


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    reporting.write_certificate(terminalreporter, config)
    for line in slow_first_calls(session_of(config)):
        terminalreporter.write_line(line)


def slow_first_calls(session: Session | None) -> list[str]:
    """A line for each first call into an implementation (of a dtype, on a device; its
    first probe call) in this process that took longer than --example-timeout and passed
    only because a first call may compile (``implementations.guard.COMPILE_FACTOR``)."""
    from implementations import guard

    if session is None or not session.impl_spec:
        return []
    names = {id(s.impl): s.impl_spec for s in (session.subjects.values() or [session]) if s.impl is not None}
    lines = []
    for key, seconds in guard.slow_first_calls().items():
        if key[0] == "probe":
            what = f"the first probe call of {key[1]}"
        elif key[0] in names:
            what = f"the first {key[1]} call on {key[2]} of {names[key[0]]}"
        else:
            continue
        lines.append(f"{what} took {seconds:.1f} s: compile time allowed "
                     f"(up to {guard.COMPILE_FACTOR:g} x --example-timeout)")
    return lines


_RESTORE_SIGNALS = pytest.StashKey[Any]()


def pytest_unconfigure(config: pytest.Config) -> None:
    restore_signals = config.stash.get(_RESTORE_SIGNALS, None)
    try:
        _end_session(config)
    finally:
        if restore_signals is not None:  # after the marker is gone: no window without a handler
            del config.stash[_RESTORE_SIGNALS]
            restore_signals()


def _end_session(config: pytest.Config) -> None:
    session = session_of(config)
    if session is None or not session.impl_spec:
        return
    from conformance.isolation import supervisor as isolation

    for subject in session.subjects.values() or [session]:
        if subject.isolation is not None:
            subject.isolation.close()
    import sys

    if "conformance.sharded.group" in sys.modules:  # the sharded level's worker groups, if any ran
        sys.modules["conformance.sharded.group"].close_all()
    isolation.forget_running()
    _freeze_heap()


def _freeze_heap() -> None:
    """pytest's clean-up after ``pytest_unconfigure`` runs a full garbage collection five
    times over everything torch, NumPy and Hypothesis allocated (to surface exceptions
    raised in ``__del__``): half a second of a run that kills a mutant in three (two
    cores, benchmarks/time_to_kill.py). The certificate is written by then, so the heap
    is frozen (those collections skip it). Not in a run nested in another pytest run (a
    pytester run inside a test: the outer process goes on); a later run in the same
    process unfreezes it first (pytest_configure)."""
    global _FROZEN
    if _nested_pytest_run():
        return
    gc.freeze()
    _FROZEN = True


_FROZEN = False
_WRAP_SESSION = os.path.join("_pytest", "main.py")


def _nested_pytest_run() -> bool:
    """Whether this hook runs inside more than one pytest session (``wrap_session``
    frames on the stack), or inside another pytest's test (PYTEST_CURRENT_TEST)."""
    if os.environ.get("PYTEST_CURRENT_TEST"):
        return True
    sessions = 0
    frame = sys._getframe()
    while frame is not None:
        code = frame.f_code
        sessions += code.co_name == "wrap_session" and code.co_filename.endswith(_WRAP_SESSION)
        frame = frame.f_back
    return sessions > 1
