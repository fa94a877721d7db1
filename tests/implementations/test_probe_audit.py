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
