"""Turn a mutant record's case (``smallest_case`` / ``safe_case``) into a concrete call.

The vocabulary is documented in :mod:`implementations.mutants.record`. Values are
drawn in float64 from a seeded generator, then rounded to the case's dtype, so a
float64 reference can be run on exactly the stored values. Used by
``tests/mutants/test_mutant_records.py`` to prove each documented case exposes its
bug, and handy as a reproducer: ``sdpa_call(MUTANTS[name].smallest_case)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["SDPACall", "MHACall", "sdpa_call", "mha_call", "case_attrs"]

SIZES = ("B", "N", "K", "L", "S", "E", "Ev")


@dataclass
class SDPACall:
    """Arguments of one SDPA call: tensors in the case's dtype and layout."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: Call twice on the same tensors and return the second result.
    repeat: bool = False
    #: The alignment ``is_causal=True`` stands for ("upper_left" / "lower_right"), or None.
    causal: str | None = None

    def run(self, sdpa, *, requires_grad: bool = False):
        q, k, v = self.query, self.key, self.value
        if requires_grad:
            q, k, v = (_leaf_like(t) for t in (q, k, v))
        elif self.repeat:
            q, k, v = (t.clone(memory_format=torch.preserve_format) for t in (q, k, v))
            sdpa(q, k, v, **self.kwargs)
        return sdpa(q, k, v, **self.kwargs), (q, k, v)


def _leaf_like(t: torch.Tensor) -> torch.Tensor:
    """A leaf requiring grad with t's values and t's memory layout."""
    return t.detach().clone(memory_format=torch.preserve_format).requires_grad_(True)


def _dtype(case: dict) -> torch.dtype:
    return getattr(torch, case.get("dtype", "float64"))


def _values(case: dict, g: torch.Generator):
    B, N, K, L, S, E, Ev = (case[d] for d in SIZES)
    q = torch.randn(B, N, L, E, generator=g, dtype=torch.float64)
    k = torch.randn(B, K, S, E, generator=g, dtype=torch.float64)
    v = torch.randn(B, K, S, Ev, generator=g, dtype=torch.float64)
    pattern = case.get("values")
    if pattern in ("large", "huge"):
        c = 16.0 if pattern == "large" else 300.0
        q, k = torch.full_like(q, c), torch.full_like(k, c)
    elif pattern == "wide_rows":
        q = torch.full_like(q, 10.0)
        q[:, :, 1::2] = -10.0
        k = torch.full_like(k, 10.0)
    elif pattern == "ascending_keys":
        q = torch.ones_like(q)
        k = (torch.arange(S, dtype=torch.float64) / 4).reshape(1, 1, S, 1).expand_as(k).clone()
    elif pattern is not None:
        raise ValueError(f"values={pattern!r}: use large, huge, wide_rows or ascending_keys")
    return q, k, v


def _sdpa_mask(case: dict, g: torch.Generator, dtype: torch.dtype):
    kind = case.get("mask")
    L, S = case["L"], case["S"]
    if kind is None:
        return None
    if kind == "block_last":
        mask = torch.ones(L, S, dtype=torch.bool)
        mask[:, -1] = False
        return mask
    if kind == "all_blocked":
        return torch.zeros(L, S, dtype=torch.bool)
    if kind == "additive_all_blocked":
        return torch.full((L, S), float("-inf"), dtype=dtype)
    if kind == "oversized":
        return torch.ones(L, S + 1, dtype=torch.bool)
    if kind == "causal":
        return torch.ones(L, S, dtype=torch.bool).tril()
    if kind == "additive":
        bias = torch.randn(L, S, generator=g, dtype=torch.float64)
        bias = bias + 0.25 * torch.sign(bias)  # no exact zeros: a bool reading shows
        return bias.to(dtype)
    raise ValueError(f"mask={kind!r}: use block_last, all_blocked, "
                     "additive_all_blocked, oversized, causal or additive")


def _layout(t: torch.Tensor, layout: str | None) -> torch.Tensor:
    if layout is None or layout == "contiguous":
        return t
    if layout == "transposed":
        return t.transpose(1, 2).contiguous().transpose(1, 2)  # stored (B, L, N, E)
    raise ValueError(f"layout={layout!r}: use contiguous or transposed")


def sdpa_call(case: dict, seed: int = 0) -> SDPACall:
    """The SDPA call a record's case describes (tensors in its dtype and layout)."""
    g = torch.Generator().manual_seed(seed)
    dtype = _dtype(case)
    q, k, v = _values(case, g)
    mask = _sdpa_mask(case, g, dtype)
    if case.get("layout") == "stride0":
        # K/V of batch item 0 expanded over the batch with stride 0 (needs B >= 2).
        k, v = k[:1].expand_as(k), v[:1].expand_as(v)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    else:
        q, k, v = (_layout(t.to(dtype), case.get("layout")) for t in (q, k, v))
    kwargs: dict[str, Any] = {"attn_mask": mask}
    causal = _causal_alignment(case)
    if causal:
        kwargs["is_causal"] = True
    if case.get("scale") is not None:
        kwargs["scale"] = case["scale"]
    if case.get("dropout_p"):
        kwargs["dropout_p"] = case["dropout_p"]
    if case["N"] != case["K"]:
        kwargs["enable_gqa"] = True
    if case.get("sinks") is not None:  # learned sinks (N,), one logit per query head
        kwargs["sinks"] = torch.tensor(case["sinks"], dtype=torch.float32)
    return SDPACall(q, k, v, kwargs, repeat=bool(case.get("repeat")), causal=causal)


def _causal_alignment(case: dict) -> str | None:
    """``causal``: True (upper-left, PyTorch's is_causal) or an alignment name."""
    causal = case.get("causal")
    if causal is True:
        return "upper_left"
    if causal in (None, False):
        return None
    if causal not in ("upper_left", "lower_right"):
        raise ValueError(f"causal={causal!r}: use True, 'upper_left' or 'lower_right'")
    return causal


@dataclass
class MHACall:
    """One MHA module call: weights, module options and forward arguments."""

    params: Any
    options: dict[str, Any]
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kwargs: dict[str, Any]
    training: bool = False

    def run(self, factory, load_weights, *, inputs: tuple | None = None):
        """The module's (output, weights); ``inputs`` replaces (query, key, value)."""
        D, N = self.params.embed_dim, self.params.num_heads
        module = factory(D, N, dtype=torch.float64, **self.options)
        load_weights(module, self.params)
        module.train(self.training)
        query, key, value = inputs if inputs is not None else (self.query, self.key, self.value)
        return module(query, key, value, **self.kwargs)


def _mha_mask(kind: str | None, shape: tuple[int, int], g: torch.Generator):
    if kind is None:
        return None
    rows, S = shape
    if kind == "bool_block_last":
        mask = torch.zeros(rows, S, dtype=torch.bool)
        mask[:, -1] = True
        return mask
    if kind == "bool_all":
        return torch.ones(rows, S, dtype=torch.bool)
    if kind == "float_block_last":
        mask = torch.zeros(rows, S, dtype=torch.float64)
        mask[:, -1] = float("-inf")
        return mask
    if kind == "float":
        bias = torch.randn(rows, S, generator=g, dtype=torch.float64)
        return bias + 0.25 * torch.sign(bias)
    if kind == "causal_bool":
        return torch.ones(rows, S, dtype=torch.bool).triu(diagonal=1)  # True = blocked
    raise ValueError(
        f"mask kind {kind!r}: use bool_block_last, bool_all, float_block_last, float, causal_bool"
    )


def mha_call(case: dict, seed: int = 0) -> MHACall:
    """The MHA call a record's case describes (float64, sequence-first inputs, or
    (L, D) with ``unbatched``)."""
    g = torch.Generator().manual_seed(seed)
    B, N, L, S, E = (case[d] for d in ("B", "N", "L", "S", "E"))
    D = N * E

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    params = SimpleNamespace(
        embed_dim=D, num_heads=N, kdim=D, vdim=D, add_zero_attn=False,
        in_proj_weight=randn(3 * D, D, scale=0.7).numpy(), in_proj_bias=randn(3 * D).numpy(),
        q_proj_weight=None, k_proj_weight=None, v_proj_weight=None,
        out_proj_weight=randn(D, D, scale=0.7).numpy(), out_proj_bias=randn(D).numpy(),
        bias_k=None, bias_v=None,
    )
    unbatched = bool(case.get("unbatched"))
    if unbatched and B != 1:
        raise ValueError(f"unbatched=True needs B=1, got B={B}")
    if unbatched:
        query, key, value = randn(L, D), randn(S, D), randn(S, D)
    else:
        query, key, value = randn(L, B, D), randn(S, B, D), randn(S, B, D)
    if case.get("self_attention"):  # one input as query, key and value (L = S)
        if L != S:
            raise ValueError(f"self_attention=True needs L = S, got L={L}, S={S}")
        key = value = query
    elif case.get("shared_kv"):  # cross-attention with one key/value input
        value = key
    padding = _mha_mask(case.get("key_padding_mask"), (B, S), g)
    if unbatched and padding is not None:
        padding = padding[0]                                                    # (S,)
    kwargs: dict[str, Any] = {
        "key_padding_mask": padding,
        "attn_mask": _mha_mask(case.get("attn_mask"), (L, S), g),
        "need_weights": case.get("need_weights", True),
        "average_attn_weights": case.get("average_attn_weights", True),
    }
    if case.get("is_causal"):
        kwargs["is_causal"] = True
    options = {"dropout": case.get("dropout", 0.0)}
    return MHACall(params, options, query, key, value, kwargs, training=case.get("training", False))


def case_attrs(case: dict, level: str) -> dict[str, Any]:
    """Case attributes (docs/CONTRACTS.md) for ``Implementation.not_supported_reasons``."""
    attrs: dict[str, Any] = {d: case[d] for d in SIZES}
    attrs.update(level=level, device="cpu", dtype=case.get("dtype", "float64"))
    if level == "sdpa":
        mask = case.get("mask")
        attrs["mask_kind"] = "additive" if mask and mask.startswith("additive") else (
            "bool" if mask else "none")
        attrs["causal"] = _causal_alignment(case)
        attrs["scale"] = case.get("scale")
        attrs["dropout_p"] = case.get("dropout_p", 0.0)
        attrs["grad"] = bool(case.get("grad"))
        attrs["layout"] = case.get("layout", "contiguous")
        attrs["sinks"] = case.get("sinks") is not None
    elif level == "flash":
        attrs["causal"] = "lower_right" if case.get("causal") else None
        attrs["flash_features"] = {f for f in ("window", "softcap", "alibi", "lse", "sinks", "dropout_pattern")
                                   if case.get(f)}
        attrs["grad"] = bool(case.get("grad"))
        attrs["fp8"] = case.get("fp8")
        attrs["dropout_p"] = case.get("dropout_p", 0.0)
    else:
        features = set()
        for name in ("key_padding_mask", "attn_mask", "is_causal"):
            if case.get(name):
                features.add(name)
        if case.get("need_weights", True):
            features.add("need_weights")
        if not case.get("average_attn_weights", True):
            features.add("per_head_weights")
        if case.get("dropout"):
            features.add("dropout")
        if case.get("unbatched"):
            features.add("unbatched")
        if not case.get("self_attention"):
            features.add("kv_cross_attention" if case.get("shared_kv") else "cross_attention")
        attrs["mha_features"] = features
    return attrs
