"""pytest plugin of the conformance runner (loaded by the root ``conftest.py``).

Options (group "attention-conformance"): ``--impl`` (required to run
``conformance/``; ``--impl=list`` lists the built-ins), ``--impl-option
key=value`` (repeatable: override a declared capability), ``--device``
(cpu, cuda, all), ``--dtype`` (comma-separated subset), ``--conformance-report
PATH`` (writes PATH.json and PATH.md), ``--replay FILE`` (re-run one saved
failing case), ``--example-timeout SECONDS`` and ``--isolate auto|always|never``
(run the implementation in a worker process, ``conformance.isolation``).
Hypothesis profiles: ``dev`` (default), ``ci`` (derandomized, CI-sized) and
``thorough``. Every option is checked in ``pytest_configure`` (the report path
included), so a bad one is a one-line usage error before any test runs.

Every test pytest runs has a result on the certificate: one that crashed its
process (xdist reports it) or errored outside the property's code gets a ``failed``
or ``error`` result from its report.

The options and what the property tests record live on one
``conformance.session.Session`` in ``config.stash``; the records of every
xdist worker reach the controller's session through the reports, and the
certificate is built from them by ``conformance.certificate``.
"""

from __future__ import annotations

import os
import platform
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from conformance import certificate
from conformance.session import SESSION_KEY, Session, session_of
from implementations.base import ALL_DTYPES, ImplementationError

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


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attention-conformance", "attention conformance suite")
    group.addoption("--impl", default=None, metavar="NAME",
                    help="implementation to certify: a registered name (see --impl=list), "
                         "an entry point, module:attr, path/to/file.py:attr or mutant:NAME")
    group.addoption("--impl-option", action="append", default=[], metavar="KEY=VALUE",
                    help="override a declared capability, e.g. causal=lower_right, fully_masked=nan")
    group.addoption("--xfail-file", default=None, metavar="PATH",
                    help="expected failures of the implementation (TOML, the schema of "
                         "implementations/xfail/*.toml), added to any it declares")
    group.addoption("--device", default="cpu", choices=("cpu", "cuda", "all"),
                    help="device(s) to certify on (cuda is skipped with a reason when absent)")
    group.addoption("--dtype", default=None, metavar="DTYPES",
                    help="comma-separated subset of float64,float32,float16,bfloat16 "
                         "(default: what the implementation declares)")
    group.addoption("--conformance-report", default=None, metavar="PATH",
                    help="write the certificate to PATH.json and PATH.md")
    group.addoption("--replay", default=None, metavar="FILE",
                    help="re-run the one failing case saved in FILE (.npz)")
    group.addoption("--example-timeout", default=60.0, type=float, metavar="SECONDS",
                    help="fail a property when one call takes longer than this (0: no limit)")
    group.addoption("--shape-budget", default=None, type=int, metavar="N",
                    help="at most N distinct shapes per property (JIT implementations compile once "
                         "per shape); default 8 when the implementation declares jit; 0: no budget")
    group.addoption("--isolate", default="auto", choices=("auto", "always", "never"),
                    help="run the implementation in a worker process that a crash or hang cannot "
                         "take down (auto: only an implementation an earlier run in this "
                         "checkout saw crash; it costs ~5 s to start and a few ms an example)")


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
    raw = config.getoption("dtype")
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
    from implementations import registry

    if impl_spec == "list":
        print(registry.listing(), flush=True)
        pytest.exit("listed the registered implementations (--impl=list)", returncode=0)
    options = _parse_options(config.getoption("impl_option"))
    timeout = _example_timeout(config)
    session.dtypes = _dtypes(config)
    report_path = config.getoption("conformance_report")
    if report_path and not hasattr(config, "workerinput"):
        _check_writable(report_path)
    session.impl = _with_xfail_file(config, _resolve(config, session, impl_spec, options, timeout))
    session.impl_spec, session.options = impl_spec, options
    impl = session.impl
    from conformance.strategies.shape_budget import shape_budget_for

    try:
        session.shape_budget = shape_budget_for(impl.capabilities, config.getoption("shape_budget"))
    except Exception as err:  # noqa: BLE001 - the strategies' InvalidArgument names the rule
        raise pytest.UsageError(str(err)) from None
    if config.getoption("device") in ("cuda", "all"):
        from conformance.devices import pin_cuda_device

        pin_cuda_device(getattr(config, "workerinput", {}).get("workerid"))
    from conformance.expectations import entry_errors
    from conformance.runner import registered_properties

    properties = registered_properties()
    errors = entry_errors(impl.expected_failures, properties)
    if errors:
        raise pytest.UsageError(f"--impl={impl_spec}: {len(errors)} invalid expected failure(s): "
                                + "; ".join(errors))
    replay_path = config.getoption("replay")
    if replay_path:
        from conformance import failures

        try:
            case, meta = failures.load_case(replay_path)
            failures.validate_saved(case, meta, properties)
        except ValueError as err:
            raise pytest.UsageError(f"--replay {replay_path}: cannot replay it: {err}") from None
        session.replay = failures.Replay(meta["property"], meta["target"], case)
    config.pluginmanager.register(_ResultCollector(session), "conformance-results")


def _with_xfail_file(config: pytest.Config, impl: Any) -> Any:
    """``impl`` with the entries of ``--xfail-file`` added (checked against the
    properties with the implementation's own, below)."""
    path = config.getoption("xfail_file")
    if not path:
        return impl
    from implementations import registry

    try:
        return registry.with_expected_failures(impl, registry.load_expected_failures_file(path))
    except ImplementationError as err:
        raise pytest.UsageError(str(err)) from None


def _example_timeout(config: pytest.Config) -> float:
    timeout = config.getoption("example_timeout")
    if not timeout >= 0:  # negative or NaN
        raise pytest.UsageError(
            f"--example-timeout={timeout:g} must be >= 0 seconds (0 means no limit)"
        )
    return timeout


def _check_writable(path: str) -> None:
    """Fail now, not after the run, when ``path``.json / .md cannot be written."""
    base = Path(path)
    current = base.parent
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        for current in (Path(f"{base}.json"), Path(f"{base}.md")):
            if current.is_dir():
                raise IsADirectoryError(f"{current} is a directory")
            if current.exists() and not os.access(current, os.W_OK):
                raise PermissionError(f"{current} is not writable")
        current = base.parent
        with tempfile.NamedTemporaryFile(dir=base.parent, prefix=".conformance-report-check-"):
            pass
    except OSError as err:
        raise pytest.UsageError(
            f"--conformance-report={path}: cannot write the certificate there ({current}: "
            f"{type(err).__name__}: {err}); give a path in a writable folder, e.g. "
            "--conformance-report=reports/certificate"
        ) from None


def _resolve(config: pytest.Config, session: Session, impl_spec: str, options: dict[str, str],
             timeout: float) -> Any:
    """The implementation, resolved here or, isolated, in a worker process."""
    from conformance import isolation

    isolate, session.isolate_reason = isolation.choose(config.getoption("isolate"), impl_spec)
    isolation.mark_running(impl_spec)  # removed at a clean end, below or in pytest_unconfigure
    try:
        return _resolve_in(config, session, impl_spec, options, timeout, isolate)
    except BaseException:
        isolation.forget_running()
        raise


def _resolve_in(config: pytest.Config, session: Session, impl_spec: str, options: dict[str, str],
                timeout: float, isolate: bool) -> Any:
    from conformance import isolation
    from implementations import registry

    if not isolate:
        try:
            return registry.resolve(impl_spec, options or None, timeout=timeout)
        except ImplementationError as err:
            raise pytest.UsageError(str(err)) from None
    worker = isolation.Worker(impl_spec, options, timeout)
    try:
        impl = worker.start()
    except ImplementationError as err:
        raise pytest.UsageError(str(err)) from None
    except isolation.WorkerDied as died:
        worker.close()
        isolation.record_crash(impl_spec, f"{died.how} while resolving")
        log = f"; its last output:\n{died.log}" if died.log else ""
        raise pytest.UsageError(
            f"--impl={impl_spec}: the isolated worker process died while importing and probing "
            f"the implementation ({died.how}): its code ends the process{log}"
        ) from None
    except (isolation.WorkerTimedOut, RuntimeError) as err:
        worker.close()
        raise pytest.UsageError(f"--impl={impl_spec}: resolving it in the isolated worker failed: {err}") from None
    if getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput"):
        worker.close()  # the xdist controller runs no test; each xdist worker starts its own
    session.isolation = worker
    return impl


@pytest.fixture(scope="session")
def conformance_session(request: pytest.FixtureRequest) -> Session:
    """This run's :class:`~conformance.session.Session` (every property test takes it)."""
    session = session_of(request.config)
    assert session is not None, "conformance.plugin was not configured"
    return session


def _selects_conformance(config: pytest.Config) -> bool:
    for arg in config.args:
        path = Path(str(arg).split("::", 1)[0]).resolve()
        if path == _CONFORMANCE_DIR or _CONFORMANCE_DIR in path.parents:
            return True
    return False


def _devices(config: pytest.Config) -> list[str]:
    device = config.getoption("device")
    return ["cpu", "cuda"] if device == "all" else [device]


def _targets(config: pytest.Config, level: str) -> list[Any]:
    from conformance.runner import Target

    session = session_of(config)
    caps = session.impl.caps(level)
    dtypes = session.dtypes or list(caps.dtypes) or ["float32"]
    timeout = config.getoption("example_timeout")
    return [Target(session.impl, level, dtype, device, timeout, session.shape_budget)
            for device in _devices(config) for dtype in dtypes]


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
    metafunc.parametrize("target", targets, ids=[t.id for t in targets])


def pytest_report_header(config: pytest.Config) -> list[str]:
    session = session_of(config)
    if session is None or session.impl is None:
        return []
    import torch

    impl = session.impl
    lines = [
        f"attention-conformance: impl={session.impl_spec} ({impl.name} {impl.version}) "
        f"options={session.options or '{}'} profile={session.profile}",
        f"  devices={_devices(config)} dtypes={session.dtypes or 'declared'} "
        f"torch={torch.__version__} cuda={torch.version.cuda} "
        f"cuda_available={torch.cuda.is_available()} triton={_triton_version()} "
        f"python={platform.python_version()}",
    ]
    caps = impl.capabilities
    lines.append(
        f"  declared: causal={caps.causal} fully_masked={caps.fully_masked_text()} dtypes={caps.dtypes} "
        f"devices={caps.devices} autograd={caps.autograd} gqa={caps.gqa}"
    )
    lines += [f"  probe note: {note}" for note in caps.probe_notes]
    isolated = "in a worker process" if session.isolation is not None else "in-process"
    lines.append(f"  implementation runs {isolated} ({session.isolate_reason})")
    return lines


def _triton_version() -> str:
    try:
        import importlib.metadata as md

        return md.version("triton")
    except Exception:  # noqa: BLE001 - absent is a fine answer
        return "absent"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]):
    outcome = yield
    report = outcome.get_result()
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
        report.user_properties.append(("conformance", record.as_dict()))
        session.current = None


_NODE_ID = re.compile(r"::test_(?P<property>\w+)\[(?P<level>[a-z]+)-(?P<dtype>\w+)-(?P<device>\w+)\]$")


class _ResultCollector:
    """Gathers the records attached to test reports into the session: under
    xdist the controller receives every worker's reports here. A property test
    whose report carries no record (its process crashed, a fixture failed, a
    marker skipped it) gets one made from the report, so that the certificate
    counts every test pytest counts."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        from conformance import isolation

        isolation.mark_running(self.session.impl_spec, item.nodeid)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        recorded = False
        for key, value in getattr(report, "user_properties", ()):
            if key == "conformance":
                self.session.results.append(value)
                recorded = True
        if recorded:
            self.session.recorded.add(report.nodeid)
        elif report.nodeid not in self.session.recorded and (
                report.failed or (report.skipped and report.when == "setup")):
            result = self._result_from_report(report)
            if result is not None:
                self.session.results.append(result)
                self.session.recorded.add(report.nodeid)

    def _result_from_report(self, report: pytest.TestReport) -> dict[str, Any] | None:
        from conformance import isolation
        from conformance.runner import Record, registered_properties

        m = _NODE_ID.search(report.nodeid)
        if m is None or m["property"] not in registered_properties():
            return None
        record = Record(m["property"], m["level"], m["dtype"], m["device"])
        text = str(getattr(report, "longreprtext", "") or report.longrepr or "").strip()
        if report.skipped:
            record.outcome = "skipped"
            record.reason = text.rsplit("Skipped: ", 1)[-1] if "Skipped: " in text else text
        elif "crashed while running" in text:
            record.outcome = "failed"
            record.message = (
                f"{text.splitlines()[-1]}: the test process died (os._exit, abort or a segfault in "
                "the implementation?) before the property could save the case; rerun with "
                "--isolate=always to run the implementation in a worker process that survives it"
            )
            isolation.record_crash(self.session.impl_spec, f"a test process died during {report.nodeid}")
        else:
            record.outcome = "failed" if report.when == "call" else "error"
            record.message = f"{report.when} of the test failed outside the property: " + text[-2000:]
        return record.as_dict()


def _environment(config: pytest.Config) -> dict[str, Any]:
    import torch

    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cuda_device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "devices": _devices(config),
    }


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    session = session_of(config)
    if session is None or session.impl is None or not session.results:
        return
    cert = certificate.certificate(
        implementation=certificate.implementation_entry(session.impl, session.impl_spec, session.options),
        environment=_environment(config),
        profile=session.profile,
        seconds=time.time() - session.started,
        results=session.results,
    )
    tr = terminalreporter
    tr.write_sep("=", certificate.title(cert))
    for line in certificate.terminal_lines(cert):
        tr.write_line(line)
    path = config.getoption("conformance_report")
    if path:
        try:
            json_path, md_path = certificate.write(cert, path)
        except OSError as err:
            tr.write_line(f"certificate NOT written to {path}.json/.md: {type(err).__name__}: {err}", red=True)
        else:
            tr.write_line(f"certificate written to {json_path} and {md_path}")


def pytest_unconfigure(config: pytest.Config) -> None:
    session = session_of(config)
    if session is None or not session.impl_spec:
        return
    from conformance import isolation

    if session.isolation is not None:
        session.isolation.close()
    isolation.forget_running()
