"""Thresholds as pure functions of committed measurements: the rules, and artifact
reading and writing with provenance. ``python -m weight_sync_bench.tolerance`` measures.
"""
