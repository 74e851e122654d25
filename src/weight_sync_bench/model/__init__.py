"""The model: ModelConfig and the built-in geometries, parameters and tokens from a seed,
the dense reference, its tensor-parallel plan (``layout_for``) and the sharded forward.
"""
