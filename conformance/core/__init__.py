"""The lowest layer: cases, tensors, tolerances, comparison, the target and its guarded call, the registry."""
