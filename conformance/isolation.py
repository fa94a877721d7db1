"""Process isolation: run an untrusted or crashing implementation in a worker process.

With ``--isolate=always`` (or ``auto`` choosing it, see :func:`choose`) the pytest
process never runs the implementation's code. A worker process
(``python -m conformance.isolation``) resolves ``--impl`` itself, probing included, and
runs each example's whole check (``check(target, case)`` of the property: the calls,
the backward passes, the comparison with the oracle) on the case it is sent. The
pytest process keeps drawing and shrinking cases with Hypothesis, and certifies the
:class:`IsolatedImplementation` the worker described (capabilities, expected
failures, skip reasons) without ever importing the implementation.

Protocol, over two pipes of the worker's own (never its stdout): each message is a
frame ``<u32 header length><u32 payload length><JSON header><.npz payload>``; cases
travel as NumPy arrays (loaded with ``allow_pickle=False``) plus JSON, so nothing is
ever unpickled. Requests: ``resolve`` (spec, options, timeout) and ``check``
(property id, target, case). While a check runs, the worker writes the time each call
into the implementation started (0 when none runs) into a small shared file, the
*call clock*; the pytest process reads it between waits, so it enforces the per-call
timeout itself without being woken by every call: a call that does not return in time,
or a worker that dies (``os._exit``, ``abort``, a segfault), kills the worker, fails
the property with the case saved (:class:`~conformance.runner.ImplementationHung`,
:class:`~conformance.runner.ImplementationCrashed`), and the next check starts a
fresh worker. The worker's stdout and stderr go to a log file whose last lines are
quoted in a crash message.

Cost, measured on this project's shared (heavily loaded) 2-core CPU machine: the
plumbing of one example (the case as ``.npz``, two pipe transfers) is about 1 ms, and
3-8 ms end to end under load; starting a worker (interpreter, torch, the suite,
resolution) about 5 s, once per session and again after each crash. A bare SDPA
function given as ``file.py:attr``, ``--hypothesis-profile=ci --dtype=float32``, every
property: 12 s in-process, 19-20 s isolated. That is not small, so ``auto`` isolates
only an implementation an earlier run in this checkout saw crash; pass
``--isolate=always`` for untrusted code. In-process, every call still goes through
``implementations.guard`` (timeouts, exceptions, global state): only the death of the
process itself needs a worker.

Crash markers (``.conformance/``, or ``$ATTENTION_CONFORMANCE_STATE``): every pytest
process that runs property tests keeps ``running-<pid>.json`` (implementation and
current test) and removes it when it finishes cleanly. A later run that finds one
whose process is gone records a crash of that implementation in ``crashes.json``; so
does a worker that dies in isolated mode and an xdist worker that crashes. ``auto``
isolates every implementation recorded there (delete the file to forget).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import io
import json
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from conformance.levels import LEVEL_MODULES
from implementations.base import (
    ALL_DTYPES,
    Capabilities,
    ExpectedFailure,
    Implementation,
    ImplementationError,
)

__all__ = [
    "ISOLATE_MODES",
    "IsolatedImplementation",
    "Worker",
    "WorkerDied",
    "case_digest",
    "choose",
    "crash_seen",
    "decode_case",
    "encode_case",
    "forget_running",
    "mark_running",
    "record_crash",
]

#: ``--isolate`` values.
ISOLATE_MODES = ("auto", "always", "never")
#: The call clock's layout: when the running call started (time.monotonic(), one
#: clock for every process of the machine), 0.0 when no call runs.
_CLOCK = struct.Struct("<d")


def state_dir() -> Path:
    """Where the crash markers live (``$ATTENTION_CONFORMANCE_STATE``, default ``.conformance``)."""
    return Path(os.environ.get("ATTENTION_CONFORMANCE_STATE", ".conformance"))


# --------------------------------------------------------------------------- cases as arrays + JSON


def _case_classes() -> dict[str, type]:
    from conformance import levels
    from conformance.cases import MHACase, SDPACase
    from spec import MHAParams

    extra = {cls.__name__: cls for cls in (levels.module(n).Case for n in levels.LEVEL_MODULES)}
    return {"SDPACase": SDPACase, "MHACase": MHACase, "MHAParams": MHAParams, **extra}


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON data")


def encode_case(case: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(meta, arrays)`` for an SDPACase or MHACase (and the MHAParams inside):
    arrays by dotted field name, everything else JSON data; a field holding the very
    array of an earlier one (self-attention: key is query) says so."""
    arrays: dict[str, np.ndarray] = {}
    seen: dict[int, str] = {}

    def encode(obj: Any, prefix: str) -> dict[str, Any]:
        meta: dict[str, Any] = {"__class__": type(obj).__name__}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            name = prefix + f.name
            if isinstance(value, np.ndarray):
                if id(value) in seen:
                    meta[f.name] = {"__same_as__": seen[id(value)]}
                else:
                    seen[id(value)] = name
                    arrays[name] = value
                    meta[f.name] = {"__array__": name}
            elif dataclasses.is_dataclass(value):
                meta[f.name] = encode(value, name + ".")
            elif isinstance(value, tuple):
                meta[f.name] = {"__tuple__": list(value)}
            else:
                meta[f.name] = value
        return meta

    return encode(case, ""), arrays


def decode_case(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> Any:
    """The case :func:`encode_case` encoded."""
    classes = _case_classes()
    made: dict[str, np.ndarray] = {}

    def decode(m: dict[str, Any]) -> Any:
        values = {}
        for key, value in m.items():
            if key == "__class__":
                continue
            if isinstance(value, dict) and "__array__" in value:
                values[key] = made.setdefault(value["__array__"], arrays[value["__array__"]])
            elif isinstance(value, dict) and "__same_as__" in value:
                values[key] = made[value["__same_as__"]]
            elif isinstance(value, dict) and "__tuple__" in value:
                values[key] = tuple(value["__tuple__"])
            elif isinstance(value, dict) and "__class__" in value:
                values[key] = decode(value)
            else:
                values[key] = value
        return classes[m["__class__"]](**values)

    return decode(meta)


def case_digest(case: Any) -> str:
    """A digest of the case's contents (the same case drawn twice has the same one)."""
    meta, arrays = encode_case(case)
    h = hashlib.sha1(json.dumps(meta, sort_keys=True, default=_json_default).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- framing


def _write_frame(fd: int, header: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> None:
    payload = b""
    if arrays:
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        payload = buffer.getvalue()
    head = json.dumps(header, default=_json_default).encode()
    data = memoryview(struct.pack("<II", len(head), len(payload)) + head + payload)
    while data:
        data = data[os.write(fd, data):]


def _read_exactly(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other end of the pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    head_len, payload_len = struct.unpack("<II", _read_exactly(fd, 8))
    header = json.loads(_read_exactly(fd, head_len))
    arrays: dict[str, np.ndarray] = {}
    if payload_len:
        with np.load(io.BytesIO(_read_exactly(fd, payload_len)), allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    return header, arrays


# --------------------------------------------------------------------------- the implementation as data


def _caps_to_json(caps: Capabilities) -> dict[str, Any]:
    return {f.name: (sorted(v) if isinstance(v, (set, frozenset)) else list(v) if isinstance(v, tuple) else v)
            for f in dataclasses.fields(caps) for v in [getattr(caps, f.name)]}


def _caps_from_json(data: dict[str, Any]) -> Capabilities:
    values = {}
    for f in dataclasses.fields(Capabilities):
        if f.name not in data:
            continue
        value = data[f.name]
        if f.name in ("mask_kinds", "mha_features") or f.name.endswith("_features"):
            value = frozenset(value)
        elif isinstance(value, list):
            value = tuple(value)
        values[f.name] = value
    return Capabilities(**values)


#: The levels of ``conformance.levels`` (each an Implementation field and its capabilities).
_LEVELS = tuple(LEVEL_MODULES)


def _skip_key(level: str, device: str, dtype: str) -> str:
    return f"{level}/{device}/{dtype}"


def _describe(impl: Implementation) -> dict[str, Any]:
    """What the pytest process needs to know of the implementation, as JSON data."""
    return {
        "name": impl.name,
        "version": impl.version,
        "description": impl.description,
        "unavailable_reason": impl.unavailable_reason,
        "listed": impl.listed,
        "sdpa": impl.sdpa is not None,
        "mha": impl.mha is not None,
        "capabilities": _caps_to_json(impl.capabilities),
        "mha_capabilities": None if impl.mha_capabilities is None else _caps_to_json(impl.mha_capabilities),
        # conformance.levels: each level's callable (present or not) and its capabilities.
        "levels": {level: {"present": getattr(impl, level) is not None,
                           "capabilities": None if getattr(impl, f"{level}_capabilities") is None
                           else _caps_to_json(getattr(impl, f"{level}_capabilities"))}
                   for level in _LEVELS},
        "expected_failures": [dataclasses.asdict(e) | {"match": dict(e.match)} for e in impl.expected_failures],
        # An Implementation subclass may say more than its capabilities do.
        "skip_reasons": {
            _skip_key(level, device, dtype): impl.not_supported_reasons(
                {"level": level, "device": device, "dtype": dtype})
            for level in ("sdpa", "mha", *_LEVELS) for device in ("cpu", "cuda") for dtype in ALL_DTYPES
        },
    }


class _OnlyInTheWorker:
    """Stands in for the implementation's callables in the pytest process."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"the implementation's {self.what} runs only in its isolated worker process "
            "(--isolate); call it through conformance.isolation.Worker.check"
        )


@dataclass
class IsolatedImplementation(Implementation):
    """The implementation a worker resolved, as the pytest process sees it: names,
    capabilities, expected failures and skip reasons; its ``sdpa`` and ``mha`` raise
    (the calls happen in the worker)."""

    skip_reasons: dict[str, list[str]] = field(default_factory=dict, repr=False)

    def not_supported_reasons(self, case: Any) -> list[str]:
        if set(case) == {"level", "device", "dtype"}:
            key = _skip_key(case["level"], case["device"], case["dtype"])
            if key in self.skip_reasons:
                return list(self.skip_reasons[key])
        return super().not_supported_reasons(case)

    @classmethod
    def from_description(cls, data: dict[str, Any]) -> IsolatedImplementation:
        return cls(
            name=data["name"],
            capabilities=_caps_from_json(data["capabilities"]),
            sdpa=_OnlyInTheWorker("sdpa") if data["sdpa"] else None,
            mha=_OnlyInTheWorker("mha") if data["mha"] else None,
            load_weights=_OnlyInTheWorker("load_weights") if data["mha"] else None,
            mha_capabilities=None if data["mha_capabilities"] is None else _caps_from_json(data["mha_capabilities"]),
            **{level: _OnlyInTheWorker(level) if entry["present"] else None
               for level, entry in data.get("levels", {}).items()},
            **{f"{level}_capabilities": None if entry["capabilities"] is None else _caps_from_json(entry["capabilities"])
               for level, entry in data.get("levels", {}).items()},
            version=data["version"],
            description=data["description"],
            expected_failures=tuple(ExpectedFailure(**e) for e in data["expected_failures"]),
            unavailable_reason=data["unavailable_reason"],
            listed=data["listed"],
            skip_reasons=data["skip_reasons"],
        )


# --------------------------------------------------------------------------- the pytest side


class WorkerDied(Exception):
    """The worker process ended (``how``: exit code or signal, ``log``: its last output lines)."""

    def __init__(self, how: str, log: str, during_call: bool) -> None:
        self.how, self.log, self.during_call = how, log, during_call
        super().__init__(how)


class WorkerTimedOut(Exception):
    """A call in the worker did not return within the timeout; the worker was killed."""


def _how_it_ended(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}" + (" (abort)" if name == "SIGABRT" else
                                      " (segmentation fault)" if name == "SIGSEGV" else "")
    return f"exit code {returncode} (os._exit in the implementation?)"


class Worker:
    """One worker process certifying ``spec`` (``options``: ``--impl-option`` pairs;
    ``timeout``: ``--example-timeout``). Started on first use and again after it dies."""

    #: Seconds the suite's own code in the worker may take between two calls.
    SUITE_LIMIT = 900.0

    def __init__(self, spec: str, options: dict[str, str], timeout: float) -> None:
        self.spec, self.options, self.timeout = spec, dict(options), timeout
        self.process: subprocess.Popen | None = None
        self.description: dict[str, Any] | None = None
        self.starts = 0
        self._to_worker = self._from_worker = -1
        self._log: Any = None
        self._clock: Any = None  # the call clock: 8 bytes, a float64 time.monotonic() or 0

    # -- life cycle

    def start(self) -> IsolatedImplementation:
        """Start the worker and resolve the implementation there (raises
        ImplementationError, WorkerDied or WorkerTimedOut)."""
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        self._log = tempfile.NamedTemporaryFile(prefix="conformance-worker-", suffix=".log", delete=False)
        self._clock = tempfile.TemporaryFile()
        os.pwrite(self._clock.fileno(), _CLOCK.pack(0.0), 0)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "conformance.isolation", str(request_r), str(reply_w),
             str(self._clock.fileno())],
            pass_fds=(request_r, reply_w, self._clock.fileno()), stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=os.getcwd(),
        )
        os.close(request_r)
        os.close(reply_w)
        self._to_worker, self._from_worker = request_w, reply_r
        self.starts += 1
        # Resolution probes with ~20 calls, each limited by the worker's own guard.
        limit = None if not self.timeout else 30 * self.timeout + 120
        reply, _ = self._request({"op": "resolve", "spec": self.spec, "options": self.options,
                                  "timeout": self.timeout}, limit=limit)
        if "error" in reply:
            self.close()
            raise ImplementationError(reply["error"])
        self.description = reply["implementation"]
        return IsolatedImplementation.from_description(self.description)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def close(self) -> None:
        """Stop the worker (killed: it may be stuck in the implementation)."""
        for fd in (self._to_worker, self._from_worker):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._to_worker = self._from_worker = -1
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
        if self._clock is not None:
            self._clock.close()
            self._clock = None
        if self._log is not None:
            self._log.close()
            try:
                os.unlink(self._log.name)
            except OSError:
                pass
            self._log = None

    def _log_tail(self, lines: int = 6) -> str:
        if self._log is None:
            return ""
        try:
            text = Path(self._log.name).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    # -- requests

    def _request(self, header: dict[str, Any], arrays: dict[str, np.ndarray] | None = None, *,
                 limit: float | None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """Send a request; read replies until the answer. ``limit``: seconds the whole
        request may take (None: only the per-call timeout applies)."""
        try:
            _write_frame(self._to_worker, header, arrays)
        except OSError:
            pass  # it died: the read below says how
        start = last_call_end = time.monotonic()
        # Between waits, read the call clock: how long the current call has run.
        poll = min(max(self.timeout / 10, 0.02), 1.0) if self.timeout else 1.0
        while True:
            ready, _, _ = select.select([self._from_worker], [], [], poll)
            if ready:
                try:
                    return _read_frame(self._from_worker)
                except (EOFError, OSError, struct.error, ValueError):
                    raise self._died(self._call_started() > 0) from None
            now, call_started = time.monotonic(), self._call_started()
            if call_started:
                last_call_end = now
                if self.timeout and now - call_started > self.timeout:
                    self._kill()
                    raise WorkerTimedOut()
            elif (limit is not None and now - start > limit) or now - last_call_end > self.SUITE_LIMIT:
                self._kill()
                raise RuntimeError(
                    f"the isolated worker did not answer {header['op']!r} within "
                    f"{limit if limit is not None else self.SUITE_LIMIT:g}s (the suite's own code, "
                    "or resolution); it was killed"
                )

    def _call_started(self) -> float:
        """When the call into the implementation now running started (0: none runs)."""
        try:
            return _CLOCK.unpack(os.pread(self._clock.fileno(), _CLOCK.size, 0))[0]
        except (OSError, struct.error, AttributeError):
            return 0.0

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def _died(self, during_call: bool) -> WorkerDied:
        assert self.process is not None
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._kill()
        return WorkerDied(_how_it_ended(self.process.returncode), self._log_tail(), during_call)

    def check(self, property_id: str, target: Any, case: Any) -> float | None:
        """Run property ``property_id``'s check on ``case`` in the worker; returns its
        ratio or raises what it raised (a PropertyFailure subclass, or RuntimeError
        for an error of the suite itself). A hang or a crash kills the worker (a fresh
        one is started on the next call) and raises ImplementationHung /
        ImplementationCrashed."""
        from conformance import runner

        if not self.alive:
            self.close()
            try:
                self.start()
            except WorkerDied as died:
                record_crash(self.spec, f"{died.how} while resolving it again")
                raise runner.ImplementationCrashed(
                    f"{self.spec} ended a fresh isolated worker process while it was resolved "
                    f"again, before {property_id}[{target.id}] could run: {died.how}"
                ) from None
            except (ImplementationError, RuntimeError) as err:
                raise runner.PropertyFailure(
                    f"a fresh isolated worker could not resolve {self.spec} again (it had the first "
                    f"time): {err}"
                ) from None
        meta, arrays = encode_case(case)
        header = {"op": "check", "property": property_id, "level": target.level, "dtype": target.dtype,
                  "device": target.device, "timeout": target.timeout, "case": meta}
        name = target.impl.name
        hung = (f"{name} did not return within {target.timeout:g}s (per-example timeout, "
                "--example-timeout); its isolated worker process was killed and a fresh one continues")
        try:
            reply, _ = self._request(header, arrays, limit=None)
        except WorkerTimedOut:
            self.close()
            raise runner.ImplementationHung(hung) from None
        except WorkerDied as died:
            self.close()
            record_crash(self.spec, f"{died.how} during {property_id}[{target.id}]")
            where = "during a call into it" if died.during_call else "between calls (in the suite's code)"
            log = f"\nlast output of the worker:\n{died.log}" if died.log else ""
            raise runner.ImplementationCrashed(
                f"{name} ended its isolated worker process {where}: {died.how}; "
                f"a fresh worker continues{log}"
            ) from None
        if "ratio" in reply:
            return reply["ratio"]
        if reply.get("failure") == "ImplementationHung":  # the worker's own guard saw it first
            self.close()  # its call thread is still running
            raise runner.ImplementationHung(hung)
        if "failure" in reply:
            cls = getattr(runner, reply["failure"], None)
            if not (isinstance(cls, type) and issubclass(cls, runner.PropertyFailure)):
                cls = runner.PropertyFailure
            raise cls(reply["message"])
        raise RuntimeError(f"the suite raised in the isolated worker: {reply.get('error')}")


# --------------------------------------------------------------------------- choosing, crash markers


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


# --------------------------------------------------------------------------- the worker side


@contextmanager
def _on_the_clock(clock_fd: int) -> Iterator[None]:
    """Around each call into the implementation in the worker: its start on the call clock."""
    os.pwrite(clock_fd, _CLOCK.pack(time.monotonic()), 0)
    try:
        yield
    finally:
        os.pwrite(clock_fd, _CLOCK.pack(0.0), 0)


def _serve(request_fd: int, reply_fd: int, clock_fd: int) -> int:
    import functools

    from conformance import runner
    from implementations import registry

    checks = runner.registered_checks()
    impl: Implementation | None = None
    watch = functools.partial(_on_the_clock, clock_fd)
    while True:
        try:
            header, arrays = _read_frame(request_fd)
        except EOFError:
            return 0
        if header["op"] == "resolve":
            try:
                impl = registry.resolve(header["spec"], header["options"] or None, timeout=header["timeout"])
            except ImplementationError as exc:
                _write_frame(reply_fd, {"error": str(exc)})
                continue
            _write_frame(reply_fd, {"implementation": _describe(impl)})
        elif header["op"] == "check":
            assert impl is not None, "check before resolve"
            target = runner.Target(impl, header["level"], header["dtype"], header["device"],
                                   header["timeout"], watch=watch)
            try:
                case = decode_case(header["case"], arrays)
                ratio = checks[header["property"]](target, case)
            except runner.PropertyFailure as exc:
                _write_frame(reply_fd, {"failure": type(exc).__name__, "message": str(exc)})
            except Exception as exc:  # noqa: BLE001 - the suite's own error, reported as such
                _write_frame(reply_fd, {"error": "".join(traceback.format_exception(exc))[-4000:]})
            else:
                _write_frame(reply_fd, {"ratio": None if ratio is None else float(ratio)})


def main(argv: list[str]) -> int:
    """``python -m conformance.isolation REQUEST_FD REPLY_FD CLOCK_FD``: serve one pytest process."""
    import faulthandler

    faulthandler.enable()  # a segfault leaves its traceback in the log quoted on a crash
    return _serve(int(argv[0]), int(argv[1]), int(argv[2]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
