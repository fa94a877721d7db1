"""Where the ranks of a hung sharded call are blocked, and the likely cause.

On a hang the supervisor (``group``) asks each rank that has not answered for the Python
stack of every thread (``SIGUSR1``; the worker registered ``faulthandler`` for it, which
writes to the rank's log) and reads it back here. A rank whose innermost frames are
``torch.distributed``'s (a collective, a send or receive, a barrier) or a request's
``wait()`` blocks in communication; otherwise it is busy in the implementation's own code.
Pure functions of the log text (tested without processes).
"""

from __future__ import annotations

import linecache
import re
from dataclasses import dataclass

__all__ = ["Blocked", "blocked_at", "likely_cause"]

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
#: Source text of a frame that waits for other ranks (a request's wait, a receive).
_WAITS = re.compile(r"\.wait\(|\brecv\(|\bbarrier\(|\ball_reduce\(|\ball_gather|\ball_to_all|\bbroadcast\(|"
                    r"\breduce_scatter|\bbatch_isend_irecv\(")


@dataclass(frozen=True)
class Blocked:
    """Where one rank was: ``collective`` (the torch.distributed function, or the waiting
    source line; None: not in communication) and ``caller`` (the innermost frame outside
    torch, ``file:line in func``)."""

    collective: str | None
    caller: str


def _short(path: str) -> str:
    """A frame's file as a user reads it: from the package or the project's folder on."""
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    for marker in ("conformance/", "implementations/", "tests/"):
        at = path.rfind("/" + marker)
        if at >= 0:
            return path[at + 1:]
    return path


def _threads(text: str) -> list[list[tuple[str, int, str]]]:
    """Each thread's frames, innermost first (faulthandler's order)."""
    threads: list[list[tuple[str, int, str]]] = []
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            threads.append([])
        elif threads and (m := _FRAME.match(line)):
            threads[-1].append((m["file"], int(m["line"]), m["func"]))
    return threads


def blocked_at(text: str) -> Blocked | None:
    """Where the rank whose faulthandler dump is ``text`` was blocked: its thread that
    runs the call (the one with the worker's ``run_case``), or None without a dump."""
    threads = [t for t in _threads(text) if t]
    serving = [t for t in threads if any(f.endswith("worker.py") and fn == "run_case" for f, _, fn in t)]
    if not serving:
        return None
    frames = serving[-1]
    collective = None
    for path, _, func in frames:
        if "torch/distributed/" in path and not func.startswith(("wrapper", "_")):
            collective = f"torch.distributed.{func}"
            break
    inner = next(((p, n, fn) for p, n, fn in frames if "/torch/" not in p), frames[0])
    source = linecache.getline(inner[0], inner[1]).strip()
    if collective is None and _WAITS.search(source) and not any("/torch/" in p for p, _, _ in frames[:1]):
        collective = source
    if collective is None and "/torch/distributed/" in frames[0][0]:
        collective = f"torch.distributed ({frames[0][2]})"
    caller = f"{_short(inner[0])}:{inner[1]} in {inner[2]}" + (f": {source}" if source else "")
    return Blocked(collective, caller)


def _name(collective: str | None) -> str:
    """The function a waiting rank is in (``torch.distributed.recv`` -> ``recv``)."""
    return (collective or "").rsplit(".", 1)[-1].split("(")[0]


def likely_cause(blocked: dict[int, Blocked | None], answered: list[int], world_size: int) -> str:
    """One sentence: where the ranks that did not answer were, and why a call hangs so."""
    where = "; ".join(
        f"rank {r} " + ("gave no stack" if b is None else
                        f"waits in {b.collective} ({b.caller})" if b.collective else f"is busy at {b.caller}")
        for r, b in sorted(blocked.items()))
    waiting = [r for r, b in blocked.items() if b is not None and b.collective]
    busy = [r for r, b in blocked.items() if b is not None and not b.collective]
    if waiting and answered:
        cause = (f"rank(s) {answered} finished the call while rank(s) {sorted(waiting)} wait for a peer: the "
                 "ranks made different communication calls (one rank skipped a send, a receive, a barrier "
                 "or a collective the others made, or made it on another group)")
    elif waiting and not busy and len({_name(blocked[r].collective) for r in waiting}) > 1:
        cause = ("the ranks wait in different communication calls: their sequences of sends, receives, "
                 "barriers and collectives differ (one rank skipped one or made one more, as a branch taken "
                 "on one rank only does)")
    elif waiting and not busy:
        cause = (f"every waiting rank blocks in communication: the ranks wait on each other (a blocking "
                 f"receive before the matching send, collectives in different orders, or a peer rank "
                 f"outside the world of {world_size} rank(s): the default group here is exactly the "
                 f"call's {world_size} rank(s))")
    elif busy:
        cause = (f"rank(s) {sorted(busy)} are not in communication: the implementation's own code runs on "
                 "(a loop, a sleep or a very slow computation)"
                 + (f", while rank(s) {sorted(waiting)} wait for them" if waiting else ""))
    else:
        cause = "the ranks gave no stack (blocked in native code outside Python)"
    return f"{where}. Likely cause: {cause}"
