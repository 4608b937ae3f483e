"""Lag recovery: a shard that starts far behind reads live from near the tip, and the gap it
jumped over is read again, separately, at a bounded rate, until nothing of it is left.

``queue`` is the durable list of gaps (in the lease item), ``rate`` the worker-wide budget of
the recovery reads, ``detect`` the look at a shard's first unprocessed record, and ``shard``
one held shard's recovery: its queue, its reader and its checkpoints.
"""
