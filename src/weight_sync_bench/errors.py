"""The typed errors a user of the harness can meet. Each message names what was wrong."""

from __future__ import annotations


class WsbError(Exception):
    """Base class of every error the harness raises on bad input."""


class InvalidConfig(WsbError, ValueError):
    """A ModelConfig whose fields cannot describe a model (or an unknown config name)."""


class UnsupportedLayout(WsbError, ValueError):
    """A placement that cannot split a parameter of this shape at this degree.

    The message names the parameter, the degree and the violated rule, e.g.
    ``layers.0.qkv.weight: HeadPartitioned needs n_kv_heads % t == 0 (n_kv_heads=2, t=4)``.
    """


class InvalidShards(WsbError, ValueError):
    """Rank-local shards (from a user's split or reshard function) that do not fit the layout:
    a missing or extra name, a wrong shape or dtype, or the wrong number of ranks."""


class ToleranceMismatch(WsbError, RuntimeError):
    """A tolerance artifact that does not describe the running check (geometry, token shape,
    phase), or that is missing or malformed."""
