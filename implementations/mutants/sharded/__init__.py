"""Mutants of the sharded (context-parallel) level."""
