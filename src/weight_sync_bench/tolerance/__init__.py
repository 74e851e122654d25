"""Floors and the thresholds derived from them: the one package that derives thresholds.

- ``rules``: ``derive_threshold`` (the smallest power of ten at or above 100x the worst
  observation), the phase floors read back, what covers a check (``floor_for``) and how the
  running process differs from where a floor was measured;
- ``phase``, ``training``, ``sampled``: what each kind of floor records, built from what its
  measuring loop measured (``check.floor``, ``training.floor``, ``fuzz.floor``), and the
  thresholds (or rule, for fuzzed geometries) each implies; ``sampled_moe``: that rule
  validated on the Mixture-of-Experts forwards;
- ``kernels``: floors measured under every CPU kernel set and on every CPU vendor, merged;
- ``artifacts``: where each kind lives, the environment a measurement records, reading and
  writing.

``wsb floor <kind>`` measures (``python -m weight_sync_bench.tolerance`` is the same command).
"""
