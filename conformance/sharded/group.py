"""The sharded level's persistent worker group (the pytest side).

A :class:`WorkerGroup` is ``world`` processes (``python -m conformance.sharded.worker``,
connected back to the supervisor over a local socket) joined in one process group,
gloo on the CPU or NCCL on CUDA with one process per GPU (``backends``), started on the
first sharded call of an implementation on that device and reused by every later one
(the group of each ``--impl`` and device is kept in :data:`_GROUPS`; ``close_all`` ends
them at the end of the run, and at exit). Each call
hands the same request (the case's full arrays) to ranks ``0..w-1``, which shard it
themselves, and waits for every reply with a deadline:

* a rank that does not answer in time is a **hang** (:class:`GroupHung`), a rank whose
  process ends is a **crash** (:class:`GroupCrashed`); in both cases every process of
  the group is killed and reaped, and the next call starts a fresh group;
* a rank that raised while others may wait on it in a collective: the others get a
  short grace, then the group is killed and restarted likewise (:class:`GroupRaised`).

Like ``conformance.isolation`` (one worker per implementation, killed and restarted on a
hang or crash), extended to a group: no process outlives a case that broke it.
"""

from __future__ import annotations

import atexit
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

from conformance.sharded import backends

__all__ = ["WorkerGroup", "GroupError", "GroupHung", "GroupCrashed", "GroupRaised", "GroupStartFailed",
           "group_for", "world_for", "register", "close_all", "live_processes", "DEFAULT_WORLD", "START_TIMEOUT"]

#: Ranks in every group: world sizes 1..DEFAULT_WORLD run on its prefix subgroups.
DEFAULT_WORLD = backends.MAX_RANKS
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
        self.tmp = tempfile.mkdtemp(prefix="conformance-sharded-")
        self.starts += 1
        authkey = secrets.token_bytes(16)
        address = self._socket_address()
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
        config = json.dumps({"world": self.world, "init_file": f"{self.tmp}/rendezvous",
                             "backend": self.backend, "device": self.device,
                             "address": address, "impl_spec": self.impl_spec,
                             "options": self.options, "timeout": max(60.0, self.start_timeout)})
        env = dict(os.environ, OMP_NUM_THREADS="1", CONFORMANCE_SHARDED_AUTHKEY=authkey.hex())
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] )
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
                self.kill()
                if raised:
                    raise GroupRaised(self._raised_text(replies[raised[0]], raised[0], missing), raised[0])
                what = "start" if starting else "answer"
                raise GroupHung(f"rank(s) {missing} did not {what} within {timeout:g} s", missing[0])
            pending = [c for c, r in by_conn.items() if r not in replies]
            for conn in wait(pending, timeout=min(limit - now, 0.5)):
                rank = by_conn[conn]
                try:
                    replies[rank] = conn.recv()
                except (EOFError, OSError):
                    self.processes[rank].wait(2) if self.processes[rank].poll() is None else None
                    code = self.processes[rank].poll()
                    self.kill()
                    raise GroupCrashed(f"rank {rank}'s process ended (exit code {code}) during the call",
                                       rank) from None
                if "raised" in replies[rank] and raised_at is None:
                    raised_at = time.monotonic()
            for rank in ranks:  # a rank may die with its socket still held open by nobody else
                if rank not in replies and self.processes[rank].poll() is not None and not self.conns[rank].poll():
                    code = self.processes[rank].poll()
                    self.kill()
                    raise GroupCrashed(f"rank {rank}'s process ended (exit code {code}) during the call", rank)
        return [replies[r] for r in ranks]

    @staticmethod
    def _raised_text(reply: dict[str, Any], rank: int, missing: list[int]) -> str:
        waiting = f"; rank(s) {missing} were still waiting for it" if missing else ""
        return f"rank {rank} raised {reply['raised']}{waiting}"

    def call(self, request: dict[str, Any], world_size: int, timeout: float) -> list[dict[str, Any]]:
        """``request`` on ranks ``0..world_size-1``; their replies in rank order."""
        if not 1 <= world_size <= self.world:
            raise ValueError(f"world_size={world_size} must be in 1..{self.world}")
        if not self.running:
            self.start()
        request = dict(request, op="run", world_size=world_size)
        for rank in range(world_size):
            try:
                self.conns[rank].send(request)
            except (BrokenPipeError, OSError):
                self.kill()
                raise GroupCrashed(f"rank {rank}'s process had ended before the call", rank) from None
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


#: One group per implementation (its --impl spec and options).
_GROUPS: dict[tuple[str, tuple[tuple[str, str], ...], str], WorkerGroup] = {}
#: How each resolved implementation was named (``register``): id(impl) -> (spec, options).
_NAMES: dict[int, tuple[str, dict[str, str]]] = {}


def register(impl: Any, impl_spec: str, options: dict[str, str] | None) -> None:
    """Remember how ``impl`` was resolved, so that its ranks resolve it the same way."""
    _NAMES[id(impl)] = (impl_spec, dict(options or {}))


def group_for(impl: Any, device: str = "cpu") -> WorkerGroup:
    """The worker group of ``impl`` on ``device`` (created, not started, on first use; as many
    ranks as the largest world size it declares, at most :data:`DEFAULT_WORLD`, and on CUDA
    at most one per GPU: ``backends.world_limit``). An implementation nobody registered is
    resolved in the ranks by its name (a built-in or ``mutant:NAME``)."""
    spec, options = _NAMES.get(id(impl), (impl.name, {}))
    key = (spec, tuple(sorted(options.items())), device)
    if key not in _GROUPS:
        _GROUPS[key] = WorkerGroup(spec, options, world=world_for(impl, device), device=device)
    return _GROUPS[key]


def world_for(impl: Any, device: str = "cpu", n_gpus: int | None = None) -> int:
    """The ranks of ``impl``'s group on ``device``: its ``max_world_size``, capped by
    :data:`DEFAULT_WORLD` and, on CUDA, by the GPUs (``backends.ranks_for``)."""
    return backends.ranks_for(impl.caps("sharded"), device, n_gpus)


def close_all() -> None:
    """Stop every group (the end of the run)."""
    for group in list(_GROUPS.values()):
        group.close()
    _GROUPS.clear()


def live_processes() -> list[int]:
    """The pids of every rank process still alive (tests: none after a broken case)."""
    return [p.pid for g in _GROUPS.values() for p in g.processes if p.poll() is None]


atexit.register(close_all)
