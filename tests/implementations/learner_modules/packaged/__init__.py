"""A package whose attention module imports its helpers relatively."""
