"""The conformance suite: run as ``pytest conformance --impl=NAME``."""
