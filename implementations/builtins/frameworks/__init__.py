"""Built-ins of other array frameworks: JAX."""
