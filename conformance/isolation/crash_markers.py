"""Crash markers: which implementations crashed in earlier runs, and ``--isolate``'s choice.

Every pytest process that runs property tests keeps ``running-<pid>.json``
(implementation and current test) in :func:`state_dir` and removes it when it
finishes cleanly (:func:`mark_running`, :func:`forget_running`). A later run that
finds one whose process is gone records a crash of that implementation in
``crashes.json`` (:func:`record_crash`); so does a worker that dies in isolated mode
and an xdist worker that crashes. ``--isolate=auto`` isolates every implementation
recorded there (:func:`choose`; delete the file to forget).

Only a crash is a crash: a run the user interrupts (Ctrl-C / SIGINT, SIGTERM, SIGHUP)
is not one. :func:`catch_interrupts` (installed for the run by the plugin) marks the
process's marker ``interrupted`` the moment the signal arrives, turns SIGTERM and
SIGHUP into :class:`Interrupted` (a ``KeyboardInterrupt``: pytest's own clean exit path,
which removes the marker), and restores the handlers it replaced when the run ends. A
marker marked so is dropped, never counted, even if the process is then killed before
it could remove it. A process that dies otherwise (``os._exit``, ``abort``, a
segfault, SIGKILL) leaves an unmarked marker: a crash.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any, Callable

__all__ = [
    "INTERRUPT_SIGNALS",
    "ISOLATE_MODES",
    "Interrupted",
    "catch_interrupts",
    "choose",
    "crash_seen",
    "forget_running",
    "interrupted_by",
    "mark_running",
    "record_crash",
    "state_dir",
]

#: ``--isolate`` values.
ISOLATE_MODES = ("auto", "always", "never")
#: The signals with which a user (a terminal, ``kill``, ``timeout``, a CI runner) stops a
#: run: a process that ends by one of them was interrupted, it did not crash.
INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal (``signum``); pytest ends it as it ends a Ctrl-C."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"the run was interrupted by {signal.Signals(signum).name}")


#: The signal that interrupted this process (None: not interrupted).
_interrupted: list[int] = []


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
            if data.get("spec") and not data.get("interrupted"):
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
    data: dict[str, Any] = {"pid": os.getpid(), "spec": spec, "test": test}
    if _interrupted:
        data["interrupted"] = signal.Signals(_interrupted[0]).name
    _write_json(state_dir() / f"running-{os.getpid()}.json", data)


def interrupted_by() -> str | None:
    """The name of the signal that interrupted this process (None: not interrupted)."""
    return signal.Signals(_interrupted[0]).name if _interrupted else None


def _mark_interrupted(signum: int) -> None:
    """Mark this process's marker (if any) as interrupted by ``signum``: not a crash."""
    if not _interrupted:
        _interrupted.append(signum)
    path = state_dir() / f"running-{os.getpid()}.json"
    data = _read_json(path)
    if data and not data.get("interrupted"):
        data["interrupted"] = signal.Signals(signum).name
        _write_json(path, data)


def catch_interrupts() -> Callable[[], None]:
    """Install this run's handlers of :data:`INTERRUPT_SIGNALS` (see the module docstring);
    returns the function that puts the previous handlers back. SIGINT keeps its
    previous behaviour (Python's: ``KeyboardInterrupt``) after the marker is marked;
    SIGTERM and SIGHUP raise :class:`Interrupted` where their handler was the default
    (a handler someone else installed is called instead). A signal that was ignored
    stays ignored. Outside the main thread (signals cannot be caught there) nothing
    is installed."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    _interrupted.clear()
    previous: dict[int, Any] = {}

    def handler(signum: int, frame: Any) -> None:
        _mark_interrupted(signum)
        before = previous.get(signum)
        if callable(before):
            before(signum, frame)  # Python's SIGINT handler raises KeyboardInterrupt
        else:
            raise Interrupted(signum)

    for signum in INTERRUPT_SIGNALS:
        try:
            before = signal.getsignal(signum)
            if before in (signal.SIG_IGN, None):
                continue  # ignored (nohup, a background job): it stays so
            previous[signum] = before
            signal.signal(signum, handler)
        except (OSError, ValueError):
            previous.pop(signum, None)

    def restore() -> None:
        for signum, before in previous.items():
            try:
                if signal.getsignal(signum) is handler:
                    signal.signal(signum, before)
            except (OSError, ValueError, TypeError):
                pass
        previous.clear()
        _interrupted.clear()

    return restore


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
