"""The README is the front door: it fits a screen or two, and what it says runs.

* at most 250 lines (reference material lives in docs/, rendered by the MkDocs site);
* the sections a newcomer needs are there: the quick start, certifying your own
  implementation, reading the certificate, a failure, and the map of docs/;
* the quick start's test command is the one ``.ci/run`` runs, with extras it installs;
* every built-in the README names with ``--impl=`` resolves.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from implementations import registry

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
MAX_LINES = 250


def test_the_readme_fits_in_250_lines():
    lines = README.count("\n") + (not README.endswith("\n"))
    assert lines <= MAX_LINES, (
        f"README.md has {lines} lines, more than {MAX_LINES}: move reference material into docs/ "
        "(and mkdocs.yml's nav), keeping one paragraph and one command per case here")


@pytest.mark.parametrize("heading", ["Quick start", "Certify your own implementation",
                                     "Reading the certificate", "When a property fails",
                                     "Documentation"])
def test_the_readme_has_the_sections_a_newcomer_needs(heading):
    assert re.search(rf"^## {re.escape(heading)}\s*$", README, re.M), f"README.md has no '## {heading}'"


def test_the_quick_start_test_command_is_what_ci_runs():
    command = re.search(r'pip install -e "\.\[([\w,]+)\]" && pytest -n 2$', README, re.M)
    assert command, "README.md's quick start has no test command of the form pip install -e \".[...]\" && pytest -n 2"
    ci = (ROOT / ".ci" / "run").read_text()
    installed = re.search(r'pip install --quiet -e "\.\[([\w,]+)\]"', ci)
    assert installed and set(command.group(1).split(",")) <= set(installed.group(1).split(","))
    assert re.search(r"-m pytest -n 2\b", ci)


def test_every_builtin_the_readme_names_resolves():
    names = set(re.findall(r"--impl=([\w:-]+)(?=[\s`])", README))
    declared = set(re.findall(r"^\[tool\.attention-conformance\.implementations\.([\w-]+)\]", README, re.M))
    builtins = {n for n in names if ":" not in n or n.startswith("mutant:")} - {"list", "NAME", "X"} - declared
    assert builtins, "README.md names no built-in implementation"
    for name in sorted(builtins):
        assert registry.resolve(name) is not None, name
