"""Root conftest: loads the conformance runner's pytest plugin in this checkout, nothing else.

Installed, the package's ``pytest11`` entry point (conformance/activation.py) registers
the same plugin, under the same name, when a run asks for the suite; pytest then sees it
registered and this line does not load it a second time. Without an install (the
checkout on PYTHONPATH) this line is what loads it.
"""

pytest_plugins = ["conformance.plugin"]
