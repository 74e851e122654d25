"""Layouts as data: placements, ShardSpec, LayoutTable, and split / gather / reshard.

Generic tensor-parallel data movement: nothing here knows the model. Moves are bit-exact.
"""
