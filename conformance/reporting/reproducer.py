"""The reproducer: a self-contained Python snippet that makes a failing call again in a
fresh interpreter and prints how its result differs from the oracle
(``replay.show_sdpa_call`` / ``show_mha_call``, the code the runner called). A small
call is spelled out as literals, each array in the fewest digits that give back its
values exactly (:func:`_literal`); a larger one is loaded from the saved ``.npz``.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np

from conformance.calls.replay import SDPACallSpec
from conformance.core import levels
from conformance.core.cases import MHACase, SDPACase

__all__ = ["LITERAL_LIMIT", "reproducer"]

#: A call whose arrays hold at most this many numbers is spelled out in the reproducer.
LITERAL_LIMIT = 400
_MHA_FLAGS = ("is_causal", "need_weights", "average_attn_weights", "batch_first", "unbatched", "dtype", "device")


def _body(a: np.ndarray) -> str:
    """``a``'s values, each in the fewest digits that read back as it in ``a``'s dtype."""
    body = np.array2string(a, separator=", ", threshold=10**9, floatmode="unique", max_line_width=100)
    body = re.sub(r"(?<![\w.])(-?)inf\b", r"\1np.inf", body)
    return re.sub(r"(?<![\w.])nan\b", "np.nan", body)


def _literal(a: np.ndarray) -> str:
    """``np.array(...)`` reproducing ``a`` exactly as float64, in the fewest digits: a value
    that a narrower float holds exactly (a float32 input's) is written as that float's
    shortest repr and read back through it (``dtype=np.float32).astype(np.float64)``),
    not as the seventeen digits of its float64 expansion."""
    a = np.asarray(a)
    if a.dtype == np.bool_:
        return f"np.array({a.tolist()!r})"
    wide = a.astype(np.float64)
    best, through = _body(wide), None
    for narrow in (np.float32, np.float16):
        with np.errstate(over="ignore"):
            held = wide.astype(narrow)
        if not np.array_equal(held.astype(np.float64), wide, equal_nan=True):
            break
        body = _body(held)
        if len(body) < len(best):
            best, through = body, narrow
    lines = [line for line in best.splitlines() if line.strip()]  # no blank lines between blocks
    tail = ")" if through is None else f", dtype=np.{through.__name__}).astype(np.float64)"
    return "np.array(" + ("\n" + " " * 9).join(lines) + tail


def _call_size(call: Any) -> int:
    """How many numbers the call's arrays hold (one array object counted once)."""
    arrays: dict[int, np.ndarray] = {}

    def collect(obj: Any) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, np.ndarray):
                arrays[id(value)] = value
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                collect(value)

    collect(call.case)
    if getattr(call, "grad_output", None) is not None:
        arrays[id(call.grad_output)] = np.asarray(call.grad_output)
    return sum(int(a.size) for a in arrays.values())


def _kwargs(values: dict[str, Any], defaults: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" if isinstance(v, str) and v.isidentifier() and k in ("attend_mask",
                     "additive_mask", "sinks", "key_padding_mask", "attn_mask", "grad_output") else f"{k}={v!r}"
                     for k, v in values.items() if k not in defaults or defaults[k] != v)


def _call_arguments(call: Any) -> str:
    args = {f.name: getattr(call, f.name) for f in dataclasses.fields(call) if f.name not in ("case", "grad_output")}
    defaults = {f.name: f.default for f in dataclasses.fields(call)}
    text = _kwargs(args, defaults)
    if call.grad_output is not None:
        text += (", " if text else "") + "grad_output=grad_output"
    return text


def _sdpa_literal(case: SDPACase) -> list[str]:
    lines = [f"query = {_literal(case.query)}  # (B, N, L, E)",
             f"key = {_literal(case.key)}  # (B, K, S, E)",
             f"value = {_literal(case.value)}  # (B, K, S, Ev)"]
    masks = {}
    if case.attend_mask is not None:
        lines.append(f"attend_mask = {_literal(case.attend_mask)}  # bool, True = may attend")
        masks["attend_mask"] = "attend_mask"
    if case.additive_mask is not None:
        lines.append(f"additive_mask = {_literal(case.additive_mask)}  # added to the scaled scores")
        masks["additive_mask"] = "additive_mask"
    if case.sinks is not None:
        lines.append(f"sinks = {_literal(case.sinks)}  # (N,) learned sink logits")
        masks["sinks"] = "sinks"
    fields = dict(masks, causal=case.causal, scale=case.scale, dtype=case.dtype, device=case.device,
                  layout=case.layout, regime=case.regime, notes=case.notes)
    defaults = {"causal": None, "scale": None, "regime": "normal", "notes": ()}
    lines.append(f"case = SDPACase(query, key, value, {_kwargs(fields, defaults)})")
    return lines


def _mha_literal(case: MHACase) -> list[str]:
    p = case.params
    params = []
    for f in dataclasses.fields(p):
        value = getattr(p, f.name)
        if isinstance(value, np.ndarray):
            params.append(f"    {f.name}={_literal(value)},")
        elif value is not None:
            params.append(f"    {f.name}={value!r},")
    layout = "(L, D)" if case.unbatched else "(B, L, D)" if case.batch_first else "(L, B, D)"
    lines = ["params = MHAParams(", *params, ")", f"query = {_literal(case.query)}  # {layout}"]
    for name in ("key", "value"):
        array = getattr(case, name)
        same = "query" if array is case.query else "key" if (name == "value" and array is case.key) else None
        lines.append(f"{name} = {same}  # the same tensor: self-attention" if same else f"{name} = {_literal(array)}")
    masks = {}
    for name in ("key_padding_mask", "attn_mask"):
        array = getattr(case, name)
        if array is not None:
            lines.append(f"{name} = {_literal(array)}  # bool True = blocked, float added")
            masks[name] = name
    fields = dict(masks, **{k: getattr(case, k) for k in _MHA_FLAGS}, notes=case.notes)
    defaults = {"is_causal": False, "need_weights": True, "average_attn_weights": True, "batch_first": False,
                "unbatched": False, "notes": ()}
    lines.append(f"case = MHACase(params, query, key, value, {_kwargs(fields, defaults)})")
    return lines


def reproducer(call: Any, impl: str, path: Path | None, options: dict[str, str]) -> str:
    """A Python snippet that makes ``call`` (a replay call spec) in a fresh
    interpreter and prints how its result differs from the oracle (``impl`` and
    ``options``: the ``--impl`` and ``--impl-option`` values). Small calls are
    spelled out as literals; larger ones are loaded from ``path``."""
    resolve = f"resolve({impl!r}" + (f", {options!r})" if options else ")")
    if call.level in levels.LEVEL_MODULES:  # loaded from the saved file, never spelled out
        show = levels.module(call.level).SHOW
        return "\n".join(["from conformance.reporting.failures import load_call",
                          f"from {levels.LEVEL_MODULES[call.level]} import {show}",
                          "from implementations.registry import resolve", "",
                          f"call = load_call({str(path)!r})  # {call.case.describe()}",
                          f"{show}({resolve}, call)"]) + "\n"
    sdpa = isinstance(call, SDPACallSpec)
    show = "show_sdpa_call" if sdpa else "show_mha_call"
    spec_name = "SDPACallSpec" if sdpa else "MHACallSpec"
    lines = ["import numpy as np"]
    if path is not None and _call_size(call) > LITERAL_LIMIT:
        lines += ["from conformance.reporting.failures import load_call",
                  f"from conformance.calls.replay import {show}",
                  "from implementations.registry import resolve",
                  "",
                  f"call = load_call({str(path)!r})  # {call.case.describe()}"]
    else:
        lines += [f"from conformance.core.cases import {'SDPACase' if sdpa else 'MHACase'}",
                  f"from conformance.calls.replay import {spec_name}, {show}",
                  "from implementations.registry import resolve"]
        if not sdpa:
            lines.append("from spec import MHAParams")
        lines.append("")
        lines += _sdpa_literal(call.case) if sdpa else _mha_literal(call.case)
        if call.grad_output is not None:
            lines.append(f"grad_output = {_literal(call.grad_output)}  # the upstream gradient")
        arguments = _call_arguments(call)
        lines.append(f"call = {spec_name}(case{', ' + arguments if arguments else ''})")
    lines.append(f"{show}({resolve}, call)")
    return "\n".join(lines) + "\n"
