"""Isolation: running each example's check in a worker process that may hang or crash."""
