"""The lowest layer: cases, tensors, tolerances, comparison, devices, options, levels, expected failures, observations, the target and the guarded call, the property registry."""
