"""Isolation: each example's check in a worker process, which may hang or crash."""
