"""pytest plugin of the conformance runner (work in progress)."""
