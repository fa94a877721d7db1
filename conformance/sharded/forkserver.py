"""A fork server for the sharded level's rank processes (the pytest side and the server).

Starting a rank as ``python -m conformance.sharded.worker`` costs an interpreter and the
import of torch and the registry, for every rank of every group: most of a sharded run on
the CPU (the four groups of a ``ci`` run of ``ring`` started in 74 s of its 146 s). The
server is started once per run: it imports what every rank needs, then forks a rank on
request (the child runs ``worker.main`` with its own log as stdout and stderr, and its
own environment entries) and reaps it, reporting its exit code. :class:`ForkedRank` gives
the supervisor (``group``) what it uses of a ``subprocess.Popen``: ``pid``, ``poll``,
``wait``, ``kill``, ``send_signal``.

The server is one thread (it never forks while another thread of it holds a lock) and
imports torch without running it (no thread pool, no CUDA): CPU groups only; CUDA groups
(NCCL) spawn their ranks as before, and so does everything where ``os.fork`` is missing or
``ATTENTION_CONFORMANCE_SHARDED_FORK=0`` is set.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from typing import Any

__all__ = ["ForkServer", "ForkedRank", "available", "server", "stop"]

#: Seconds the server may take to import what the ranks need.
START_TIMEOUT = 120.0


def available(device: str) -> bool:
    """Whether ranks of ``device`` are forked from the server (CPU, a platform with fork,
    not turned off)."""
    return (device == "cpu" and hasattr(os, "fork") and sys.platform.startswith("linux")
            and os.environ.get("ATTENTION_CONFORMANCE_SHARDED_FORK", "1") != "0")


class ForkedRank:
    """A rank process forked by the server, as ``group`` uses a ``subprocess.Popen``."""

    def __init__(self, pid: int, owner: ForkServer) -> None:
        self.pid, self._owner = pid, owner

    @property
    def returncode(self) -> int | None:
        return self._owner.exit_code(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The supervisor's handle on the server process (one per run: :func:`server`)."""

    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.process = subprocess.Popen([sys.executable, "-m", "conformance.sharded.forkserver"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        env=env)
        self._codes: dict[int, int] = {}
        self._pids: dict[int, int] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._ready = False
        self._gone = False
        threading.Thread(target=self._read, daemon=True).start()
        with self._changed:
            self._changed.wait_for(lambda: self._ready or self._gone, timeout=START_TIMEOUT)
        if not self._ready:
            self.close()
            raise RuntimeError("the sharded level's fork server did not start")

    def _read(self) -> None:
        for line in self.process.stdout:
            message = json.loads(line)
            with self._changed:
                if message.get("ready"):
                    self._ready = True
                elif "forked" in message:
                    self._pids[message["forked"]] = message["pid"]
                elif "exited" in message:
                    self._codes[message["exited"]] = message["code"]
                self._changed.notify_all()
        with self._changed:  # the server ended: its ranks are reported ended (and killed)
            self._gone = True
            for pid in self._pids.values():
                if pid not in self._codes:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    self._codes[pid] = -signal.SIGKILL
            self._changed.notify_all()

    @property
    def alive(self) -> bool:
        return not self._gone and self.process.poll() is None

    def exit_code(self, pid: int) -> int | None:
        with self._lock:
            return self._codes.get(pid)

    def fork(self, rank: int, config: str, log: str, env: dict[str, str]) -> ForkedRank:
        """A rank process running ``worker.main(rank, config)``, its output to ``log``."""
        with self._changed:
            self._next += 1
            ident = self._next
        request = json.dumps({"id": ident, "rank": rank, "config": config, "log": log, "env": env})
        self.process.stdin.write((request + "\n").encode())
        self.process.stdin.flush()
        with self._changed:
            self._changed.wait_for(lambda: ident in self._pids or self._gone, timeout=30)
            if ident not in self._pids:
                raise RuntimeError("the sharded level's fork server did not fork a rank")
            return ForkedRank(self._pids[ident], self)

    def close(self) -> None:
        stop(self.process)


def stop(process: subprocess.Popen) -> None:
    """End a server that reads requests on its stdin: close its input (it ends when its
    input does) and wait for it, killing it after 5 s."""
    try:
        process.stdin.close()
    except OSError:
        pass
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


_SERVER: ForkServer | None = None


def server() -> ForkServer:
    """The run's fork server, started on first use (again if it ended)."""
    global _SERVER
    if _SERVER is None or not _SERVER.alive:
        _SERVER = ForkServer()
    return _SERVER


def close() -> None:
    global _SERVER
    if _SERVER is not None:
        _SERVER.close()
        _SERVER = None


# --------------------------------------------------------------------------- the server


def _child(request: dict[str, Any], out: int) -> None:
    """In the forked rank: its own output and environment, then the rank's life."""
    code = 0
    try:
        os.close(out)
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        # fresh stream objects: the server's own may hold state from before the fork
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.environ.update(request["env"])
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        from conformance.sharded import worker

        worker.main(int(request["rank"]), json.loads(request["config"]))
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - the rank's output says why
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve() -> None:
    import numpy  # noqa: F401 - imported once here, shared by every forked rank
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    import implementations.registry  # noqa: F401
    from conformance.sharded import worker  # noqa: F401

    out = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing but messages on the pipe

    def send(message: dict[str, Any]) -> None:
        os.write(out, (json.dumps(message) + "\n").encode())

    send({"ready": True})
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin.buffer, selectors.EVENT_READ)
    pending = b""
    children: set[int] = set()
    open_input = True
    while open_input or children:
        if open_input and selector.select(timeout=0.05):
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:
                open_input = False
                selector.unregister(sys.stdin.buffer)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request, out)
                children.add(pid)
                send({"forked": request["id"], "pid": pid})
        elif not open_input:
            time.sleep(0.05)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        if not open_input:  # the supervisor is gone: end the ranks left
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


if __name__ == "__main__":
    _serve()
