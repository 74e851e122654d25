"""The verdict on a layout: ``Checker``, ``Verdict``, the sweep, the diagnosis of a shard
that differs, ``check_split`` / ``check_reshard``, the layout mutations, and the forwards
(in process or over gloo) a check runs; the phase floors it is judged against are measured
here (``check.floor``).
"""
