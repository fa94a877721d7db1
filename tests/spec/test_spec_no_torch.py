"""spec/ never imports torch, not even indirectly (docs/DESIGN.md#layout-and-dependency-rules)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import spec

SPEC_DIR = pathlib.Path(spec.__file__).parent


def test_importing_spec_does_not_import_torch():
    code = ("import sys, spec, spec.masks, spec.mha, spec.emulate, spec.errors; "
            "spec.emulate_sdpa([[[1.0]]], [[[1.0]]], [[[1.0]]], dtype='bfloat16'); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')); "
            "assert not bad, bad")
    env = {**os.environ, "PYTHONPATH": str(SPEC_DIR.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=SPEC_DIR.parent, env=env, timeout=60)
    assert result.returncode == 0, result.stderr


def test_no_source_file_mentions_a_torch_import():
    for path in SPEC_DIR.rglob("*.py"):
        text = path.read_text()
        assert "import torch" not in text and "from torch" not in text, path


def test_public_api_is_declared():
    assert set(spec.__all__) >= {"SpecError", "sdpa", "SDPAResult", "sdpa_vjp", "SDPAGrads",
                                 "emulate_sdpa", "MHAParams", "mha_forward", "masks"}
    assert issubclass(spec.SpecError, ValueError)
    for name in spec.__all__:
        assert getattr(spec, name).__doc__, name
