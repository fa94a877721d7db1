"""The private internals of pytest and Hypothesis the suite still leans on, pinned.

Each has no public equivalent (the reason is in the docstring of the code that uses
it); each degrades to a clear usage error or to doing nothing when the internal is
missing, and each is pinned here so that a new release that changes it fails a named
test instead of changing a run quietly. Checked on the versions in :data:`CHECKED_ON`
(``benchmarks/dependency_range.py`` installs the oldest and the newest allowed releases
and runs the quick tier, this file included).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import hypothesis
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.database import InMemoryExampleDatabase

from conformance import activation
from conformance.core import options

#: The releases on which every pin below was seen to hold.
CHECKED_ON = {
    "pytest": ("9.0.0", "9.0.3", "9.2.0"),
    "hypothesis": ("6.155.0", "6.155.2", "6.170.27"),
}


def _changed(what: str, where: str) -> str:
    return (f"{what} changed in this release (pytest {pytest.__version__}, hypothesis "
            f"{hypothesis.__version__}; checked on {CHECKED_ON}): update {where}")


def test_determine_setup_takes_keywords_and_returns_four_values(tmp_path):
    """``conformance.activation._consume_option_values`` picks the rootdir again with it:
    a value of a suite option written after a space must not move the rootdir, and no
    public hook runs before pytest picks it."""
    from _pytest.config.findpaths import determine_setup

    params = set(inspect.signature(determine_setup).parameters)
    assert {"inifile", "args", "rootdir_cmd_arg", "invocation_dir"} <= params, (  # override_ini: 9.0+
        _changed("determine_setup's parameters", "conformance/activation.py"))
    given = {"inifile": None, "override_ini": None, "args": [str(tmp_path)], "rootdir_cmd_arg": None,
             "invocation_dir": tmp_path}
    got = determine_setup(**{k: v for k, v in given.items() if k in params})
    assert len(got) >= 3 and Path(got[0]) == tmp_path, _changed("determine_setup's result",
                                                               "conformance/activation.py")


def test_the_config_keeps_its_rootpath_and_header_info_where_activation_sets_them(pytestconfig):
    assert pytestconfig._rootpath == pytestconfig.rootpath, _changed("Config._rootpath", "conformance/activation.py")
    assert isinstance(pytestconfig._parser.extra_info, dict), _changed("Parser.extra_info",
                                                                       "conformance/activation.py")


def test_the_rewrite_hook_keeps_its_marked_packages_in_a_set(pytestconfig):
    """``activation.without_assertion_rewriting`` takes the suite's own packages off it
    (no public way to un-mark a package a plugin's distribution marked)."""
    hook = getattr(pytestconfig.pluginmanager, "rewrite_hook", None)
    marked = getattr(hook, "_must_rewrite", None)
    assert isinstance(marked, set), _changed("the rewrite hook's _must_rewrite", "conformance/activation.py")
    assert hasattr(activation, "without_assertion_rewriting")


def test_the_parser_lists_options_registered_before_the_suite(pytester):
    """``options._registered_names`` finds a ``--device`` a project's conftest.py has
    registered, so the suite keeps only ``--conformance-device`` (argparse would refuse
    the clash at parse time; pytest has no public list of registered options)."""
    pytester.makeconftest("from conformance.core.options import pytest_addoption as suite_options\n"
                          "def pytest_addoption(parser):\n"
                          "    parser.addoption('--device', default='mine')\n"
                          "    suite_options(parser)\n")
    config = pytester.parseconfig("-p", "no:attention_conformance")
    assert config.getoption("device") == "mine", _changed("option registration", "conformance/core/options.py")
    assert config.getoption("conformance_device") == "cpu"
    assert "--device" in options._registered_names(config._parser), _changed(
        "Parser._groups / _anonymous", "conformance/core/options.py")


def test_wrap_session_is_the_frame_a_pytest_session_runs_in():
    """``plugin._nested_pytest_run`` counts these frames: a pytester run inside a test
    must not freeze the outer process' heap, and pytester removes PYTEST_CURRENT_TEST."""
    from _pytest import main

    assert callable(getattr(main, "wrap_session", None)), _changed("_pytest.main.wrap_session",
                                                                   "conformance/plugin.py")
    assert Path(main.__file__).as_posix().endswith("_pytest/main.py")


def test_hypothesis_files_failures_under_the_internal_database_key():
    """``conformance.harness.runner`` gives each property x target its own key, so the
    next run retries its own failure first (every search is the same function)."""
    database = InMemoryExampleDatabase()

    @settings(database=database, derandomize=False, max_examples=20)
    @given(st.integers(0, 10))
    def search(n: int) -> None:
        assert n < 5

    search._hypothesis_internal_database_key = b"attention-conformance-pin"
    with pytest.raises(AssertionError):
        search()
    keys = set(database.data)
    assert any(k.startswith(b"attention-conformance-pin") for k in keys), _changed(
        "_hypothesis_internal_database_key", "conformance/harness/runner.py")
