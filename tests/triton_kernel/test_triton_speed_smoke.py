"""benchmarks/triton_speed.py runs end to end (--smoke: tiny sizes, Triton interpreter on CPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import implementations.builtins.kernels.triton_attention as ta  # (before triton: see its docstring)


SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "triton_speed.py"


def test_speed_script_smoke(tmp_path):
    if not ta.make_implementation().available:
        pytest.skip("triton implementation unavailable here")
    spec = importlib.util.spec_from_file_location("triton_speed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "speed.md"
    assert module.main(["--smoke", "--reps", "1", "--warmup", "0", "--out", str(out)]) == 0
    table = out.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 4, table  # L in (17, 33) x causal off/on
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[-1]) < 1e-2, f"triton differs from SDPA: {row}"
