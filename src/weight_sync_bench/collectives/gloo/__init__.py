"""One process per rank over gloo: the collective, breadcrumbs and fault hooks, the rank
side, the rank pool and its watchdog, and the transport that delivers shards to the ranks.
"""
