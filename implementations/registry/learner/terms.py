"""A failing MHA call in the learner's own terms: their class, their Linear layers, their
forward's arguments and their mask convention, as a snippet that runs with torch alone.

The suite states every MHA case in nn.MultiheadAttention's terms (``in_proj_weight``,
``(L, B, D)`` inputs, ``key_padding_mask`` with True = blocked); the learner level
translates each call for the module (:mod:`implementations.registry.learner`). A learner
reads the failure best as the call their module received: :func:`in_own_terms` makes the
call through the same translation, records what the module got (a forward pre-hook), and
writes it out with the spec's expected output, so the difference shows in their names.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import spec

__all__ = ["LIMIT", "in_own_terms", "layer_at"]

#: Numbers a snippet spells out at most; a larger call is described, not written out.
LIMIT = 600


def _tensor(a: np.ndarray, dtype: str) -> str:
    a = np.asarray(a)
    if a.dtype == np.bool_:
        return f"torch.tensor({a.tolist()!r})"
    if np.issubdtype(a.dtype, np.integer):
        return f"torch.tensor({a.tolist()!r})"
    body = np.array2string(a.astype(np.float64), separator=", ", threshold=10**9, floatmode="unique",
                           max_line_width=100).replace("inf", "float('inf')").replace("nan", "float('nan')")
    body = "\n    ".join(line for line in body.splitlines() if line.strip())
    return f"torch.tensor({body}, dtype=torch.{dtype})"


def _import_lines(origin: str, cls_name: str) -> list[str]:
    where, _, _ = origin.rpartition(":")
    if where.endswith(".py"):
        import os

        path = os.path.abspath(where)
        module, folder = os.path.splitext(os.path.basename(path))[0], os.path.dirname(path)
        while os.path.isfile(os.path.join(folder, "__init__.py")):  # a package member: its dotted name
            module, folder = f"{os.path.basename(folder)}.{module}", os.path.dirname(folder)
        return ["import sys", "", "import torch", "",
                f"sys.path.insert(0, {folder!r})", f"from {module} import {cls_name}"]
    return ["import torch", "", f"from {where} import {cls_name}"]


def _mask_text(plan: Any, shape: tuple[int, ...]) -> str:
    kind = {"keep": "1/True = keep, 0/False = blocked", "blocked": "True = blocked",
            "additive": "added to the scores (-inf = blocked)"}.get(plan.mask, plan.mask)
    return f"{tuple(shape)}: {kind}"


def layer_at(module: Any, path: str) -> Any:
    """The submodule at a dotted attribute path ("w_q", "linears.0")."""
    for part in path.split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module


def in_own_terms(module: Any, plan: Any, case: Any, fully_masked: str) -> str | None:
    """The snippet for ``case`` (an MHA case) on ``module``, the learner's module inside
    nn.MultiheadAttention's interface (built for the case, its weights loaded: see
    :meth:`~implementations.registry.learner.wrapper.LearnerMHA.own_terms`) whose reading is
    ``plan``; None when the call is too large to spell out."""
    import torch

    params = case.params
    dtype = case.dtype
    tdtype = getattr(torch, dtype)
    module.eval()
    seen: dict[str, Any] = {}

    def record(_module, args, kwargs):
        seen["args"], seen["kwargs"] = args, dict(kwargs)

    handle = module.inner.register_forward_pre_hook(record, with_kwargs=True)
    as_tensor = (lambda a: None if a is None else torch.as_tensor(np.asarray(a)).to(
        tdtype if np.asarray(a).dtype != np.bool_ else torch.bool))
    try:
        with torch.no_grad():
            module(as_tensor(case.query), as_tensor(case.key), as_tensor(case.value),
                   key_padding_mask=as_tensor(case.key_padding_mask), attn_mask=as_tensor(case.attn_mask),
                   need_weights=False, is_causal=case.is_causal)
    finally:
        handle.remove()
    args, kwargs = seen["args"], seen["kwargs"]
    expected, _ = spec.mha_forward(params, case.query, case.key, case.value, key_padding_mask=case.key_padding_mask,
                                   attn_mask=case.attn_mask, need_weights=False, is_causal=case.is_causal,
                                   batch_first=case.batch_first, fully_masked=fully_masked)
    expected = np.asarray(expected)
    if expected.ndim == 2:
        expected = expected[None]                                 # unbatched: (L, D) -> (1, L, D)
    elif not case.batch_first:
        expected = expected.transpose(1, 0, 2)                    # (L, B, D) -> (B, L, D)
    layers = []
    from implementations.registry.learner.plan import expanded

    for _, path in expanded(plan.projections, params.num_heads):
        layer = layer_at(module.inner, path)
        layers.append((f"{path}.weight", layer.weight.detach().double().numpy()))
        layers.append((f"{path}.bias", None if layer.bias is None else layer.bias.detach().double().numpy()))
    arrays = [a.detach().double().numpy() for a in args] + [np.asarray(v.detach().cpu()) for v in kwargs.values()
                                                            if hasattr(v, "detach")]
    if sum(a.size for a in arrays) + sum(0 if a is None else a.size for _, a in layers) + expected.size > LIMIT:
        return None
    name = plan.cls.__name__
    lines = ["# " + f"the failing call as {name} received it (through the learner level's reading; "
             "paste into python)"]
    lines += _import_lines(getattr(plan, "origin", "") or f"{plan.cls.__module__}:{name}", name)
    build = plan.construction.snippet(name, params.embed_dim, params.num_heads)
    lines += ["", *build[:-1], f"{build[-1]}.to(torch.{dtype}).eval()", "with torch.no_grad():"]
    for path, value in layers:
        where = "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path.split("."))
        if path.endswith(".bias"):  # assigned: the case may add a bias to a bias-free layer, or remove one
            lines.append(f"    module{where} = None  # no bias in this case" if value is None else
                         f"    module{where} = torch.nn.Parameter({_tensor(value, dtype)})")
        else:
            lines.append(f"    module{where}.copy_({_tensor(value, dtype)})")
    names = list(plan.forward_names)
    inputs = list(args) + [kwargs.pop(n) for n in names if n in kwargs]
    if plan.seq_first:  # shown batch-first, handed over as the module takes them
        inputs = [a.transpose(0, 1) for a in inputs]
    shown: list[tuple[str, Any]] = []
    call_args = []
    for i, a in enumerate(inputs):
        same = next((n for n, b in shown if b.shape == a.shape and torch.equal(b, a)), None)
        arg_name = names[i] if i < len(names) else f"arg{i}"
        if same is None:
            shape = "(" + ", ".join(f"{d}={n}" for d, n in zip("BLD", a.shape, strict=False)) + ")"
            lines.append(f"{arg_name} = {_tensor(a.detach().double().numpy(), dtype)}  # {shape}")
            shown.append((arg_name, a))
        value = same or arg_name
        if plan.seq_first:
            value = f"{value}.transpose(0, 1)"
        call_args.append(f"{arg_name}={value}" if plan.keyword else value)
    for key, value in kwargs.items():
        if hasattr(value, "detach"):
            lines.append(f"{key} = {_tensor(np.asarray(value.detach().cpu()), dtype)}  "
                         f"# {_mask_text(plan, tuple(value.shape))}")
            call_args.append(f"{key}={key}")
    pick = "[0]" if plan.returns == "pair" else ""
    policy = {"zero": "0 (the output bias after the out projection)", "nan": "NaN",
              "uniform": "uniform weights"}.get(fully_masked, fully_masked)
    if plan.seq_first:
        pick += ".transpose(0, 1)"
    lines.append(f"out = module({', '.join(call_args)}){pick}")
    if module.out_proj is not None:  # the module has no output projection: the spec's after it
        weight = module.out_proj.weight.detach().double().numpy()
        bias = None if module.out_proj.bias is None else module.out_proj.bias.detach().double().numpy()
        lines.append(f"out = torch.nn.functional.linear(out, {_tensor(weight, dtype)}, "
                     f"{'None' if bias is None else _tensor(bias, dtype)})  # the spec's output projection")
    lines += [
              f"expected = {_tensor(expected, 'float64')}  # the spec's output (B, L, D); a row with "
              f"every key blocked: {policy}",
              "both_nan = out.isnan() & expected.isnan()  # NaN where both are NaN agrees",
              "print('max |out - expected| =', torch.where(both_nan, 0.0, (out.double() - expected).abs())"
              ".max().item())"]
    return "\n".join(lines) + "\n"
