"""Hypothesis profiles with fewer random examples, for benchmarks: ``PROFILE-maxN``.

``ci-max5`` is the ``ci`` profile with ``max_examples=5``: each property test keeps its
directed examples and each sweep its sizes, and Hypothesis draws at most 5 examples
more. The suite registers no such profile; a benchmark that runs pytest in a working
directory of its own calls :func:`plugin_args` with that directory and the profile's
name, and adds what it returns to the pytest command line: for a derived name it writes a
throw-away plugin module there that registers the profile before Hypothesis loads one
(``python -m pytest`` puts the working directory on ``sys.path``), and returns
``["-p", module]``; for any other name it writes nothing and returns ``[]``.

Used by ``certify_speed.py --max-examples`` and ``mutation_score.py --profile ci-max5``:
what a cut of the random search saves in seconds, and what it costs in kills.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["derived_profile", "plugin_args"]

MODULE = "benchmark_derived_profiles"
_NAME = re.compile(r"^(?P<base>.+)-max(?P<count>[1-9][0-9]*)$")

#: The plugin module's text; it matches names with ``_NAME``'s pattern.
_PLUGIN = f'''\
import re

import pytest
from hypothesis import settings


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    name = config.getoption("hypothesis_profile", None) or ""
    match = re.match({_NAME.pattern!r}, name)
    if match:
        settings.register_profile(name, parent=settings.get_profile(match["base"]),
                                  max_examples=int(match["count"]))
'''


def derived_profile(profile: str, max_examples: int) -> str:
    """The name of ``profile`` with ``max_examples`` random examples per test."""
    if max_examples < 1:
        raise ValueError(f"max_examples={max_examples}: Hypothesis needs at least 1 example per test")
    return f"{profile}-max{max_examples}"


def plugin_args(workdir: str | Path, profile: str) -> list[str]:
    """pytest arguments that make ``profile`` known to a run in ``workdir``."""
    if not _NAME.match(profile):
        return []
    Path(workdir, f"{MODULE}.py").write_text(_PLUGIN)
    return ["-p", MODULE]
