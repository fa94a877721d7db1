"""What a run shows and writes: the ``pytest_report_header`` lines, the environment on
the certificate, and the certificate itself (one implementation's, or the comparison
of several) in the terminal and in ``--conformance-report`` files, whose path is
checked up front. ``conformance.plugin``'s hooks call these.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from conformance.core.compare import PropertyFailure
from conformance.harness.session import Session, session_of
from conformance.harness.subjects import devices
from conformance.reporting import certificate

__all__ = ["header_lines", "check_writable", "probe_saw", "write_certificate"]


def header_lines(config: pytest.Config) -> list[str]:
    """The lines of ``pytest_report_header``: what was selected, the versions, the
    device, the profile, and per implementation its declaration and where it runs."""
    session = session_of(config)
    if session is None or session.impl is None:
        return []
    import torch

    impl = session.impl
    if session.compares:
        first = (f"attention-conformance: {len(session.subjects)} implementations compared: "
                 f"{', '.join(s.impl_spec for s in session.subjects.values())}")
    else:
        first = f"attention-conformance: impl={session.impl_spec} ({impl.name} {impl.version})"
    lines = [
        f"{first} options={session.options or '{}'} profile={session.profile}",
        f"  devices={devices(config)} dtypes={session.dtypes or 'declared'} "
        f"torch={torch.__version__} threads={torch.get_num_threads()} cuda={torch.version.cuda} "
        f"cuda_available={torch.cuda.is_available()} triton={_triton_version()} "
        f"python={platform.python_version()}",
    ]
    if session.exitfirst:
        lines.append("  --impl-exitfirst: an implementation's tests after its first failure skip")
    for subject in session.subjects.values():
        indent = "  "
        if session.compares:
            lines.append(f"  {subject.label}: {subject.impl.name} {subject.impl.version}")
            indent = "    "
        caps = subject.impl.capabilities
        # The source of each semantic value: declared, the signature's contract, or probed.
        src = {name: f"({source})" for name, source in caps.sources if source != "declared"}
        lines.append(
            f"{indent}capabilities: causal={caps.causal}{src.get('causal', '')} "
            f"fully_masked={caps.fully_masked_text()}{src.get('fully_masked', '')} dtypes={caps.dtypes} "
            f"devices={caps.devices} autograd={caps.autograd} gqa={caps.gqa}"
            + (" (contract: the signature's meaning, tested; probed: read off the implementation, "
               "not a declaration; the rest declared)" if src else "")
        )
        for name in ("autograd", "gqa", "different_v_dim", "mask_kinds"):
            for dtype, value in caps.dtype_differences(name).items():
                shown = sorted(value) if isinstance(value, frozenset) else value
                lines.append(f"{indent}in {dtype}: {name}={shown} (probed)")
        lines += [f"{indent}probe note: {note}" for note in caps.probe_notes]
        isolated = "in a worker process" if subject.isolation is not None else "in-process"
        lines.append(f"{indent}implementation runs {isolated} ({subject.isolate_reason})")
    return lines


def _triton_version() -> str:
    try:
        import importlib.metadata as md

        return md.version("triton")
    except Exception:  # noqa: BLE001 - absent is a fine answer
        return "absent"


def check_writable(path: str) -> None:
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


def _environment(config: pytest.Config) -> dict[str, Any]:
    import torch

    return {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cuda_device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "devices": devices(config),
    }


def write_certificate(terminalreporter: Any, config: pytest.Config) -> None:
    """The certificate at the end of ``pytest_terminal_summary``, and in the files
    of ``--conformance-report`` (nothing when no property test ran)."""
    session = session_of(config)
    if session is None or session.impl is None or not session.results:
        return
    if session.compares:
        cert = _comparison(config, session)
    else:
        cert = certificate.certificate(
            implementation=certificate.implementation_entry(session.impl, session.impl_spec, session.options,
                                                          compile_budget=session.shape_budget,
                                                          declaration=_declaration(config, session.impl_spec)),
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


def _declaration(config: pytest.Config, spec: str) -> Any:
    """The declaration ``--impl=spec`` named (a TOML file, a pyproject.toml table), or None."""
    from implementations.base import ImplementationError
    from implementations.registry.declaration import find_declaration

    try:
        return find_declaration(spec, config.rootpath)
    except ImplementationError:  # it was read when the run started; gone since: not shown
        return None


def _comparison(config: pytest.Config, session: Session) -> dict[str, Any]:
    """The certificate of a run of several implementations: each one's certificate (its
    ``seconds``: the time inside its property tests) and their matrix."""
    environment = _environment(config)
    by_label: dict[str, list[dict[str, Any]]] = {label: [] for label in session.subjects}
    for result in session.results:
        result = dict(result)
        by_label.setdefault(result.pop("implementation", ""), []).append(result)
    certificates = [
        certificate.certificate(
            implementation=certificate.implementation_entry(s.impl, s.impl_spec, s.options,
                                                          compile_budget=s.shape_budget,
                                                          declaration=_declaration(config, s.impl_spec)),
            environment=environment,
            profile=session.profile,
            seconds=sum(r.get("seconds") or 0.0 for r in by_label[s.label]),
            results=by_label[s.label],
        )
        for s in session.subjects.values()
    ]
    return certificate.comparison(certificates=certificates, environment=environment,
                                  profile=session.profile, seconds=time.time() - session.started)


class probe_saw:
    """Around a check: a failure's message gets, after its first line, what probing saw
    of ``name`` (``Capabilities.probe_note``: e.g. that ``is_causal`` behaved as the
    lower-right triangle, and the ``--impl-option`` that declares it if intended)."""

    def __init__(self, target: Any, name: str) -> None:
        self.note = target.caps.probe_note(name)

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if self.note and isinstance(error, PropertyFailure):
            first, _, rest = str(error).partition("\n")
            raise PropertyFailure(f"{first}\nprobe: {self.note}" + (f"\n{rest}" if rest else ""),
                                  ratio=error.ratio) from None
        return False
