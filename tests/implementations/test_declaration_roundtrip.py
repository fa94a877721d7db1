"""``--conformance-write-declaration``: the draft a run writes, read back with
``--impl=that.toml``, certifies alike (the same certificate table) and is shown on the
certificate; a kernel with tile limits certifies from a ``pyproject.toml`` table alone."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from conformance.reporting.certificate import render_table, summary
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]
IMPLS = "tests/runner/partial_support_impls.py"


def certify(impl: str, tmp_path: Path, name: str, *args: str, cwd: Path = ROOT) -> tuple[dict, str]:
    env = dict(os.environ, ATTENTION_CONFORMANCE_FAILURES=str(tmp_path / "failures"), PYTHONPATH=str(ROOT))
    proc = pytest_process.run(
        [sys.executable, "-m", "pytest", "--pyargs", "conformance", "-p", "no:cacheprovider", "-q",
         "--hypothesis-profile=ci", f"--conformance-report={tmp_path / name}", f"--impl={impl}", *args],
        cwd=cwd, capture_output=True, text=True, timeout=900, env=env)
    assert (tmp_path / f"{name}.json").is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / f"{name}.json").read_text()), proc.stdout


def _round_trip(impl: str, options: tuple[str, ...], tmp_path: Path) -> str:
    decl = tmp_path / "decl.toml"
    first, _ = certify(impl, tmp_path, "probed", "--dtype=float32", *options,
                       f"--conformance-write-declaration={decl}")
    text = decl.read_text()
    assert text.count("# probe") + text.count("# default") + text.count("# declared") > 10, text
    again, out = certify(str(decl), tmp_path, "declared", "--dtype=float32")
    assert render_table(again) == render_table(first)
    assert summary(again) == summary(first)
    assert "declaration used" in out and f'spec = "{impl}"' in out, out[-3000:]
    return text


@pytest.mark.parametrize("impl, options", [
    ("handwritten", ()),
    ("examples/sdpa_function.py:attention", ()),
    ("tests/implementations/learner_modules/tutorial_modules.py:FusedBlockedAttention", ()),
])
def test_a_written_declaration_read_back_certifies_alike(impl, options, tmp_path):
    text = _round_trip(impl, options, tmp_path)
    if impl == "handwritten":
        assert "# the implementation's own declaration" in text and "# probe" not in text
    elif "learner_modules" in impl:  # a hand-written module: the conventions the learner level probed
        assert 'learner_fused = "qkv"  # probe' in text and 'learner_mask = "blocked"  # probe' in text, text
    else:
        assert "dtypes = [" in text and "# probe" in text and "causal = \"upper_left\"  # contract" in text


@pytest.mark.slow
def test_a_tile_limited_kernel_round_trips_with_its_declarations(tmp_path):
    text = _round_trip(f"{IMPLS}:blocks_of_4", ("--impl-option", "seq_multiple=4", "--impl-option",
                                                "dropout=false"), tmp_path)
    assert "seq_multiple = 4  # declared" in text and "dropout = false  # declared" in text


@pytest.mark.slow
def test_a_kernel_with_tile_limits_certifies_from_a_pyproject_table(tmp_path):
    """The README's table, no --impl-option: a flash kernel that runs only 16-bit, head
    dims >= 16 and lengths in blocks of 16 (its spec line points at the test's kernel)."""
    readme = (ROOT / "README.md").read_text()
    table = readme.split("```toml\n", 1)[1].split("```", 1)[0]
    assert table.startswith("[tool.attention-conformance.implementations.my_kernel]\nspec = "), table
    kernel = f'spec = "{ROOT / "tests/implementations/declared_kernels.py"}:tiled_16bit"'
    (tmp_path / "pyproject.toml").write_text("\n".join(kernel if line.startswith("spec = ") else line
                                                      for line in table.splitlines()) + "\n")
    cert, out = certify("my_kernel", tmp_path, "cert", cwd=tmp_path)
    outcomes = {r["outcome"] for r in cert["results"]}
    assert "failed" not in outcomes and "error" not in outcomes and "passed" in outcomes, out[-3000:]
    assert "declaration used" in out and "seq_multiple = 16" in out and "min_head_dim = 16" in out
