"""The check tests' narrow geometries: a built-in one over a 512-word vocabulary, for tests
whose assertions do not depend on the vocabulary (refusals, user-code guards, a wrong byte on
any rank, the names a diagnosis gives). The embedding and head are most of TOY's weights, so
these draw and move about a fifth of them. No floor is committed for them: they are judged by
``THRESHOLD``, a tenth of TOY's committed threshold (1e-3) and 100x what their declared shards
deviate by at fp32; the faults those tests plant are in the bytes, which no threshold excuses."""

from weight_sync_bench.model.config import ModelConfig

THRESHOLD = 1e-4


def narrowed(config: ModelConfig) -> ModelConfig:
    """``config`` over a 512-word vocabulary, named so (``toy`` -> ``toy_vocab512``)."""
    return config.replace(name=f"{config.name}_vocab512", vocab=512)
