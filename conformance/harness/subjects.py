"""The implementations a run certifies: ``--impl`` read as a list of specs (comma-separated,
globs over the registered and mutant names), each one's label in the test ids, and each
resolved into a ``conformance.harness.session.Subject``, in this process or, isolated, in a worker
(``--isolate``, ``conformance.isolation.supervisor``), with ``--xfail-file``, its shape budget and
its expected failures checked. Every problem is a ``pytest.UsageError`` naming the option.
``conformance.plugin`` calls these from ``pytest_configure``.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

import pytest

from conformance.harness.session import Subject
from implementations.base import ImplementationError

__all__ = ["impl_specs", "labels", "resolve_subject", "devices", "write_declaration"]


_GLOB = re.compile(r"[*?\[]")


def impl_specs(raw: str) -> list[str]:
    """``--impl`` as a list: its comma-separated entries, each glob (``mutant:*``)
    expanded over the registered names and ``mutant:NAME``, repeats dropped."""
    specs: list[str] = []
    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            continue
        if not _GLOB.search(entry):
            specs.append(entry)
            continue
        names = _glob_names()
        found = [name for name in names if fnmatch.fnmatchcase(name, entry)]
        if not found:
            raise pytest.UsageError(
                f"--impl={raw}: {entry!r} matches no registered name and no mutant:NAME "
                f"(registered: {', '.join(n for n in names if not n.startswith('mutant:'))}; "
                "the bug zoo: mutant:*)"
            )
        specs += found
    if not specs:
        raise pytest.UsageError(f"--impl={raw!r} names no implementation; see `pytest conformance --impl=list`")
    return list(dict.fromkeys(specs))


def _glob_names() -> list[str]:
    """What an ``--impl`` glob is matched against: the registered names, then the bug zoo's."""
    from implementations import registry

    names = list(registry.registered())
    try:
        from implementations.mutants import MUTANTS
    except ImportError:
        return names
    return names + [f"mutant:{name}" for name in sorted(MUTANTS)]


def labels(specs: list[str]) -> list[str]:
    """Each implementation's label, the prefix of its test ids: its spec, characters
    a test id or ``-k`` cannot hold replaced by ``_``, made unique."""
    labels: list[str] = []
    for spec in specs:
        label = base = re.sub(r"[^\w.:+/-]", "_", spec)
        n = 2
        while label in labels:
            label, n = f"{base}_{n}", n + 1
        labels.append(label)
    return labels


def resolve_subject(config: pytest.Config, spec: str, label: str, options: dict[str, str],
                    timeout: float, properties: Any) -> Subject:
    """Implementation ``spec`` resolved (here or in an isolated worker), its shape budget
    and expected failures checked: a usage error names ``--impl=spec``."""
    from conformance.core.expectations import entry_errors
    from conformance.strategies.shape_budget import shape_budget_for

    impl, worker, reason = _resolve(config, spec, options, timeout)
    impl = _with_xfail_file(config, impl)
    subject = Subject(spec, impl, label, options, isolation=worker, isolate_reason=reason)
    if getattr(impl, "sharded", None) is not None:  # its ranks resolve it by the same spec
        from conformance.sharded import group as sharded_group

        subject.impl = impl = sharded_group.register(impl, spec, options)  # with the groups' run note
    try:
        requested, name = config.getoption("conformance_compile_budget"), "--compile-budget"
        if requested is None:
            requested, name = config.getoption("conformance_shape_budget"), "--shape-budget"
        subject.shape_budget = shape_budget_for(impl.capabilities, requested, name=name)
    except Exception as err:  # noqa: BLE001 - the strategies' InvalidArgument names the rule
        _close(worker)
        raise pytest.UsageError(str(err)) from None
    errors = entry_errors(impl.expected_failures, properties)
    if errors:
        _close(worker)
        raise pytest.UsageError(f"--impl={spec}: {len(errors)} invalid expected failure(s): "
                                + "; ".join(errors))
    return subject


def _close(worker: Any) -> None:
    if worker is not None:
        worker.close()


def _resolve(config: pytest.Config, impl_spec: str, options: dict[str, str],
             timeout: float) -> tuple[Any, Any, str]:
    """The implementation, resolved here or, isolated, in a worker process; the
    worker (None: in-process) and why it is (or is not) isolated."""
    from conformance.isolation import supervisor as isolation

    isolate, reason = isolation.choose(config.getoption("conformance_isolate"), impl_spec)
    isolation.mark_running(impl_spec)  # removed at a clean end, below or in pytest_unconfigure
    try:
        impl, worker = _resolve_in(config, impl_spec, options, timeout, isolate)
    except BaseException:
        isolation.forget_running()
        raise
    return impl, worker, reason


def _resolve_in(config: pytest.Config, impl_spec: str, options: dict[str, str],
                timeout: float, isolate: bool) -> tuple[Any, Any]:
    from conformance.isolation import supervisor as isolation
    from implementations import registry

    if not isolate:
        try:
            return registry.resolve(impl_spec, options or None, timeout=timeout, root=config.rootpath), None
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
    return impl, worker


def _with_xfail_file(config: pytest.Config, impl: Any) -> Any:
    """``impl`` with the entries of ``--xfail-file`` added (checked against the
    properties with the implementation's own, below)."""
    path = config.getoption("conformance_xfail_file")
    if not path:
        return impl
    from implementations import registry

    try:
        return registry.with_expected_failures(impl, registry.load_expected_failures_file(path))
    except ImplementationError as err:
        raise pytest.UsageError(str(err)) from None


def write_declaration(config: pytest.Config, subjects: list[Subject]) -> None:
    """``--conformance-write-declaration PATH``: the implementation's effective declaration
    (``implementations.registry.declaration.draft_declaration``) written to PATH."""
    path = config.getoption("conformance_write_declaration")
    if not path or hasattr(config, "workerinput"):
        return
    if len(subjects) != 1:
        raise pytest.UsageError(f"--conformance-write-declaration={path} drafts the declaration of one "
                                f"implementation; --impl names {len(subjects)}: give one")
    from pathlib import Path

    from implementations.registry.declaration import draft_declaration, find_declaration

    subject = subjects[0]
    try:
        declaration = find_declaration(subject.impl_spec, config.rootpath)
        Path(path).write_text(draft_declaration(subject.impl, subject.impl_spec, subject.options, declaration),
                              encoding="utf-8")
    except (OSError, ImplementationError) as err:
        raise pytest.UsageError(f"--conformance-write-declaration={path}: cannot write it: {err}") from None


def devices(config: pytest.Config) -> list[str]:
    device = config.getoption("conformance_device")
    return ["cpu", "cuda"] if device == "all" else [device]
