"""Bad ``--impl`` values: each gives a one-paragraph ImplementationError saying what was
found and what was expected."""

from __future__ import annotations

import textwrap

import pytest

from implementations import registry
from implementations.base import ImplementationError


def error_for(spec: str) -> str:
    with pytest.raises(ImplementationError) as info:
        registry.resolve(spec)
    message = str(info.value)
    assert "\n" not in message, f"not one paragraph: {message!r}"
    return message


def test_unknown_name_lists_registered_names():
    message = error_for("handwriten")
    assert "'handwriten'" in message and "not a registered implementation" in message
    for name in ("handwritten", "sdpa-math", "torch-mha", "spec"):
        assert name in message
    assert "module:attr" in message


def test_empty_spec():
    assert "empty" in error_for("  ")


def test_bad_file_path(tmp_path):
    missing = tmp_path / "nope.py"
    message = error_for(f"{missing}:attention")
    assert "no file" in message and str(missing) in message


def test_unimportable_module():
    message = error_for("no_such_package_xyz.attention:attention")
    assert "no module named 'no_such_package_xyz.attention'" in message


def test_missing_attribute(tmp_path):
    path = tmp_path / "has_other.py"
    path.write_text("def something_else(query, key, value):\n    return query\n")
    message = error_for(f"{path}:attention")
    assert "has no attribute 'attention'" in message and "something_else" in message
    assert "scaled_dot_product_attention" in message


def test_wrong_function_signature(tmp_path):
    path = tmp_path / "wrong_sig.py"
    path.write_text("def attention(q, k, v, mask=None):\n    return q\n")
    message = error_for(f"{path}:attention")
    assert "attention(q, k, v, mask)" in message
    assert "query, key, value" in message


def test_a_q_k_v_function_is_told_which_parameters_keep_it_from_flash_attn_func(tmp_path):
    # fairseq2's naive SDPA: q, k, v are named as flash_attn_func's are; the message must not
    # claim they are not (the real reason is the other parameters).
    path = tmp_path / "naive.py"
    path.write_text("def naive_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, needs_weights=False,"
                    " training=True):\n    return q\n")
    message = error_for(f"{path}:naive_sdpa")
    assert "must be named query, key, value" not in message
    assert "attn_mask, needs_weights, training are not among them" in message
    assert "name its first three parameters query, key, value" in message


def test_other_first_parameter_names_are_told_the_names_to_use(tmp_path):
    path = tmp_path / "other.py"
    path.write_text("def attend(seqs, keys, values, mask=None):\n    return seqs\n")
    message = error_for(f"{path}:attend")
    assert "attend(seqs, keys, values, mask)" in message
    assert "the first three parameters must be named query, key, value (or q, k, v" in message


def test_wrong_class_signature(tmp_path):
    path = tmp_path / "wrong_cls.py"
    path.write_text(textwrap.dedent(
        """
        import torch.nn as nn

        class Attention(nn.Module):
            def __init__(self, d_model, n_heads):
                super().__init__()

            def forward(self, x, mask=None):
                return x
        """
    ))
    message = error_for(f"{path}:Attention")
    assert "not a drop-in for torch.nn.MultiheadAttention" in message
    assert "embed_dim" in message and "key_padding_mask" in message


def test_exception_inside_the_users_module(tmp_path):
    path = tmp_path / "crashes.py"
    path.write_text("import math\nvalue = 1 / 0\n\ndef attention(query, key, value):\n    return query\n")
    message = error_for(f"{path}:attention")
    assert "ZeroDivisionError: division by zero" in message
    assert f"{path}:2" in message  # the line in the user's file


def test_exception_inside_an_imported_module(tmp_path, monkeypatch):
    (tmp_path / "crashing_mod_xyz.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(tmp_path)
    message = error_for("crashing_mod_xyz:attention")
    assert "importing module 'crashing_mod_xyz' raised ModuleNotFoundError" in message
    assert "no_such_dependency_xyz" in message


def test_not_callable(tmp_path):
    path = tmp_path / "constant.py"
    path.write_text("attention = 42\n")
    message = error_for(f"{path}:attention")
    assert "is a int, not callable" in message


def test_zero_arg_factory_returning_something_else(tmp_path):
    path = tmp_path / "factory.py"
    path.write_text("def make():\n    return 'not an implementation'\n")
    message = error_for(f"{path}:make")
    assert "returned str" in message and "Implementation" in message


def test_sdpa_function_that_cannot_run(tmp_path):
    path = tmp_path / "raises.py"
    path.write_text("def attention(query, key, value, attn_mask=None):\n    raise RuntimeError('nope')\n")
    message = error_for(f"{path}:attention")
    assert "RuntimeError: nope" in message and "plain float32 call" in message


def test_unknown_mutant():
    message = error_for("mutant:definitely_not_a_mutant")
    assert "definitely_not_a_mutant" in message


@pytest.mark.parametrize("old, new", [("bias", "no_bias"), ("average_weights", "per_head_weights")])
def test_former_mha_feature_names_are_refused_with_their_new_name(old, new):
    """The old names read as the opposite of their meaning, so they are not mapped silently."""
    from implementations.base import Capabilities
    from implementations.registry.options import apply_options

    with pytest.raises(ImplementationError, match=f"'{old}' is now '{new}'"):
        Capabilities(mha_features=frozenset({old, "need_weights"}))
    impl = registry.resolve("torch-mha")
    with pytest.raises(ImplementationError, match=f"'{old}' is now '{new}'"):
        apply_options(impl, {"mha_features": f"need_weights,{old}"})
    assert new in apply_options(impl, {"mha_features": f"need_weights,{new}"}).caps("mha").mha_features
