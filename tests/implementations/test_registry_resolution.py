"""implementations.registry: resolution order, recognition of user objects, options."""

from __future__ import annotations

import textwrap

import pytest

from implementations import registry
from implementations.base import Capabilities, Implementation, ImplementationError

EXPECTED_BUILTINS = {
    "spec", "handwritten", "sdpa", "sdpa-math", "sdpa-flash", "sdpa-flash-cuda",
    "sdpa-efficient", "sdpa-cudnn", "torch-mha", "flex", "flash-ref", "triton", "jax",
    "varlen-reference", "ring", "ulysses", "torch-cp", "torch-cp-alltoall",
}

SDPA_SOURCE = textwrap.dedent(
    """
    import torch.nn.functional as F

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    def no_mask(query, key, value):
        return F.scaled_dot_product_attention(query, key, value)
    """
)


def test_registered_lists_every_builtin_lazily():
    builders = registry.registered()
    assert set(builders) == EXPECTED_BUILTINS
    assert all(callable(build) for build in builders.values())


@pytest.mark.parametrize("name", sorted(EXPECTED_BUILTINS))
def test_every_builtin_resolves_by_name(name):
    impl = registry.resolve(name)
    assert isinstance(impl, Implementation)
    assert impl.name == name
    assert impl.available or impl.unavailable_reason


def test_builtins_are_built_once():
    assert registry.resolve("handwritten") is registry.resolve("handwritten")


def test_module_attr_resolves_a_plain_sdpa_function(tmp_path, monkeypatch):
    (tmp_path / "user_attention_mod.py").write_text(SDPA_SOURCE)
    monkeypatch.syspath_prepend(tmp_path)
    impl = registry.resolve("user_attention_mod:attention")
    assert impl.sdpa is not None and impl.mha is None
    c = impl.capabilities
    assert (c.causal, c.fully_masked, c.gqa, c.different_v_dim, c.dropout) == ("upper_left", "zero", True, True, True)
    assert set(c.dtypes) == {"float64", "float32", "float16", "bfloat16"}
    assert c.mask_kinds == {"none", "bool", "additive"}


def test_missing_optional_parameters_mean_unsupported_features(tmp_path, monkeypatch):
    (tmp_path / "user_attention_mod2.py").write_text(SDPA_SOURCE)
    monkeypatch.syspath_prepend(tmp_path)
    impl = registry.resolve("user_attention_mod2:no_mask")
    c = impl.capabilities
    assert c.mask_kinds == {"none"} and c.causal is None and not c.gqa and not c.custom_scale
    import torch

    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        impl.sdpa(q, q, q, attn_mask=torch.ones(2, 2, dtype=torch.bool))


def test_file_path_resolves(tmp_path):
    path = tmp_path / "my_attention.py"
    path.write_text(SDPA_SOURCE)
    impl = registry.resolve(f"{path}:attention")
    assert impl.sdpa is not None


def test_implementation_instance_and_zero_arg_factory(tmp_path):
    path = tmp_path / "explicit.py"
    path.write_text(textwrap.dedent(
        """
        import torch.nn.functional as F
        from implementations import Capabilities, Implementation

        impl = Implementation(name="explicit", sdpa=F.scaled_dot_product_attention,
                              capabilities=Capabilities(causal="lower_right"))

        def make():
            return impl
        """
    ))
    by_instance = registry.resolve(f"{path}:impl")
    assert by_instance.name == "explicit" and by_instance.capabilities.causal == "lower_right"
    # a file is executed once per resolve, so compare by content
    assert registry.resolve(f"{path}:make").name == "explicit"


def test_lower_right_causal_is_noted_not_declared(tmp_path):
    """SDPA's contract (upper-left) stays declared; the note gives the declaration, and the
    user's --impl-option causal=lower_right wins."""
    path = tmp_path / "lower_right.py"
    path.write_text(textwrap.dedent(
        """
        import torch
        import torch.nn.functional as F

        def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            if is_causal:
                L, S = query.shape[-2], key.shape[-2]
                attn_mask = torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)
            return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale,
                                                  enable_gqa=enable_gqa)
        """
    ))
    caps = registry.resolve(f"{path}:attention").capabilities
    assert caps.causal == "upper_left" and caps.source("causal") == "contract"
    assert "behaved as the lower-right triangle" in caps.probe_note("causal")
    assert "declare --impl-option causal=lower_right" in caps.probe_note("causal")
    declared = registry.resolve(f"{path}:attention", {"causal": "lower_right"}).capabilities
    assert declared.causal == "lower_right" and declared.source("causal") == "declared"


def test_mutant_prefix_is_not_a_module_name(tmp_path, monkeypatch):
    (tmp_path / "mutant.py").write_text("raise AssertionError('a module named mutant must not be imported')\n")
    monkeypatch.syspath_prepend(tmp_path)
    with pytest.raises(ImplementationError, match="mutant") as info:
        registry.resolve("mutant:no_such_mutant_xyz")
    assert "must not be imported" not in str(info.value)


def test_registered_name_wins_over_module_attr_form():
    # "sdpa" is a name, never looked up as a module
    assert registry.resolve("sdpa").name == "sdpa"


# ----------------------------------------------------------------------------- options


def test_options_override_capabilities():
    impl = registry.resolve(
        "handwritten",
        {"causal": "lower_right", "fully_masked": "nan", "dtypes": "float32,float16", "gqa": "false",
         "max_head_dim": "64", "mha_features": "batch_first,attn_mask"},
    )
    c = impl.capabilities
    assert (c.causal, c.fully_masked, c.dtypes, c.gqa, c.max_head_dim) == (
        "lower_right", "nan", ("float32", "float16"), False, 64)
    assert impl.caps("mha").mha_features == {"batch_first", "attn_mask"}
    # the registry's own instance is untouched
    assert registry.resolve("handwritten").capabilities.causal == "upper_left"


def test_option_causal_none_removes_the_flag():
    assert registry.resolve("sdpa", {"causal": "none"}).capabilities.causal is None


def test_unknown_option_names_the_valid_ones():
    with pytest.raises(ImplementationError) as info:
        registry.resolve("sdpa", {"causual": "lower_right"})
    message = str(info.value)
    assert "causual" in message and "fully_masked" in message and "dtypes" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("causal", "diagonal", "lower_right"),
        ("fully_masked", "ignore", "unspecified"),
        ("dtypes", "float32,int8", "bfloat16"),
        ("gqa", "maybe", "true or false"),
        ("max_head_dim", "big", "max_head_dim"),
    ],
)
def test_bad_option_value_names_the_valid_ones(key, value, expected):
    with pytest.raises(ImplementationError) as info:
        registry.resolve("sdpa", {key: value})
    message = str(info.value)
    assert f"{key}={value}" in message and expected in message and "\n" not in message


# ----------------------------------------------------------------------------- listing


def test_listing_and_describe():
    table = registry.listing()
    for name in EXPECTED_BUILTINS:
        assert name in table
    assert "needs a CUDA device" in table or "cuda" in table
    text = registry.describe(registry.resolve("torch-mha"))
    assert "MHA level" in text and "pytorch/pytorch#160064" in text


def test_load_expected_failures(tmp_path):
    (tmp_path / "toy.toml").write_text(textwrap.dedent(
        """
        [[xfail]]
        property = "forward_agreement"
        match = { dtype = "float16", need_weights = true }
        reason = "r"
        reference = "org/repo#1"
        """
    ))
    (entry,) = registry.load_expected_failures("toy", directory=tmp_path)
    assert entry.property == "forward_agreement" and entry.reference == "org/repo#1"
    assert entry.applies("forward_agreement", {"dtype": "float16", "need_weights": True, "B": 2})
    assert not entry.applies("forward_agreement", {"dtype": "float32", "need_weights": True})
    assert registry.load_expected_failures("no-such-file", directory=tmp_path) == ()
    (tmp_path / "bad.toml").write_text('[[xfail]]\nproperty = "x"\n')
    with pytest.raises(ImplementationError, match="needs property and reason"):
        registry.load_expected_failures("bad", directory=tmp_path)


def test_capabilities_type_is_frozen_dataclass():
    assert isinstance(registry.resolve("sdpa").capabilities, Capabilities)


def test_self_attention_only_dropin_is_probed_feature_by_feature(tmp_path):
    path = tmp_path / "self_only.py"
    path.write_text(textwrap.dedent(
        """
        from torch import nn

        class SelfOnly(nn.MultiheadAttention):
            def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                        average_attn_weights=True, is_causal=False):
                if not (query is key and key is value):
                    raise NotImplementedError("self-attention only")
                return super().forward(query, key, value, key_padding_mask=key_padding_mask,
                                       need_weights=need_weights, attn_mask=attn_mask,
                                       average_attn_weights=average_attn_weights, is_causal=is_causal)
        """
    ))
    caps = registry.resolve(f"{path}:SelfOnly").caps("mha")
    assert "cross_attention" not in caps.mha_features
    assert {"key_padding_mask", "attn_mask", "batch_first", "need_weights", "bias_kv"} <= caps.mha_features
    assert "kdim_vdim" not in caps.mha_features  # needs distinct key/value tensors
    assert caps.fully_masked == "zero"
