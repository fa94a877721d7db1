"""The sharded (context-parallel) level: cases and calls (``cases``, the level's entry of
``conformance.core.levels``), the spec's bounds (``checks``), the strategies
(``strategies``), and the persistent worker group that runs each call on every rank
(``group``, the pytest side; ``worker``, one rank's process)."""
