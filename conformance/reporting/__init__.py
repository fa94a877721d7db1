"""Reporting: saved failures and reproducers, the certificate and merging certificates."""
