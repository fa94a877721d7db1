"""Probing a learner's mask convention (keep, blocked, additive) and the shapes it takes."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from implementations.registry.learner.options import LENGTH_NAMES, MASK_CONVENTIONS
from implementations.registry.learner.plan import _AXES, LearnerPlan, _shape_text, axis_order
from implementations.registry.learner.probes import (
    _B,
    _D,
    _H,
    _L,
    _build,
    _Probe,
    _raw,
    torch_allclose,
)
from implementations.registry.learner.reading import forward_of

#: Mask shapes tried, most specific convention first: full (B, 1, L, S) masks decide the
#: polarity; key-padding shapes after them; the per-head (B, H, L, S); then the
#: sequence-first ones (labml-nn's (L, S, B) and its key padding (1, S, B)).
_SHAPES = (("B", "1", "L", "S"), ("B", "L", "S"), ("B", "1", "1", "S"), ("B", "1", "S"), ("B", "S"), ("L", "S"),
           ("B", "H", "L", "S"), ("L", "S", "B"), ("1", "S", "B"))


def _keep_pattern(shape: tuple[str, ...], per_row: bool, causal: bool = False) -> np.ndarray:
    """A keep (True = attend) mask of ``shape`` leaving each query row one key: key 0, S-1,
    1 for batch items 0, 1, 2; with ``per_row`` (shapes with L) row L-1 of each item keeps
    another one; per head (H) head 1 keeps that other one on every row. ``causal`` (the
    module blocks the keys after each query itself): key 0 on every row, the other key
    of row L-1 (2, 1, 3 by batch item), head 1 keeping key 0 there too."""
    full = np.zeros((_B, _H, _L, _L), dtype=bool)
    for b in range(_B):
        key = 0 if causal else (0, _L - 1, 1)[b % 3]
        other = (2, 1, 3)[b % 3] if causal else (key + 2) % _L
        full[b, :, :, key] = True
        if per_row and "L" in shape:
            full[b, :, -1, :] = False
            full[b, :, -1, other] = True
        if "H" in shape:
            full[b, 1] = False
            full[b, 1, :, key if causal else other] = True
    index = tuple(slice(None) if d in shape else slice(0, 1) for d in _AXES)
    sizes = {"B": _B, "H": _H, "L": _L, "S": _L, "1": 1}
    named = full[index].reshape(tuple(sizes[d] for d in _AXES if d in shape))
    return np.transpose(named, axis_order(shape)).reshape(tuple(sizes[d] for d in shape))


def _as_full(shape: tuple[str, ...], mask: np.ndarray) -> np.ndarray:
    """The (B, H, L, S) keep pattern a mask of ``shape`` means (missing dims broadcast)."""
    sizes = {"B": _B, "H": _H, "L": _L, "S": _L}
    named = mask.reshape(tuple(sizes[d] for d in shape if d in _AXES))
    canonical = np.transpose(named, np.argsort(axis_order(shape)))
    return np.broadcast_to(canonical.reshape(tuple(sizes[d] if d in shape else 1 for d in _AXES)),
                           (_B, _H, _L, _L))


def _rows_follow(out: Any, full_keep: np.ndarray) -> bool:
    """Rows of each batch item that attend the same keys are equal, and rows attending
    different ones differ (``full_keep`` (B, H, L, S), True = attend)."""
    got = out.detach().double().numpy()
    if not np.isfinite(got).all():
        return False
    for b in range(got.shape[0]):
        pattern = [full_keep[b, :, row].tobytes() for row in range(got.shape[1])]
        for i in range(got.shape[1]):
            for j in range(i + 1, got.shape[1]):
                same = np.allclose(got[b, i], got[b, j], rtol=1e-9, atol=1e-9)
                if same != (pattern[i] == pattern[j]):
                    return False
    return True


def _convention_tensor(keep: np.ndarray, convention: str, dtype: str) -> Any:
    import torch

    if convention == "additive":
        return torch.from_numpy(np.where(keep, 0.0, -np.inf))
    value = keep if convention == "keep" else ~keep
    tensor = torch.from_numpy(np.ascontiguousarray(value))
    return tensor if dtype == "bool" else tensor.to(torch.int64)


def _probe_mask(probe: _Probe, plan: LearnerPlan, params: Any, x: Any, options: Mapping[str, str]) -> LearnerPlan:
    if plan.mask_arg is None:
        forward = [p.name for p in inspect.signature(forward_of(plan.cls)).parameters.values()]
        lengths = next((n for n in forward if n.lower() in LENGTH_NAMES), None)
        if lengths is not None:
            return replace(plan, mask=None, mask_how=(
                f"{plan.cls.__name__}.forward's {lengths} is read as valid lengths, which the learner level "
                "does not translate yet: masked cases skipped (a mask argument, e.g. mask of shape (B, 1, S) "
                "with 1 = keep, would enable them)"))
        return replace(plan, mask=None, mask_how=f"{plan.cls.__name__}.forward takes no mask argument")
    module = probe.value("a plain call", lambda: _build(plan, params))
    plain = probe.value("a plain call", lambda: _raw(module, plan, x))
    if plain is None or _rows_follow(plain, np.ones((_B, _H, _L, _L), dtype=bool)):
        return replace(plan, mask=None, mask_how="rows of a plain call are already equal; the mask cannot be probed")
    conventions = [options["learner_mask"]] if "learner_mask" in options else list(MASK_CONVENTIONS)
    found: dict[tuple[str, ...], tuple[str, str]] = {}
    # Patterns a causal rule leaves alone (key 0 on every row) are tried second: a module
    # that is causal by mistake keeps its mask convention, and fails as what it says.
    for shape in _SHAPES:
        for causal in ((True,) if plan.causal is not None else (False, True)):
            found_as = _shape_convention(probe, plan, module, x, shape, conventions, causal)
            if found_as is not None:
                found[shape] = found_as
                break
    if not found:
        return _assumed_mask(probe, plan, module, x, options)
    first = next(iter(found))
    convention, dtype = found[first]
    disagree = [s for s, (c, _) in found.items() if c != convention]
    words = {"keep": "1/True = keep, 0/False = blocked", "blocked": "True = blocked",
             "additive": "additive (0 = keep, -inf = blocked)"}[convention]
    how = f"{words}{' as ' + dtype if dtype == 'long' else ''} ({'--impl-option learner_mask' if 'learner_mask' in options else 'probed'})"
    if disagree:
        how += (f"; but shapes {', '.join(_shape_text(s) for s in disagree)} read the other way (inconsistent): "
                "the suite hands them over in this convention too, so the inconsistency fails")
    also_additive = convention != "additive" and "learner_mask" not in options and all(
        _shape_convention(probe, plan, module, x, shape, ["additive"], plan.causal is not None) is not None
        for shape in found)
    if also_additive:
        how += "; additive float masks (0 = keep, -inf = blocked) followed too (probed): float cases go additive"
    unfollowed = _shapes_that_act(probe, plan, module, x, plain, convention, dtype,
                                  [s for s in _SHAPES if s not in found])
    if unfollowed:
        how += (f"; shapes {', '.join(_shape_text(s) for s in unfollowed)} run and change the output but their "
                "rows do not follow that convention: the suite hands them over in it too, so a mask read wrongly "
                "there fails")
    return replace(plan, mask=convention, mask_dtype=dtype, mask_shapes=(*found, *unfollowed), mask_how=how,
                   also_additive=also_additive)


def _shapes_that_act(probe: _Probe, plan: LearnerPlan, module: Any, x: Any, plain: Any, convention: str,
                     dtype: str, shapes: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """The ``shapes`` whose masks in ``convention`` run, keep the output's shape and change
    it. A shape the module takes but reads against its own convention (axes swapped, rows
    shifted) is not left out for it: the evidence of a shape is that it runs, never that
    the output looks right, so the mistake shows on the certified cases."""
    acting = []
    for shape in shapes:
        keep = _keep_pattern(shape, per_row=True, causal=plan.causal is not None)
        tensor = _convention_tensor(keep, convention, dtype)
        got = probe.value(f"mask {convention} {_shape_text(shape)}", lambda t=tensor: _raw(module, plan, x, t))
        if got is not None and tuple(got.shape) == (_B, _L, _D) and not bool(torch_allclose(got, plain)):
            acting.append(shape)
    return acting


def _shape_convention(probe: _Probe, plan: LearnerPlan, module: Any, x: Any, shape: tuple[str, ...],
                      conventions: list[str], causal: bool) -> tuple[str, str] | None:
    """``(convention, dtype)`` of the first convention whose masks of ``shape`` the module
    follows (rows left the same keys equal, the others not), or None."""
    for convention in conventions:
        for dtype in (("float",) if convention == "additive" else ("bool", "long")):
            ok = True
            for per_row in ((False, True) if "L" in shape else (False,)):
                keep = _keep_pattern(shape, per_row, causal)
                tensor = _convention_tensor(keep, convention, dtype)
                got = probe.value(f"mask {convention} {_shape_text(shape)}", lambda t=tensor: _raw(module, plan, x, t))
                if got is None or tuple(got.shape) != (_B, _L, _D) or not _rows_follow(got, _as_full(shape, keep)):
                    ok = False
                    break
            if ok:
                return convention, dtype
    return None


def _assumed_mask(probe: _Probe, plan: LearnerPlan, module: Any, x: Any, options: Mapping[str, str]) -> LearnerPlan:
    """No convention passed the probe (the module may have a mistake that breaks it):
    assume the most common one (1 = keep, or ``learner_mask``) in the shapes where a mask
    of it runs and changes the output, and say so; none: masks are not certified."""
    convention = options.get("learner_mask", "keep")
    dtype = "float" if convention == "additive" else "bool"
    plain = probe.value("a plain call", lambda: _raw(module, plan, x))
    shapes = [] if plain is None else _shapes_that_act(probe, plan, module, x, plain, convention, dtype,
                                                       list(_SHAPES))
    tried = "keep, blocked, additive" if "learner_mask" not in options else options["learner_mask"]
    if not shapes:
        return replace(plan, mask=None, mask_how=(
            f"no convention ({tried}) in any shape made a query row that is left one key attend only it, "
            f"and no {convention} mask changed the output (shapes tried: "
            f"{', '.join(_shape_text(s) for s in _SHAPES)}); masks are not certified "
            "(--impl-option learner_mask=keep|blocked|additive sets the convention)"))
    words = {"keep": "1/True = keep", "blocked": "True = blocked", "additive": "additive"}[convention]
    return replace(plan, mask=convention, mask_dtype=dtype, mask_shapes=tuple(shapes), mask_how=(
        f"{words} ASSUMED: no convention ({tried}) made a query row that is left one key attend only it, "
        "which a correct module does whatever its convention, so the module's attention itself is "
        "suspect (see the failures); --impl-option learner_mask=keep|blocked|additive sets it"))


