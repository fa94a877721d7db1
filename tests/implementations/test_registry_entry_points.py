"""An implementation shipped by a separately installed package is found through its
entry point (group ``attention_conformance.implementations``).

The toy package is "installed" the way pip leaves it: a package directory plus a
``*.dist-info`` folder with METADATA and entry_points.txt, in a directory on
sys.path. importlib.metadata finds it for real; nothing is monkeypatched.
"""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap

import pytest

from implementations import registry
from implementations.base import ImplementationError


@pytest.fixture
def toy_site(tmp_path, monkeypatch):
    package = tmp_path / "toy_attention_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(
        """
        import torch.nn.functional as F

        __version__ = "0.3.1"

        def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        """
    ))
    (package / "broken.py").write_text("raise RuntimeError('toy package is broken on purpose')\n")
    dist_info = tmp_path / "toy_attention_pkg-0.3.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-attention-pkg\nVersion: 0.3.1\n")
    (dist_info / "entry_points.txt").write_text(textwrap.dedent(
        """
        [attention_conformance.implementations]
        toy-attention = toy_attention_pkg:attention
        toy-broken = toy_attention_pkg.broken:attention
        handwritten = toy_attention_pkg:attention
        """
    ))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("toy_attention_pkg")]:
        del sys.modules[name]


def test_the_toy_distribution_is_really_installed(toy_site):
    names = {ep.name for ep in importlib.metadata.entry_points(group=registry.ENTRY_POINT_GROUP)}
    assert {"toy-attention", "toy-broken"} <= names


def test_entry_point_is_resolved_and_recognised(toy_site):
    impl = registry.resolve("toy-attention")
    assert impl.name == "toy-attention"
    assert impl.sdpa is not None and impl.capabilities.gqa
    assert impl.version == "0.3.1"


def test_registered_name_wins_over_an_entry_point_of_the_same_name(toy_site):
    impl = registry.resolve("handwritten")
    assert impl.mha is not None  # the built-in, not the toy function


def test_entry_point_that_fails_to_import_gives_one_paragraph(toy_site):
    with pytest.raises(ImplementationError) as info:
        registry.resolve("toy-broken")
    message = str(info.value)
    assert "toy_attention_pkg.broken:attention" in message
    assert "RuntimeError: toy package is broken on purpose" in message
    assert "\n" not in message


def test_unknown_name_lists_installed_entry_points(toy_site):
    with pytest.raises(ImplementationError) as info:
        registry.resolve("no-such-impl")
    assert "toy-attention" in str(info.value)
