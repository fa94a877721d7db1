"""Directed examples: the smallest case of each known bug class, and the helpers properties build their cases with."""
