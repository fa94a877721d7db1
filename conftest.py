"""Root conftest: loads the conformance runner's pytest plugin, nothing else."""

pytest_plugins = ["conformance.plugin"]
