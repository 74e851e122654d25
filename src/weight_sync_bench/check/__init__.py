"""The verdict on a layout or a conversion: run the model under it and compare it with the
dense reference, and compare its bytes with the declared ones.

Its modules, each importing only those listed before it (no cycle between them):

- ``diagnosis``: the byte comparison, and what a shard that differs really holds, in the
  convention's own words; ``verdict``: ``Verdict``; ``mutations``: the layout bugs;
  ``naming``: whether shards that differ are exactly a catalogued bug;
- ``user_code``: calling the user's function; ``forwards``: the sharded forwards a check
  runs (in process, phase 1a, or over gloo, phase 1b);
- ``streaming``: the streamed pass, one stage at a time; ``floor``: the phase floors are
  measured here; ``threshold``: which floor judges a check;
- ``stream``: ``stream_check``; ``checker``: ``Checker``, ``check_split``, ``check_reshard``;
- ``shards``, ``conversion``, ``streamed_conversion``, ``checkpoint`` and ``convert``
  (``check_convert``, ``verify_checkpoint``): the same verdict for conversions between
  frameworks' storage conventions;
- ``state``: ``verify_state``, what an engine rank holds after a sync, tensor by tensor
  (byte comparisons and the diagnosis only: no forward).
"""
