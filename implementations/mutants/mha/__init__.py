"""Mutants of the multi-head attention and learner levels."""
