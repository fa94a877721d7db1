"""Documents point only inside the repository, and every link and anchor resolves.

* every relative markdown link in a ``*.md`` file names an existing file or folder, and
  its ``#anchor`` (if any) is a heading of the target, by GitHub's anchor rules;
* every ``docs/X.md#anchor`` or ``spec/README.md#anchor`` written in a markdown file or
  in ``conformance/``, ``implementations/`` and ``tests/`` source (``section=`` strings,
  docstrings, comments) resolves the same way, and every ``docs/KNOWN_BUGS.md #n`` (the
  mutants' ``origin``) names a numbered row of that file;
* no file mentions a path outside the checkout (``../shared``, ``/work/``), and the design
  notes and known-bug list are only ever named as ``docs/DESIGN.md`` and
  ``docs/KNOWN_BUGS.md`` (files inside ``docs/``, and mkdocs.yml's nav, may name them
  relatively);
* the rendered site: mkdocs.yml's nav lists every page of ``docs/`` once, the MkDocs hook
  (``mkdocs_hooks.py``) warns on a missing link target (inside ``docs/`` or out of it) and
  on nothing else, and sends links out of ``docs/`` to ``repo_url``; where mkdocs is
  installed (the ``docs`` extra), ``mkdocs build --strict`` is clean.
"""

from __future__ import annotations

import re
import subprocess
import unicodedata
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()
#: Folders never scanned when git is not available to list the checkout's files.
SKIPPED_DIRS = {".git", ".hypothesis", ".conformance", ".ruff_cache", ".pytest_cache", "__pycache__",
                "build", "dist", ".venv", "venv"}

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
ANCHOR_REFERENCE = re.compile(r"\b((?:docs/[\w-]+|spec/README)\.md)#([\w-]+)")
KNOWN_BUG_ROW = re.compile(r"\bdocs/KNOWN_BUGS\.md #(\d+)")
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
OUTSIDE = re.compile(r"\.\./shared|/work/")
NOTES_NAME = re.compile(r"(?<!docs/)\b(?:DESIGN|KNOWN_BUGS)\b")


@cache
def checkout_files() -> tuple[Path, ...]:
    """Tracked files plus untracked ones git does not ignore (a walk when git is missing)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=ROOT, capture_output=True, check=True).stdout
        paths = [ROOT / name for name in listed.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in ROOT.rglob("*") if not SKIPPED_DIRS & set(p.relative_to(ROOT).parts)]
    return tuple(sorted(p for p in paths if p.is_file()))


@cache
def text_of(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: rendered text, lower case, punctuation dropped
    (letters, digits, marks, '_', '-' and spaces kept), each space turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = text.replace("`", "").lower()
    kept = "".join(ch for ch in text
                   if ch in " -_" or unicodedata.category(ch)[0] in "LNM")
    return kept.replace(" ", "-")


@cache
def anchors_of(path: Path) -> frozenset[str]:
    """Heading anchors of a markdown file, with GitHub's -1, -2 suffixes for repeats."""
    text = FENCE.sub("", text_of(path) or "")
    seen: dict[str, int] = {}
    anchors = set()
    for match in HEADING.finditer(text):
        base = github_anchor(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        anchors.add(base if count == 0 else f"{base}-{count}")
    return frozenset(anchors)


def markdown_files() -> list[Path]:
    return [p for p in checkout_files() if p.suffix == ".md"]


def source_files() -> list[Path]:
    folders = ("conformance", "implementations", "tests")
    return [p for p in checkout_files()
            if p.suffix == ".py" and p.relative_to(ROOT).parts[0] in folders and p != THIS]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def check_target(source: Path, target: Path, anchor: str | None, what: str) -> str | None:
    """None if ``target`` (and ``anchor`` in it) exists, else the problem in words."""
    try:
        target = target.resolve()
        target.relative_to(ROOT)
    except ValueError:
        return f"{rel(source)}: {what} points outside the repository"
    if not target.exists():
        return f"{rel(source)}: {what}: no such file {target.relative_to(ROOT)}"
    if anchor and target.suffix == ".md" and anchor not in anchors_of(target):
        return (f"{rel(source)}: {what}: no heading with anchor #{anchor} in "
                f"{target.relative_to(ROOT)} (anchors: {', '.join(sorted(anchors_of(target)))})")
    return None


def test_github_anchor_rules():
    assert github_anchor("Decisions (each one tested)") == "decisions-each-one-tested"
    assert github_anchor("Tests (`tests/spec/`)") == "tests-testsspec"
    assert github_anchor("4. is_causal dropped") == "4-is_causal-dropped"
    assert github_anchor("6. Causal alignment when L ≠ S") == "6-causal-alignment-when-l--s"
    assert github_anchor("Upstream classes (rows 1–15)") == "upstream-classes-rows-115"


def test_there_are_documents_to_check():
    names = {rel(p) for p in markdown_files()}
    assert {"README.md", "spec/README.md", "docs/DESIGN.md", "docs/KNOWN_BUGS.md",
            "docs/CONTRACTS.md"} <= names, sorted(names)


@pytest.mark.parametrize("path", markdown_files(), ids=rel)
def test_relative_markdown_links_resolve(path):
    text = INLINE_CODE.sub("", FENCE.sub("", text_of(path) or ""))
    problems = []
    for match in LINK.finditer(text):
        link = match.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", link, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = link.partition("#")
        target = path if not file_part else path.parent / file_part
        problem = check_target(path, target, anchor or None, f"link {link!r}")
        if problem:
            problems.append(problem)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", markdown_files() + source_files(), ids=rel)
def test_anchor_references_resolve(path):
    text = text_of(path) or ""
    problems = []
    for match in ANCHOR_REFERENCE.finditer(text):
        problem = check_target(path, ROOT / match.group(1), match.group(2), f"reference {match.group(0)!r}")
        if problem:
            problems.append(problem)
    rows = anchors_of(ROOT / "docs" / "KNOWN_BUGS.md")
    for match in KNOWN_BUG_ROW.finditer(text):
        if not any(anchor.startswith(f"{match.group(1)}-") for anchor in rows):
            problems.append(f"{rel(path)}: {match.group(0)!r} names no numbered row of docs/KNOWN_BUGS.md")
    assert not problems, "\n".join(problems)


def test_nothing_points_outside_the_repository():
    problems = []
    for path in checkout_files():
        text = text_of(path)
        if text is None or path == THIS:
            continue
        # mkdocs.yml's nav names pages relative to docs/, as the pages themselves do.
        in_docs = path.relative_to(ROOT).parts[0] == "docs" or rel(path) == "mkdocs.yml"
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                problems.append(f"{rel(path)}:{number}: a path outside the checkout: {line.strip()}")
            if not in_docs and NOTES_NAME.search(line):
                problems.append(f"{rel(path)}:{number}: names the design notes or the known-bug "
                                f"list without docs/: {line.strip()}")
    assert not problems, "\n".join(problems)


# -- the rendered site (mkdocs.yml, mkdocs_hooks.py) ------------------------------------


def _hooks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Page:
    def __init__(self, path: Path):
        self.file = type("File", (), {"abs_src_path": str(path), "src_uri": path.name})()


def _run_hook(markdown: str, caplog, repo_url: str = "") -> str:
    config = {"docs_dir": str(ROOT / "docs"), "config_file_path": str(ROOT / "mkdocs.yml"), "repo_url": repo_url}
    with caplog.at_level("WARNING", logger="mkdocs.hooks.links"):
        return _hooks().on_page_markdown(markdown, _Page(ROOT / "docs" / "index.md"), config, None)


def test_mkdocs_nav_lists_every_page():
    config = (ROOT / "mkdocs.yml").read_text()
    in_nav = re.findall(r"^\s*- [^:\n]+: ([\w/-]+\.md)\s*$", config, re.M)
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert len(in_nav) == len(set(in_nav)), "a page is twice in mkdocs.yml's nav"
    assert sorted(in_nav) == pages, f"mkdocs.yml nav: {sorted(in_nav)}, docs/: {pages}"


def test_mkdocs_hook_warns_on_a_missing_target_only(caplog):
    text = ("[ok](OPTIONS.md#options) [out](../spec/README.md) [web](https://example.org/x.md) "
            "[missing](NOPE.md) [gone](../nope/README.md#a) `[code](../code.md)`\n"
            "```\n[fenced](../fenced.md)\n```\n")
    assert _run_hook(text, caplog) == text
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned
    assert "links 'NOPE.md': no such file docs/NOPE.md" in warned[0]
    assert "links '../nope/README.md#a': no such file nope/README.md" in warned[1]


def test_mkdocs_hook_sends_links_out_of_docs_to_the_repository(caplog):
    out = _run_hook("[s](../spec/README.md#decisions-each-one-tested) [b](../benchmarks) [o](OPTIONS.md)",
                    caplog, repo_url="https://example.org/org/repo/")
    assert out == ("[s](https://example.org/org/repo/blob/HEAD/spec/README.md#decisions-each-one-tested) "
                   "[b](https://example.org/org/repo/tree/HEAD/benchmarks) [o](OPTIONS.md)")
    assert not caplog.records


def test_mkdocs_strict_build_is_clean(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]')")
    pytest.importorskip("pymdownx", reason="pymdown-extensions is not installed (pip install -e '.[docs]')")
    import sys

    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                             "--site-dir", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "PROPERTIES" / "index.html").exists()
