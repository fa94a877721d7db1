"""The suite as an installed package: built as a wheel, installed into a folder of its
own, it certifies a user's function from a directory outside this checkout
(``pytest --pyargs conformance --impl=...``) and leaves unrelated pytest runs alone.

The installed copy must be the one that runs: the checkout is kept off sys.path
(the test processes run elsewhere, with PYTHONPATH set to the install folder only),
and the user's module records which ``conformance`` and ``implementations`` it was
certified by.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
#: What the wheel is built from: the packages and the project metadata.
SOURCES = ("pyproject.toml", "README.md", "spec", "conformance", "implementations")

MINE = '''\
import json, pathlib, sys
import torch
import torch.nn.functional as F

pathlib.Path(__file__).with_name("loaded_from.json").write_text(json.dumps(
    {name: sys.modules[name].__file__ for name in ("conformance", "implementations", "spec")}))


def attn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
         enable_gqa=False):
    if is_causal:  # an explicit mask: torch's causal kernel is wrong for scale <= 0
        L, S = query.shape[-2], key.shape[-2]
        attn_mask = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        is_causal = False
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                          dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale, enable_gqa=enable_gqa)
'''

UNRELATED_CONFTEST = '''\
import pytest


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu")  # the conformance plugin's name too


@pytest.fixture
def target():  # a name the conformance plugin parametrizes
    return 3
'''

UNRELATED_TESTS = '''\
import sys

from hypothesis import given, settings, strategies as st


def test_own_option_and_fixture(target, request):
    assert target == 3 and request.config.getoption("device") == "cpu"
    assert "conformance.plugin" not in sys.modules


def test_hypothesis_profile_untouched():
    assert settings.default.max_examples == 100


@given(st.integers())
def test_property(x):
    pass
'''


def _run(args: list[str], cwd: Path, site: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    env["PYTHONPATH"] = str(site)  # the install folder only: never the checkout
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The folder the wheel was installed into (``pip install --target``)."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("building the wheel without build isolation needs setuptools installed")
    work = tmp_path_factory.mktemp("installed")
    source = work / "source"  # a copy, so the build leaves nothing in the checkout
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, source / name)
    wheels, site = work / "wheels", work / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(source)], check=True, capture_output=True, timeout=600)
    (wheel,) = wheels.glob("*.whl")
    subprocess.run([*pip, "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=600)
    return site


def test_wheel_ships_what_runs(installed):
    assert (installed / "implementations" / "xfail" / "sdpa.toml").is_file()
    assert (installed / "implementations" / "xfail" / "jax.toml").is_file()
    assert sorted(p.name for p in (installed / "conformance").glob("test_*.py")) == sorted(
        p.name for p in (ROOT / "conformance").glob("test_*.py"))
    (dist_info,) = installed.glob("attention_conformance-*.dist-info")
    assert "conformance.activation" in (dist_info / "entry_points.txt").read_text()


def test_certifies_a_function_from_outside_the_checkout(installed, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "mine.py").write_text(MINE)
    where = _run(["-c", "import conformance; print(conformance.__file__)"], project, installed)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(installed)

    run = _run(["-m", "pytest", "--pyargs", "conformance", f"--impl={project / 'mine.py'}:attn",
                "--hypothesis-profile=ci", "-k", "forward_agreement or output_contract",
                "-p", "no:cacheprovider"], project, installed)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    loaded = json.loads((project / "loaded_from.json").read_text())
    assert all(Path(f).is_relative_to(installed) for f in loaded.values()), loaded
    assert "attention-conformance certificate" in output
    for prop in ("forward_agreement", "output_contract"):
        line = next(x for x in output.splitlines() if x.startswith(prop + " "))
        assert line.count("PASS") == 4, line  # float64, float32, float16, bfloat16
    assert "FAIL" not in output


def test_inert_in_an_unrelated_project(installed, tmp_path):
    project = tmp_path / "unrelated"
    project.mkdir()
    (project / "conftest.py").write_text(UNRELATED_CONFTEST)
    (project / "test_unrelated.py").write_text(textwrap.dedent(UNRELATED_TESTS))
    run = _run(["-m", "pytest", "-p", "no:cacheprovider", "-q", "--trace-config"], project, installed)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert "3 passed" in output
    assert "conformance.activation" in output  # the entry point was loaded ...
    assert "conformance.plugin" not in output  # ... and loaded nothing else
