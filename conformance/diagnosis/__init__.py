"""Diagnosis: which known cause explains a failing example."""
