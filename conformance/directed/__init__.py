"""Directed examples, the smallest case of each known bug class, and the properties' case helpers."""
