"""The certificate: which properties hold for one implementation, as data and as text.

Everything here works on plain data: a certificate is the dict written to
``PATH.json`` (layout in docs/CONTRACTS.md), and its ``results`` are the dicts
the property tests attach to their reports (``registry.Record.as_dict()``). The
plugin gathers them, from every xdist worker, and calls :func:`certificate`;
:func:`terminal_lines`, :func:`markdown` and :func:`write` render it.

A table cell reads ``outcome worst-ratio (examples)``: ``PASS 0.02 (20)``.

A run of several implementations (``--impl=sdpa,sdpa-math``) gives a **comparison**
(:func:`comparison`): each implementation's certificate, as a run of it alone writes
it, and their matrix, a row per property and a column per (implementation, device,
dtype), built and rendered by ``conformance.reporting.merge``. :func:`title`,
:func:`terminal_lines`, :func:`markdown` and :func:`write` take either.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from conformance.diagnosis import diagnose as diagnosis
from implementations.base import ALL_DTYPES, Implementation

__all__ = [
    "OUTCOME_SYMBOLS",
    "SOURCE_MEANINGS",
    "per_dtype",
    "provenance",
    "implementation_entry",
    "certificate",
    "comparison",
    "cell",
    "render_table",
    "levels_shown",
    "levels_left_out",
    "details",
    "unapplied_expected_failures",
    "summary",
    "title",
    "terminal_lines",
    "markdown",
    "write",
]

#: How each outcome of a result is shown in a cell.
OUTCOME_SYMBOLS = {"passed": "PASS", "failed": "FAIL", "skipped": "skip", "xfailed": "xfail",
                   "stale-xfail": "STALE", "error": "ERROR"}


def _plain(value: Any) -> Any:
    return sorted(value) if isinstance(value, (set, frozenset)) else value


def _capabilities(caps: Any) -> dict[str, Any]:
    d = asdict(caps)
    if not isinstance(caps.fully_masked, str):  # a policy per kind: {"bool": "uniform", ...}
        d["fully_masked"] = dict(caps.fully_masked)
    d["sources"] = dict(caps.sources)  # semantic field -> declared / contract / probed
    d["by_dtype"] = {dtype: {k: _plain(v) for k, v in values} for dtype, values in caps.by_dtype}
    return {k: _plain(v) for k, v in d.items()}


#: What each source of a semantic value means, for the certificate's provenance line.
SOURCE_MEANINGS = {
    "declared": "by the implementation or --impl-option",
    "contract": "the signature's documented meaning, tested whatever a probe saw",
    "probed": "read off the implementation where the contract leaves it open; not a declaration",
}
_SHOWN = {"fully_masked": "fully-masked rows", "causal": "causal flag", "shared_kv": "key is value",
          "flash_features": "flash features"}


def provenance(caps: dict[str, Any]) -> str:
    """``semantics: contract (...): causal flag, key is value; probed (...): fully-masked rows``
    ("" when every semantic value is declared)."""
    sources = caps.get("sources") or {}
    if not sources or set(sources.values()) == {"declared"}:
        return ""
    groups = {}
    for name, source in sorted(sources.items()):
        groups.setdefault(source, []).append(f"{_SHOWN.get(name, name)}={_policy_text(caps.get(name))}")
    return "semantics: " + "; ".join(f"{source} ({SOURCE_MEANINGS[source]}): {', '.join(groups[source])}"
                                      for source in ("declared", "contract", "probed") if source in groups)


def per_dtype(caps: dict[str, Any], implementation: dict[str, Any] | None = None) -> str:
    """``per dtype: float16: autograd=False (probed)`` for the capabilities that differ in a
    dtype ("" if none); a value is ``declared`` when ``--impl-option DTYPE.FIELD`` or the
    declaration's ``[DTYPE]`` table (``implementation``: the certificate's entry) gave it."""
    by_dtype = caps.get("by_dtype") or {}
    if not by_dtype:
        return ""
    declared = set((implementation or {}).get("options") or {})
    text = ((implementation or {}).get("declaration") or {}).get("text")
    if text:
        import tomllib

        try:
            table = tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            table = {}
        declared |= {f"{dtype}.{key}" for dtype, values in table.items() if isinstance(values, dict)
                     for key in values}

    def item(dtype: str, key: str, value: Any) -> str:
        shown = _policy_text(value) if isinstance(value, dict) else \
            ",".join(value) if isinstance(value, (list, tuple)) else value
        return f"{key}={shown} ({'declared' if f'{dtype}.{key}' in declared else 'probed'})"

    return "per dtype: " + "; ".join(
        f"{dtype}: " + ", ".join(item(dtype, k, v) for k, v in values.items())
        for dtype, values in by_dtype.items())


def _policy_text(policy: Any) -> str:
    """A fully-masked policy as written in the JSON: one string or kind -> policy."""
    if isinstance(policy, dict):
        return ",".join(f"{kind}:{value}" for kind, value in policy.items())
    return str(policy)


def _input_declarations(caps: dict[str, Any]) -> str:
    """``; inputs: ...`` for the SDPA input conventions the implementation declares."""
    parts = [text for key, text in (("self_attention_lengths", "L == S only"),
                                    ("shared_kv", "key is value (one tensor)"))
             if caps.get(key)]
    if caps.get("batch_dims") is not None:
        parts.append(f"batch_dims={caps['batch_dims']} (4-D inputs and masks)")
    # Partial support, each narrowing what is drawn.
    for key, text in (("head_dims", "head dims in {}"), ("min_head_dim", "head dims >= {}"),
                      ("max_head_dim", "head dims <= {}"), ("seq_multiple", "L and S multiples of {}"),
                      ("seq_block", "L and S <= {0} or multiples of {0}"), ("max_seq_len", "L and S <= {}"),
                      ("backward_seq_multiple", "gradients where L and S are multiples of {}")):
        if caps.get(key) is not None:
            value = caps[key]
            parts.append(text.format(list(value) if isinstance(value, (list, tuple)) else value))
    parts += [text for key, text in (("causal_only", "causal calls only"),
                                     ("positive_scale", "explicit scale > 0 only")) if caps.get(key)]
    return f"; inputs: {', '.join(parts)}" if parts else ""


def implementation_entry(impl: Implementation, spec: str, options: dict[str, str], *,
                         compile_budget: int | None = None, declaration: Any = None) -> dict[str, Any]:
    """The certificate's ``implementation`` entry: names, declared capabilities at
    both levels and the expected failures (``spec``, ``options``: ``--impl`` and
    ``--impl-option`` as given; ``compile_budget``: the configurations per property its
    random search was limited to, None: none; ``declaration``: the
    ``implementations.registry.declaration.Declaration`` ``--impl`` named, if any)."""
    return {
        "declaration": None if declaration is None else {"source": declaration.source,
                                                         "text": declaration.pasteable()},
        "name": impl.name,
        "spec": spec,
        "version": impl.version,
        "options": options,
        "compile_budget": compile_budget,
        "run_notes": list(impl.run_notes()) if impl.run_notes is not None else [],
        "capabilities": _capabilities(impl.capabilities),
        "mha_capabilities": _capabilities(impl.caps("mha")),
        # None without a flash level; a derived one says so in its probe notes.
        "flash_capabilities": _capabilities(impl.caps("flash")) if impl.flash is not None else None,
        "expected_failures": [
            {"property": e.property, "match": dict(e.match), "reason": e.reason, "reference": e.reference,
             "intermittent": e.intermittent}
            for e in impl.expected_failures
        ],
    }


def certificate(*, implementation: dict[str, Any], environment: dict[str, Any], profile: str,
                seconds: float, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The certificate dict, results sorted by (level, property, device, dtype), and
    the failures grouped by probable cause (``diagnosis.cause_groups``)."""
    return {
        "implementation": implementation,
        "environment": environment,
        "profile": profile,
        "seconds": round(seconds, 2),
        "results": sorted(results, key=lambda r: (r["level"], r["property"], r["device"], r["dtype"])),
        "causes": diagnosis.cause_groups(results),
    }


def comparison(*, certificates: list[dict[str, Any]], environment: dict[str, Any], profile: str,
               seconds: float) -> dict[str, Any]:
    """The comparison of several implementations certified in one run: ``comparison``
    (their ``--impl`` specs, in order), the run's environment, profile and seconds,
    ``certificates`` (one per implementation, made by :func:`certificate`) and
    ``matrix`` (``conformance.reporting.merge.to_json``)."""
    from conformance.reporting import merge

    specs = [c["implementation"]["spec"] for c in certificates]
    return {
        "comparison": specs,
        "environment": environment,
        "profile": profile,
        "seconds": round(seconds, 2),
        "certificates": certificates,
        "matrix": merge.to_json(merge.merge(certificates, names=specs, order=specs)),
    }


def _is_comparison(cert: dict[str, Any]) -> bool:
    return "comparison" in cert


def _matrix_lines(cert: dict[str, Any], *, markdown: bool) -> list[str]:
    from conformance.reporting import merge

    certificates = cert["certificates"]
    merged = merge.merge(certificates, names=cert["comparison"], order=cert["comparison"])
    return merge.render_table(merged, markdown=markdown)


def cell(result: dict[str, Any]) -> str:
    """``outcome ratio (examples)``; ratio ``-`` when the property has none. A FAIL
    cell shows the failing example's ratio and the examples run until the first
    failure."""
    text = OUTCOME_SYMBOLS.get(result["outcome"], result["outcome"])
    if result["outcome"] in ("passed", "xfailed", "stale-xfail", "failed") and result["examples"]:
        ratio = "-" if result["worst_ratio"] is None else f"{result['worst_ratio']:.2g}"
        text += f" {ratio} ({result['examples']})"
    return text


def levels_shown(results: list[dict[str, Any]]) -> set[str]:
    """The levels the table shows: those where some property ran (not every result a
    skip); every level when none ran."""
    ran = {r["level"] for r in results if r["outcome"] != "skipped"}
    return ran or {r["level"] for r in results}


def levels_left_out(cert: dict[str, Any]) -> str:
    """``levels not run (every property skipped): mha (reason), ...``, or ""."""
    shown = levels_shown(cert["results"])
    reasons: dict[str, str] = {}
    for r in cert["results"]:
        if r["level"] not in shown:
            reasons.setdefault(r["level"], r.get("reason") or "skipped")
    if not reasons:
        return ""
    return "levels not run (every property skipped, rows left out of the table): " + "; ".join(
        f"{level} ({reason})" for level, reason in sorted(reasons.items()))


def render_table(cert: dict[str, Any], markdown: bool = False) -> str:
    """One row per (level, property), one column per (device, dtype); only the levels
    where some property ran (:func:`levels_shown`)."""
    shown = levels_shown(cert["results"])
    results = [r for r in cert["results"] if r["level"] in shown]
    columns = sorted({(r["device"], r["dtype"]) for r in results},
                     key=lambda c: (c[0], ALL_DTYPES.index(c[1]) if c[1] in ALL_DTYPES else 9))
    rows: dict[tuple[str, str], dict[tuple[str, str], str]] = {}
    for r in results:
        rows.setdefault((r["level"], r["property"]), {})[(r["device"], r["dtype"])] = cell(r)
    header = ["property", "level"] + [f"{dt}/{dev}" for dev, dt in columns]
    body = [[p, lvl] + [cells.get(c, "") for c in columns] for (lvl, p), cells in sorted(rows.items())]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body, strict=True)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    return "\n".join([fmt.format(*header)] + [fmt.format(*row) for row in body])


def compile_budget_line(budget: int | None) -> str:
    """What a compile budget limited, for the certificate ("" without one)."""
    if budget is None:
        return ""
    return (f"compile budget: {budget} configurations per property (--compile-budget; "
            "the implementation compiles per configuration): each SDPA property's random "
            f"search was limited to {budget} fixed (layout, shape, causal flag, mask kind, "
            "scale) configurations, each option of each drawn at least once; its derived "
            "calls and directed examples are configurations of their own; "
            f"small_sizes_sweep visits at most {2 * budget} sizes")


def ran_lines(results: list[dict[str, Any]]) -> list[str]:
    """One line per level and device whose calls say how they ran (``Record.ran``), e.g.
    ``sharded level on cpu ran with backend gloo, world sizes 1, 2, 3, 4``."""
    merged: dict[tuple[str, str], dict[str, set[Any]]] = {}
    for r in results:
        for key, values in (r.get("ran") or {}).items():
            merged.setdefault((r["level"], r["device"]), {}).setdefault(key, set()).update(values)
    lines = []
    for (level, device), ran in sorted(merged.items()):
        parts = [f"{key.replace('_', ' ')} {', '.join(str(v) for v in sorted(values))}"
                 for key, values in sorted(ran.items())]
        lines.append(f"{level} level on {device} ran with " + ", ".join(parts))
    return lines


def details(cert: dict[str, Any]) -> list[str]:
    """The lines under the table: declared policies, then each failure, expected
    failure, stale entry and (once per reason) skip."""
    lines = []
    caps = cert["implementation"]["capabilities"]
    # A probe note ("causal: ...") says how probing decided that policy (several notes of
    # one field are joined).
    notes: dict[str, str] = {}
    for n in caps.get("probe_notes") or ():
        key, _, said = n.partition(": ")
        notes[key] = f"{notes[key][:-1]}; {said})" if key in notes else f" (probe: {said})"
    sources = caps.get("sources") or {}
    tag = {name: f" [{source}]" for name, source in sources.items() if source != "declared"}
    lines.append(
        f"{'policies' if tag else 'declared policies'}: fully-masked rows={_policy_text(caps['fully_masked'])}"
        f"{tag.get('fully_masked', '')}{notes.pop('fully_masked', '')}, "
        f"causal flag={caps['causal']}{tag.get('causal', '')}{notes.pop('causal', '')}, tf32={caps['tf32']}"
        + _input_declarations(caps)
        + "".join(f"; {key}{note}" for key, note in notes.items())
    )
    lines += [text for text in (provenance(caps), per_dtype(caps, cert["implementation"])) if text]
    declared = cert["implementation"].get("declaration")
    if declared:  # pasteable: a TOML file, or a pyproject.toml table
        lines += [f"declaration used ({declared['source']}):", *("    " + x for x in declared["text"].splitlines())]
    budget_line = compile_budget_line(cert["implementation"].get("compile_budget"))
    lines += [budget_line] if budget_line else []
    lines += [f"run: {n}" for n in cert["implementation"].get("run_notes") or ()]
    flash = cert["implementation"].get("flash_capabilities") or {}
    # The flash level's own notes, e.g. that it is derived from the SDPA level through masks.
    lines += [f"flash level: {n}" for n in flash.get("probe_notes") or () if n not in (caps.get("probe_notes") or ())]
    lines += ran_lines(cert["results"])
    left_out = levels_left_out(cert)
    lines += [left_out] if left_out else []
    shown = levels_shown(cert["results"])
    seen: set[str] = set()
    for r in cert["results"]:
        if r["level"] not in shown:
            continue
        tag = f"{r['property']}[{r['level']}-{r['dtype']}-{r['device']}]"
        if r["outcome"] in ("failed", "error"):
            word = "FAIL" if r["outcome"] == "failed" else "ERROR"
            ce = r.get("counterexample")
            case = f"shrunk case {ce}" if ce else "no case"
            called = r.get("called")
            called_text = f"; called {called['case']} with {called['arguments']}" if called else ""
            saved = f"; saved {r['failure_file']}" if r.get("failure_file") else ""
            lines.append(f"{word} {tag}: after {r['examples']} examples; {case}{called_text}{saved}")
            first = (r.get("message") or "").splitlines()[:3]
            lines += ["    " + x for x in first]
            cause = diagnosis.cause_line(r)
            lines += ["    " + cause] if cause else []
        elif r["outcome"] == "xfailed":
            lines.append(f"expected failure {tag}: {r['xfail_reason']} ({r['xfail_hits']} of {r['examples']} examples)")
            if r["reason"]:
                lines.append(f"STALE expected failure {tag}: {r['reason']}")
        elif r["outcome"] == "stale-xfail":
            lines.append(f"STALE expected failure {tag}: {r['reason']}")
        elif r["outcome"] == "skipped" and r["reason"] and r["reason"] not in seen:
            seen.add(r["reason"])
            lines.append(f"skipped ({r['reason']}) e.g. {tag}")
    leftover = max((r.get("leftover_threads") or 0 for r in cert["results"]), default=0)
    if leftover:
        lines.append(
            f"{leftover} call(s) that timed out were still running in threads at the end (a thread "
            "cannot be stopped, and a spinning one slows every later property): rerun with "
            "--isolate=always to run the implementation in a worker process that is killed instead"
        )
    return lines + unapplied_expected_failures(cert)


def unapplied_expected_failures(cert: dict[str, Any]) -> list[str]:
    """One line per expected failure that excused no failing example in this run
    although its property ran (a wildcard entry: although some property ran)."""
    entries = cert["implementation"].get("expected_failures", [])
    ran = {r["property"] for r in cert["results"] if r["outcome"] not in ("skipped", "error")}
    hits: dict[int, int] = {}
    covered: dict[int, int] = {}
    for r in cert["results"]:
        for e in r.get("expected_failures") or ():
            hits[e["entry"]] = hits.get(e["entry"], 0) + e["hits"]
            covered[e["entry"]] = covered.get(e["entry"], 0) + e["covered_passes"]
    # an entry for another device, dtype or level than the run's could not have applied
    scopes = {key: {r.get(key) for r in cert["results"] if r["outcome"] not in ("skipped", "error")}
              for key in ("device", "dtype", "level")}
    lines = []
    for index, entry in enumerate(entries):
        if not ran or (entry["property"] != "*" and entry["property"] not in ran) or hits.get(index):
            continue
        if _outside_the_run(entry.get("match") or {}, scopes):
            continue
        lines.append(f"expected failure never applied: property={entry['property']} match={entry['match']} "
                     f"({entry['reason'][:70]}...): no failing example matched it in this run; "
                     f"{covered.get(index, 0)} covered example(s) passed"
                     + (" (intermittent: its covered cases may pass)" if entry.get("intermittent") else ""))
    return lines


def _outside_the_run(match: dict[str, Any], scopes: dict[str, set[Any]]) -> bool:
    """Whether ``match`` names only devices, dtypes or levels the run did not certify
    (``sdpa.toml``'s CUDA entries in a CPU run)."""
    for key, seen in scopes.items():
        wanted = match.get(key)
        if isinstance(wanted, str):
            wanted = [wanted]
        if isinstance(wanted, list) and seen and not set(wanted) & seen:
            return True
    return False


def summary(cert: dict[str, Any]) -> str:
    """``summary: 75 passed, 45 skipped, 8 xfailed`` (outcomes in alphabetical order)."""
    counts: dict[str, int] = {}
    for r in cert["results"]:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    return "summary: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))


def _named(impl: dict[str, Any]) -> str:
    return f"{impl['spec']} ({impl['name']} {impl['version']})"


def title(cert: dict[str, Any]) -> str:
    if _is_comparison(cert):
        return (f"attention-conformance certificate: {len(cert['comparison'])} implementations "
                f"compared ({', '.join(cert['comparison'])})")
    return f"attention-conformance certificate: {_named(cert['implementation'])}"


def terminal_lines(cert: dict[str, Any]) -> list[str]:
    """What the terminal shows under the title (the table is one multi-line entry).
    A comparison: the matrix, then each implementation's details and summary under a
    ``-- spec (name version) --`` line, then one summary line per implementation."""
    threads = cert["environment"].get("torch_threads")
    head = (f"profile={cert['profile']} torch={cert['environment']['torch']} "
            + (f"threads={threads} " if threads else "") +
            "cell = outcome, worst error/allowed ratio (1 = at tolerance), examples run")
    if not _is_comparison(cert):
        return [head, render_table(cert), *details(cert), *diagnosis.cause_lines(cert), summary(cert)]
    lines = [head, "\n".join(_matrix_lines(cert, markdown=False))]
    for one in cert["certificates"]:
        lines += [f"-- {_named(one['implementation'])} --", *details(one), *diagnosis.cause_lines(one)]
    lines += [f"{one['implementation']['spec']}: {summary(one)}" for one in cert["certificates"]]
    return lines


def markdown(cert: dict[str, Any]) -> str:
    """The certificate as a Markdown page (``PATH.md``)."""
    if _is_comparison(cert):
        return _comparison_markdown(cert)
    impl = cert["implementation"]
    md = [f"# attention-conformance certificate: `{impl['spec']}`", "",
          f"- implementation: {impl['name']} {impl['version']}",
          f"- profile: {cert['profile']}; torch {cert['environment']['torch']}; "
          f"devices {cert['environment']['devices']}",
          "- cell: outcome, worst error/allowed ratio, examples", "",
          render_table(cert, markdown=True), ""]
    md += [f"- {line}" for line in details(cert)]
    md += diagnosis.cause_markdown(cert)
    return "\n".join(md) + "\n"


def _comparison_markdown(cert: dict[str, Any]) -> str:
    """A comparison as a Markdown page: the matrix, then a section per implementation."""
    md = [f"# attention-conformance certificate: {len(cert['comparison'])} implementations compared", "",
          "- implementations: " + ", ".join(f"`{c['implementation']['spec']}` ({c['implementation']['name']} "
                                             f"{c['implementation']['version']})" for c in cert["certificates"]),
          f"- profile: {cert['profile']}; torch {cert['environment']['torch']}; "
          f"devices {cert['environment']['devices']}",
          "- cell: outcome, worst error/allowed ratio, examples", "",
          *_matrix_lines(cert, markdown=True)]
    for one in cert["certificates"]:
        md += ["", f"## `{one['implementation']['spec']}`", "", f"- {summary(one)}"]
        md += [f"- {line}" for line in details(one)]
        md += [line.replace("## ", "### ", 1) for line in diagnosis.cause_markdown(one)]
    return "\n".join(md) + "\n"


def write(cert: dict[str, Any], base: str | Path) -> tuple[Path, Path]:
    """Write ``base.json`` and ``base.md`` (folders created); returns both paths."""
    base = Path(base)
    base.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = Path(str(base) + ".json"), Path(str(base) + ".md")
    json_path.write_text(json.dumps(cert, indent=2, default=str))
    md_path.write_text(markdown(cert))
    return json_path, md_path
