"""nn.MultiheadAttention's interface around a learner's module: the constructor, the
forward (masks merged and rendered in the module's convention) and the weights."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from implementations.base import ImplementationError
from implementations.registry.learner.plan import LearnerPlan, _Unsupported, axis_order, expanded
from implementations.registry.learner.reading import transposed
from implementations.registry.learner.terms import layer_at


def call_inner(plan: LearnerPlan, inner: Any, tensors: tuple, mask: Any = None) -> Any:
    """``inner`` called on batch-first ``tensors`` (q[, k, v | kv], in that order) and
    ``mask`` (passed to its mask parameter, None included: a mask without a default needs
    it), each bound to the parameter read for it; the output comes back batch-first."""
    # contiguous, as a caller's own tensors are (GPT-2's Conv1D views its input)
    tensors = tuple((t.transpose(0, 1) if plan.seq_first else t).contiguous() for t in tensors)
    kwargs = {} if plan.mask_arg is None else {plan.mask_arg: mask}
    if plan.keyword:
        out = inner(**dict(zip(plan.forward_names, tensors, strict=True)), **kwargs)
    else:
        out = inner(*tensors, **kwargs)
    if plan.seq_first:
        if isinstance(out, (tuple, list)):
            return (out[0].transpose(0, 1), *out[1:])
        return out.transpose(0, 1)
    return out


def _causal_rest(plan: LearnerPlan, mask: Any, L: int, S: int) -> Any:
    """For an always-causal module: ``mask`` (additive, (B|1, H|1, L, S)) without the causal
    rule the module applies itself (None when nothing else is blocked); a call that is not
    causal is outside what the module does."""
    import torch

    upper = torch.triu(torch.ones(L, S, dtype=torch.bool, device=mask.device if mask is not None else None),
                       diagonal=1)
    if mask is None or not bool(torch.isneginf(mask.expand(-1, -1, L, S)[..., upper]).all()):
        raise _Unsupported(f"{plan.cls.__name__} is always causal ({plan.causal}): a non-causal call is outside it")
    rest = mask.masked_fill(upper, 0.0)
    return None if not bool(rest.ne(0).any()) else mask


def _make_learner_mha(plan: LearnerPlan):
    import torch
    from torch import nn

    from implementations.registry.learner.reading import in_out

    class _LearnerMHA(nn.Module):
        """nn.MultiheadAttention's constructor and forward around a learner's module."""

        def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                     kdim=None, vdim=None, batch_first=False, device=None, dtype=None):
            super().__init__()
            name = plan.cls.__name__
            if add_bias_kv or add_zero_attn:
                raise _Unsupported(f"{name} has no bias_k/bias_v or zero-attention key (add_bias_kv, add_zero_attn)")
            if kdim not in (None, embed_dim) or vdim not in (None, embed_dim):
                raise _Unsupported(f"{name} projects keys and values from d_model only (kdim/vdim)")
            if dropout and plan.dropout_arg is None:
                raise _Unsupported(f"{name}'s constructor takes no dropout argument")
            inner = _materialised(plan.construction.build(plan.cls, embed_dim, num_heads, dropout), plan, embed_dim)
            if plan.dropout_arg is None:  # a hard-wired nn.Dropout: off, as dropout=0 asks
                for sub in inner.modules():
                    if isinstance(sub, nn.Dropout):
                        sub.p = 0.0
            self.inner = inner.to(device=device, dtype=dtype)
            # No output projection in the module (BERT's self-attention): the spec's is
            # applied after it, so what the module computes is certified as is.
            self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype) \
                if plan.out_identity else None
            self.embed_dim, self.num_heads, self.batch_first = embed_dim, num_heads, batch_first
            with torch.no_grad():
                for _, path in expanded(plan.projections, num_heads):
                    layer = layer_at(self.inner, path)
                    if bias and layer.bias is None:  # a projection applies its bias when it has one
                        layer.bias = nn.Parameter(torch.zeros(in_out(layer)[1], device=layer.weight.device,
                                                              dtype=layer.weight.dtype))
                    elif not bias and layer.bias is not None and transposed(layer):
                        # Conv1D always adds its bias (addmm): a zero one, frozen, is none
                        layer.bias = nn.Parameter(torch.zeros_like(layer.bias), requires_grad=False)
                    elif not bias and layer.bias is not None:
                        layer.bias = None

        def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                    average_attn_weights=True, is_causal=False):
            unbatched = query.dim() == 2
            if unbatched:
                query, key, value = (t.unsqueeze(1) for t in (query, key, value))
                if key_padding_mask is not None:
                    key_padding_mask = key_padding_mask.unsqueeze(0)
            elif self.batch_first:
                query, key, value = (t.transpose(0, 1) for t in (query, key, value))
            q, k, v = (t.transpose(0, 1) for t in (query, key, value))  # (B, T, D)
            B, L, S = q.shape[0], q.shape[1], k.shape[1]
            mask = _merged_mask(key_padding_mask, attn_mask, B, self.num_heads, L, S, q.dtype)
            if plan.causal is not None:
                mask = _causal_rest(plan, mask, L, S)
            if mask is not None and plan.mask_arg is None:
                raise _Unsupported(f"{plan.cls.__name__}.forward takes no mask")
            # an attn_mask keeps its L axis where the module takes one, even where its rows
            # are alike (L = 1, or key padding blocking every row): a (B, 1, 1, S) mask
            # means key padding alone, as a user would pass it
            floats = any(m is not None and m.is_floating_point() for m in (key_padding_mask, attn_mask))
            rendered = None if mask is None else _render_mask(
                replace(plan, mask="additive") if plan.also_additive and floats else plan, mask,
                (B, self.num_heads, L, S), with_rows=attn_mask is not None)
            if plan.inputs == "self":
                if not (key is query or torch.equal(k, q)) or not (value is query or torch.equal(v, q)):
                    raise _Unsupported(f"{plan.cls.__name__} is self-attention only: forward takes one input")
                tensors = (q,)
            elif plan.inputs == "kv":
                if not (value is key or torch.equal(k, v)):
                    raise _Unsupported(f"{plan.cls.__name__} takes one key/value input: key must equal value")
                tensors = (q, k)
            else:
                tensors = (q, k, v)
            out = call_inner(plan, self.inner, tensors, rendered)
            weights = None
            if plan.returns == "pair":
                out, weights = out[0], out[1]
            if self.out_proj is not None:
                out = self.out_proj(out)
            if need_weights and weights is not None:
                if plan.weights == "per_head" and average_attn_weights:
                    weights = weights.mean(dim=1)
                elif plan.weights == "averaged" and not average_attn_weights:
                    raise _Unsupported(f"{plan.cls.__name__} returns weights averaged over heads")
                if unbatched:
                    weights = weights[0]
            else:
                weights = None
            if unbatched:
                return out[0], weights
            out = out if self.batch_first else out.transpose(0, 1)
            return out, weights

    _LearnerMHA.__name__ = _LearnerMHA.__qualname__ = f"{plan.cls.__name__}AsMHA"
    return _LearnerMHA


def _materialised(module: Any, plan: LearnerPlan, D: int) -> Any:
    """``module`` with its lazy layers (``nn.LazyLinear``, whose in_features are known only
    after a first call) given their shapes by one call on zeros (B=1, L=2, d_model=D)."""
    import torch
    from torch.nn.modules.lazy import LazyModuleMixin

    if not any(isinstance(m, LazyModuleMixin) and m.has_uninitialized_params() for m in module.modules()):
        return module
    x = torch.zeros(1, 2, D)
    training = module.training
    with torch.no_grad():
        module.eval()
        call_inner(plan, module, {"self": (x,), "kv": (x, x), "qkv": (x, x, x)}[plan.inputs])
    return module.train(training)


class LearnerMHA:
    """The factory: ``LearnerMHA(plan)(embed_dim, num_heads, **options)`` builds the
    learner's module inside nn.MultiheadAttention's interface."""

    def __init__(self, plan: LearnerPlan) -> None:
        self.plan = plan
        self.module_class = _make_learner_mha(plan)
        self.__name__ = plan.cls.__name__

    def __call__(self, embed_dim: int, num_heads: int, **options: Any) -> Any:
        return self.module_class(embed_dim, num_heads, **options)

    def own_terms(self, case: Any, fully_masked: str) -> str | None:
        """``case``'s call as the module receives it, a torch snippet in its own names
        (:func:`implementations.registry.learner.terms.in_own_terms`)."""
        import torch

        from implementations.registry.learner.terms import in_own_terms

        params = case.params
        if params.in_proj_weight is None or getattr(case, "add_bias_kv", False):
            return None
        module = self(params.embed_dim, params.num_heads, bias=params.in_proj_bias is not None,
                      batch_first=case.batch_first, dtype=getattr(torch, case.dtype))
        module._learner_plan = self.plan
        load_learner_weights(module, params)
        return in_own_terms(module, self.plan, case, fully_masked)


def _merged_mask(key_padding_mask, attn_mask, B, H, L, S, dtype):
    """One additive float mask broadcastable to (B, H, L, S) (-inf blocked), or None."""
    import torch

    parts = []
    for mask, shape in ((key_padding_mask, (B, 1, 1, S)), (attn_mask, None)):
        if mask is None:
            continue
        if shape is None:
            shape = (1, 1, L, S) if mask.dim() == 2 else (B, H, L, S)
        mask = mask.reshape(shape)
        if mask.dtype == torch.bool:
            mask = torch.zeros(shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
        parts.append(mask.to(dtype))
    if not parts:
        return None
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _render_mask(plan: LearnerPlan, additive, sizes_bhls, with_rows: bool = False):
    """The merged additive (B|1, H|1, L|1, S) mask in the module's convention and in the
    smallest accepted shape that holds it (``sizes_bhls``: the call's B, H, L, S);
    ``with_rows``: a shape with the L axis where the module takes one (the mask has an
    attn_mask part)."""
    if with_rows and not any("L" in shape for shape in plan.mask_shapes):
        with_rows = False
    import torch

    B, H, L, S = sizes_bhls
    varies = {"B": B > 1 and not bool((additive == additive[:1]).all()),
              "H": H > 1 and not bool((additive == additive[:, :1]).all()),
              "L": with_rows or (L > 1 and not bool((additive == additive[:, :, :1]).all()))}
    if plan.mask != "additive" and not bool((torch.isneginf(additive) | (additive == 0)).all()):
        raise _Unsupported(f"{plan.cls.__name__}'s mask is {plan.mask}: a float bias has no such form")
    # The smallest shape that holds the mask: key padding goes as (B, 1, 1, S) where the
    # module takes it, so a convention the module reads differently there shows.
    for shape in sorted(plan.mask_shapes, key=lambda s: sum(d in s for d in ("B", "H", "L"))):
        if (varies["B"] and "B" not in shape) or (varies["H"] and "H" not in shape) or \
                (varies["L"] and "L" not in shape):
            continue
        full = additive
        if "H" not in shape:
            full = full[:, :1]
        if "L" not in shape:
            full = full[:, :, :1]
        if "B" not in shape:
            full = full[:1]
        sizes = {"B": B, "H": H, "L": L, "S": S}
        target = tuple(sizes[d] if d != "1" else 1 for d in shape)
        kept = [d for d in ("B", "H", "L", "S") if d in shape]
        full = full.expand(B if "B" in shape else 1, H if "H" in shape else 1, L if "L" in shape else 1, S)
        squeezed = full.reshape(tuple(sizes[d] for d in kept)).permute(*axis_order(shape))
        mask = squeezed.reshape(target).contiguous()
        if plan.mask == "additive":
            return mask
        blocked = torch.isneginf(mask)
        wanted = ~blocked if plan.mask == "keep" else blocked
        return wanted if plan.mask_dtype == "bool" else wanted.to(getattr(torch, {"long": "int64"}.get(
            plan.mask_dtype, plan.mask_dtype)))
    raise _Unsupported(f"{plan.cls.__name__} takes no mask shape that holds this mask "
                       f"(varies along {[d for d, v in varies.items() if v]})")


def load_learner_weights(module: Any, params: Any) -> None:
    """Copy ``spec.MHAParams`` onto the learner's Linear layers (casting to their dtype)."""
    import torch

    plan = module_plan(module)
    inner = module.inner
    D, H = params.embed_dim, params.num_heads
    if params.in_proj_weight is None:
        raise _Unsupported(f"{plan.cls.__name__} projects keys and values from d_model only (kdim/vdim)")
    w, b = np.asarray(params.in_proj_weight), params.in_proj_bias
    rows = {"q": np.arange(0, D), "k": np.arange(D, 2 * D), "v": np.arange(2 * D, 3 * D)}
    dh = D // H
    if plan.fused == "kqv":
        fused = np.concatenate([rows["k"], rows["q"], rows["v"]])
    elif plan.fused == "qkv_per_head":
        fused = np.concatenate([np.arange(h * dh, (h + 1) * dh) + part * D for h in range(H) for part in range(3)])
    else:
        fused = np.arange(3 * D)
    rows["qkv"] = fused
    rows["kv"] = np.arange(D, 3 * D)
    with torch.no_grad():
        layers = [(role, layer_at(inner, path), path) for role, path in expanded(plan.projections, H)]
        if module.out_proj is not None:
            layers.append(("o", module.out_proj, "(the identity: no output projection)"))
        for role, layer, path in layers:
            base, _, head = role.partition("@")
            if base == "o":
                weight, bias = np.asarray(params.out_proj_weight), params.out_proj_bias
            else:
                index = rows[base] if not head else rows[base][int(head) * dh:(int(head) + 1) * dh]
                weight, bias = w[index], None if b is None else np.asarray(b)[index]
            if transposed(layer):  # Conv1D: weight stored (in, out)
                weight = weight.T
            if tuple(layer.weight.shape) != weight.shape:
                raise ImplementationError(
                    f"{plan.cls.__name__}.{path}.weight has shape {tuple(layer.weight.shape)}, but the "
                    f"{role} projection of d_model={D} needs {weight.shape}")
            layer.weight.copy_(torch.as_tensor(weight, dtype=torch.float64))
            if layer.bias is not None:
                out = weight.shape[1] if transposed(layer) else weight.shape[0]
                layer.bias.copy_(torch.as_tensor(np.zeros(out) if bias is None else np.asarray(bias),
                                                 dtype=torch.float64))


def module_plan(module: Any) -> LearnerPlan:
    return module._learner_plan



class _PlannedFactory(LearnerMHA):
    def __call__(self, embed_dim: int, num_heads: int, **options: Any) -> Any:
        module = super().__call__(embed_dim, num_heads, **options)
        module._learner_plan = self.plan
        return module
