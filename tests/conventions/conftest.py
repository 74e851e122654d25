"""Shared by the conventions tests: the geometries they run on and one ConversionChecker per
geometry (the reference, threshold and declared shards computed once per worker)."""

from __future__ import annotations

import functools

import pytest

from weight_sync_bench.check.convert import conversion_checker, measure_threshold
from weight_sync_bench.conventions import CONVENTIONS, endpoint
from weight_sync_bench.model.config import CONFIGS


@functools.cache
def _checker(config):
    if config.name in CONFIGS and CONFIGS[config.name] == config:
        return conversion_checker(config)  # the committed phase 1a floor
    # A reduced HF geometry has no committed floor: measured here, as phase1a.json is.
    eps = [endpoint(f"{n}:{t}") for n, c in CONVENTIONS.items()
           for t in c.supported_degrees(config, 16)]
    return conversion_checker(config, threshold=measure_threshold(config, eps))


@pytest.fixture(scope="session")
def checker_for_config():
    """``checker_for_config(config)`` -> the cached ConversionChecker of that geometry."""
    return _checker
