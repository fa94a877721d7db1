"""The probe audit (docs/CONTRACTS.md, "Audit of every probe"): each SDPA capability probe
is built where the alternatives it decides between differ. For each, a function that
differs from a correct one in that alone (``probe_audit_impls.py``) is resolved as
``--impl`` resolves it: the probe must set the field one way for it and the other way for
the correct function, with a note of what it tried. The probes of semantics (the causal
alignment, value ignored, fully-masked rows) are pinned where their mutants are
(``tests/implementations/test_contract_probing.py``, ``tests/runner/test_declarations.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from implementations import registry
from implementations.registry.probe_plan import probe_plan

IMPLS = Path(__file__).resolve().parent / "probe_audit_impls.py"

#: function -> (the capability its probe decides, its value there, the note's words).
AUDIT = {
    "equal_lengths_only": ("self_attention_lengths", True, "self_attention_lengths: query length 2 with key length 3"),
    "four_dims_only": ("batch_dims", 1, "batch_dims: 3-D and 5-D inputs raise"),
    "bool_masks_only": ("mask_kinds", frozenset({"none", "bool"}), "a float mask"),
    "one_kv_head_broadcast": ("gqa", False, "GQA (N=4, K=2"),
    "same_head_dims": ("different_v_dim", False, "Ev=3 != E=4"),
    "forward_only": ("autograd", False, "backward through query, key, value"),
    "detached_mask": ("mask_grad", False, "mask_grad: a gradient w.r.t. a float mask"),
    "no_dropout": ("dropout", False, "dropout_p=0.5"),
    "default_scale_only": ("custom_scale", False, "scale=0.5"),
    "contiguous_only": ("non_contiguous", False, "a transposed query"),
}


def _caps(name: str):
    return registry.resolve(f"{IMPLS}:{name}").capabilities


@pytest.fixture(scope="module")
def correct():
    return _caps("correct")


@pytest.mark.parametrize("name", list(AUDIT))
def test_each_probe_tells_its_alternatives_apart(name, correct):
    field, value, said = AUDIT[name]
    caps = _caps(name)
    assert getattr(caps, field) == value, (name, field, getattr(caps, field), caps.probe_notes)
    assert getattr(correct, field) != value, (field, getattr(correct, field))
    assert any(said in note for note in caps.probe_notes), caps.probe_notes
    # the field it decides, and nothing else: every other probed capability as for the correct function
    others = [f for f, _, _ in AUDIT.values() if f != field and not (f == "mask_grad" and field in ("autograd",
                                                                                                    "mask_kinds"))]
    assert {f: getattr(caps, f) for f in others} == {f: getattr(correct, f) for f in others}, name


def test_dtypes_are_probed_one_by_one():
    caps = _caps("no_float16")
    assert "float16" not in caps.dtypes and {"float64", "float32", "bfloat16"} <= set(caps.dtypes)
    assert any("float16" in note and "float16 is not supported" in note for note in caps.probe_notes)


def test_the_probe_sizes_are_where_the_alternatives_differ():
    """L != S: a self-attention-only kernel raises, and upper-left and lower-right causal
    masks differ; Ev != E: a kernel with one head dim raises; the GQA call has K = 2 of
    N = 4 (K = 1 passes a kernel that only broadcasts one key/value head)."""
    plan = probe_plan(level="sdpa")
    assert plan.L != plan.S and plan.Ev_other not in (None, plan.E)


# --------------------------------------------------------------------------- the MHA level


class _KeyIsValueOnly(torch.nn.MultiheadAttention):
    """An nn.MultiheadAttention drop-in that attends over one memory tensor: key and value
    must be the same tensor (``kv_cross_attention`` and self-attention, not ``cross_attention``)."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if value is not key:
            raise ValueError("key and value must be one tensor")
        return super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                               attn_mask=attn_mask, average_attn_weights=average_attn_weights, is_causal=is_causal)


class _SelfLengthsOnly(torch.nn.MultiheadAttention):
    """Takes keys of the query's length only (a fused self-attention kernel behind it): no
    cross-attention of another length, whatever tensors it is given."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if key.shape[0 if not self.batch_first else 1] != query.shape[0 if not self.batch_first else 1]:
            raise ValueError("the key length must equal the query length")
        return super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                               attn_mask=attn_mask, average_attn_weights=average_attn_weights, is_causal=is_causal)


@pytest.mark.parametrize("module, without, keeps", [
    (_KeyIsValueOnly, {"cross_attention", "kdim_vdim"}, {"kv_cross_attention"}),
    (_SelfLengthsOnly, {"cross_attention", "kv_cross_attention", "kdim_vdim"}, set()),
], ids=["key-is-value-only", "self-lengths-only"])
def test_the_mha_cross_attention_probes_tell_key_value_apart_and_other_lengths(module, without, keeps):
    """The cross-attention probes call with keys of length 4 != L = 3 (a module that takes
    S = L only is not taken for cross-attention), ``cross_attention`` with key and value
    two tensors, ``kv_cross_attention`` with one: each feature is claimed only where its
    own call runs."""
    from implementations.registry.recognition import recognise

    plain = recognise(torch.nn.MultiheadAttention, name="torch").capabilities.mha_features
    features = recognise(module, name=module.__name__).capabilities.mha_features
    assert without <= plain and keeps <= plain
    assert not (without & features) and keeps <= features, sorted(features)
    assert features == plain - without


def _refusing(feature: str) -> type:
    """An nn.MultiheadAttention drop-in that raises on ``feature`` alone (a constructor
    option, a forward argument or form), or for ``need_weights`` returns no weights."""

    def refuse(condition: bool) -> None:
        if condition:
            raise NotImplementedError(f"{feature} is not supported")

    class Refusing(torch.nn.MultiheadAttention):
        def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                     kdim=None, vdim=None, batch_first=False, device=None, dtype=None):
            refuse({"no_bias": not bias, "kdim_vdim": kdim is not None or vdim is not None,
                    "bias_kv": add_bias_kv, "zero_attn": add_zero_attn, "batch_first": batch_first,
                    "dropout": dropout > 0}.get(feature, False))
            super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias, add_bias_kv=add_bias_kv,
                             add_zero_attn=add_zero_attn, kdim=kdim, vdim=vdim, batch_first=batch_first,
                             device=device, dtype=dtype)

        def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                    average_attn_weights=True, is_causal=False):
            refuse({"unbatched": query.dim() == 2, "key_padding_mask": key_padding_mask is not None,
                    "attn_mask": attn_mask is not None,
                    "per_head_attn_mask": attn_mask is not None and attn_mask.dim() == 3,
                    "is_causal": is_causal, "per_head_weights": need_weights and not average_attn_weights,
                    "float_masks": any(m is not None and m.is_floating_point() for m in (attn_mask, key_padding_mask)),
                    }.get(feature, False))
            out, weights = super().forward(query, key, value, key_padding_mask=key_padding_mask,
                                           need_weights=need_weights, attn_mask=attn_mask,
                                           average_attn_weights=average_attn_weights, is_causal=is_causal)
            return (out, None) if feature == "need_weights" else (out, weights)

    Refusing.__name__ = Refusing.__qualname__ = f"Refuses_{feature}"
    return Refusing


#: feature a module refuses -> the MHA features its probe must find missing (a feature
#: whose probe call goes through the refused one is missing with it).
MHA_AUDIT = {
    "no_bias": {"no_bias"},
    "kdim_vdim": {"kdim_vdim"},
    "bias_kv": {"bias_kv"},
    "zero_attn": {"zero_attn"},
    "batch_first": {"batch_first"},
    "dropout": {"dropout"},
    "unbatched": {"unbatched"},
    "key_padding_mask": {"key_padding_mask"},
    "attn_mask": {"attn_mask", "per_head_attn_mask", "is_causal"},  # the two others pass an attn_mask too
    "per_head_attn_mask": {"per_head_attn_mask"},
    "is_causal": {"is_causal"},
    "need_weights": {"need_weights", "per_head_weights"},
    "per_head_weights": {"per_head_weights"},
}


@pytest.fixture(scope="module")
def plain_mha():
    from implementations.registry.recognition import recognise

    return recognise(torch.nn.MultiheadAttention, name="torch").capabilities


@pytest.mark.parametrize("feature", list(MHA_AUDIT))
def test_each_mha_feature_probe_finds_that_feature_alone_missing(feature, plain_mha):
    """Every MHA feature probe: a drop-in that refuses that one feature loses it (and only
    the features whose probe calls use it), with a note; the mask kinds, dtypes and
    autograd stay as for nn.MultiheadAttention."""
    from implementations.registry.recognition import recognise

    caps = recognise(_refusing(feature), name=f"refuses-{feature}").capabilities
    assert MHA_AUDIT[feature] <= plain_mha.mha_features
    assert caps.mha_features == plain_mha.mha_features - MHA_AUDIT[feature], sorted(caps.mha_features)
    assert any(f"mha_features: {feature} in float32" in note for note in caps.probe_notes), caps.probe_notes
    for field in ("mask_kinds", "dtypes", "autograd"):
        assert getattr(caps, field) == getattr(plain_mha, field), (feature, field)
    assert caps.dropout == (feature != "dropout")


def test_the_mha_float_mask_probe_finds_bool_masks_only():
    """A drop-in that takes bool masks only keeps both mask features and loses the kind
    ``additive``: its masks are drawn bool."""
    from implementations.registry.recognition import recognise

    caps = recognise(_refusing("float_masks"), name="refuses-float-masks").capabilities
    plain = recognise(torch.nn.MultiheadAttention, name="torch").capabilities
    assert {"attn_mask", "key_padding_mask"} <= caps.mha_features == plain.mha_features
    assert caps.mask_kinds == plain.mask_kinds - {"additive"} and "additive" in plain.mask_kinds
    assert any("float masks declared unsupported" in note for note in caps.probe_notes), caps.probe_notes
