"""The fuzz layer: the domain, cases, the corpus, profiles and the runner, the random-geometry
floor, and the Hypothesis strategies (``fuzz.strategies``, kept in the top-level
``strategies/`` folder). The core never imports it.
"""
