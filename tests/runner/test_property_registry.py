"""The property registry is the one list of properties: the README's table and
docs/CONTRACTS.md name exactly the registered ids, each id is registered once,
and each property names the spec section it checks."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import conformance
import spec
from conformance.runner import registered_properties

ROOT = Path(__file__).resolve().parents[2]


def _section(markdown: str, heading: str) -> str:
    """The text under ``## heading`` up to the next ``## `` heading."""
    start = markdown.index(f"## {heading}")
    end = markdown.find("\n## ", start + 1)
    return markdown[start:end if end != -1 else None]


def _first_cell_ids(table_text: str) -> list[str]:
    return [pid for line in table_text.splitlines() if line.startswith("| `")
            for pid in re.findall(r"`([a-z0-9_]+)`", line.split("|")[1])]


def _contracts_ids() -> dict[str, list[str]]:
    text = _section((ROOT / "docs" / "CONTRACTS.md").read_text(), "Property ids")
    ids = {}
    for level in ("SDPA", "MHA", "Flash", "Varlen", "KVCache"):
        paragraph = text[text.index(f"{level} level:"):].split("\n\n", 1)[0]
        ids[level.lower()] = re.findall(r"[a-z0-9_]+", paragraph.split(":", 1)[1])
    return ids


def test_every_property_test_is_registered_once():
    tests = []
    for module in pkgutil.iter_modules(conformance.__path__):
        if module.name.startswith("test_"):
            mod = importlib.import_module(f"conformance.{module.name}")
            tests += [f.conformance_property for f in vars(mod).values()
                      if callable(f) and hasattr(f, "conformance_property")]
    assert len(tests) == len(set(tests)), f"ids registered twice: {sorted(t for t in tests if tests.count(t) > 1)}"
    assert set(tests) == set(registered_properties())


def test_readme_property_table_matches_the_registry():
    readme = (ROOT / "README.md").read_text()
    in_table = _first_cell_ids(_section(readme, "The properties"))
    assert len(in_table) == len(set(in_table)), "a property is listed twice in the README table"
    registered = set(registered_properties())
    assert set(in_table) - registered == set(), "README table rows that are not registered properties"
    assert registered - set(in_table) == set(), "registered properties missing from the README table"


def test_readme_checklist_names_registered_properties():
    checklist = _section((ROOT / "README.md").read_text(), "The hand-written-attention checklist")
    named = {pid for line in checklist.splitlines()[1:] if line.startswith("| ") and "---" not in line
             for pid in re.findall(r"`([a-z0-9_]+)`", line.split("|")[2])}
    assert named and named <= set(registered_properties()), named - set(registered_properties())


def test_contracts_lists_every_registered_id_at_its_level():
    listed = _contracts_ids()
    registered = registered_properties()
    for level, ids in listed.items():
        assert len(ids) == len(set(ids)), f"{level}: listed twice"
        wrong = {i: registered[i].level for i in ids if i in registered and registered[i].level != level}
        assert not wrong, f"docs/CONTRACTS.md lists these under {level.upper()} level: {wrong}"
    every = {i for ids in listed.values() for i in ids}
    assert every - set(registered) == set(), "docs/CONTRACTS.md ids that are not registered properties"
    assert set(registered) - every == set(), "registered properties missing from docs/CONTRACTS.md"


@pytest.mark.parametrize("pid", sorted(registered_properties()))
def test_property_names_its_spec_section_and_says_what_it_checks(pid):
    info = registered_properties()[pid]
    match = re.match(r"spec\.(\w+)", info.section)
    doc = re.match(r"docs/([A-Z_]+\.md)#[\w-]+", info.section)  # anchors: tests/test_docs_links.py
    assert (match and hasattr(spec, match.group(1))) or (doc and (ROOT / "docs" / doc.group(1)).exists()), (
        f"section={info.section!r}, but should start with spec.<name> of a public spec function or "
        "module, or name a docs/<FILE>.md#anchor")
    assert info.level in ("sdpa", "mha", "flash", "varlen", "kvcache") and info.doc and info.examples_factor > 0
