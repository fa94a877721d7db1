"""The property registry is the one list of properties: the property table of
docs/PROPERTIES.md (generated from it by ``python -m conformance.docgen``) and
docs/CONTRACTS.md name exactly the registered ids, every generated region of the
documentation is fresh, each id is registered once, and each property names the spec
section it checks."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import conformance
import spec
from conformance import docgen
from conformance.core.registry import registered_properties

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
    for level, name in docgen.LEVEL_NAMES.items():
        paragraph = text[text.index(f"{name} level:"):].split("\n\n", 1)[0]
        ids[level] = re.findall(r"[a-z0-9_]+", paragraph.split(":", 1)[1])
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


def _region(markdown: str, name: str) -> str:
    """The body of the generated region ``name``."""
    start = markdown.index(f"<!-- generated: {name} -->")
    return markdown[start:markdown.index(docgen.END, start)]


def test_property_table_matches_the_registry():
    page = (ROOT / "docs" / "PROPERTIES.md").read_text()
    in_table = _first_cell_ids(_region(page, "properties"))
    assert len(in_table) == len(set(in_table)), "a property is listed twice in the table of docs/PROPERTIES.md"
    registered = set(registered_properties())
    assert set(in_table) - registered == set(), "docs/PROPERTIES.md table rows that are not registered properties"
    assert registered - set(in_table) == set(), "registered properties missing from docs/PROPERTIES.md's table"


def test_checklist_names_registered_properties():
    named = {pid for _, entries in docgen.CHECKLIST for pid, _ in entries if pid != "*_agreement"}
    assert named and named <= set(registered_properties()), named - set(registered_properties())
    table = _region((ROOT / "docs" / "PROPERTIES.md").read_text(), "checklist")
    shown = {pid for line in table.splitlines() if line.startswith("| ") and "---" not in line
             for pid in re.findall(r"`([a-z0-9_]+)`", line.split("|")[2])}
    assert named <= shown, f"checklist entries not in docs/PROPERTIES.md: {named - shown}"


def test_the_generated_tables_have_their_regions():
    # Deleting a page's markers would make every region "fresh": the pages that must hold
    # each region are named here.
    found = {(path.relative_to(ROOT).as_posix(), region.name)
             for path in docgen.pages(ROOT) for region in docgen.regions(path, path.read_text())}
    assert {("docs/PROPERTIES.md", "properties"), ("docs/PROPERTIES.md", "checklist")} <= found, sorted(found)


def test_generated_regions_are_fresh():
    stale = docgen.check(ROOT)
    assert not stale, "\n".join(stale) + f"\nrun {docgen.COMMAND} and commit the pages it writes"


def _fake_checkout(tmp_path: Path, body: str) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# r\n")
    (tmp_path / "docs" / "P.md").write_text(f"# p\n\n<!-- generated: properties -->\n{body}<!-- end generated -->\n\ntail\n")
    return tmp_path / "docs" / "P.md"


def test_a_stale_region_is_found_and_rewritten(tmp_path):
    props = registered_properties()
    page = _fake_checkout(tmp_path, "| hand-edited | row |\n")
    assert docgen.check(tmp_path, props) == ["docs/P.md:3: region 'properties' is stale"]
    assert docgen.write(tmp_path, props) == [page]
    assert docgen.check(tmp_path, props) == []
    text = page.read_text()
    assert text.startswith("# p\n\n<!-- generated: properties -->\n| id |") and text.endswith("<!-- end generated -->\n\ntail\n")
    # A docstring edited in a property module makes the committed table stale.
    changed = dict(props)
    changed["temperature"] = dataclasses.replace(props["temperature"], doc="Something else must hold.")
    assert docgen.check(tmp_path, changed) == ["docs/P.md:3: region 'properties' is stale"]


def test_bad_markers_are_errors_naming_the_page_and_line(tmp_path):
    page = _fake_checkout(tmp_path, "")
    page.write_text("x\n<!-- generated: propertiez -->\n<!-- end generated -->\n")
    with pytest.raises(ValueError, match=r"P\.md:2: unknown generated region 'propertiez'; known: properties"):
        docgen.check(tmp_path)
    page.write_text("x\n<!-- generated: properties -->\nno end\n")
    with pytest.raises(ValueError, match=r"P\.md:2: region 'properties' has no '<!-- end generated -->' line"):
        docgen.check(tmp_path)
    page.write_text("x\n<!-- end generated -->\n")
    with pytest.raises(ValueError, match=r"P\.md:2: '<!-- end generated -->' without its"):
        docgen.check(tmp_path)


def test_summary_is_the_docstrings_first_paragraph():
    assert docgen.summary("First line\n    goes on.\n\n    Detail.") == "First line goes on."
    assert "\\|" in docgen.render_properties({"p": dataclasses.replace(
        registered_properties()["temperature"], id="p", doc="|x| is kept")})


def test_property_ids_region_reads_as_the_contracts_lists():
    # The form docs/CONTRACTS.md's "Property ids" paragraphs have, ready to be marked as a
    # region: each level's paragraph names exactly its registered ids, the end marker apart.
    registered = registered_properties()
    marked = f"## Property ids\n\n<!-- generated: property-ids -->\n{docgen.END}\n\nMore.\n"
    text = docgen.render(marked, Path("CONTRACTS.md"), registered)
    ids = {}
    for level, name in docgen.LEVEL_NAMES.items():
        paragraph = text[text.index(f"{name} level:"):].split("\n\n", 1)[0]
        ids[level] = re.findall(r"[a-z0-9_]+", paragraph.split(":", 1)[1])
    assert {level: sorted(v) for level, v in ids.items()} == {
        level: sorted(p.id for p in registered.values() if p.level == level) for level in docgen.LEVEL_NAMES}


def test_checklist_with_an_unregistered_id_is_an_error(monkeypatch):
    monkeypatch.setattr(docgen, "CHECKLIST", (("an item", (("no_such_property", ""),)),))
    with pytest.raises(ValueError, match="'an item' names 'no_such_property', which is not a registered property"):
        docgen.render_checklist(registered_properties())


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
    assert info.level in docgen.LEVELS and info.doc and info.examples_factor > 0


def test_requirements_are_data_the_registry_reads():
    """``requires=`` names what a property needs of the capabilities: each requirement reads
    a Capabilities field, an unknown name is refused at registration, an unmet one skips
    the property with its reason, and the registry knows which properties each field gates
    (docs/OPTIONS.md's generated table)."""
    import dataclasses

    from conformance.core.registry import registered_properties, skip_reasons
    from conformance.core.requirements import REQUIREMENTS, gated_by
    from conformance.core.target import Target
    from conformance.harness.runner import conformance_property
    from implementations import registry as impl_registry
    from implementations.base import Capabilities

    fields = {f.name for f in dataclasses.fields(Capabilities)}
    assert {r.field for r in REQUIREMENTS.values()} <= fields
    props = registered_properties()
    used = {name for info in props.values() for name in info.requires}
    assert used == set(REQUIREMENTS), set(REQUIREMENTS) - used        # no requirement left unused
    gates = gated_by(props)
    assert "gradient_agreement" in gates["autograd"] and gates["gqa"] == ["gqa_equivalence"]
    with pytest.raises(ValueError, match="not requirements.*autograd"):
        conformance_property("no_such_property", level="sdpa", section="spec.sdpa", cases=lambda t: None,
                             requires=("autograd_typo",))
    impl = impl_registry.resolve("handwritten", {"gqa": "false", "autograd": "false"})
    target = Target(impl, "sdpa", "float64", "cpu")
    assert skip_reasons(props["gqa_equivalence"], target) == ["GQA not declared"]
    assert skip_reasons(props["gradient_agreement"], target) == ["autograd not declared"]
    assert skip_reasons(props["forward_agreement"], target) == []
