"""pytest plugin of the conformance runner (loaded by the root ``conftest.py``).

Options (group "attention-conformance"): ``--impl`` (required to run
``conformance/``; ``--impl=list`` lists the built-ins), ``--impl-option
key=value`` (repeatable: override a declared capability), ``--device``
(cpu, cuda, all), ``--dtype`` (comma-separated subset), ``--conformance-report
PATH`` (writes PATH.json and PATH.md), ``--replay FILE`` (re-run one saved
failing case) and ``--example-timeout SECONDS``. Hypothesis profiles: ``dev``
(default), ``ci`` (derandomized, CI-sized) and ``thorough``.

The options and what the property tests record live on one
``conformance.session.Session`` in ``config.stash``; the records of every
xdist worker reach the controller's session through the reports, and the
certificate is built from them by ``conformance.certificate``.
"""

from __future__ import annotations

import platform
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
    if not raw:
        return None
    dtypes = [d.strip() for d in raw.split(",") if d.strip()]
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
    try:
        impl = registry.resolve(impl_spec, options or None)
    except ImplementationError as err:
        raise pytest.UsageError(str(err)) from None
    session.impl, session.impl_spec, session.options = impl, impl_spec, options
    session.dtypes = _dtypes(config)
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
        f"  declared: causal={caps.causal} fully_masked={caps.fully_masked} dtypes={caps.dtypes} "
        f"devices={caps.devices} autograd={caps.autograd} gqa={caps.gqa}"
    )
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


class _ResultCollector:
    """Gathers the records attached to test reports into the session: under
    xdist the controller receives every worker's reports here."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for key, value in getattr(report, "user_properties", ()):
            if key == "conformance":
                self.session.results.append(value)


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
        json_path, md_path = certificate.write(cert, path)
        tr.write_line(f"certificate written to {json_path} and {md_path}")
