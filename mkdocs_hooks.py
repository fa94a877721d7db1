"""MkDocs hook (``hooks:`` in mkdocs.yml): links from docs/ to the rest of the repository.

The pages link files outside ``docs_dir`` (``../README.md``, ``../spec/README.md``), which
MkDocs cannot see: it would report each as not found, broken or not. This hook checks
every relative link of a page itself: a target that does not exist, inside docs/ or out,
is a warning (an error under ``mkdocs build --strict``), naming the page, the link and the
missing file. A link out of docs/ to a file that exists is rewritten to ``repo_url``'s copy
of it when mkdocs.yml sets ``repo_url``, and left as written (it works on GitHub, where
the pages are read in place) when it does not. Anchors inside the site are MkDocs' own
check (``validation.links.anchors``); anchors into files outside it are checked by
``tests/test_docs_links.py``, as every link is.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.links")

LINK = re.compile(r"(!?\[[^\]]*\]\(\s*<?)([^)\s>]+)(>?(?:\s+\"[^\"]*\")?\s*\))")
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
SCHEME = re.compile(r"[a-z][a-z0-9+.-]*:", re.I)


def _outside_code(markdown: str) -> list[tuple[int, int]]:
    """Spans of ``markdown`` that are neither fenced blocks nor inline code."""
    hidden = [m.span() for m in FENCE.finditer(markdown)]
    hidden += [m.span() for m in INLINE_CODE.finditer(FENCE.sub(lambda m: " " * len(m.group(0)), markdown))]
    spans, last = [], 0
    for start, end in sorted(hidden):
        if start > last:
            spans.append((last, start))
        last = max(last, end)
    return spans + [(last, len(markdown))]


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs = Path(config["docs_dir"]).resolve()
    root = Path(config["config_file_path"]).resolve().parent
    source = Path(page.file.abs_src_path)
    repo_url = (config.get("repo_url") or "").rstrip("/")

    def fix(match: re.Match[str]) -> str:
        link = match.group(2)
        if SCHEME.match(link) or link.startswith("#"):
            return match.group(0)
        file_part, hash_, anchor = link.partition("#")
        target = (source.parent / file_part).resolve()
        if not target.exists():
            log.warning(f"Doc file '{page.file.src_uri}' links '{link}': no such file "
                        f"{target.relative_to(root) if target.is_relative_to(root) else target}")
            return match.group(0)
        if target.is_relative_to(docs) or not target.is_relative_to(root) or not repo_url:
            return match.group(0)
        kind = "tree" if target.is_dir() else "blob"
        url = f"{repo_url}/{kind}/HEAD/{target.relative_to(root).as_posix()}{hash_}{anchor}"
        return match.group(1) + url + match.group(3)

    out, last = [], 0
    for start, end in _outside_code(markdown):
        out += [markdown[last:start], LINK.sub(fix, markdown[start:end])]
        last = end
    return "".join(out) + markdown[last:]
