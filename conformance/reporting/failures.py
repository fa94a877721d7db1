"""Failing cases: saved as ``.npz`` (no pickle), reproduced, replayed.

When a property fails, the shrunk case Hypothesis drew and the call the property
made into the implementation on it (a ``replay`` call spec: the case as called
and every argument) are written to
``.conformance/failures/<impl>-<property>-<target>-<digest>.npz``, and the
failure message gets notes: the property and its spec section, the
implementation, the drawn case and the called one, a self-contained Python
snippet that makes that call in a fresh interpreter and prints how its result
differs from the oracle (``replay.show_sdpa_call`` / ``show_mha_call``: the same
code the runner called), and the ``--replay`` command line that re-runs the
property on the drawn case.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from conformance.calls.replay import MHACallSpec, SDPACallSpec, first_failing_call
from conformance.core import levels
from conformance.core.cases import LAYOUTS, MHACase, SDPACase
from conformance.reporting.failure_choice import case_label, origin_line
from conformance.reporting.reproducer import LITERAL_LIMIT, _literal, reproducer  # noqa: F401 - as before the split

__all__ = ["save_case", "load_case", "load_call", "validate_saved", "Replay", "annotate", "reproducer"]

FAILURE_DIR = Path(os.environ.get("ATTENTION_CONFORMANCE_FAILURES", ".conformance/failures"))

_SDPA_ARRAYS = ("query", "key", "value", "attend_mask", "additive_mask", "sinks")
_MHA_ARRAYS = ("query", "key", "value", "key_padding_mask", "attn_mask")
_MHA_FLAGS = ("is_causal", "need_weights", "average_attn_weights", "batch_first", "unbatched", "dtype", "device")
#: What a saved file's ``kind`` may be: a level.
_KINDS = ("sdpa", "mha", *levels.LEVEL_MODULES)
#: Prefix of the called case's arrays in a saved file (the drawn case's have none).
_CALL = "call__"


@dataclass(frozen=True)
class Replay:
    """``--replay``: the saved case and the one property test (id and target id)
    that re-runs it; every other test skips."""

    property: str
    target_id: str
    case: Any


def _meta_of(case: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    arrays: dict[str, np.ndarray] = {}
    if isinstance(case, SDPACase):
        for name in _SDPA_ARRAYS:
            value = getattr(case, name)
            if value is not None:
                arrays[name] = np.asarray(value)
        meta = {
            "kind": "sdpa",
            "causal": case.causal,
            "scale": case.scale,
            "dtype": case.dtype,
            "device": case.device,
            "layout": case.layout,
            "regime": case.regime,
            "notes": list(case.notes),
        }
        return meta, arrays
    if isinstance(case, MHACase):
        # Self-attention is one array object (nn.MultiheadAttention's fast path
        # checks `query is key is value`): saved once, restored as one.
        same = {"key": "query" if case.key is case.query else None,
                "value": "query" if case.value is case.query else "key" if case.value is case.key else None}
        for name in _MHA_ARRAYS:
            value = getattr(case, name)
            if value is not None and not same.get(name):
                arrays[name] = np.asarray(value)
        params_meta = {}
        for f in dataclasses.fields(case.params):
            value = getattr(case.params, f.name)
            if isinstance(value, np.ndarray):
                arrays["params__" + f.name] = value
            else:
                params_meta[f.name] = value
        meta = {
            "kind": "mha",
            "params": params_meta,
            "same": same,
            **{k: getattr(case, k) for k in _MHA_FLAGS},
            "notes": list(case.notes),
        }
        return meta, arrays
    if levels.level_of(case):
        return levels.module(levels.level_of(case)).case_meta(case)
    raise TypeError(f"cannot save a case of type {type(case).__name__}")


def _case_from(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> Any:
    if meta["kind"] == "sdpa":
        return SDPACase(
            **{k: arrays.get(k) for k in _SDPA_ARRAYS},
            causal=meta["causal"],
            scale=meta["scale"],
            dtype=meta["dtype"],
            device=meta["device"],
            layout=meta["layout"],
            regime=meta["regime"],
            notes=tuple(meta["notes"]),
        )
    if meta["kind"] in levels.LEVEL_MODULES:
        return levels.module(meta["kind"]).case_from_meta(meta, arrays)
    if meta["kind"] != "mha":
        raise ValueError(f"kind={meta['kind']!r}, but should be one of {_KINDS}")
    from spec import MHAParams

    params = {k[len("params__"):]: v for k, v in arrays.items() if k.startswith("params__")}
    params.update(meta["params"])
    fields = {f.name for f in dataclasses.fields(MHAParams)}
    for name in fields - set(params):
        params[name] = None
    values = {k: arrays.get(k) for k in _MHA_ARRAYS}
    same = meta.get("same", {})
    if same.get("key") == "query":
        values["key"] = values["query"]
    if same.get("value") in ("query", "key"):
        values["value"] = values[same["value"]]
    return MHACase(
        params=MHAParams(**{k: v for k, v in params.items() if k in fields}),
        **values,
        **{k: meta[k] for k in _MHA_FLAGS},
        notes=tuple(meta["notes"]),
    )


def _call_meta(call: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    meta, arrays = _meta_of(call.case)
    if call.grad_output is not None:
        arrays["grad_output"] = np.asarray(call.grad_output)
    args = {f.name: getattr(call, f.name) for f in dataclasses.fields(call)
            if f.name not in ("case", "grad_output")}
    return {"case": meta, "arguments": args}, {_CALL + k: v for k, v in arrays.items()}


def _call_from(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> Any:
    own = {k[len(_CALL):]: v for k, v in arrays.items() if k.startswith(_CALL)}
    grad_output = own.pop("grad_output", None)
    case = _case_from(meta["case"], own)
    return _call_class(meta["case"]["kind"])(case, grad_output=grad_output, **meta["arguments"])


def _call_class(kind: str) -> type:
    if kind in levels.LEVEL_MODULES:
        return levels.module(kind).CallSpec
    return SDPACallSpec if kind == "sdpa" else MHACallSpec


def save_case(case: Any, path: Path, *, call: Any = None, **extra_meta: Any) -> Path:
    """Write ``case`` (as drawn), ``call`` (the call made on it, a replay call spec)
    and ``extra_meta`` (property, impl, target, options) to ``path`` (.npz)."""
    meta, arrays = _meta_of(case)
    if call is not None:
        meta["call"], call_arrays = _call_meta(call)
        arrays.update(call_arrays)
    meta.update(extra_meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, __meta__=np.array(json.dumps(meta)), **arrays)
    return path


def _read(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The metadata and arrays of a saved file; ValueError (one line) for anything
    that is not a complete file written by :func:`save_case`."""
    try:
        with np.load(path, allow_pickle=False) as data:
            if "__meta__" not in data.files:
                raise ValueError("it has no __meta__ entry (not written by the conformance runner)")
            meta = json.loads(str(data["__meta__"]))
            arrays = {k: data[k] for k in data.files if k != "__meta__"}
    except ValueError:
        raise
    except FileNotFoundError:
        raise ValueError("no such file") from None
    except Exception as err:  # noqa: BLE001 - zipfile.BadZipFile, EOFError, OSError, ...
        raise ValueError(f"not a readable .npz file ({type(err).__name__}: {err})") from None
    if not isinstance(meta, dict) or meta.get("kind") not in _KINDS:
        raise ValueError(f"its metadata has no kind of {_KINDS}")
    return meta, arrays


def load_case(path: str | os.PathLike[str]) -> tuple[Any, dict[str, Any]]:
    """Read a case saved by :func:`save_case`: returns ``(case as drawn, meta)``;
    ValueError (one line) when the file is not a complete saved case."""
    meta, arrays = _read(path)
    try:
        return _case_from(meta, {k: v for k, v in arrays.items() if not k.startswith(_CALL)}), meta
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"its case cannot be rebuilt ({type(err).__name__}: {err})") from None


def load_call(path: str | os.PathLike[str]) -> Any:
    """The call a saved failure made (a ``replay`` call spec), for the reproducer;
    a file without one gives the plain call of its case."""
    meta, arrays = _read(path)
    if "call" not in meta:
        case, _ = load_case(path)
        return _plain_call(case)
    try:
        return _call_from(meta["call"], arrays)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"its call cannot be rebuilt ({type(err).__name__}: {err})") from None


def validate_saved(case: Any, meta: dict[str, Any], properties: Any) -> None:
    """ValueError (one line naming what is wrong) unless ``meta`` names a known
    property (``properties``: id -> info with ``.level``) and a target of its level
    and ``case`` is a valid case of that level (shapes consistent per the spec)."""
    import spec
    from implementations.base import ALL_DTYPES

    prop = meta.get("property")
    if prop not in properties:
        raise ValueError(f"property={prop!r} is not a property of this suite; known: {', '.join(sorted(properties))}")
    level = properties[prop].level
    target = str(meta.get("target", ""))
    parts = target.split("-")
    if len(parts) != 3 or parts[0] != level or parts[1] not in ALL_DTYPES or parts[2] not in ("cpu", "cuda"):
        raise ValueError(f"target={target!r}, but should be {level}-<dtype>-<device> for {prop} "
                         f"(dtype in {', '.join(ALL_DTYPES)}, device cpu or cuda)")
    if meta["kind"] != level:
        raise ValueError(f"the case is {meta['kind']}-level but {prop} is an {level}-level property")
    if case.dtype != parts[1] or case.device != parts[2]:
        raise ValueError(f"the case is {case.dtype}/{case.device} but its target is {target}")
    try:
        if isinstance(case, SDPACase):
            for name in ("query", "key", "value"):
                if np.ndim(getattr(case, name)) != 4:
                    raise ValueError(f"{name} has shape {np.shape(getattr(case, name))}, but should be 4-D "
                                     "(B, N|K, L|S, E|Ev)")
            if case.layout not in LAYOUTS or case.causal not in (None, "upper_left", "lower_right"):
                raise ValueError(f"layout={case.layout!r} causal={case.causal!r}: layout must be one of "
                                 f"{LAYOUTS}, causal None, 'upper_left' or 'lower_right'")
            spec.sdpa(case.query, case.key, case.value, attend_mask=case.attend_mask,
                      additive_mask=case.additive_mask, causal=case.causal, scale=case.scale, sinks=case.sinks)
        elif level in levels.LEVEL_MODULES:
            levels.module(level).validate(case)
        else:
            spec.mha_forward(case.params, case.query, case.key, case.value,
                             key_padding_mask=case.key_padding_mask, attn_mask=case.attn_mask,
                             need_weights=case.need_weights, is_causal=case.is_causal,
                             batch_first=case.batch_first)
    except ValueError as err:  # spec.SpecError included
        raise ValueError(f"the saved case is not a valid {level} case: "
                         f"{str(err).strip().splitlines()[0]}") from None


# -- annotating a failure ------------------------------------------------------


def _counterexample(case: Any) -> dict[str, Any]:
    if isinstance(case, SDPACase):
        out: dict[str, Any] = dict(case.sizes())
        out.update(mask=case.mask_kind, causal=case.causal, scale=case.scale,
                   layout=case.layout, regime=case.regime, dtype=case.dtype)
        return out
    attrs = case.attrs()
    attrs.pop("mha_features", None)
    return {k: v for k, v in attrs.items() if isinstance(v, (int, float, str, bool, type(None)))}


def _plain_call(case: Any) -> Any:
    return _call_class(levels.level_of(case) or ("sdpa" if isinstance(case, SDPACase) else "mha"))(case)


def _failing_call(exc: BaseException, target: Any, record: Any) -> tuple[Any, bool | None]:
    """The call the reproducer makes and whether it alone shows the failure when
    made again (None: not re-made: the implementation raised or hung on it)."""
    from conformance.core.target import (
        ImplementationHung,
        ImplementationRaised,
        call_guarded,
    )

    if getattr(record, "picked_call", None) is not None:  # picked in the isolated worker
        return record.picked_call
    calls = record.failing_calls
    if not calls:
        return _plain_call(record.failing_case), None
    # An isolated worker's implementation (``isolation.protocol.IsolatedImplementation``)
    # says that its calls are made elsewhere: only its worker may make them again.
    if isinstance(exc, (ImplementationHung, ImplementationRaised)) or getattr(target.impl, "calls_elsewhere", False):
        return calls[-1], None  # not made again (isolated: only its worker may; it had no answer)
    try:
        picked = first_failing_call(target.impl, calls, invoke=partial(call_guarded, target))
    except Exception:  # noqa: BLE001 - the failure itself must still be reported
        picked = None
    if picked is None:
        return calls[-1], False
    return picked[0], True


def _in_own_terms(target: Any, case: Any) -> str | None:
    """The call in an implementation's own terms, where it can say them (a learner
    module: its class, Linear layers, forward arguments and mask convention), else None;
    never an error (the failure's report stands without it)."""
    own = getattr(getattr(target.impl, "mha", None), "own_terms", None)
    if target.level != "mha" or not callable(own):
        return None
    try:
        policy = target.caps.fully_masked_policy("additive" if case.attn_mask is not None and
                                                 case.attn_mask.dtype != np.bool_ else "bool")
        return own(case, policy)
    except Exception:  # noqa: BLE001 - a courtesy: the failure is reported with or without it
        return None


def _section(property_id: str) -> str:
    from conformance.core.registry import registered_properties

    info = registered_properties().get(property_id)
    return info.section if info is not None else ""


def _claims(exc: BaseException, target: Any, call: Any, options: dict[str, str]) -> str:
    """Where the claim came from, for an implementation that raised on a claimed case."""
    from conformance.core.target import ImplementationRaised
    from conformance.reporting.claims import claim_note

    if not isinstance(exc, ImplementationRaised):
        return ""
    try:
        return claim_note(target, call.attrs(), options)
    except Exception:  # noqa: BLE001 - a courtesy: the failure is reported with or without it
        return ""


def annotate(exc: BaseException, property_id: str, target: Any, record: Any, *,
             impl_spec: str, options: dict[str, str]) -> None:
    """Save the shrunk failing case and the call the property made on it, and
    attach the property's section, the drawn and called case, the reproducer and
    the replay line (``impl_spec``, ``options``: the session's ``--impl`` and
    ``--impl-option``)."""
    case = record.failing_case
    impl = impl_spec or target.impl.name
    record.message = str(exc).strip()[:4000]
    if case is None:
        return
    record.counterexample = _counterexample(case)
    call, shows = _failing_call(exc, target, record)
    differs = not call.same_as(case)
    if differs:
        record.called = {"case": _counterexample(call.case), "arguments": call.arguments()}
    meta, arrays = _meta_of(case)
    digest = hashlib.sha1(json.dumps(meta, sort_keys=True, default=str).encode()
                          + b"".join(a.tobytes() for a in arrays.values())).hexdigest()[:10]
    safe_impl = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in impl)[-60:]
    path = FAILURE_DIR / f"{safe_impl}-{property_id}-{target.id}-{digest}.npz"
    try:
        save_case(case, path, call=call, property=property_id, impl=impl, target=target.id, options=options)
        record.failure_file = str(path)
    except OSError as err:  # a read-only checkout must not hide the failure itself
        path = None
        record.failure_file = f"(not saved: {err})"
    option_args = "".join(f" --impl-option {k}={v}" for k, v in options.items())
    record.reproducer = reproducer(call, impl, path, options)
    how = {True: "it makes the call above and prints how the result differs from the oracle",
           None: "it makes the call above",
           False: "the call above, made again alone, agrees with the oracle: the property compares "
                  "several calls; the replay line re-runs all of them"}[shows]
    section = _section(property_id)
    own = _in_own_terms(target, call.case)
    note = (
        f"\nproperty {property_id}{f' ({section})' if section else ''} "
        f"{'could not be checked (the suite broke)' if record.outcome == 'error' else 'failed'} for implementation {impl} on "
        f"{target.level}/{target.dtype}/{target.device}\n"
        f"{case_label(record)}: {case.describe()}\n"
        + origin_line(record)
        + (f"called: {call.describe()}\n" if differs else f"called as drawn: {call.arguments()}\n")
        + _claims(exc, target, call, options)
        + f"saved: {record.failure_file}\n"
        f"replay: pytest conformance --impl={impl}{option_args} --replay={path}\n"
        f"reproducer (paste into python; {how}):\n{record.reproducer}"
        + (f"in your module's terms:\n{own}" if own else "")
    )
    if hasattr(exc, "add_note"):
        exc.add_note(note)
