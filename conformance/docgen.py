"""The documentation's generated regions, written from the property registry.

    python -m conformance.docgen           # rewrite every stale region
    python -m conformance.docgen --check   # only report them (exit status 1 if any)

A page marks a region with two lines::

    <!-- generated: properties -->
    ...
    <!-- end generated -->

and everything between them is what :data:`GENERATORS` renders for that name: the
region is never edited by hand. The facts come from one place each: a property's id,
level and spec section from its ``@conformance_property`` registration, what must hold
from the first paragraph of its docstring, its row order from the level's measured order
(``conformance/harness/property_order.json``, unlisted properties after the listed ones), and the
hand-written-attention checklist from :data:`CHECKLIST` below (every id in it must be a
registered property), the ``--impl-option`` keys from
``implementations/registry/option_docs.py``. ``tests/runner/test_property_registry.py``
fails while a region is stale. The pages are those of a checkout (``README.md`` and ``docs/*.md``); an installed
copy has no documentation to write.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CHECKLIST", "GENERATORS", "ROOT", "Region", "check", "main", "pages", "regions", "render", "write"]

ROOT = Path(__file__).resolve().parents[1]
#: The levels in the order a run certifies them; a level not named here comes after these.
LEVELS = ("sdpa", "mha", "flash", "varlen", "kvcache", "sharded")
LEVEL_NAMES = {"sdpa": "SDPA", "mha": "MHA", "flash": "Flash", "varlen": "Varlen", "kvcache": "KVCache", "sharded": "Sharded"}
START = re.compile(r"^<!-- generated: ([\w-]+) -->[ \t]*$", re.M)
END = "<!-- end generated -->"
COMMAND = "python -m conformance.docgen"

#: A bug a hand-written attention often has -> the properties that catch it, each with an
#: optional note. The id ``*_agreement`` stands for every registered ``..._agreement``
#: property (they all fail a NaN where the oracle is finite).
CHECKLIST: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("output shape kept", (("output_contract", ""), ("mha_output_contract", ""))),
    ("rows of weights sum to 1", (("weights_are_distributions", ""), ("mha_agreement", "weights"))),
    ("masked weights are 0", (("masked_keys_ignored", ""), ("fully_masked_rows", ""),
                              ("mha_mask_conventions", ""))),
    ("no NaN", (("*_agreement", "NaN where the oracle is finite fails"), ("fully_masked_rows", ""),
                ("dropout_expectation", ""))),
    ("gradients reach every parameter", (("mha_gradients", ""), ("gradient_agreement", ""))),
    ("eval vs train", (("mha_eval_determinism", ""), ("mha_dropout_expectation", ""),
                       ("dropout_expectation", ""))),
    ("agrees with nn.MultiheadAttention",
     (("mha_agreement", "the oracle is pinned to nn.MultiheadAttention to 1e-15 in `tests/spec`"),)),
    ("scale 1/sqrt(head dim), not model dim", (("forward_agreement", ""), ("scaling_variance", ""),
                                               ("temperature", ""))),
    ("heads split and merged correctly", (("mha_agreement", ""), ("head_independence", ""))),
)


def _properties() -> Mapping[str, Any]:
    from conformance.core.registry import registered_properties

    return registered_properties()


def _ordered(props: Mapping[str, Any]) -> list[Any]:
    """The properties level by level, each level in the order a run certifies it."""
    from conformance.harness.ordering import property_rank

    registration = {pid: index for index, pid in enumerate(props)}
    levels = list(LEVELS) + sorted({p.level for p in props.values()} - set(LEVELS))
    return sorted(props.values(), key=lambda p: (levels.index(p.level), property_rank(p.level, p.id),
                                                 registration[p.id]))


def summary(doc: str) -> str:
    """A docstring's first paragraph on one line (what the property says must hold)."""
    paragraph = textwrap.dedent(doc).strip().split("\n\n", 1)[0]
    return " ".join(paragraph.split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_properties(props: Mapping[str, Any]) -> str:
    """The property table: id, level, what must hold, the spec section it checks."""
    lines = ["| id | level | what must hold | checks |", "|---|---|---|---|"]
    for p in _ordered(props):
        lines.append(f"| `{p.id}` | {p.level} | {_cell(summary(p.doc))} | `{_cell(p.section)}` |")
    return "\n".join(lines)


def render_checklist(props: Mapping[str, Any]) -> str:
    """The hand-written-attention checklist: each item and the properties that check it."""
    lines = ["| checklist item | properties |", "|---|---|"]
    for item, entries in CHECKLIST:
        cells = []
        for pid, note in entries:
            if pid == "*_agreement":
                ids = ", ".join(f"`{p.id}`" for p in _ordered(props) if p.id.endswith("_agreement"))
                cells.append(f"every agreement property ({note}: {ids})" if note else f"every agreement property ({ids})")
                continue
            if pid not in props:
                raise ValueError(f"conformance/docgen.py CHECKLIST: {item!r} names {pid!r}, which is not a "
                                 f"registered property (registered: {', '.join(sorted(props))}); "
                                 "name a registered id or drop the entry")
            cells.append(f"`{pid}` ({note})" if note else f"`{pid}`")
        lines.append(f"| {_cell(item)} | {', '.join(cells)} |")
    return "\n".join(lines)


def render_property_ids(props: Mapping[str, Any]) -> str:
    """Each level's ids as a paragraph (``SDPA level: a, b, ...``), in the certified order."""
    ordered = _ordered(props)
    levels = list(dict.fromkeys(p.level for p in ordered))
    paragraphs = []
    for level in levels:
        ids = ", ".join(p.id for p in ordered if p.level == level)
        paragraphs.append(textwrap.fill(f"{LEVEL_NAMES.get(level, level)} level: {ids}.", width=88,
                                        break_on_hyphens=False))
    # A blank line before the end marker: a reader of paragraphs (the CONTRACTS.md test)
    # must not take the marker for more ids.
    return "\n\n".join(paragraphs) + "\n"


def render_requirements(props: Mapping[str, Any]) -> str:
    """Each capability field a property ``requires`` and the properties it gates (skipped
    where the implementation's capabilities do not meet it), from the registry."""
    from conformance.core.requirements import REQUIREMENTS, gated_by

    order = {p.id: i for i, p in enumerate(_ordered(props))}
    lines = ["| field | requirement: skipped with | properties it gates |", "|---|---|---|"]
    gates = gated_by(props)
    for field in sorted(gates):
        named = [f"`{name}`: {req.missing}" for name, req in REQUIREMENTS.items() if req.field == field
                 and any(name in getattr(props[pid], "requires", ()) for pid in gates[field])]
        ids = ", ".join(f"`{pid}`" for pid in sorted(gates[field], key=lambda pid: order.get(pid, 0)))
        lines.append(f"| `{field}` | {_cell('; '.join(named))} | {ids} |")
    return "\n".join(lines)


def render_options(props: Mapping[str, Any]) -> str:
    """Every ``--impl-option`` key with an example value and what it declares (the keys a
    declaration holds: ``implementations/registry/option_docs.py``), then the scopes."""
    from implementations.base import ALL_DTYPES, PER_DTYPE_FIELDS
    from implementations.registry.option_docs import option_rows
    from implementations.registry.options import OPTION_LEVELS

    lines = ["| option | what it declares |", "|---|---|"]
    lines += [f"| `--impl-option {key}={_cell(example)}` | {_cell(meaning)} |" for key, example, meaning in option_rows()]
    levels, dtypes = "`, `".join(f"{level}." for level in OPTION_LEVELS), "`, `".join(f"{d}." for d in ALL_DTYPES)
    lines.append(f"| `--impl-option flash.head_dims=64,128` | a level-scoped key: `{levels}` before a capability "
                 "key applies it at that level only (also to the flash level derived from an SDPA callable) |")
    per_dtype = ", ".join(f"`{name}`" for name in PER_DTYPE_FIELDS)
    lines.append(f"| `--impl-option float16.fully_masked=nan` | a dtype-scoped key: `{dtypes}` before one of "
                 f"{per_dtype} applies it in that dtype only (float16's fully-masked rows NaN, the other dtypes' "
                 "as declared or probed) |")
    return "\n".join(lines)


#: Region name -> its renderer (given the registry).
GENERATORS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "properties": render_properties,
    "checklist": render_checklist,
    "property-ids": render_property_ids,
    "requirements": render_requirements,
    "options": render_options,
}


@dataclass(frozen=True)
class Region:
    """One marked region of a page: its name and where its body starts and ends."""

    path: Path
    name: str
    line: int
    start: int
    end: int


def pages(root: Path = ROOT) -> list[Path]:
    """The pages that may hold generated regions: README.md and docs/*.md."""
    docs = root / "docs"
    if not docs.is_dir():
        raise FileNotFoundError(f"{docs} does not exist: {COMMAND} writes the documentation of a "
                                "checkout of attention-conformance; run it in one")
    return [p for p in [root / "README.md", *sorted(docs.glob("*.md"))] if p.is_file()]


def regions(path: Path, text: str) -> list[Region]:
    """The marked regions of ``text``; a start without its end, a nested start or an
    unknown name is a ValueError naming the page and line."""
    found = []
    for match in START.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(f"{path.name}:{line}: unknown generated region {name!r}; known: "
                             f"{', '.join(GENERATORS)} (conformance/docgen.py GENERATORS)")
        body = match.end() + 1
        end = text.find("\n" + END, match.end())
        if end == -1:
            raise ValueError(f"{path.name}:{line}: region {name!r} has no {END!r} line after it; add one")
        nested = START.search(text, body, end + 1)
        if nested:
            raise ValueError(f"{path.name}:{line}: region {name!r} is not closed before the next "
                             f"'<!-- generated: ... -->'; add {END!r} before it")
        found.append(Region(path, name, line, body, end + 1))
    ends = [m.start() for m in re.finditer(r"^" + re.escape(END) + r"[ \t]*$", text, re.M)]
    if len(ends) > len(found):
        closed = {region.end for region in found}
        orphan = next(pos for pos in ends if pos not in closed)
        raise ValueError(f"{path.name}:{text.count(chr(10), 0, orphan) + 1}: {END!r} without its "
                         "'<!-- generated: NAME -->' line; add the start line or remove this one")
    return found


def render(text: str, path: Path, props: Mapping[str, Any]) -> str:
    """``text`` with every marked region's body rendered anew."""
    out, last = [], 0
    for region in regions(path, text):
        out += [text[last:region.start], GENERATORS[region.name](props), "\n"]
        last = region.end
    return "".join(out) + text[last:]


def _stale_pages(root: Path, props: Mapping[str, Any] | None):
    """(page, its text, the text rendered afresh) for each page a region of which is stale."""
    props = _properties() if props is None else props
    for path in pages(root):
        text = path.read_text(encoding="utf-8")
        fresh = render(text, path, props)
        if fresh != text:
            yield path, text, fresh, props


def check(root: Path = ROOT, props: Mapping[str, Any] | None = None) -> list[str]:
    """Each stale region as ``page:line: region 'name' is stale``; [] when all are fresh."""
    return [f"{path.relative_to(root)}:{region.line}: region {region.name!r} is stale"
            for path, text, _, props in _stale_pages(root, props)
            for region in regions(path, text)
            if text[region.start:region.end] != GENERATORS[region.name](props) + "\n"]


def write(root: Path = ROOT, props: Mapping[str, Any] | None = None) -> list[Path]:
    """Rewrite every page whose regions are stale; the pages written."""
    written = []
    for path, _, fresh, _ in _stale_pages(root, props):
        path.write_text(fresh, encoding="utf-8")
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="report stale regions, write nothing")
    args = parser.parse_args(argv)
    try:
        if args.check:
            stale = check()
            for line in stale:
                print(f"{line}: run {COMMAND}", file=sys.stderr)
            return 1 if stale else 0
        for path in write():
            print(f"wrote {path.relative_to(ROOT)}")
    except (ValueError, FileNotFoundError) as exc:
        print(f"{COMMAND}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
