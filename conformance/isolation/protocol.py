"""What crosses the pipes between the pytest process and an isolated worker.

A message is a frame ``<u32 header length><u32 payload length><JSON header><.npz
payload>`` (:func:`write_frame` / :func:`read_frame`); a case travels as NumPy
arrays plus JSON (:func:`encode_case` / :func:`decode_case`, loaded with
``allow_pickle=False``, so nothing is ever unpickled); the implementation a worker
resolved travels as JSON data (:func:`describe_implementation`) and becomes an
:class:`IsolatedImplementation` in the pytest process. ``CALL_CLOCK`` is the layout
of the small shared file where the worker writes when its running call started.
See :mod:`conformance.isolation.supervisor` for the whole protocol.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from conformance.core.levels import LEVEL_MODULES
from implementations.base import (
    ALL_DTYPES,
    Capabilities,
    ExpectedFailure,
    Implementation,
)

__all__ = [
    "CALL_CLOCK",
    "IsolatedImplementation",
    "case_digest",
    "decode_case",
    "describe_implementation",
    "CalledAttrs",
    "decode_attrs",
    "decode_calls",
    "encode_attrs",
    "encode_calls",
    "encode_case",
    "prefixed",
    "read_frame",
    "unprefixed",
    "write_frame",
]

#: The call clock's layout: when the running call started (time.monotonic(), one
#: clock for every process of the machine), 0.0 when no call runs.
CALL_CLOCK = struct.Struct("<d")


# --------------------------------------------------------------------------- cases as arrays + JSON


def _case_classes() -> dict[str, type]:
    from conformance.core import levels
    from conformance.core.cases import MHACase, SDPACase
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


def _tagged(value: Any) -> Any:
    if isinstance(value, tuple):
        return {"__tuple__": [_tagged(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {"__set__": [_tagged(v) for v in sorted(value, key=repr)]}
    if isinstance(value, np.generic):
        return value.item()
    return value


def _untagged(value: Any) -> Any:
    if isinstance(value, dict) and "__tuple__" in value:
        return tuple(_untagged(v) for v in value["__tuple__"])
    if isinstance(value, dict) and "__set__" in value:
        return {_untagged(v) for v in value["__set__"]}
    return value


def encode_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """A call's attributes as JSON data that :func:`decode_attrs` gives back with the
    same types (tuples and sets stay tuples and sets: expected failures compare them)."""
    return {key: _tagged(value) for key, value in attrs.items()}


def decode_attrs(data: dict[str, Any]) -> dict[str, Any]:
    return {key: _untagged(value) for key, value in data.items()}


class CalledAttrs:
    """What the pytest process keeps of a call a passing example made in the worker:
    its attributes (``call.attrs()``, sent through :func:`encode_attrs`), which
    expected failures are matched against."""

    __slots__ = ("_attrs",)

    def __init__(self, attrs: dict[str, Any]) -> None:
        self._attrs = decode_attrs(attrs)

    def attrs(self) -> dict[str, Any]:
        return dict(self._attrs)


def prefixed(arrays: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """``arrays`` with each name under ``prefix`` (several groups in one frame)."""
    return {prefix + name: value for name, value in arrays.items()}


def unprefixed(arrays: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The arrays of one group :func:`prefixed` put under ``prefix``, named as before."""
    return {name[len(prefix):]: value for name, value in arrays.items() if name.startswith(prefix)}


def encode_calls(calls: list[Any]) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    """The calls an example made (replay call specs) as JSON data and arrays, each
    call's arrays under ``call<i>/`` (the format of a saved failure's call)."""
    from conformance.reporting.failures import _call_meta

    metas, arrays = [], {}
    for i, call in enumerate(calls):
        meta, own = _call_meta(call)
        metas.append(meta)
        arrays.update(prefixed(own, f"call{i}/"))
    return metas, arrays


def decode_calls(metas: list[dict[str, Any]], arrays: dict[str, np.ndarray],
                 case: Any = None) -> list[Any]:
    """The calls :func:`encode_calls` encoded; a call on the very contents of ``case``
    is given ``case`` itself (a call spec is "as drawn" only on its case object)."""
    from conformance.reporting.failures import _call_from

    digest = case_digest(case) if case is not None else None
    calls = []
    for i, meta in enumerate(metas):
        call = _call_from(meta, unprefixed(arrays, f"call{i}/"))
        if digest is not None and case_digest(call.case) == digest:
            call = dataclasses.replace(call, case=case)
        calls.append(call)
    return calls


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


def write_frame(fd: int, header: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> None:
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


def read_frame(fd: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
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


#: The levels of ``conformance.core.levels`` (each an Implementation field and its capabilities).
_LEVELS = tuple(LEVEL_MODULES)
#: The fields of an Implementation (a level's own capabilities field is optional).
_FIELDS = frozenset(f.name for f in dataclasses.fields(Implementation))


def _skip_key(level: str, device: str, dtype: str) -> str:
    return f"{level}/{device}/{dtype}"


def describe_implementation(impl: Implementation) -> dict[str, Any]:
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
        # conformance.core.levels: each level's callable (present or not) and its own capabilities
        # (a field <level>_capabilities where the level has one, as flash does).
        "levels": {level: {"present": getattr(impl, level) is not None,
                           "capabilities": None if getattr(impl, f"{level}_capabilities", None) is None
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
            "(--isolate); call it through conformance.isolation.supervisor.Worker.check"
        )


@dataclass
class IsolatedImplementation(Implementation):
    """The implementation a worker resolved, as the pytest process sees it: names,
    capabilities, expected failures and skip reasons; its ``sdpa`` and ``mha`` raise
    (the calls happen in the worker)."""

    skip_reasons: dict[str, list[str]] = field(default_factory=dict, repr=False)
    #: Its calls are made in the worker, never in this process (``failures`` reads it).
    calls_elsewhere: ClassVar[bool] = True

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
               for level, entry in data.get("levels", {}).items() if f"{level}_capabilities" in _FIELDS},
            version=data["version"],
            description=data["description"],
            expected_failures=tuple(ExpectedFailure(**e) for e in data["expected_failures"]),
            unavailable_reason=data["unavailable_reason"],
            listed=data["listed"],
            skip_reasons=data["skip_reasons"],
        )
