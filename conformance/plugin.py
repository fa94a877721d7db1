"""pytest plugin of the conformance runner (loaded by the root ``conftest.py``).

Options (group "attention-conformance"): ``--impl`` (required to run
``conformance/``; ``--impl=list`` lists the built-ins), ``--impl-option
key=value`` (repeatable: override a declared capability), ``--device``
(cpu, cuda, all), ``--dtype`` (comma-separated subset), ``--conformance-report
PATH`` (writes PATH.json and PATH.md), ``--replay FILE`` (re-run one saved
failing case) and ``--example-timeout SECONDS``. Hypothesis profiles: ``dev``
(default), ``ci`` (derandomized, CI-sized) and ``thorough``.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from implementations.base import ALL_DTYPES, ImplementationError

__all__ = ["PROFILES"]

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
_STATE_KEY = pytest.StashKey[dict]()


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
    state: dict[str, Any] = {"profile": profile, "impl": None, "records": [], "started": time.time()}
    config.stash[_STATE_KEY] = state
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
    from conformance import failures

    failures.set_impl_spec(impl_spec, options)
    state.update(impl=impl, impl_spec=impl_spec, options=options, dtypes=_dtypes(config))
    replay_path = config.getoption("replay")
    if replay_path:
        try:
            case, meta = failures.load_case(replay_path)
        except (OSError, KeyError, ValueError) as err:
            raise pytest.UsageError(f"--replay {replay_path}: cannot read a saved case ({err})") from None
        failures.set_replay(failures.Replay(meta["property"], meta["target"], meta.get("impl", ""), case))


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

    state = config.stash[_STATE_KEY]
    impl = state["impl"]
    caps = impl.caps(level)
    dtypes = state["dtypes"] or list(caps.dtypes) or ["float32"]
    timeout = config.getoption("example_timeout")
    return [Target(impl, level, dtype, device, timeout)
            for device in _devices(config) for dtype in dtypes]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "target" not in metafunc.fixturenames:
        return
    state = metafunc.config.stash[_STATE_KEY]
    if state["impl"] is None:
        raise pytest.UsageError(
            "the conformance suite needs --impl=NAME (a registered name, module:attr, "
            "path/to/file.py:attr or mutant:NAME); see `pytest conformance --impl=list`"
        )
    level = getattr(metafunc.function, "conformance_level", "sdpa")
    targets = _targets(metafunc.config, level)
    metafunc.parametrize("target", targets, ids=[t.id for t in targets])


def pytest_report_header(config: pytest.Config) -> list[str]:
    state = config.stash.get(_STATE_KEY, None)
    if not state or state["impl"] is None:
        return []
    import torch

    impl = state["impl"]
    lines = [
        f"attention-conformance: impl={state['impl_spec']} ({impl.name} {impl.version}) "
        f"options={state['options'] or '{}'} profile={state['profile']}",
        f"  devices={_devices(config)} dtypes={state['dtypes'] or 'declared'} "
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
    if prop is None:
        return
    from conformance.runner import RECORDS

    record = RECORDS.current
    if record is None or record.property != prop:
        return
    if report.when == "call" or (report.when == "setup" and report.skipped):
        if report.failed and record.outcome not in ("failed",):
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
        RECORDS.current = None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for key, value in getattr(report, "user_properties", ()):
        if key == "conformance":
            _PENDING.append(value)


_PENDING: list[dict[str, Any]] = []


def _certificate(config: pytest.Config) -> dict[str, Any]:
    import torch

    state = config.stash[_STATE_KEY]
    impl = state["impl"]
    from dataclasses import asdict

    def caps_dict(c: Any) -> dict[str, Any]:
        d = asdict(c)
        return {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in d.items()}

    return {
        "implementation": {
            "name": impl.name,
            "spec": state["impl_spec"],
            "version": impl.version,
            "options": state["options"],
            "capabilities": caps_dict(impl.capabilities),
            "mha_capabilities": caps_dict(impl.caps("mha")),
            "expected_failures": [
                {"property": e.property, "match": dict(e.match), "reason": e.reason, "reference": e.reference}
                for e in impl.expected_failures
            ],
        },
        "environment": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(),
            "triton": _triton_version(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "devices": _devices(config),
        },
        "profile": state["profile"],
        "seconds": round(time.time() - state["started"], 2),
        "results": sorted(_PENDING, key=lambda r: (r["level"], r["property"], r["device"], r["dtype"])),
    }


_SYMBOL = {"passed": "PASS", "failed": "FAIL", "skipped": "skip", "xfailed": "xfail",
           "stale-xfail": "STALE", "error": "ERROR"}


def _cell(r: dict[str, Any]) -> str:
    text = _SYMBOL.get(r["outcome"], r["outcome"])
    if r["outcome"] in ("passed", "xfailed", "stale-xfail", "failed") and r["examples"]:
        ratio = "-" if r["worst_ratio"] is None else f"{r['worst_ratio']:.2g}"
        text += f" {ratio} ({r['examples']})"
    return text


def render_table(cert: dict[str, Any], markdown: bool = False) -> str:
    results = cert["results"]
    columns = sorted({(r["device"], r["dtype"]) for r in results},
                     key=lambda c: (c[0], ALL_DTYPES.index(c[1]) if c[1] in ALL_DTYPES else 9))
    rows: dict[tuple[str, str], dict[tuple[str, str], str]] = {}
    for r in results:
        rows.setdefault((r["level"], r["property"]), {})[(r["device"], r["dtype"])] = _cell(r)
    header = ["property", "level"] + [f"{dt}/{dev}" for dev, dt in columns]
    body = [[p, lvl] + [cells.get(c, "") for c in columns] for (lvl, p), cells in sorted(rows.items())]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    return "\n".join([fmt.format(*header)] + [fmt.format(*row) for row in body])


def _details(cert: dict[str, Any]) -> list[str]:
    lines = []
    caps = cert["implementation"]["capabilities"]
    lines.append(
        f"declared policies: fully-masked rows={caps['fully_masked']}, causal flag={caps['causal']}, "
        f"tf32={caps['tf32']}"
    )
    seen: set[str] = set()
    for r in cert["results"]:
        tag = f"{r['property']}[{r['level']}-{r['dtype']}-{r['device']}]"
        if r["outcome"] in ("failed", "error"):
            ce = r.get("counterexample") or {}
            lines.append(f"FAIL {tag}: after {r['examples']} examples; shrunk case {ce}; saved {r['failure_file']}")
            first = (r.get("message") or "").splitlines()[:3]
            lines += ["    " + x for x in first]
        elif r["outcome"] == "xfailed":
            lines.append(f"expected failure {tag}: {r['xfail_reason']} ({r['xfail_hits']} of {r['examples']} examples)")
            if r["reason"]:
                lines.append(f"STALE expected failure {tag}: {r['reason']}")
        elif r["outcome"] == "stale-xfail":
            lines.append(f"STALE expected failure {tag}: {r['reason']}")
        elif r["outcome"] == "skipped" and r["reason"] and r["reason"] not in seen:
            seen.add(r["reason"])
            lines.append(f"skipped ({r['reason']}) e.g. {tag}")
    return lines


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(_STATE_KEY, None)
    if not state or state["impl"] is None or not _PENDING:
        return
    cert = _certificate(config)
    tr = terminalreporter
    impl = cert["implementation"]
    tr.write_sep("=", f"attention-conformance certificate: {impl['spec']} ({impl['name']} {impl['version']})")
    tr.write_line(f"profile={cert['profile']} torch={cert['environment']['torch']} "
                  f"cell = outcome, worst error/allowed ratio (1 = at tolerance), examples run")
    tr.write_line(render_table(cert))
    for line in _details(cert):
        tr.write_line(line)
    counts: dict[str, int] = {}
    for r in cert["results"]:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    tr.write_line("summary: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    path = config.getoption("conformance_report")
    if path:
        base = Path(path)
        base.parent.mkdir(parents=True, exist_ok=True)
        Path(str(base) + ".json").write_text(json.dumps(cert, indent=2, default=str))
        md = [f"# attention-conformance certificate: `{impl['spec']}`", "",
              f"- implementation: {impl['name']} {impl['version']}",
              f"- profile: {cert['profile']}; torch {cert['environment']['torch']}; "
              f"devices {cert['environment']['devices']}",
              "- cell: outcome, worst error/allowed ratio, examples", "",
              render_table(cert, markdown=True), ""]
        md += [f"- {line}" for line in _details(cert)]
        Path(str(base) + ".md").write_text("\n".join(md) + "\n")
        tr.write_line(f"certificate written to {base}.json and {base}.md")
