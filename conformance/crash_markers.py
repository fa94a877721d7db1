"""Crash markers: which implementations crashed in earlier runs, and ``--isolate``'s choice.

Every pytest process that runs property tests keeps ``running-<pid>.json``
(implementation and current test) in :func:`state_dir` and removes it when it
finishes cleanly (:func:`mark_running`, :func:`forget_running`). A later run that
finds one whose process is gone records a crash of that implementation in
``crashes.json`` (:func:`record_crash`); so does a worker that dies in isolated mode
and an xdist worker that crashes. ``--isolate=auto`` isolates every implementation
recorded there (:func:`choose`; delete the file to forget).
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "ISOLATE_MODES",
    "choose",
    "crash_seen",
    "forget_running",
    "mark_running",
    "record_crash",
    "state_dir",
]

#: ``--isolate`` values.
ISOLATE_MODES = ("auto", "always", "never")


def state_dir() -> Path:
    """Where the crash markers live (``$ATTENTION_CONFORMANCE_STATE``, default ``.conformance``)."""
    return Path(os.environ.get("ATTENTION_CONFORMANCE_STATE", ".conformance"))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only checkout: no markers, nothing else changes


def record_crash(spec: str, what: str) -> None:
    """Remember that ``spec`` crashed (``what``: how and where) for later ``auto`` runs."""
    path = state_dir() / "crashes.json"
    crashes = _read_json(path)
    crashes[spec] = {"what": what, "when": datetime.datetime.now().isoformat(timespec="seconds")}
    _write_json(path, crashes)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _collect_dead_runs() -> None:
    """Turn the running markers of processes that are gone into crash records."""
    for path in state_dir().glob("running-*.json"):
        data = _read_json(path)
        pid = data.get("pid")
        if isinstance(pid, int) and pid != os.getpid() and not _pid_alive(pid):
            if data.get("spec"):
                record_crash(data["spec"], f"a run (pid {pid}) ended without finishing, during "
                                           f"{data.get('test') or 'resolution'}")
            try:
                path.unlink()
            except OSError:
                pass


def crash_seen(spec: str) -> str | None:
    """How ``spec`` crashed in an earlier run in this checkout, or None."""
    _collect_dead_runs()
    entry = _read_json(state_dir() / "crashes.json").get(spec)
    return None if not isinstance(entry, dict) else f"{entry.get('what')} ({entry.get('when')})"


def mark_running(spec: str, test: str = "") -> None:
    """This process runs ``spec`` (now in ``test``): a marker a later run reads if we die."""
    _write_json(state_dir() / f"running-{os.getpid()}.json", {"pid": os.getpid(), "spec": spec, "test": test})


def forget_running() -> None:
    """This process finished cleanly: remove its marker."""
    try:
        (state_dir() / f"running-{os.getpid()}.json").unlink()
    except OSError:
        pass


def choose(mode: str, spec: str) -> tuple[bool, str]:
    """Whether to isolate ``spec`` under ``--isolate=mode``, and why (for the header)."""
    if mode == "always":
        return True, "--isolate=always"
    if mode == "never":
        return False, "--isolate=never"
    crashed = crash_seen(spec)
    if crashed:
        return True, (f"--isolate=auto: an earlier run of this implementation crashed ({crashed}); "
                      f"remove {state_dir() / 'crashes.json'} or pass --isolate=never to run it in-process")
    return False, "--isolate=auto: no crash of this implementation seen in this checkout"
