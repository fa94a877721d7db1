"""Mutants of the varlen and kvcache levels."""
