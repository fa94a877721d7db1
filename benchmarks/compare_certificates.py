"""Compare two sets of certificates (JSON, as written by --conformance-report).

    python benchmarks/compare_certificates.py BEFORE_DIR AFTER_DIR

For every ``NAME.json`` in both folders, each (level, property, dtype, device)
result must have the same outcome and the same number of examples. Prints one
line per implementation and every difference; exits 1 when any differ.
Worst ratios are shown side by side but never judged (they move with rounding).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _rows(path: Path) -> dict[tuple[str, str, str, str], dict]:
    cert = json.loads(path.read_text())
    return {(r["level"], r["property"], r["dtype"], r["device"]): r for r in cert["results"]}


def compare(before: Path, after: Path) -> int:
    differences = 0
    for old in sorted(before.glob("*.json")):
        new = after / old.name
        if not new.exists():
            print(f"{old.stem}: missing in {after}")
            differences += 1
            continue
        a, b = _rows(old), _rows(new)
        diffs = []
        for key in sorted(set(a) | set(b)):
            ra, rb = a.get(key), b.get(key)
            if ra is None or rb is None:
                diffs.append(f"  {key}: only in {'after' if ra is None else 'before'}")
                continue
            if (ra["outcome"], ra["examples"]) != (rb["outcome"], rb["examples"]):
                diffs.append(f"  {key}: {ra['outcome']}({ra['examples']}) -> {rb['outcome']}({rb['examples']})")
        print(f"{old.stem}: {len(a)} results, {'identical' if not diffs else f'{len(diffs)} differ'}")
        print("\n".join(diffs)) if diffs else None
        differences += len(diffs)
    return 1 if differences else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(compare(Path(sys.argv[1]), Path(sys.argv[2])))
