"""Hypothesis strategies for weight-sync-bench: geometries, TP degree pairs and seeds."""
