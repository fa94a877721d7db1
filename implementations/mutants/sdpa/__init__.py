"""Mutants that break the SDPA level (and the properties every level shares)."""
