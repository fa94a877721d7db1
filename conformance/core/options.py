"""The conformance runner's command-line options (``pytest_addoption``, which
``conformance.plugin`` exposes to pytest); ``conformance.plugin`` checks their values."""

from __future__ import annotations

import pytest

__all__ = ["NAMESPACED_OPTIONS", "VALUE_OPTIONS", "pytest_addoption"]


#: Options whose plain names are common in other projects' conftest.py files: each is
#: also registered as ``--conformance-<name>``, and only under that name when the plain
#: one is already taken (by a conftest.py loaded before this plugin, or another plugin).
NAMESPACED_OPTIONS = ("--xfail-file", "--device", "--dtype", "--replay", "--example-timeout",
                      "--compile-budget", "--shape-budget", "--torch-threads", "--isolate")


#: Every option of the suite that takes a value (``--NAME VALUE`` or ``--NAME=VALUE``), its
#: ``--conformance-`` names included. pytest picks its rootdir from the command line's
#: paths before it loads this plugin, so ``--xfail-file PATH`` would make PATH count as
#: a test path there; ``conformance.activation`` reads the command line with this list
#: first, so that both spellings give the same run (tests/runner/test_option_spelling.py
#: checks that the list is every value-taking option ``pytest_addoption`` registers).
VALUE_OPTIONS = ("--impl", "--impl-option", "--conformance-report", "--conformance-write-declaration",
                 *NAMESPACED_OPTIONS, *("--conformance-" + n[2:] for n in NAMESPACED_OPTIONS))


def _registered_names(parser: pytest.Parser) -> set[str]:
    """Option strings other plugins and conftest files have registered so far."""
    groups = [getattr(parser, "_anonymous", None), *getattr(parser, "_groups", [])]
    return {name for group in groups if group is not None
            for option in group.options for name in option.names()}


def _add(group, taken: set[str], name: str, **attrs) -> None:
    """``--NAME`` and ``--conformance-NAME`` (only the latter where ``--NAME`` is taken),
    read as ``config.getoption("conformance_NAME")`` (a dest of its own: a project's
    ``--NAME`` keeps its value)."""
    names = [n for n in (name, "--conformance-" + name[2:]) if n not in taken]
    group.addoption(*names, dest="conformance_" + name[2:].replace("-", "_"), **attrs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attention-conformance", "attention conformance suite")
    taken = _registered_names(parser)
    group.addoption("--impl", default=None, metavar="NAME",
                    help="implementation to certify: a registered name (see --impl=list), "
                         "an entry point, module:attr, path/to/file.py:attr or mutant:NAME; "
                         "several, comma-separated or as a glob over the registered and mutant "
                         "names ('mutant:*', 'sdpa*'), are certified side by side in one run")
    group.addoption("--impl-exitfirst", action="store_true", default=False,
                    help="stop certifying an implementation at its first failing test (its "
                         "remaining tests skip, the other implementations go on; -x stops the run)")
    group.addoption("--impl-option", action="append", default=[], metavar="KEY=VALUE",
                    help="override a declared capability, e.g. causal=lower_right, fully_masked=nan")
    _add(group, taken, "--xfail-file", default=None, metavar="PATH",
                    help="expected failures of the implementation (TOML, the schema of "
                         "implementations/xfail/*.toml), added to any it declares")
    _add(group, taken, "--device", default="cpu", choices=("cpu", "cuda", "all"),
                    help="device(s) to certify on (cuda is skipped with a reason when absent)")
    _add(group, taken, "--dtype", default=None, metavar="DTYPES",
                    help="comma-separated subset of float64,float32,float16,bfloat16 "
                         "(default: what the implementation declares)")
    group.addoption("--conformance-report", default=None, metavar="PATH",
                    help="write the certificate to PATH.json and PATH.md")
    group.addoption("--conformance-write-declaration", default=None, metavar="PATH",
                    help="write what resolution and probing found as a declaration (TOML, each entry "
                         "with where it came from) to PATH; --impl=PATH reads it back, unprobed")
    _add(group, taken, "--replay", default=None, metavar="FILE",
                    help="re-run the one failing case saved in FILE (.npz)")
    _add(group, taken, "--example-timeout", default=60.0, type=float, metavar="SECONDS",
                    help="fail a property when one call takes longer than this (0: no limit); "
                         "the first call of each dtype and device may take 5x as long (compilation), "
                         "and time spent waiting for a CPU other processes hold is not counted, "
                         "up to 4x the limit (docs/DESIGN.md, Timeouts)")
    _add(group, taken, "--compile-budget", default=None, type=int, metavar="N",
                    help="random examples of each property take their configuration (shapes, "
                         "scale, causal flag, mask kind, layout) from N fixed ones, and a sweep "
                         "visits 2N sizes (implementations that compile per configuration); "
                         "default 8 when the implementation declares jit; 0: no budget")
    _add(group, taken, "--shape-budget", default=None, type=int, metavar="N",
                    help="the older name of --compile-budget")
    _add(group, taken, "--torch-threads", default=1, type=int, metavar="N",
                    help="torch intra-op threads while certifying (default 1: the cases are tiny, "
                         "and a thread pool costs more than it saves, ten times more on a busy "
                         "machine); 0 leaves torch's own setting")
    _add(group, taken, "--isolate", default="auto", choices=("auto", "always", "never"),
                    help="run the implementation in a worker process that a crash or hang cannot "
                         "take down (auto: only an implementation an earlier run in this "
                         "checkout saw crash; it costs ~5 s to start and a few ms an example)")
