"""The sharded (context-parallel) level: its cases, bounds, strategies and persistent worker group.

``cases`` (the cases and calls), ``level`` (the level's entry of ``conformance.core.levels``),
``checks`` (the spec's bounds), ``strategies``, and ``group`` (the pytest side of the worker
group that runs each call on every rank) with ``worker`` (one rank's process).
"""
