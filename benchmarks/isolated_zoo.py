"""An isolated certificate reads as an in-process one, over the whole bug zoo.

Certifies the zoo's mutants (the Triton ones aside unless ``--triton``: the interpreter
makes each worker slow) twice in one pytest process each, ``--impl-exitfirst``: in
process (``--isolate=never``) and each mutant in its own worker process
(``--isolate=always``, what ``auto`` does after a crash). Then compares, per mutant, what
its first failure's certificate entry says: the killing property and dtype, the shrunk
counterexample, the call the reproducer makes, the diagnosis' causes and the reproducer's
text (with each run's scratch directory written as WORKDIR). Prints the wall seconds of
both runs, the counts of identical fields and every mutant that differs.

    python benchmarks/isolated_zoo.py
    python benchmarks/isolated_zoo.py --only causal_lower_right,mha_no_out_proj --output benchmarks/results/isolated-zoo.txt

Exit status: 0 when every mutant is killed both ways and every field agrees, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from mutation_score import certify_in_process  # noqa: E402

from implementations.mutants import MUTANTS  # noqa: E402

#: What a failure's certificate entry says, compared field by field.
FIELDS = ("property", "dtype", "counterexample", "called", "causes", "reproducer")


def first_failures(names: list[str], mode: str, profile: str, timeout_s: float) -> tuple[dict[str, dict], float, int | None]:
    """Each mutant's first failure (the FIELDS of it; {} when it survived), the run's
    wall seconds and exit code."""
    with tempfile.TemporaryDirectory(prefix="isolated-zoo-") as workdir:
        certificates, wall, code, _ = certify_in_process(
            [f"mutant:{n}" for n in names], profile, Path(workdir), timeout_s,
            ["--impl-exitfirst", f"--isolate={mode}"])
        out = {}
        for name in names:
            cert = certificates.get(f"mutant:{name}") or {}
            failed = [r for r in cert.get("results", []) if r.get("outcome") == "failed"]
            if not failed:
                out[name] = {}
                continue
            first = failed[0]
            out[name] = {
                "property": first.get("property"), "dtype": first.get("dtype"),
                "counterexample": first.get("counterexample"), "called": first.get("called"),
                "causes": [c.get("variant") for c in first.get("causes") or []],
                "reproducer": (first.get("reproducer") or "").replace(workdir, "WORKDIR"),
            }
    return out, wall, code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated mutant names (default: all but Triton's)")
    parser.add_argument("--triton", action="store_true", help="include the Triton mutants")
    parser.add_argument("--profile", default="ci", help="Hypothesis profile (default ci)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per pytest process")
    parser.add_argument("--output", default=None, metavar="PATH", help="also write the report to PATH")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or [
        n for n in sorted(MUTANTS) if args.triton or not n.startswith("triton")]
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        parser.error(f"--only names unknown mutants {unknown}; known: {', '.join(sorted(MUTANTS))}")

    runs = {mode: first_failures(names, mode, args.profile, args.timeout) for mode in ("never", "always")}
    here, there = runs["never"][0], runs["always"][0]
    lines = [f"$ python benchmarks/isolated_zoo.py {' '.join(argv if argv is not None else sys.argv[1:])}",
             f"profile {args.profile}; {len(names)} mutants, one pytest process per mode, --impl-exitfirst", ""]
    for mode, (rows, wall, code) in runs.items():
        killed = sum(1 for r in rows.values() if r)
        named = sum(1 for r in rows.values() if r.get("causes"))
        lines.append(f"--isolate={mode}: {wall:.0f} s wall, exit code {code}, killed {killed}/{len(names)}, "
                     f"a cause named for {named}")
    same = {f: sum(here[n].get(f) == there[n].get(f) for n in names) for f in FIELDS}
    lines.append("identical isolated and in process (of %d): %s" % (
        len(names), ", ".join(f"{f} {k}" for f, k in same.items())))
    differ = [n for n in names if here[n] != there[n] or not here[n]]
    for name in differ:
        fields = [f for f in FIELDS if here[name].get(f) != there[name].get(f)] or ["survived"]
        lines.append(f"  {name}: {', '.join(fields)}: "
                     + "; ".join(f"{f}: {here[name].get(f)!r} vs {there[name].get(f)!r}"
                                 for f in fields if f not in ("reproducer", "survived")))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.output:
        Path(args.output).write_text(text)
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
