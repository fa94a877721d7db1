"""Reference implementations: the oracle, the handwritten module, the flash and varlen references."""
