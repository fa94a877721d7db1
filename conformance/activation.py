"""The installed pytest plugin's entry point: loads ``conformance.plugin`` only when
the command line asks for the conformance suite.

Installed, this package is a plugin of every pytest run in the environment
(``[project.entry-points.pytest11]`` in pyproject.toml names this module). The
conformance plugin adds options with common names (``--device``, ``--dtype``,
``--replay``), loads a Hypothesis profile and parametrizes tests that take a
``target`` argument; loaded everywhere, it would change other projects' runs or
clash with their own ``--device``. So this module does nothing unless the run asks
for the suite (:func:`suite_requested`): ``--impl`` or ``--impl-option`` on the
command line (or in ``addopts``), or a test path inside the installed
``conformance`` package, or ``--pyargs conformance[.module]``. Then it registers
``conformance.plugin`` under that module name once the initial conftest.py files are
read: a checkout's root ``conftest.py`` naming the same plugin in ``pytest_plugins``
has loaded it already (``import_plugin`` does not load it twice), and where a
project's conftest.py registers a plain name the suite also uses (``--device``), the
suite keeps that option only as ``--conformance-device``.

``pytest -p no:attention_conformance`` switches this module off.

pytest picks its rootdir (and ini file) from the command line's paths before it loads
any plugin, so a suite option's value given after a space (``--xfail-file PATH``, the
README's spelling) would count as a test path there, and the rootdir, the initial
conftest.py files and every test id would differ from the run with
``--xfail-file=PATH``. :func:`_consume_option_values` takes the values of the suite's
value-taking options (``conformance.core.options.VALUE_OPTIONS``) out of those paths and
picks the rootdir again, before the initial conftest.py files are found.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

__all__ = ["PLUGIN", "without_assertion_rewriting", "suite_requested"]

#: The module registered when the suite is asked for (and its plugin name).
PLUGIN = "conformance.plugin"
_PACKAGE = "conformance"
_PACKAGE_DIR = Path(__file__).resolve().parent
_IMPL_OPTIONS = ("--impl", "--impl-option")


def suite_requested(args: Sequence[str], invocation_dir: Path | str = ".") -> bool:
    """Whether pytest's command line ``args`` ask for the conformance suite.

    True for ``--impl[=...]`` / ``--impl-option[=...]``, a path argument (relative to
    ``invocation_dir``) inside this package's directory, or, with ``--pyargs``, a
    module argument ``conformance`` or ``conformance.<module>``.
    """
    args = [str(a) for a in args]
    if any(a.split("=", 1)[0] in _IMPL_OPTIONS for a in args):
        return True
    pyargs = "--pyargs" in args
    for arg in args:
        if arg.startswith("-"):
            continue
        target = arg.split("::", 1)[0]
        if pyargs and (target == _PACKAGE or target.startswith(_PACKAGE + ".")):
            return True
        path = (Path(invocation_dir) / target).resolve()
        if path == _PACKAGE_DIR or _PACKAGE_DIR in path.parents:
            return True
    return False


#: Packages whose modules pytest marks for assertion rewriting (because they ship a pytest
#: plugin: Hypothesis does, and so does this distribution, whose every module pytest marks)
#: and in which the suite needs no rewritten assert: this project's own modules raise their
#: own failures with their own messages. Rewriting compiles each marked module from source
#: in every run where no rewritten bytecode can be cached (PYTHONDONTWRITEBYTECODE=1,
#: read-only site-packages, as in many containers), ignoring the bytecode pip compiled at
#: install: about 90 Hypothesis modules (0.4-0.7 s of every run's start-up on two cores)
#: and about 110 of this project's (0.15-0.4 s; ``benchmarks/time_to_kill.py``). The test
#: modules the suite collects (``conformance/test_*.py``) are still rewritten: pytest
#: rewrites what it collects by their file name, not by this list.
_NOT_REWRITTEN = ("hypothesis", "_hypothesis_globals", "conformance", "implementations", "spec")


def without_assertion_rewriting(config: pytest.Config) -> bool:
    """Take Hypothesis' and this project's modules (:data:`_NOT_REWRITTEN`) off pytest's
    assertion-rewriting list, before Hypothesis is imported; True when done. Reaches
    into pytest's import hook (``rewrite_hook``, ``_must_rewrite``), so anything
    unexpected there leaves it as it was."""
    if "hypothesis" in sys.modules:
        return False
    hook = getattr(config.pluginmanager, "rewrite_hook", None)
    marked = getattr(hook, "_must_rewrite", None)
    if not isinstance(marked, set):
        return False
    marked.difference_update(_NOT_REWRITTEN)
    cache = getattr(hook, "_marked_for_rewrite_cache", None)
    if isinstance(cache, dict):
        for name in [n for n in cache if n.split(".", 1)[0] in _NOT_REWRITTEN]:
            del cache[name]
    return True


def option_values(args: Sequence[str]) -> list[str]:
    """The values the suite's value-taking options take from the argument after them
    (``--impl X``: ``X``; ``--impl=X`` takes none from the next argument), in order."""
    from conformance.core.options import VALUE_OPTIONS

    values, i = [], 0
    while i < len(args):
        arg = str(args[i])
        if arg == "--":
            break
        if arg in VALUE_OPTIONS and i + 1 < len(args):
            values.append(str(args[i + 1]))
            i += 2
            continue
        i += 1
    return values


def _consume_option_values(early_config: pytest.Config, args: Sequence[str]) -> None:
    """Take the suite's option values out of pytest's early test paths and, when they
    changed, pick the rootdir again (see the module docstring). A pytest whose
    internals differ (``determine_setup``, the attributes set here) is left as it
    was, unless a value is an existing path, which would move its rootdir: then a
    usage error says to write ``--NAME=VALUE``."""
    namespace = early_config.known_args_namespace
    paths = list(getattr(namespace, "file_or_dir", None) or [])
    values = [v for v in option_values(args) if v in paths]
    if not values:
        return
    for value in values:
        paths.remove(value)
    try:
        import inspect

        from _pytest.config.findpaths import determine_setup

        given = {"inifile": namespace.inifilename, "override_ini": namespace.override_ini,
                 "args": paths, "rootdir_cmd_arg": namespace.rootdir or None,
                 "invocation_dir": early_config.invocation_params.dir}
        accepted = inspect.signature(determine_setup).parameters  # override_ini: pytest >= 9
        rootpath, inipath = determine_setup(**{k: v for k, v in given.items() if k in accepted})[:2]
        old_root, old_ini = early_config.rootpath, early_config.inipath
        if inipath != old_ini:
            raise pytest.UsageError(
                f"the value {values[0]!r} of a conformance option written after a space made pytest "
                f"read its settings from {old_ini or 'no ini file'} instead of {inipath}; write "
                "the option as --NAME=VALUE (e.g. --xfail-file=PATH)")
        namespace.file_or_dir = paths
        if rootpath != old_root:
            early_config._rootpath = rootpath
            early_config._parser.extra_info["rootdir"] = str(rootpath)
            if inipath is None and namespace.confcutdir == str(old_root):
                namespace.confcutdir = str(rootpath)  # pytest's default: the rootdir
    except pytest.UsageError:
        raise
    except Exception as err:  # noqa: BLE001 - another pytest's internals: say what to write
        if any(Path(early_config.invocation_params.dir, v).exists() for v in values):
            raise pytest.UsageError(
                f"pytest took {values[0]!r}, the value of a conformance option written after a "
                f"space, for a test path ({type(err).__name__}: {err}); write the option as "
                "--NAME=VALUE (e.g. --xfail-file=PATH)") from None


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser,
                                  args: list[str]):
    requested = suite_requested(args, early_config.invocation_params.dir)
    if requested:
        _consume_option_values(early_config, args)
        without_assertion_rewriting(early_config)
    # After the initial conftest.py files: options they register (a project's own
    # --device) are seen by the plugin, which then keeps only --conformance-device.
    result = yield
    if requested:
        # import_plugin registers the module under its name and skips one already registered.
        early_config.pluginmanager.import_plugin(PLUGIN)
    return result
