"""Mutants of the flash level (window, soft-capping, ALiBi, LSE, dropout)."""
