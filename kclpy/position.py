"""The checkpoint sentinels: the positions in a shard that are not a record's sequence number.

They are the strings the Java KCL writes into a lease's ``checkpoint`` attribute, so they
are part of the lease table's schema; they live below everything that names a position
(the lease model, the checkpointer, the fetcher, lag recovery) so that reading a shard
needs no lease.
"""

from __future__ import annotations

TRIM_HORIZON = "TRIM_HORIZON"
LATEST = "LATEST"
AT_TIMESTAMP = "AT_TIMESTAMP"
SHARD_END = "SHARD_END"
SENTINELS = frozenset({TRIM_HORIZON, LATEST, AT_TIMESTAMP, SHARD_END})
