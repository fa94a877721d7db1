"""The harness every property runs in: runner, session, directed-first pass, sweeps, order."""
