"""Failing cases: saved as ``.npz`` (no pickle), reproduced, replayed.

When a property fails, the shrunk case is written to
``.conformance/failures/<impl>-<property>-<target>-<digest>.npz`` and the failure
message gets notes: the property, the implementation, the case spelled out, a
self-contained Python snippet that reproduces the call in a fresh interpreter,
and the ``--replay`` command line that re-runs exactly that case.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from conformance.cases import MHACase, SDPACase

__all__ = ["save_case", "load_case", "Replay", "annotate", "reproducer"]

FAILURE_DIR = Path(os.environ.get("ATTENTION_CONFORMANCE_FAILURES", ".conformance/failures"))

_SDPA_ARRAYS = ("query", "key", "value", "attend_mask", "additive_mask")
_MHA_ARRAYS = ("query", "key", "value", "key_padding_mask", "attn_mask")


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
        for name in _MHA_ARRAYS:
            value = getattr(case, name)
            if value is not None:
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
            **{k: getattr(case, k) for k in (
                "is_causal", "need_weights", "average_attn_weights", "batch_first",
                "unbatched", "dtype", "device")},
            "notes": list(case.notes),
        }
        return meta, arrays
    raise TypeError(f"cannot save a case of type {type(case).__name__}")


def save_case(case: Any, path: Path, **extra_meta: Any) -> Path:
    """Write ``case`` and ``extra_meta`` (property, impl, target) to ``path`` (.npz)."""
    meta, arrays = _meta_of(case)
    meta.update(extra_meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, __meta__=np.array(json.dumps(meta)), **arrays)
    return path


def load_case(path: str | os.PathLike[str]) -> tuple[Any, dict[str, Any]]:
    """Read a case saved by :func:`save_case`: returns ``(case, meta)``."""
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(str(data["__meta__"]))
        arrays = {k: data[k] for k in data.files if k != "__meta__"}
    if meta["kind"] == "sdpa":
        case = SDPACase(
            **{k: arrays.get(k) for k in _SDPA_ARRAYS},
            causal=meta["causal"],
            scale=meta["scale"],
            dtype=meta["dtype"],
            device=meta["device"],
            layout=meta["layout"],
            regime=meta["regime"],
            notes=tuple(meta["notes"]),
        )
        return case, meta
    from spec import MHAParams

    params = {k[len("params__"):]: v for k, v in arrays.items() if k.startswith("params__")}
    params.update(meta["params"])
    fields = {f.name for f in dataclasses.fields(MHAParams)}
    for name in fields - set(params):
        params[name] = None
    case = MHACase(
        params=MHAParams(**{k: v for k, v in params.items() if k in fields}),
        **{k: arrays.get(k) for k in _MHA_ARRAYS},
        **{k: meta[k] for k in ("is_causal", "need_weights", "average_attn_weights",
                                "batch_first", "unbatched", "dtype", "device")},
        notes=tuple(meta["notes"]),
    )
    return case, meta


def _literal(a: np.ndarray, dtype: str) -> str:
    if a.dtype == np.bool_:
        return f"torch.tensor({a.tolist()!r}, dtype=torch.bool)"
    body = np.array2string(a, separator=", ", threshold=10**6, floatmode="unique",
                           max_line_width=100)
    body = body.replace("inf", "float('inf')").replace("nan", "float('nan')")
    return f"torch.tensor({body}, dtype=torch.float64).to(torch.{dtype})"


def reproducer(case: Any, impl: str, path: Path | None, options: dict[str, str]) -> str:
    """A Python snippet that runs in a fresh interpreter and shows the mismatch
    (``impl`` and ``options``: the ``--impl`` and ``--impl-option`` values)."""
    resolve = f"resolve({impl!r}" + (f", {options!r})" if options else ")")
    if not isinstance(case, SDPACase):
        return (
            "import numpy as np\n"
            "from conformance.failures import load_case\n"
            "from conformance.replay import run_mha_case\n"
            "from implementations.registry import resolve\n"
            f"case, _ = load_case({str(path)!r})\n"
            f"print(run_mha_case({resolve}, case))\n"
        )
    small = sum(a.size for a in (case.query, case.key, case.value)) <= 256 and all(
        m is None or m.size <= 256 for m in (case.attend_mask, case.additive_mask)
    )
    lines = ["import numpy as np, torch", "import spec", "from implementations.registry import resolve"]
    if small:
        for name in ("query", "key", "value"):
            lines.append(f"{name} = {_literal(getattr(case, name), case.dtype)}  # {_shape_doc(name)}")
        mask = case.attend_mask if case.attend_mask is not None else case.additive_mask
        lines.append("attn_mask = " + ("None" if mask is None else _literal(
            mask, "bool" if mask.dtype == np.bool_ else case.dtype).replace(".to(torch.bool)", "")))
    else:
        lines += [
            "from conformance.failures import load_case",
            f"case, _ = load_case({str(path)!r})",
            f"query, key, value = (torch.from_numpy(a).to(torch.{case.dtype}) for a in (case.query, case.key, case.value))",
            "m = case.attend_mask if case.attend_mask is not None else case.additive_mask",
            f"attn_mask = None if m is None else (torch.from_numpy(m) if m.dtype == bool else torch.from_numpy(m).to(torch.{case.dtype}))",
        ]
    lines += [
        f"impl = {resolve}",
        f"out = impl.sdpa(query, key, value, attn_mask=attn_mask, is_causal={case.causal is not None}, "
        f"scale={case.scale!r}, enable_gqa={case.K != case.N})",
        "m = None if attn_mask is None else attn_mask.double().numpy() if attn_mask.dtype != torch.bool else attn_mask.numpy()",
        "ref = spec.sdpa(query.double().numpy(), key.double().numpy(), value.double().numpy(),",
        "               attend_mask=m if m is not None and m.dtype == bool else None,",
        "               additive_mask=m if m is not None and m.dtype != bool else None,",
        f"               causal={case.causal!r}, scale={case.scale!r}).output",
        "print('max |out - oracle| =', np.nanmax(np.abs(out.double().numpy() - ref)))",
    ]
    if case.layout != "contiguous":
        lines.insert(3, f"# the failing call used layout={case.layout!r}; "
                        "conformance.tensors.sdpa_inputs(case) rebuilds it")
    return "\n".join(lines) + "\n"


def _shape_doc(name: str) -> str:
    return {"query": "(B, N, L, E)", "key": "(B, K, S, E)", "value": "(B, K, S, Ev)"}[name]


def _counterexample(case: Any) -> dict[str, Any]:
    if isinstance(case, SDPACase):
        out: dict[str, Any] = dict(case.sizes())
        out.update(mask=case.mask_kind, causal=case.causal, scale=case.scale,
                   layout=case.layout, regime=case.regime, dtype=case.dtype)
        return out
    attrs = case.attrs()
    attrs.pop("mha_features", None)
    return {k: v for k, v in attrs.items() if isinstance(v, (int, float, str, bool, type(None)))}


def annotate(exc: BaseException, property_id: str, target: Any, record: Any, *,
             impl_spec: str, options: dict[str, str]) -> None:
    """Save the shrunk failing case and attach the case, reproducer and replay line
    (``impl_spec``, ``options``: the session's ``--impl`` and ``--impl-option``)."""
    case = record.failing_case
    impl = impl_spec or target.impl.name
    record.message = str(exc).strip()[:4000]
    if case is None:
        return
    record.counterexample = _counterexample(case)
    meta, arrays = _meta_of(case)
    digest = hashlib.sha1(json.dumps(meta, sort_keys=True, default=str).encode()
                          + b"".join(a.tobytes() for a in arrays.values())).hexdigest()[:10]
    safe_impl = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in impl)[-60:]
    path = FAILURE_DIR / f"{safe_impl}-{property_id}-{target.id}-{digest}.npz"
    try:
        save_case(case, path, property=property_id, impl=impl, target=target.id,
                  options=options)
        record.failure_file = str(path)
    except OSError as err:  # a read-only checkout must not hide the failure itself
        path = None
        record.failure_file = f"(not saved: {err})"
    option_args = " ".join(f"--impl-option {k}={v}" for k, v in options.items())
    record.reproducer = reproducer(case, impl, path, options)
    note = (
        f"\nproperty {property_id} failed for implementation {impl} on "
        f"{target.level}/{target.dtype}/{target.device}\n"
        f"shrunk case: {case.describe()}\n"
        f"saved: {record.failure_file}\n"
        f"replay: pytest conformance --impl={impl} {option_args} --replay {path}\n"
        f"reproducer (paste into python):\n{record.reproducer}"
    )
    if hasattr(exc, "add_note"):
        exc.add_note(note)
