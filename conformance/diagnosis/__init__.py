"""Diagnosis: which known cause (a variant of spec.variants) explains a failing example."""
