"""``python -m pytest`` for the tests that run the suite as a user would, forked from a
server that has already imported torch.

A fresh ``python -m pytest`` spends about 2 s on two cores before it collects anything
(the interpreter, then torch, NumPy, Hypothesis and pytest), and the project's tests
start some 300 of them: about a fifth of the test command's time (docs/SPEED.md). A
server, started on first use by the test process, imports those modules once and does
nothing else (no thread, no torch op); each run is a child forked from it that takes the
run's working directory, environment, ``sys.path`` and ``sys.argv`` as a fresh ``python
-m pytest`` would, then runs pytest's ``__main__`` and its exit handlers.

What a fork cannot change is the environment read when the interpreter starts or a
preloaded module is imported (``PYTHON*`` other than ``PYTHONPATH``, ``OMP_*``,
``ATEN_*``, ``TORCH*``...): a server is started in each such environment a run asks
for (the two used last are kept), so that its children start as a fresh process in that
environment would. Paddle sets ``OMP_NUM_THREADS=1`` in the test process on import, for
one: the runs after it get a server started with it.

:func:`run` is ``subprocess.run`` for such a command, and falls back to it for a command
other than ``python -m pytest ARGS``, input on stdin, output to a file object, a platform
without ``fork``, or ``ATTENTION_CONFORMANCE_TEST_FORK=0`` in the run's environment.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

__all__ = ["run", "forked"]

#: Variables read when the interpreter starts or a preloaded module is imported: a run
#: gets a server started with its own values of these.
START_VARIABLES = ("PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOTO", "ATEN_", "TORCH", "PYTORCH",
                   "CUDA", "NUMPY", "NPY_", "HYPOTHESIS", "LD_", "MALLOC", "GLIBC")
#: What the server imports before it forks: most of a fresh pytest process's start. The
#: other pytest plugins installed (entry points, jaxtyping's and anyio's here) are imported
#: too, except this project's, whose modules read the run's environment when imported.
PRELOAD = ("numpy", "torch", "torch.nn.functional", "hypothesis", "pytest", "_pytest.python", "_pytest.main",
           "_pytest.pytester")

_SUPPORTED = {"cwd", "env", "capture_output", "text", "timeout", "check", "stdout", "stderr"}


def _start_variable(key: str) -> bool:
    return key != "PYTHONPATH" and key.upper().startswith(START_VARIABLES)


class _Server:
    """The test process's handle on a server started in ``env`` (runs are serialised)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, env=env, cwd=os.getcwd())
        self.lock = threading.Lock()
        self._pending = b""
        if self._message(120.0) != {"ready": True}:
            self.close()
            raise RuntimeError("the tests' pytest fork server did not start")

    def _message(self, timeout: float | None) -> dict[str, Any] | None:
        """The server's next message, None when ``timeout`` passes first."""
        fd = self.process.stdout.fileno()
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return {"gone": True}
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def alive(self) -> bool:
        return self.process.poll() is None

    def run(self, request: dict[str, Any], timeout: float | None) -> int | None:
        """The child's exit code, or None when ``timeout`` passed (the child is killed)."""
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        self.process.stdin.flush()
        started = self._message(30.0)
        if not started or "pid" not in started:
            raise RuntimeError("the tests' pytest fork server did not fork a run")
        ended = self._message(timeout)
        if ended is None:
            try:
                os.kill(started["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._message(30.0)
            return None
        if "code" not in ended:
            raise RuntimeError("the tests' pytest fork server ended during a run")
        return ended["code"]

    def close(self) -> None:
        from conformance.sharded.forkserver import stop

        stop(self.process)


#: Servers by the start variables of their environment, the one used last at the end.
_SERVERS: dict[tuple[tuple[str, str], ...], _Server] = {}
_SERVERS_LOCK = threading.Lock()
#: Servers kept at a time (a run in an environment of its own, such as a PYTHONHASHSEED
#: check, then starts one where it would have started a process).
KEPT = 2


def _signature(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if _start_variable(k)))


def _server(env: dict[str, str]) -> _Server:
    """The server started in ``env``'s start variables (started now if none is)."""
    key = _signature(env)
    with _SERVERS_LOCK:
        server = _SERVERS.pop(key, None)
        if server is None or not server.alive():
            server = _Server(env)
            atexit.register(server.close)
            log = os.environ.get("ATTENTION_CONFORMANCE_TEST_FORK_LOG")
            if log:  # which environments servers were started in (docs/SPEED.md)
                with open(log, "a") as f:
                    f.write(json.dumps({"pid": os.getpid(), "start": dict(key)}) + "\n")
        _SERVERS[key] = server
        while len(_SERVERS) > KEPT:
            _SERVERS.pop(next(iter(_SERVERS))).close()
        return server


def forked(cmd: Any, env: dict[str, str] | None = None, **kwargs: Any) -> bool:
    """Whether :func:`run` forks this command from a server (else it starts a process)."""
    if not (hasattr(os, "fork") and sys.platform.startswith("linux")):
        return False
    environ = os.environ if env is None else env
    if environ.get("ATTENTION_CONFORMANCE_TEST_FORK", "1") == "0":
        return False
    if not isinstance(cmd, (list, tuple)) or list(cmd[:3]) != [sys.executable, "-m", "pytest"]:
        return False
    if set(kwargs) - (_SUPPORTED - {"env"}):
        return False
    if kwargs.get("stdout") not in (None, subprocess.PIPE, subprocess.DEVNULL):
        return False
    return kwargs.get("stderr") in (None, subprocess.PIPE, subprocess.DEVNULL, subprocess.STDOUT)


def run(cmd: Any, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, **kwargs)``, forked from the server where :func:`forked` says so."""
    if not forked(cmd, **kwargs):
        return subprocess.run(cmd, **kwargs)  # noqa: PLW1510 - the caller's check= stands
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    server = _server(env)
    capture = kwargs.get("capture_output", False)
    wanted = {name: capture or kwargs.get(name) == subprocess.PIPE for name in ("stdout", "stderr")}
    merged = kwargs.get("stderr") == subprocess.STDOUT
    with tempfile.TemporaryDirectory(prefix="pytest-run-") as scratch:
        paths = {name: str(Path(scratch) / name) if wanted[name] else os.devnull for name in wanted}
        if merged:
            paths["stderr"] = paths["stdout"]
        request = {"args": [str(a) for a in cmd[3:]], "cwd": str(Path(kwargs.get("cwd") or os.getcwd()).resolve()),
                   "env": env, "stdout": paths["stdout"], "stderr": paths["stderr"]}
        with server.lock:
            code = server.run(request, kwargs.get("timeout"))
        outputs = {}
        for name in ("stdout", "stderr"):
            data = Path(paths[name]).read_bytes() if wanted[name] and not (merged and name == "stderr") else None
            outputs[name] = data.decode(errors="replace") if data is not None and kwargs.get("text") else data
    if code is None:
        raise subprocess.TimeoutExpired(cmd, kwargs.get("timeout"), output=outputs["stdout"], stderr=outputs["stderr"])
    result = subprocess.CompletedProcess(cmd, code, outputs["stdout"], outputs["stderr"])
    if kwargs.get("check"):
        result.check_returncode()
    return result


# --------------------------------------------------------------------------- the server


def _child(request: dict[str, Any], base_path: list[str]) -> None:
    """In the forked run: a fresh ``python -m pytest``'s state, then pytest's __main__."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        err = out if request["stderr"] == request["stdout"] else os.open(
            request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {out, err}:
            os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
        sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [request["cwd"], *(os.path.abspath(p) for p in extra), *base_path]
        sys.argv = ["-m", *request["args"]]
        sys.orig_argv = [sys.executable, "-m", "pytest", *request["args"]]
        import runpy

        runpy.run_module("pytest", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the run's output says why, as an interpreter's would
        import traceback

        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _already_rewritten(entry_points: Any) -> None:
    """Mark the preloaded modules of pytest plugins' distributions (``entry_points``' own;
    Hypothesis') as pytest's assertion rewriter's docstring marker does, so that a child's
    pytest does not warn that they were imported before it could rewrite them (a fresh
    process imports them after)."""
    from importlib import metadata

    plugins = {ep.dist.name for ep in entry_points if ep.dist is not None}
    for top, dists in metadata.packages_distributions().items():
        module = sys.modules.get(top)
        if module is not None and plugins & set(dists):
            module.__doc__ = f"{module.__doc__ or ''}\n\nPYTEST_DONT_REWRITE"


def _serve() -> None:
    import importlib
    from importlib import metadata

    own = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    base_path = [p for p in sys.path[1:] if p and os.path.abspath(p) not in own]  # less the script's folder
    entry_points = metadata.entry_points(group="pytest11")
    plugins = [ep.module for ep in entry_points if not ep.module.startswith("conformance")]
    for name in (*PRELOAD, *plugins):  # not this project's plugin: its modules read the run's environment
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a plugin that cannot load here loads (or fails) in the run
            pass
    _already_rewritten(entry_points)
    out = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing but messages on the pipe

    def send(message: dict[str, Any]) -> None:
        os.write(out, (json.dumps(message) + "\n").encode())

    send({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.close(out)
            _child(request, base_path)
        send({"pid": pid})
        _, status = os.waitpid(pid, 0)
        send({"code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
