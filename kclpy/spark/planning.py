"""Where the source's next micro-batch ends: a decision made from values only.

Planning a batch needs facts only AWS has (the shards ListShards lists, where a budgeted end
stopped, whether a probe found anything after a shard's position, Kinesis' time) and a
decision made from them: which shards have a part in the batch, where each part ends, which
shards wait for their parents. :class:`kclpy.spark.source.KinesisStreamReader` gathers the
facts; this module decides, with no client, clock or randomness, so that every case of the
decision (a split, a merge, a budget, a shard gone) is a unit test on values and none needs
an emulator.

The driver's steps, facts and decisions alternating:

1. :func:`live_entries`: the previous offset without the shards no longer listed, and which
   of those were gone before their end (records lost);
2. (AWS) each budgeted end of the previous offset resolved to the position it reached;
3. :func:`starts`: where each listed shard's next part starts;
4. :func:`probe_keys`: which shards are worth a probe; (AWS) the probes;
5. :func:`plan_batch`: the next offset.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kclpy.position import AFTER, AT_TIMESTAMP, Position
from kclpy.spark.offsets import Budget, OffsetEntry, UptoEnd
from kclpy.spark.reading import Probe

__all__ = ["BatchPlan", "Limits", "ShardNode", "Target", "live_entries", "plan_batch",
           "probe_keys", "ready_shards", "share_budgets", "starts"]


@dataclass(frozen=True)
class ShardNode:
    """A listed shard's place in its stream's family tree, by offset keys: its parents are
    read to their ends before it, and a closed shard has an end to find."""

    key: str
    parents: tuple[str, ...] = ()
    closed: bool = False


@dataclass(frozen=True)
class Target:
    """An ``AvailableNow`` run's target, fixed once when it starts: the records that arrived
    before ``until_ms`` on ``shards`` (shards that appear later belong to a later run)."""

    until_ms: int
    shards: frozenset[str]


@dataclass(frozen=True)
class Limits:
    """A budgeted batch's limits (None: no limit of that kind). A batch planned with limits
    ends at each shard's ``UPTO`` end even when none is set, so that a query keeps one kind
    of end while Spark passes a row limit for some batches and not for others."""

    #: user records in the whole batch (Spark's read limit), shared among the moving shards
    rows: int | None = None
    #: user records per shard (``maxFetchRecordsPerShard``)
    per_shard_rows: int | None = None
    #: payload bytes in the whole batch (``fetchBufferSize``), shared among the moving shards
    bytes: int | None = None
    #: reading time per shard (``maxFetchDuration``)
    duration_ms: int | None = None


@dataclass(frozen=True)
class BatchPlan:
    #: the batch's end offset: every listed shard's entry, moved or not
    offset: dict[str, OffsetEntry]
    #: the shards that had something new, sorted (each has a part in the batch unless a row
    #: limit smaller than their number left it out this time)
    moving: tuple[str, ...]
    #: the row limit's turn for the next batch (shards take turns at the remainder)
    turn: int


def live_entries(previous: Mapping[str, OffsetEntry], shards: Mapping[str, ShardNode]
                 ) -> tuple[dict[str, OffsetEntry], dict[str, OffsetEntry]]:
    """The previous offset's entries of the shards still listed, and the entries of the
    shards gone (expired) before their end, whose records after the entry are lost. A shard
    gone after its ``SHARD_END`` lost nothing and is simply left out."""
    kept = {key: entry for key, entry in previous.items() if key in shards}
    lost = {key: entry for key, entry in previous.items()
            if key not in shards and not entry.is_shard_end}
    return kept, lost


def starts(resolved: Mapping[str, Position], shards: Mapping[str, ShardNode]
           ) -> dict[str, Position]:
    """Where each listed shard's next part starts: after the previous batch (its budgeted ends
    already resolved to where they stopped), and at ``TRIM_HORIZON`` for a shard the offset
    does not hold yet (a child of a split or merge). A shard absent from an offset means
    ``TRIM_HORIZON`` anyway; listing it makes the offset show every shard the query knows."""
    positions = dict(resolved)
    for key in shards:
        positions.setdefault(key, Position.trim_horizon())
    return positions


def ready_shards(positions: Mapping[str, Position], shards: Mapping[str, ShardNode],
                 target: Target | None = None) -> list[str]:
    """The shards a batch may read now, sorted: not at their end, within an ``AvailableNow``
    target, and with every parent the offset holds at its end (a child's first part comes
    after its parents' last one)."""
    return [key for key in sorted(positions) if _readable(key, positions, shards, target)]


def _readable(key: str, positions: Mapping[str, Position], shards: Mapping[str, ShardNode],
              target: Target | None) -> bool:
    position = positions[key]
    if position.is_shard_end:
        return False
    shard = shards[key]
    if target is not None:
        if key not in target.shards:
            return False
        if (position.kind == AT_TIMESTAMP and (position.timestamp_ms or 0) >= target.until_ms
                and not shard.closed):
            # Read to the target; an open shard has nothing more for this run (a closed one
            # is probed once more to find its end, which frees its children).
            return False
    return all(p not in positions or positions[p].is_shard_end for p in shard.parents)


def _cut_short(given: Mapping[str, OffsetEntry], positions: Mapping[str, Position]) -> set[str]:
    """Shards whose last part a budget ended at a record: they have more, without a probe."""
    return {key for key, entry in given.items()
            if isinstance(entry, UptoEnd) and positions[key].kind == AFTER}


def probe_keys(given: Mapping[str, OffsetEntry], positions: Mapping[str, Position],
               shards: Mapping[str, ShardNode], target: Target | None = None) -> list[str]:
    """The ready shards whose probe decides whether they move (a shard a budget cut short
    moves without one)."""
    cut_short = _cut_short(given, positions)
    return [key for key in ready_shards(positions, shards, target) if key not in cut_short]


def plan_batch(given: Mapping[str, OffsetEntry], positions: Mapping[str, Position],
               shards: Mapping[str, ShardNode], probes: Mapping[str, Probe], *, now_ms: int,
               settle_ms: int, target: Target | None = None, limits: Limits | None = None,
               turn: int = 0, plan_id: str = "plan") -> BatchPlan:
    """The next batch's end.

    ``given``: the previous offset's entries of the listed shards (:func:`live_entries`);
    ``positions``: where each listed shard's part starts (:func:`starts`); ``probes``: what
    the probes of :func:`probe_keys` found. A ready shard without a probe moves (a budget
    cut it short, so it has more). ``now_ms``: the planning time on Kinesis' clock.

    The batch ends at the arrivals before ``now_ms - settle_ms`` (and never after the
    target), so every record of it was stored before it was planned: a moving shard's part
    ends at that time, or with ``limits`` at an ``UPTO`` end holding its share of them
    (``plan_id`` makes those ends distinct from any earlier plan's), and a probe that found
    the shard's end ends its part at ``SHARD_END``. A shard that did not move
    keeps its entry as given, a budgeted one included, so that an offset with nothing new
    equals its start (which is how Spark sees the end of a run).
    """
    until_ms = now_ms - settle_ms
    if target is not None:
        until_ms = min(until_ms, target.until_ms)
    out: dict[str, OffsetEntry] = {key: given.get(key, positions[key]) for key in positions}
    moving: list[str] = []
    for key in ready_shards(positions, shards, target):
        seen = probes.get(key)
        if seen is not None and seen.shard_end:
            out[key] = Position.shard_end()
        elif seen is None or seen.undecided or (seen.first_arrival_ms is not None
                                                and seen.first_arrival_ms < until_ms):
            moving.append(key)
    if limits is None:
        until = Position.at_timestamp(until_ms)
        for key in moving:
            out[key] = until
    else:
        for key, budget in share_budgets(moving, limits, turn).items():
            out[key] = UptoEnd(positions[key], until_ms, budget, plan_id)
        if moving:
            turn += 1
    return BatchPlan(out, tuple(moving), turn)


def share_budgets(moving: Sequence[str], limits: Limits, turn: int = 0) -> dict[str, Budget]:
    """Each moving shard's budget: an equal share of the batch's rows (shards take turns at
    the remainder, starting at ``turn``, and at all of it when there are more shards than
    rows) and of its bytes, and the per-shard rows and time as they are."""
    if not moving:
        return {}
    first = turn % len(moving)
    order = list(moving[first:]) + list(moving[:first])
    share = None if limits.bytes is None else -(-limits.bytes // len(moving))
    budgets: dict[str, Budget] = {}
    for i, key in enumerate(order):
        cap = limits.per_shard_rows
        if limits.rows is not None:
            quota, extra = divmod(limits.rows, len(order))
            quota += 1 if i < extra else 0
            if quota == 0:
                continue
            cap = quota if cap is None else min(cap, quota)
        budgets[key] = Budget(cap, share, limits.duration_ms)
    return budgets
