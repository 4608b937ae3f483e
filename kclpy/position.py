"""Positions in a shard as a checkpoint names them: the sentinels, defined once here, and
the order of stored checkpoints.

A checkpoint is a sequence number with a sub-sequence number (the last user record done;
sub-sequence 0 for a plain record), or a sentinel: ``TRIM_HORIZON``, ``LATEST`` and
``AT_TIMESTAMP`` name no record and sort before every one, ``SHARD_END`` sorts after every
one. The lease item stores the two parts as the Java KCL does (``checkpoint``,
``checkpointSubSequenceNumber``); ``position_of`` turns them into something comparable, the
Java KCL's ``ExtendedSequenceNumber`` order. Nothing here imports the rest of kclpy, so every
layer (leases, checkpoints, retrieval, recovery) can use it.
"""

from __future__ import annotations

TRIM_HORIZON = "TRIM_HORIZON"
LATEST = "LATEST"
AT_TIMESTAMP = "AT_TIMESTAMP"
SHARD_END = "SHARD_END"
SENTINELS = frozenset({TRIM_HORIZON, LATEST, AT_TIMESTAMP, SHARD_END})

#: (sequence number, sub-sequence number), comparable as a tuple
Position = tuple[int, int]
#: sorts before every real sequence number: TRIM_HORIZON, LATEST, AT_TIMESTAMP
BEFORE_ALL: Position = (-1, 0)
#: sorts after every real sequence number: SHARD_END
AFTER_ALL: Position = (2**200, 0)


def position_of(checkpoint: str | None, sub_sequence_number: int | None) -> Position:
    """The sortable position of a stored checkpoint (sentinels included)."""
    if checkpoint is None or checkpoint in SENTINELS - {SHARD_END}:
        return BEFORE_ALL
    if checkpoint == SHARD_END:
        return AFTER_ALL
    return int(checkpoint), sub_sequence_number or 0
