"""What the sharded forward runs over: the ``Collective`` protocol, the in-process
collectives, and ``gloo`` (one process per rank: the collective, the rank pool, the transport).
"""
