"""Context-parallel implementations: ring, Ulysses, torch context parallel."""
