"""The sharded level's persistent worker group (the pytest side).

A :class:`WorkerGroup` is ``world`` processes (forked from the run's fork server on the
CPU, ``conformance.sharded.forkserver``; ``python -m conformance.sharded.worker`` each on
CUDA; connected back to the supervisor over a local socket) that initialise
``torch.distributed`` for exactly ``world`` ranks, gloo on the CPU or NCCL on CUDA with
one process per GPU (``backends``): **one group per world size**, whose default process
group is the call's ranks, so code written for its job's world (``dist.get_rank()``,
``dist.barrier()`` with no group) runs as written. The group of a world size is started
on the first call of that size of an implementation on that device and reused by every
later one, the examples and the shrinking steps alike (each ``--impl``, device and world
size is kept in :data:`_GROUPS`; at most :data:`MAX_LIVE_RANKS` rank processes live at
once, the least recently used group stopped first; ``close_all`` ends them at the end of
the run, and at exit). Each call hands the same request (the case's full arrays) to
every rank, which shards it itself, and waits for every reply with a deadline:

* a rank that does not answer in time is a **hang** (:class:`GroupHung`, which says where
  each waiting rank is blocked and the likely cause: ``stacks``), a rank whose
  process ends is a **crash** (:class:`GroupCrashed`); in both cases every process of
  the group is killed and reaped, and the next call of that world size starts a fresh group;
* a rank that raised while others may wait on it in a collective: after a short grace
  the supervisor asks where the others are (``stacks``); those still computing are
  waited for (they may raise too, which keeps the group in step: no restart), and once
  the rest wait in communication the group is killed and restarted likewise
  (:class:`GroupRaised`).

Like ``conformance.isolation`` (one worker per implementation, killed and restarted on a
hang or crash), extended to a group: no process outlives a case that broke it.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Listener, wait
from typing import Any

from conformance.sharded import backends, forkserver, stacks

__all__ = ["DEFAULT_WORLD", "MAX_LIVE_RANKS", "START_TIMEOUT", "GroupCrashed", "GroupError", "GroupHung",
           "GroupRaised", "GroupStartFailed", "WorkerGroup", "close_all", "group_for", "live_processes", "register",
           "run_note", "stats", "world_for"]

#: The largest world size (one group per world size 1..DEFAULT_WORLD).
DEFAULT_WORLD = backends.MAX_RANKS
#: The most rank processes alive at once (every group of every implementation): one
#: implementation's four groups hold 1 + 2 + 3 + 4 = 10.
MAX_LIVE_RANKS = 12
#: Seconds a group may take to start (spawn, import torch, rendezvous, resolve).
START_TIMEOUT = 180.0
#: Seconds the other ranks get to answer after one raised.
RAISE_GRACE = 3.0


class GroupError(Exception):
    """A sharded call did not complete on every rank."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class GroupHung(GroupError):
    """A rank did not answer within the timeout."""


class GroupCrashed(GroupError):
    """A rank's process ended during the call."""


class GroupRaised(GroupError):
    """A rank's call raised."""


class GroupStartFailed(GroupError):
    """The group could not start (resolution failed in a rank, or it timed out)."""


MAX_SOCKET_PATH = 100  # bytes; below every platform's limit on a Unix socket's path


class WorkerGroup:
    """``world`` rank processes serving ``impl_spec`` (module docstring)."""

    def __init__(self, impl_spec: str, options: dict[str, str] | None = None, *, world: int = DEFAULT_WORLD,
                 start_timeout: float = START_TIMEOUT, device: str = "cpu") -> None:
        self.impl_spec, self.options, self.world = impl_spec, dict(options or {}), world
        self.device, self.backend = device, backends.backend_for(device)
        self.start_timeout = start_timeout
        self.processes: list[Any] = []
        self.conns: list[Any] = []
        self.tmp: str | None = None
        self.socket_dir: str | None = None
        self.starts = 0
        self.start_seconds = 0.0  # spent starting, every start together
        self.restarts = 0  # starts after a hang, a crash or a raise killed the group
        self.last_used = 0.0
        self._clean = True  # not started yet, or stopped by close(): its next start is no restart

    @property
    def running(self) -> bool:
        return bool(self.processes)

    def _socket_address(self) -> str:
        """The supervisor's socket: in the group's folder, unless that path is longer than a
        Unix socket's address may be (108 bytes on Linux, 104 on macOS; a long ``TMPDIR``
        does that), then in a folder of its own under /tmp."""
        address = f"{self.tmp}/supervisor.sock"
        if len(address.encode()) < MAX_SOCKET_PATH:
            return address
        self.socket_dir = tempfile.mkdtemp(prefix="cs-", dir="/tmp" if os.path.isdir("/tmp") else None)
        return f"{self.socket_dir}/supervisor.sock"

    def start(self) -> None:
        """Start the ranks (``python -m conformance.sharded.worker``, each connecting back to a
        local socket) and wait until every one is ready."""
        began = time.monotonic()
        try:
            self._start()
        finally:
            self.start_seconds += time.monotonic() - began

    def _start(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="conformance-sharded-")
        self.restarts += 0 if self._clean else 1
        self._clean = False
        self.starts += 1
        authkey = secrets.token_bytes(16)
        address = self._socket_address()
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
        config = json.dumps({"world": self.world, "init_file": f"{self.tmp}/rendezvous",
                             "backend": self.backend, "device": self.device,
                             "address": address, "impl_spec": self.impl_spec,
                             "options": self.options, "timeout": max(60.0, self.start_timeout)})
        if forkserver.available(self.device):  # forked from a process that imported torch once
            server = forkserver.server()
            for rank in range(self.world):
                self.processes.append(server.fork(rank, config, f"{self.tmp}/rank{rank}.log",
                                                  {"CONFORMANCE_SHARDED_AUTHKEY": authkey.hex()}))
        else:
            env = dict(os.environ, OMP_NUM_THREADS="1", CONFORMANCE_SHARDED_AUTHKEY=authkey.hex())
            env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p])
            for rank in range(self.world):
                log = open(f"{self.tmp}/rank{rank}.log", "wb")
                self.processes.append(subprocess.Popen(
                    [sys.executable, "-m", "conformance.sharded.worker", str(rank), config],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env))
                log.close()
        accepted: dict[int, Any] = {}

        def accept() -> None:
            try:
                while len(accepted) < self.world:
                    conn = listener.accept()
                    accepted[conn.recv()] = conn
            except (OSError, EOFError):
                pass

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        deadline = time.monotonic() + self.start_timeout
        while thread.is_alive() and time.monotonic() < deadline and all(p.poll() is None for p in self.processes):
            thread.join(0.2)
        listener.close()
        self.conns = [accepted.get(r) for r in range(self.world)]
        if any(c is None for c in self.conns):
            dead = [r for r, p in enumerate(self.processes) if p.poll() is not None]
            logs = self.log_tail(dead[0]) if dead else ""
            self.kill()
            what = f"rank {dead[0]} ended while starting" if dead else f"not every rank started within {self.start_timeout:g} s"
            raise GroupStartFailed(f"the worker group for --impl={self.impl_spec} did not start: {what}"
                                   + (f"; its output:\n{logs}" if logs else ""))
        replies = self._collect(list(range(self.world)), self.start_timeout, starting=True)
        errors = [r.get("error") for r in replies if not r.get("ready")]
        if errors:
            self.kill()
            raise GroupStartFailed(f"the worker group for --impl={self.impl_spec} did not start: {errors[0]}")

    def log_tail(self, rank: int, size: int = 2000) -> str:
        try:
            with open(f"{self.tmp}/rank{rank}.log", "rb") as f:
                return f.read()[-size:].decode(errors="replace").strip()
        except OSError:
            return ""

    def _collect(self, ranks: list[int], timeout: float, *, starting: bool = False) -> list[dict[str, Any]]:
        """Every rank's reply, in rank order, or a GroupError (the group killed first)."""
        replies: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        raised_at: float | None = None
        by_conn = {self.conns[r]: r for r in ranks}
        while len(replies) < len(ranks):
            now = time.monotonic()
            limit = deadline if raised_at is None else min(deadline, raised_at + RAISE_GRACE)
            if now >= limit:
                missing = [r for r in ranks if r not in replies]
                raised = [r for r in ranks if "raised" in replies.get(r, {})]
                blocked = {} if starting else self.blocked(missing)
                if raised and now < deadline and any(b is not None and b.collective is None
                                                     for b in blocked.values()):
                    # A rank still computing (not waiting for the one that raised) may raise
                    # too, or answer: the group is kept in step, and no restart is needed.
                    raised_at = now
                    continue
                where = "" if starting else stacks.likely_cause(blocked, sorted(set(replies) - set(raised)),
                                                                self.world)
                self.kill()
                if raised:
                    raise GroupRaised(self._raised_text(replies[raised[0]], raised[0], missing)
                                      + (f". {where}" if where else ""), raised[0])
                what = "start" if starting else "answer"
                raise GroupHung(f"rank(s) {missing} did not {what} within {timeout:g} s"
                                + (f". {where}" if where else ""), missing[0])
            pending = [c for c, r in by_conn.items() if r not in replies]
            for conn in wait(pending, timeout=min(limit - now, 0.5)):
                rank = by_conn[conn]
                try:
                    replies[rank] = conn.recv()
                except (EOFError, OSError):
                    try:
                        self.processes[rank].wait(5)
                    except subprocess.TimeoutExpired:  # its socket closed, its exit still running
                        pass
                    code = self.processes[rank].poll()
                    output = self.log_tail(rank, 1500)
                    self.kill()
                    what = "ended" if code is not None else "closed its connection"
                    raise GroupCrashed(f"rank {rank}'s process {what} (exit code {code}) during the call"
                                       + (f"; its output:\n{output}" if output else ""), rank) from None
                if "raised" in replies[rank] and raised_at is None:
                    raised_at = time.monotonic()
            for rank in ranks:  # a rank may die with its socket still held open by nobody else
                if rank not in replies and self.processes[rank].poll() is not None and not self.conns[rank].poll():
                    code = self.processes[rank].poll()
                    self.kill()
                    raise GroupCrashed(f"rank {rank}'s process ended (exit code {code}) during the call", rank)
        return [replies[r] for r in ranks]

    def blocked(self, ranks: list[int], wait_s: float = 1.0) -> dict[int, stacks.Blocked | None]:
        """Where each of ``ranks`` is blocked: its stack, asked for with SIGUSR1 (the worker's
        faulthandler writes it to the rank's log) and read back (``stacks.blocked_at``)."""
        import signal

        if not hasattr(signal, "SIGUSR1") or self.tmp is None:
            return {r: None for r in ranks}
        sizes = {}
        for r in ranks:
            sizes[r] = self._log_size(r)
            try:
                self.processes[r].send_signal(signal.SIGUSR1)
            except (OSError, ValueError):
                pass
        found: dict[int, stacks.Blocked | None] = {r: None for r in ranks}
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(v is None for v in found.values()):
            time.sleep(0.05)
            for r in ranks:
                if found[r] is None:
                    found[r] = stacks.blocked_at(self._log_from(r, sizes[r]))
        return found

    def _log_size(self, rank: int) -> int:
        try:
            return os.path.getsize(f"{self.tmp}/rank{rank}.log")
        except OSError:
            return 0

    def _log_from(self, rank: int, offset: int) -> str:
        try:
            with open(f"{self.tmp}/rank{rank}.log", "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    @staticmethod
    def _raised_text(reply: dict[str, Any], rank: int, missing: list[int]) -> str:
        waiting = f"; rank(s) {missing} were still waiting for it" if missing else ""
        return f"rank {rank} raised {reply['raised']}{waiting}"

    def call(self, request: dict[str, Any], world_size: int, timeout: float) -> list[dict[str, Any]]:
        """``request`` on every rank (``world_size`` must be the group's); their replies in rank order."""
        if world_size != self.world:
            raise ValueError(f"world_size={world_size}, but this group has {self.world} rank(s): the group of "
                             f"a world size runs that size only (group_for(impl, device, world_size))")
        self.last_used = time.monotonic()
        if not self.running:
            self.start()
        request = dict(request, op="run", world_size=world_size)
        for rank in range(world_size):
            try:
                self.conns[rank].send(request)
            except (BrokenPipeError, OSError):
                code, output = self.processes[rank].poll(), self.log_tail(rank, 1500)
                self.kill()
                raise GroupCrashed(f"rank {rank}'s process had ended before the call (exit code {code})"
                                   + (f"; its output:\n{output}" if output else ""), rank) from None
        replies = self._collect(list(range(world_size)), timeout)
        raised = [r for r, reply in enumerate(replies) if "raised" in reply]
        if raised:
            # Every rank answered: the group is still in step, no restart needed.
            raise GroupRaised(self._raised_text(replies[raised[0]], raised[0], []), raised[0])
        return replies

    def kill(self) -> None:
        """End every process of the group at once and reap it; remove the rendezvous."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for conn in self.conns:
            if conn is not None:
                conn.close()
        self.processes, self.conns = [], []
        for folder in (self.tmp, self.socket_dir):
            if folder:
                shutil.rmtree(folder, ignore_errors=True)
        self.tmp = self.socket_dir = None

    def close(self) -> None:
        """Ask every rank to stop, then kill what is left."""
        self._clean = True
        for conn in self.conns:
            try:
                conn.send({"op": "stop"})
            except (BrokenPipeError, OSError, AttributeError):
                pass
        deadline = time.monotonic() + 5
        for process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]


#: One group per implementation (its --impl spec and options), device and world size.
_GROUPS: dict[tuple[str, tuple[tuple[str, str], ...], str, int], WorkerGroup] = {}
#: How each resolved implementation was named (``register``): id(impl) -> (spec, options).
_NAMES: dict[int, tuple[str, dict[str, str]]] = {}


def register(impl: Any, impl_spec: str, options: dict[str, str] | None) -> Any:
    """Remember how ``impl`` was resolved, so that its ranks resolve it the same way; the
    same implementation with the groups' run note added to its own (``run_notes``: a
    ``run:`` line of the certificate, :func:`run_note`), where it is an Implementation."""
    _NAMES[id(impl)] = (impl_spec, dict(options or {}))
    if not (dataclasses.is_dataclass(impl) and hasattr(impl, "run_notes")):
        return impl
    own = impl.run_notes

    def notes() -> tuple[str, ...]:
        note = run_note(impl_spec, options)
        return (*(own() if own is not None else ()), *((note,) if note else ()))

    noted = dataclasses.replace(impl, run_notes=notes)
    _NAMES[id(noted)] = _NAMES[id(impl)]
    return noted


def run_note(impl_spec: str, options: dict[str, str] | None) -> str:
    """What the worker groups of one implementation cost, for its certificate: the groups
    started, the seconds spent starting them, and the restarts among them (a restart is
    the one cost a failing case's shrink steps add to their calls); "" when none ran."""
    key = (impl_spec, tuple(sorted(dict(options or {}).items())))
    mine = [g for k, g in _GROUPS.items() if k[:2] == key and g.starts]
    if not mine:
        return ""
    starts, restarts = sum(g.starts for g in mine), sum(g.restarts for g in mine)
    sizes = ", ".join(str(W) for W in sorted({g.world for g in mine}))
    again = (f"{restarts} restart(s), each after a hang, a crash or a rank that raised while others waited "
             "(every other call, shrinking included, reused the running group of its world size)"
             if restarts else "no restart: every call, shrinking included, reused the running group of its "
             "world size")
    return (f"sharded worker groups: {starts} start(s) for world sizes {sizes}, "
            f"{sum(g.start_seconds for g in mine):.1f} s starting; {again}")


def group_for(impl: Any, device: str = "cpu", world_size: int | None = None) -> WorkerGroup:
    """The worker group of ``impl`` on ``device`` for ``world_size`` ranks (None: the largest
    it declares, :func:`world_for`), created, not started, on first use; before it starts,
    the least recently used groups are stopped until :data:`MAX_LIVE_RANKS` allows it. An
    implementation nobody registered is resolved in the ranks by its name (a built-in or
    ``mutant:NAME``)."""
    spec, options = _NAMES.get(id(impl), (impl.name, {}))
    top = world_for(impl, device)
    W = top if world_size is None else int(world_size)
    if not 1 <= W <= top:
        raise ValueError(f"world_size={world_size} must be in 1..{top} for {spec} on {device} "
                         f"(max_world_size, at most {DEFAULT_WORLD}, on CUDA one rank per GPU)")
    key = (spec, tuple(sorted(options.items())), device, W)
    if key not in _GROUPS:
        _GROUPS[key] = WorkerGroup(spec, options, world=W, device=device)
    group = _GROUPS[key]
    if not group.running:
        _make_room(group)
    return group


def _make_room(group: WorkerGroup) -> None:
    """Stop the least recently used running groups until ``group`` may start."""
    running = sorted((g for g in _GROUPS.values() if g.running and g is not group), key=lambda g: g.last_used)
    live = sum(g.world for g in running)
    while running and live + group.world > MAX_LIVE_RANKS:
        oldest = running.pop(0)
        live -= oldest.world
        oldest.close()


def world_for(impl: Any, device: str = "cpu", n_gpus: int | None = None) -> int:
    """The largest world size of ``impl`` on ``device``: its ``max_world_size``, capped by
    :data:`DEFAULT_WORLD` and, on CUDA, by the GPUs (``backends.ranks_for``)."""
    return backends.ranks_for(impl.caps("sharded"), device, n_gpus)


def stats() -> dict[str, float]:
    """Every group's starts so far, the restarts among them (a start after a hang, a crash
    or a rank that raised while others waited killed the group), and the seconds spent
    starting."""
    groups = list(_GROUPS.values())
    return {"starts": sum(g.starts for g in groups), "restarts": sum(g.restarts for g in groups),
            "start_seconds": sum(g.start_seconds for g in groups)}


def close_all() -> None:
    """Stop every group (the end of the run)."""
    for group in list(_GROUPS.values()):
        group.close()
    _GROUPS.clear()
    forkserver.close()


def live_processes() -> list[int]:
    """The pids of every rank process still alive (tests: none after a broken case)."""
    return [p.pid for g in _GROUPS.values() for p in g.processes if p.poll() is None]


atexit.register(close_all)
