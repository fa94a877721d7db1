"""Reporting: saved failures and their reproducers, the certificate, merged certificates."""
