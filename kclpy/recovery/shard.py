"""One held shard's recovery: its queue of gaps, the reader of the gap being recovered, and
the checkpointer the processor gets with each recovery batch.

The consumer asks ``begin`` before its live reader starts: if the shard's first unprocessed
record is older than ``max_lag_ms``, the gap is added to the queue and the queue written to
the lease item, through the fence, before the live reader is even created - so no crash can
lose a gap the live reader jumped over. Between live batches the consumer asks ``poll`` for
a recovery batch; ``poll`` never waits, so a slow or rate-limited recovery never holds a live
batch back.

A gap is read by a second read pipeline of the shard, fed by a polling source bounded by the
gap's end and paced by the worker's ``RecoveryRate``; a checkpoint through the recovery
checkpointer moves the gap's own checkpoint (never the live one), and the checkpoint that
covers the gap's last record removes the gap. A gap read to its end without such a
checkpoint stays queued and is read again, from its checkpoint, by the shard's next tenure.

A state store that keeps its own positions (the SQL store) outlives the lease item, which a
lease-table reset deletes with its queue: the lease created again resumes from the store's live
position, past any gap being recovered. So the store learns each gap before the queue holding
it is written (``PositionKeepingStore.record_gaps``) and forgets it once a write took it out
(``drop_gaps``); a tenure that begins re-queues every gap the store still holds that its
lease's queue lacks, from the store's progress to the gap's end (simulator seed 186).

An operator changes the queue of a held shard through requests the lease item keeps beside
it (``requests``): every write of the queue here folds in those the held lease shows, and
removes them in the same fenced write. A renewal brings new ones into the held lease; the
consumer then sees the shard ``active`` and its next ``poll`` writes the queue with them, so
an operator's backfill starts within one renewal and the lease never changes hands for it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, cast

from botocore.exceptions import ClientError

from kclpy.checkpoint import Checkpointer
from kclpy.errors import CheckpointError, ShutdownException
from kclpy.leases.lease import Lease
from kclpy.leases.serializer import RECOVERY, RECOVERY_REQUESTS, UpdateBuilder, s, ss
from kclpy.leases.table import checkpoint_changes
from kclpy.metrics import (
    RECOVERY_RECORDS,
    RECOVERY_REMAINING_MS,
    RECOVERY_SHARDS,
    RECOVERY_TRIMMED,
    Metrics,
)
from kclpy.position import TRIM_HORIZON, Position
from kclpy.records import Records
from kclpy.recovery import queue as gaps
from kclpy.recovery import requests as asked
from kclpy.recovery.detect import first_record
from kclpy.recovery.queue import RecoveryRequest
from kclpy.recovery.rate import RecoveryRate, ShardPacer
from kclpy.retrieval.clock import SKEW_MARGIN_MS, KinesisClock
from kclpy.retrieval.page import Page
from kclpy.retrieval.pipeline import FetchError, ShardPipeline
from kclpy.retrieval.polling import Pacer
from kclpy.retry import is_not_found

if TYPE_CHECKING:
    from kclpy.leases.fence import Guard, LeaseFence
    from kclpy.state.store import PositionKeepingStore, StateStore

log = logging.getLogger(__name__)

#: seconds before folding operator requests in again after a failed write (throttled)
FOLD_RETRY_S = 1.0

#: (start, until_ms, pacer, max_records) -> a polling reader of the shard, ending before
#: ``until_ms`` and paced by ``pacer`` when they are given; None means the default
ReaderFactory = Callable[[Position, "int | None", "Pacer | None", "int | None"],
                         ShardPipeline]


def _key(request: RecoveryRequest) -> Position:
    return request.start_position


def _queued_as(request: RecoveryRequest) -> tuple[int, int | None, str | None, str | None]:
    """What a state store keeps of a gap besides its progress: a change of it (a merge, an
    operator's replay) is recorded again."""
    return request.end_ms, request.first_ms, request.first_sequence, request.last_sequence


def _time_end_of(queue: tuple[RecoveryRequest, ...], start: Position) -> int:
    """The end time of the queued gap that ``start`` lies in, when it ends at a time (0
    otherwise). A gap a previous holder queued may end later than this tenure's own live
    start (its clock, or Kinesis' time then, was later), or this tenure may not be behind
    at all: live reading must start at the gap's end, not before, or the records in between
    are both in the gap and read live - applied twice with exactly-once state (simulator
    seeds 169, 292 and 464)."""
    holding = [request for request in queue if request.start_position <= start]
    if not holding or holding[-1].last_sequence is not None:  # (the queue is in order)
        return 0
    return holding[-1].end_ms


class ShardRecovery:
    """Used from the shard consumer's delivery thread; checkpoints may come from any thread."""

    def __init__(
        self,
        lease: Lease,
        *,
        token: str,
        fence: LeaseFence,
        reader_factory: ReaderFactory,
        rate: RecoveryRate,
        max_lag_ms: int | None,
        metrics: Metrics,
        wall_clock: Callable[[], float] = lambda: time.time(),
        kinesis_clock: KinesisClock | None = None,
        store: StateStore | None = None,
    ) -> None:
        self.lease_key = lease_key = lease.lease_key
        #: the worker's state store: claims the shard for this tenure and returns the
        #: position it keeps itself, if it does (the SQL store; ``StateStore.begin_tenure``)
        self._claim = (None if store is None
                       else functools.partial(store.begin_tenure, fence, lease_key, token))
        self._claimed = False
        #: the store that keeps gaps beside the lease item's queue (``keeps_position``)
        self._gap_store = (cast("PositionKeepingStore", store)
                           if store is not None and store.keeps_position else None)
        #: the gaps ``_gap_store`` holds a row of, as this tenure recorded them (None: a
        #: row it has not recorded, its end maybe unknown)
        self._recorded: dict[Position, tuple[int, int | None, str | None, str | None] | None] = {}
        self._token = token
        self._fence = fence
        self._readers = reader_factory
        self._rate = rate
        self._max_lag_ms = max_lag_ms
        self._metrics = metrics
        self._m = metrics.shard(lease_key)
        self._wall_clock = wall_clock
        #: Kinesis' time as its answers show it: a gap's end is an arrival time, which
        #: Kinesis' clock stamps, so the lag is measured on it (``begin``)
        self._kinesis_clock = kinesis_clock
        self._lock = threading.Lock()
        #: the gaps ``lease`` was taken with (its ``kclpyRecovery``)
        self._queue = gaps.loads(lease.recovery)
        #: gaps read to their end in this tenure without a checkpoint covering them
        self._passed: set[Position] = set()
        #: the last record of each gap read to its end this tenure but not yet checkpointed
        #: through it: a processor that checkpoints later (the Spark batcher, once its
        #: batch is committed) still removes the gap with that checkpoint
        self._ends: dict[Position, Position] = {}
        self._pacer: ShardPacer = rate.pacer(lease_key)
        #: a gap's read was answered that the shard is not found this tenure: it may have
        #: left the stream, which its holder confirms by the listings (then ``left_stream``)
        self.not_found = False
        self._reader: ShardPipeline | None = None
        self._reading: Position | None = None
        #: the last record of the gap being read, when it ends at one (``last_sequence``)
        self._through: str | None = None
        self._checkpointer: Checkpointer | None = None
        #: the last record handed out of the gap being read, and the same once its end was
        #: seen (the position a checkpoint must reach to finish the gap)
        self._handed: Position | None = None
        self._final: Position | None = None
        self._end_seen = False
        #: arrival (epoch ms) of the last recovery record handed out
        self._delivered_ms: int | None = None
        self._counted = False
        self._published = False
        #: operator request elements found unreadable (logged once each)
        self._unreadable: set[str] = set()
        #: where the gap ``begin`` queued this tenure starts: the live position it found,
        #: which may be the state store's, ahead of the lease's checkpoint (``_store``)
        self._began: Position | None = None
        #: monotonic time before which a failed fold of operator requests is not retried
        self._fold_after = 0.0
        self._skew_logged = False
        self._publish()

    # -- the consumer's side ---------------------------------------------------------------

    def begin(self, live: Position) -> datetime | None:
        """Look at the first record after the live checkpoint ``live``; when it is older than
        ``max_lag_ms`` (None: never), queue its gap durably and return where live reading
        starts instead (None: read live from the checkpoint). A gap already queued at the
        checkpoint moves live reading to its end either way, ``max_lag_ms`` off included.
        Any gap being read is re-read from its own checkpoint, as a restarted processor must
        see it again."""
        self._stop_reader()
        self._passed.clear()
        self._ends.clear()
        self._began = None
        self.not_found = False
        # Claimed first, so no earlier tenure commits past the store's position meanwhile
        stored = self._claim_tenure()
        self._restore()
        max_lag_ms = self._max_lag_ms
        if not (live.is_record or live.sentinel == TRIM_HORIZON):
            return None
        if stored is not None and stored > live:
            # The store's live position may be ahead of the lease's (its lease write failed
            # after the commit landed, or the lease was created again): the records between
            # were applied live, so the gap starts after it.
            live = stored
        queued_ms = _time_end_of(self._queue, live)
        if max_lag_ms is None and not (queued_ms and any(
                _key(r) == live for r in self._queue)):
            # No lag to detect, and no gap queued right at the checkpoint (its live line
            # committed nothing since: the one way kclpy leaves live reading inside a
            # queued gap): no read, so a worker without lag recovery pays for none
            return None
        checkpoint, sub_sequence_number = live.checkpoint, live.sub_sequence_number
        probe = self._readers(live, None, None, 1)
        try:
            first = first_record(probe)
        except ClientError as exc:
            if not is_not_found(exc):
                raise
            # The shard may have left the stream: the live read gets the same answer, and
            # the consumer, its processor initialized, ends the shard once the listings
            # confirm it (the retention probe leaves it to the live read alike).
            log.info("shard %s: not found while looking for the record after %s; the live "
                     "read tells whether it left the stream", self.lease_key, live)
            return None
        now_ms = self._now_ms()
        arrived = None if first is None else first.timestamp_millis
        if first is None or arrived is None:
            return None
        if max_lag_ms is None or arrived >= now_ms - max_lag_ms:
            # Not behind (or not looked at: max_lag_ms off, and a gap queued meanwhile is
            # still recovered); but a gap queued at the checkpoint by a previous holder
            # already covers the records up to its end: live reading starts there, or they
            # are read live as well (seed 292)
            return (datetime.fromtimestamp(queued_ms / 1000, tz=timezone.utc)
                    if queued_ms > arrived else None)
        live_ms = now_ms - max_lag_ms
        request = RecoveryRequest.gap(checkpoint, sub_sequence_number, live_ms, arrived,
                                      first.sequence_number)
        with self._lock:
            self._store(lambda queue: gaps.add(queue, request))
            queue = self._queue
            self._began = _key(request)
        live_ms = max(live_ms, _time_end_of(queue, request.start_position))
        log.warning("shard %s: %d ms behind (more than max_lag_ms=%d); reading live from "
                    "%s and recovering the gap after %s/%s separately", self.lease_key,
                    now_ms - arrived, max_lag_ms, _iso(live_ms), checkpoint,
                    sub_sequence_number)
        return datetime.fromtimestamp(live_ms / 1000, tz=timezone.utc)

    def poll(self) -> tuple[Page[Records], Checkpointer] | None:
        """The next recovery batch and the checkpointer that goes with it, if one is ready
        now; never waits. Operator requests the held lease shows are folded in first."""
        if self._requests_pending():
            self._fold()
        if self._reading is not None and not self._queued(self._reading):
            log.warning("shard %s: the gap being recovered was cancelled by an operator; "
                        "stopped reading it", self.lease_key)
            self._stop_reader()
        if self._end_seen:
            self._close_gap()
        try:
            reader = self._reader if self._reader is not None else self._open_next()
            if reader is None:
                return None
            result = reader.get(timeout=0)
        except (ClientError, FetchError) as exc:
            # a ClientError is the gap's retention probe (``_start_of``): only not-found is
            # given up like a failed read
            if isinstance(exc, ClientError) and not is_not_found(exc):
                raise
            self.not_found |= is_not_found(exc) or is_not_found(exc.__cause__)
            log.error("shard %s: recovery read failed; the gap stays queued for the next "
                      "owner: %r", self.lease_key, exc)
            if self._reading is not None:
                self._passed.add(self._reading)
            self._stop_reader()
            return None
        if result is None:
            return None
        if self._through is not None:
            result = _through(result, self._through)
        records = result.records
        assert self._checkpointer is not None
        if records:
            self._handed = Position.after(records[-1])
        if result.shard_end:
            self._end_seen = True
            self._final = self._handed
        if not records:
            return None
        self._delivered_ms = records[-1].timestamp_millis
        self._m.inc(RECOVERY_RECORDS, by=len(records))
        return result, self._checkpointer

    def left_stream(self) -> None:
        """The shard left the stream (its holder confirmed it by the listings), and the
        records of every queued gap with it: drop the queue in one write through the fence
        and report each gap's loss as a trimmed one. A gap left queued kept the lease the
        holder then ends at ``SHARD_END`` from being finished: shard sync deletes only
        unfinished leases not at ``SHARD_END``, lease cleanup only those without gaps, and
        every later holder took it and failed to read the gap, which was never reported.
        Raises as a recovery checkpoint does (the lease lost: nothing dropped)."""
        self._stop_reader()
        dropped: list[RecoveryRequest] = []

        def drop(queue: tuple[RecoveryRequest, ...]) -> tuple[RecoveryRequest, ...]:
            dropped[:] = queue
            return ()

        with self._lock:
            self._store(drop)
        for request in dropped:
            self._m.inc(RECOVERY_TRIMMED)
            log.error("shard %s: the shard left the stream with a recovery gap queued: its "
                      "records after %s/%s up to %s are lost", self.lease_key, request.done,
                      request.done_sub, _iso(request.end_ms))

    @property
    def active(self) -> bool:
        """Gaps are queued that this tenure has not read to their end yet, or an operator
        asked for a change of the queue that ``poll`` has not folded in yet."""
        with self._lock:
            if any(_key(r) not in self._passed for r in self._queue):
                return True
        return self._requests_pending()

    def stop(self) -> None:
        """The consumer is done with the shard: stop reading and leave the rate's turns."""
        self._stop_reader()
        if self._counted:
            self._metrics.inc(RECOVERY_SHARDS, by=-1)
            self._counted = False

    def status(self) -> list[dict[str, Any]]:
        """The queue as ``/status`` shows it, first gap first."""
        with self._lock:
            queue, reading = self._queue, self._reading
        return [{"after": r.start, "after_sub_sequence_number": r.start_sub,
                 "end": _iso(r.end_ms), "checkpoint": r.done,
                 "checkpoint_sub_sequence_number": r.done_sub,
                 "remaining_ms": r.remaining_ms(), "reading": _key(r) == reading}
                for r in queue]

    # -- the gap checkpointer's writes ------------------------------------------------------

    def checkpoint(self, gap: Position, done: Position, items: Sequence[Any] = ()) -> None:
        """Move ``gap``'s checkpoint (fenced); the checkpoint covering the gap's last record
        removes the gap. ``items`` commit in the same transaction (a stateful processor)."""
        with self._lock:
            request = next((r for r in self._queue if _key(r) == gap), None)
            if request is None and not items:
                # Finished already, or cancelled by an operator while this batch was being
                # processed: nothing to move (a transaction's items still commit below:
                # the batch was applied once).
                return
            final = self._final if self._reading == gap else self._ends.get(gap)
            finished = None
            if request is not None and final is not None and done >= final:
                finished = (request, done)
            delivered_ms = self._delivered_ms

            def change(queue: tuple[RecoveryRequest, ...]) -> tuple[RecoveryRequest, ...]:
                # A gap's checkpoint a write whose answer was lost moved further, or that
                # write's removal of the gap, is kept: this checkpoint never undoes it.
                if finished is not None:
                    return tuple(r for r in queue if _key(r) != gap)
                return tuple(r.checkpointed(done, delivered_ms)
                             if _key(r) == gap and r.done_position < done else r
                             for r in queue)

            self._store(change, items, finished)

    def finisher(self) -> ReadGapsWriter:
        """The writer of the checkpointer a finished shard's gaps' processor ends with."""
        return ReadGapsWriter(self)

    @property
    def read_unfinished(self) -> bool:
        """Gaps were read to their end this tenure and handed out, but no checkpoint covered
        their last record yet (a processor that checkpoints now and then, or only at its
        end): they stay queued until ``finish_read`` or a checkpoint through them."""
        with self._lock:
            return bool(self._read_to_end())

    def finish_read(self, items: Sequence[Any] = ()) -> None:
        """Remove every gap this tenure read to its end and handed out, in one write (with
        ``items``, a stateful processor's transaction): the processor they went to says it
        processed all of it, by checkpointing at ``SHARD_END`` in the ``shard_ended`` of a
        finished shard (``ReadGapsWriter``). Without this a closed shard whose gaps' processor
        checkpoints only there kept its gaps, and every next tenure read them again at once:
        its lease is let go as soon as the gaps are read."""
        with self._lock:
            done = self._read_to_end()
            if not done and not items:
                return
            self._store(lambda queue: tuple(r for r in queue if _key(r) not in done), items)

    def durable_read(self) -> Position | None:
        """``SHARD_END`` once the lease item's queue holds none of the gaps read to their end
        this tenure (``finish_read`` landed, whatever answers were lost), else where they
        start; None when the lease item is gone."""
        current = self._fence.durable_lease(self.lease_key, self._token)
        if current is None:
            return None
        with self._lock:
            read = self._read_to_end()
        left = [_key(r) for r in gaps.loads(current.recovery) if _key(r) in read]
        return Position.shard_end() if not left else min(left)

    def _read_to_end(self) -> set[Position]:
        """The gaps read to their end this tenure and not finished yet (``_lock`` held)."""
        return self._ends.keys() & self._passed

    def guard(self, what: str, wait: bool = True) -> AbstractContextManager[Guard]:
        return self._fence.guard(self.lease_key, self._token, what=what, wait=wait)

    def durable(self, gap: Position) -> Position | None:
        """``gap``'s checkpoint in the lease item as the table holds it now (read
        consistently, whatever answers of this holder's writes were lost): ``SHARD_END``,
        after every record, once the gap is gone from the item's queue (a checkpoint covered
        its last record, or an operator cancelled it); None when the lease item is gone."""
        current = self._fence.durable_lease(self.lease_key, self._token)
        if current is None:
            return None
        request = next((r for r in gaps.loads(current.recovery) if _key(r) == gap), None)
        return (Position.shard_end() if request is None
                else Position.of(request.done, request.done_sub))

    # -- internals ---------------------------------------------------------------------------

    def _now_ms(self) -> int:
        """The local clock, but never later than Kinesis' time as its answers (to the probe
        just made) allow it to be (``KinesisClock.plan_ms``). A gap ends, and live reading
        starts, ``max_lag_ms`` before it: on a local clock ahead of Kinesis' by more than
        that, the end would be in Kinesis' future, and live reading would start after
        records that had not arrived yet (the gap's reader waits for Kinesis' time to pass
        its end as well, so none is lost either way; planned so, it seldom waits)."""
        local = round(self._wall_clock() * 1000)
        clock = self._kinesis_clock
        if clock is None:
            return local
        ahead = clock.ahead_ms(local)
        if ahead > max(SKEW_MARGIN_MS, self._max_lag_ms or 0) and not self._skew_logged:
            self._skew_logged = True
            log.warning("shard %s: the local clock is %d ms or more ahead of Kinesis' "
                        "(max_lag_ms=%s): lag and recovery gaps are measured on Kinesis' "
                        "time", self.lease_key, ahead, self._max_lag_ms)
        return clock.plan_ms(local)

    def _claim_tenure(self) -> Position | None:
        """Claim the shard in the state store for this tenure (``StateStore.begin_tenure``)
        and return the store's live position; None without a store."""
        if self._claim is None:
            return None
        stored = self._claim()
        self._claimed = True
        return stored

    def _restore(self) -> None:
        """Queue again the gaps the state store holds that the lease's queue lacks: the
        lease item was deleted and created again (a lease-table reset) while a gap was being
        recovered, or the process died between the store's record of a new gap and the queue
        write. Each is queued from the store's progress to its end; records the store
        committed are skipped by its own position, and a gap that had finished (its row's
        drop lost) reads nothing and leaves at once. Rows an older kclpy wrote without an
        end cannot be queued again: those whose gap is not queued are dropped. Every queued
        gap gets its row, so that a reset from now on loses none."""
        store = self._gap_store
        if store is None:
            return
        held = store.stored_gaps(self.lease_key)
        with self._lock:
            queued = {_key(r) for r in self._queue}
            lost = [r for key, r in held.items() if key not in queued and r is not None]
            unknown = [key for key, r in held.items() if key not in queued and r is None]
            self._recorded = {key: None if r is None or key not in queued else _queued_as(r)
                              for key, r in held.items()}
            if unknown:
                log.info("shard %s: the state store held the progress of %d gap(s) not queued, "
                         "written by an older kclpy without their end: dropped", self.lease_key,
                         len(unknown))
                store.drop_gaps(self._fence, self.lease_key, self._token, unknown)
                for key in unknown:
                    del self._recorded[key]
            def requeue(queue: tuple[RecoveryRequest, ...]) -> tuple[RecoveryRequest, ...]:
                for request in lost:
                    queue = gaps.add(queue, request)
                return queue

            if lost:
                log.warning("shard %s: the lease's recovery queue lacks %d gap(s) the state "
                            "store holds unfinished (the lease item was deleted and created "
                            "again, or a queue write was lost); queued again: %s",
                            self.lease_key, len(lost), ", ".join(
                                f"after {r.start}/{r.start_sub} from {r.done}/{r.done_sub} "
                                f"up to {_iso(r.end_ms)}" for r in lost))
                self._store(requeue)
            else:
                self._record(self._queue)

    def _record(self, queue: tuple[RecoveryRequest, ...]) -> None:
        """Have the state store keep ``queue``'s gaps as queued, before the queue is written
        (the caller holds ``_lock``); gaps recorded so already are not written again."""
        store = self._gap_store
        if store is None:
            return
        pending = [r for r in queue if self._recorded.get(_key(r)) != _queued_as(r)]
        if not pending:
            return
        if not self._claimed:
            self._claim_tenure()  # fenced by this tenure's claim, as commits are
        store.record_gaps(self._fence, self.lease_key, self._token, pending)
        for request in pending:
            self._recorded[_key(request)] = _queued_as(request)

    def _forget_left(self) -> None:
        """Drop the state store's rows of gaps the queue just written no longer holds. A
        failure leaves them for the next write to drop (or, after a crash, for the next
        tenure to queue again and see read to their end)."""
        store = self._gap_store
        kept = {_key(r) for r in self._queue}
        left = [gap for gap in self._recorded if gap not in kept]
        if store is None or not left:
            return
        try:
            store.drop_gaps(self._fence, self.lease_key, self._token, left)
        except CheckpointError as exc:
            log.warning("shard %s: the state store keeps %d gap(s) no longer queued (%s); "
                        "dropped later", self.lease_key, len(left), exc)
            return
        for gap in left:
            del self._recorded[gap]

    def _queued(self, gap: Position) -> bool:
        with self._lock:
            return any(_key(r) == gap for r in self._queue)

    def _requests_pending(self) -> bool:
        """The held lease (as the last renewal or write returned it) carries operator
        requests not folded in yet. Reads the held entry without a write: cheap enough for
        every turn of the consumer's loop."""
        entry = self._fence.held.entry(self.lease_key)
        if entry is None or entry.lease.concurrency_token != self._token:
            return False
        texts = entry.lease.recovery_requests
        if not texts or texts <= self._unreadable:
            return False
        return time.monotonic() >= self._fold_after

    def _fold(self) -> None:
        """Write the queue with the operator requests the held lease shows. A lost lease
        ends the tenure through the fence's listeners; a throttled or failed write is tried
        again after ``FOLD_RETRY_S``."""
        try:
            with self._lock:
                self._store(lambda queue: queue)
        except ShutdownException as exc:
            log.info("shard %s: lease lost while taking in recovery requests: %s",
                     self.lease_key, exc)
            self._fold_after = time.monotonic() + FOLD_RETRY_S
        except CheckpointError as exc:
            log.warning("shard %s: taking in recovery requests failed, trying again: %s",
                        self.lease_key, exc)
            self._fold_after = time.monotonic() + FOLD_RETRY_S

    def _open_next(self) -> ShardPipeline | None:
        with self._lock:
            request = next((r for r in self._queue if _key(r) not in self._passed), None)
        if request is None:
            return None
        gap = _key(request)
        self._reading = gap
        self._through = request.last_sequence
        self._checkpointer = Checkpointer(
            self.lease_key, GapWriter(self, gap), self._token, request.done_position, gap=gap)
        reader = self._readers(self._start_of(request), request.end_ms, self._pacer, None)
        reader.start()
        self._reader = reader
        log.info("shard %s: recovering the gap after %s/%s up to %s", self.lease_key,
                 request.done, request.done_sub, _iso(request.end_ms))
        return reader

    def _start_of(self, request: RecoveryRequest) -> Position:
        """Where the gap's reading resumes: its checkpoint, unless the stream's retention
        has already trimmed past it; then what is left, from the oldest record kept, after
        logging and counting the loss."""
        resume = request.done_position
        check = request.done if request.started else request.first_sequence
        if check is None or check == TRIM_HORIZON:
            return resume
        oldest = first_record(self._readers(Position.trim_horizon(), None, None, 1))
        if oldest is not None and int(oldest.sequence_number) <= int(check):
            return resume
        self._m.inc(RECOVERY_TRIMMED)
        lost_from = f"after {check}" if request.started else f"from {check}"
        if oldest is None:
            # Retention trimmed the whole shard: nothing of the gap is left to read.
            log.error("shard %s: a recovery gap is past the stream's retention: records %s "
                      "up to its end (%s) are lost; the shard keeps no record", self.lease_key,
                      lost_from, _iso(request.end_ms))
        else:
            log.error("shard %s: part of a recovery gap is past the stream's retention: "
                      "records %s up to %s (arrived %s) are lost; recovering the rest",
                      self.lease_key, lost_from, oldest.sequence_number,
                      _iso(oldest.timestamp_millis or 0))
        return Position.trim_horizon()

    def _close_gap(self) -> None:
        """The gap being read reached its end and its last batch was handed out.

        The gap's end is kept in ``_ends`` before the reader stops (which forgets
        ``_final``), so a checkpoint from another thread (the Spark batcher's) finishes the
        gap whenever it takes ``_lock``: before that one covering the end found neither, and
        when it came between the look at the checkpointer here and ``_lock``, the gap stayed
        queued, checkpointed to its end, until the shard's next tenure read it again."""
        gap, final, checkpointer = self._reading, self._final, self._checkpointer
        assert gap is not None and checkpointer is not None
        if final is not None:
            with self._lock:
                self._ends[gap] = final
        self._stop_reader()
        # Read before taking ``_lock``: a checkpoint holds the checkpointer's lock while it
        # waits for ``_lock``.
        done = checkpointer.position
        with self._lock:
            request = next((r for r in self._queue if _key(r) == gap), None)
            if request is not None and (final is None or done >= final):
                self._store(lambda queue: tuple(r for r in queue if _key(r) != gap), (),
                            (request, done))
                return
            queued = request is not None
            if queued:
                self._passed.add(gap)
            else:
                self._ends.pop(gap, None)
        if queued:
            log.warning("shard %s: recovery gap read to its end, but not checkpointed through "
                        "its last record yet; a later checkpoint through it finishes it, else "
                        "the shard's next owner reads it again from its checkpoint",
                        self.lease_key)

    def _stop_reader(self) -> None:
        reader, self._reader = self._reader, None
        self._reading, self._end_seen, self._checkpointer = None, False, None
        self._through = None
        self._handed = self._final = None
        if reader is not None:
            reader.stop()
        self._pacer.leave()

    def _store(self, change: Callable[[tuple[RecoveryRequest, ...]], tuple[RecoveryRequest, ...]],
               items: Sequence[Any] = (),
               finished: tuple[RecoveryRequest, Position] | None = None) -> None:
        """Write the queue ``change`` makes of the lease item's to the lease item as its
        holder (the caller holds ``_lock``). The item's queue is the one the lease the fence
        writes shows, never ``_queue``: a write of the queue whose answer was lost may have
        landed, and ``_queue`` then lacks what it wrote (a gap's checkpoint, a gap removed).
        The fence hands this write the item such a write left - taken up by a renewal, or
        found when this write is refused by the counter it moved - and a queue made of
        ``_queue`` would undo it (a gap's checkpoint moved back, a finished gap queued again
        by the next fold of an operator's request).

        ``finished`` is the gap this write removes, with the checkpoint that covered its last
        record. When the live checkpoint still names where that gap starts (live reading
        committed nothing yet: an idle stream), it moves to the gap's last record in the
        same write: every record up to there is processed, and a next owner starting from
        the gap's start would find the same gap again and process it twice. The same when
        the gap is the one ``begin`` queued after the state store's position, ahead of the
        lease's checkpoint (a lease created again while the store kept the shard's position:
        the store says every record up to the gap's start is applied); otherwise the live
        checkpoint stayed behind the gap for good (simulator seed 844). Decided on the held
        lease, under the fence's lock, so a live checkpoint never moves back.

        The operator requests the held lease carries are applied to that queue and removed
        from the item in the same write (``requests``); the queue written is what this
        holder keeps from then on. A cancel the queue refuses (its gap grew since the
        operator saw it) leaves the item too, its gap kept, and is logged once the write
        landed."""
        written: list[tuple[RecoveryRequest, ...]] = []
        refused: list[str] = []
        seen: frozenset[str] | None = None
        if self._gap_store is not None:
            # The store learns the queue first, as planned on the held lease; the write
            # folds in only the requests that queue was planned with (one come since waits
            # for the next write). A queue the write makes of another item (one an earlier
            # write whose answer was lost left) holds no gap this holder did not record
            # before that earlier write.
            entry = self._fence.held.entry(self.lease_key)
            planned = change(() if entry is None else gaps.loads(entry.lease.recovery))
            readable_now, _ = asked.read(() if entry is None
                                         else entry.lease.recovery_requests)
            seen = frozenset(text for text, _ in readable_now)
            self._record(asked.apply(planned, (request for _, request in readable_now)))

        def write(lease: Lease) -> Lease:
            # Called again, on a fresh copy, when the write is repeated (during a handoff,
            # or over an earlier write of this holder found landed).
            readable, unreadable = asked.read(lease.recovery_requests)
            if seen is not None:
                readable = [(text, request) for text, request in readable if text in seen]
            self._report_unreadable(unreadable)
            final, notes = asked.applied(change(gaps.loads(lease.recovery)),
                                         (request for _, request in readable))
            refused[:] = notes
            folded = frozenset(text for text, _ in readable)
            value = gaps.dumps(final)
            changes = UpdateBuilder()
            live = lease
            # (``extended``: a live checkpoint at any sentinel before every record still
            # names where a gap from TRIM_HORIZON starts)
            if finished is not None and _live_behind(lease.checkpoint, finished[0],
                                                     self._began):
                changes = checkpoint_changes(finished[1])
                live = lease.copy(checkpoint=finished[1], owner_switches_since_checkpoint=0)
            if value is None:
                changes.remove(RECOVERY)
            else:
                changes.set(RECOVERY, s(value))
            if folded:
                changes.delete(RECOVERY_REQUESTS, ss(folded))
            written[:] = [final]
            if not items:
                return self._fence.table.guarded_update(lease, changes)
            fresh = self._fence.table.guarded_transact(lease, changes, items)
            return fresh.copy(recovery=value, recovery_requests=lease.recovery_requests - folded,
                              checkpoint=live.checkpoint,
                              owner_switches_since_checkpoint=(
                                  live.owner_switches_since_checkpoint))

        self._fence.write(self.lease_key, self._token, write,
                          what="recovery commit" if items else "recovery checkpoint",
                          transaction=bool(items))
        for note in refused:
            # the request left the set with this write: the log is its only answer
            log.warning("shard %s: an operator's recovery cancel not applied: %s",
                        self.lease_key, note)
        before = {_key(r) for r in self._queue}
        self._queue = written[0]
        for request in self._queue:
            if _key(request) not in before:
                log.info("shard %s: recovery gap after %s/%s up to %s queued", self.lease_key,
                         request.start, request.start_sub, _iso(request.end_ms))
        kept = {_key(r) for r in self._queue}
        self._passed &= kept
        self._ends = {gap: end for gap, end in self._ends.items() if gap in kept}
        self._forget_left()
        self._publish()

    def _report_unreadable(self, texts: Sequence[str]) -> None:
        for text in texts:
            if text not in self._unreadable:
                self._unreadable.add(text)
                log.error("shard %s: an operator recovery request in %s is unreadable and "
                          "left there: %r; remove it by hand", self.lease_key,
                          RECOVERY_REQUESTS, text[:200])

    def _publish(self) -> None:
        queue = self._queue
        if queue or self._published:
            # Every held shard has a recovery (an operator may queue a gap at any time):
            # a shard that never had a gap gets no series.
            self._published = True
            self._m.set(RECOVERY_REMAINING_MS, sum(r.remaining_ms() for r in queue))
        if bool(queue) != self._counted:
            self._counted = bool(queue)
            self._metrics.inc(RECOVERY_SHARDS, by=1 if queue else -1)


class GapWriter:
    """The ``CheckpointWriter`` of one gap's checkpointer: its checkpoints are the gap's."""

    def __init__(self, recovery: ShardRecovery, gap: Position) -> None:
        self._recovery = recovery
        self._gap = gap

    def update_checkpoint(self, lease_key: str, concurrency_token: str,
                          position: Position) -> None:
        self._recovery.checkpoint(self._gap, position)

    def transact_checkpoint(self, lease_key: str, concurrency_token: str, position: Position,
                            items: Sequence[Any]) -> None:
        self._recovery.checkpoint(self._gap, position, items)

    def durable_checkpoint(self, lease_key: str, concurrency_token: str) -> Position | None:
        return self._recovery.durable(self._gap)

    def guard(self, lease_key: str, concurrency_token: str | None, *,
              what: str, wait: bool = True) -> AbstractContextManager[Guard]:
        return self._recovery.guard(what, wait)


class ReadGapsWriter:
    """The ``CheckpointWriter`` of the checkpointer a finished shard's gaps' processor gets
    in ``shard_ended``: its ``SHARD_END`` checkpoint finishes every gap read to its end
    (``ShardRecovery.finish_read``), as the live processor's finishes the shard. Nothing is
    marked delivered on that checkpointer, so ``SHARD_END`` is the only position it lets
    through."""

    def __init__(self, recovery: ShardRecovery) -> None:
        self._recovery = recovery

    def update_checkpoint(self, lease_key: str, concurrency_token: str,
                          position: Position) -> None:
        self._recovery.finish_read()

    def transact_checkpoint(self, lease_key: str, concurrency_token: str, position: Position,
                            items: Sequence[Any]) -> None:
        self._recovery.finish_read(items)

    def durable_checkpoint(self, lease_key: str, concurrency_token: str) -> Position | None:
        return self._recovery.durable_read()

    def guard(self, lease_key: str, concurrency_token: str | None, *,
              what: str, wait: bool = True) -> AbstractContextManager[Guard]:
        return self._recovery.guard(what, wait)


def _through(result: Page[Records], last_sequence: str) -> Page[Records]:
    """The batch as a gap ending at record ``last_sequence`` sees it: its records up to that
    one (every user record of it), and the gap's end once a later record shows. The read
    itself stops before ``end_ms`` (the millisecond after that record arrived), so a record
    after it in the same millisecond comes through the reader and is dropped here."""
    records = result.records
    bound = int(last_sequence)
    low, high = 0, len(records)
    while low < high:  # the first record after the bound; sequence numbers grow
        middle = (low + high) // 2
        if int(records[middle].sequence_number) <= bound:
            low = middle + 1
        else:
            high = middle
    if low == len(records):
        return result
    return replace(result, records=records[:low], shard_end=True, child_shards=(),
                   bound_reached=True)


def _live_behind(live: Position, gap: RecoveryRequest, began: Position | None) -> bool:
    """Live reading committed nothing past the start of ``gap``, whose every record is now
    processed: the live checkpoint names where the gap starts, or is behind it when the gap
    is the one ``begin`` started at the state store's position (``began``)."""
    at, start = live.extended, gap.start_position.extended
    return at == start or (_key(gap) == began and at < start)


def _iso(epoch_ms: int) -> str:
    return datetime.fromtimestamp(epoch_ms / 1000, tz=timezone.utc).isoformat(
        timespec="milliseconds")
