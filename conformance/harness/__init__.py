"""The harness every property runs in: the runner, the session, ordering, sweeps, the directed-first pass."""
