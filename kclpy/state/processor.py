"""The stateful processor a user writes, and the record processor that runs it.

``StatefulProcessor.apply`` gets one record and the open transaction. ``ExactlyOnceProcessor``
is an ordinary ``IRecordProcessor`` to the shard consumer - the same ordering, lease-loss and
shutdown paths as every processor - that decides where transactions end and commits each
one with the checkpoint of the last record it covers, through the checkpointer and so the
lease fence. The user's processor never checkpoints.

A transaction ends after each batch, after ``max_records`` records, after ``max_seconds``,
or right before a record that would take it past the store's limits. When the store refuses
it because another writer changed a key it read, the first half of the transaction's records
is applied again to the state as it now is and committed, then the rest. When the lease is
gone the transaction is dropped, state included, and the user's ``lease_lost`` is called as
usual.

A commit that failed without an answer may have landed, now or - still on its way - later:
until a later commit of its line lands, the store is asked what it holds
(``durable_position``) before each batch of the line and after each refused commit, and
records it covers are never applied again - the state already holds them - so the checkpoint
only moves forward. The store's position, committed with the state in one write, is what
says which records the state holds. The lease fence remembers such a commit for the whole
tenure, beyond a processor replaced meanwhile (``ProcessorRestartRequired``), whose
successor cannot know it is in doubt: a commit the fence refuses because an earlier one
landed (``EarlierTransactionLanded``) is always read back, and the checkpointer catches up
with the checkpoint that landed.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial

from kclpy.checkpoint import Checkpointer
from kclpy.errors import EarlierTransactionLanded, TransactionRejected
from kclpy.metrics import NOWHERE, STATE_COMMITS, STATE_CONFLICTS, STATE_RECORDS, Metrics, Scope
from kclpy.position import Position
from kclpy.processor import (
    InitializeInput,
    IRecordProcessor,
    LeaseLostInput,
    ProcessRecordsInput,
    ShardEndedInput,
    ShutdownRequestedInput,
)
from kclpy.records import Record
from kclpy.retry import RetryPolicy
from kclpy.state.store import StateStore
from kclpy.state.transaction import StateTransaction, TransactionTooLarge

log = logging.getLogger(__name__)

#: commits refused for conflicting writers before the batch fails (and is retried whole)
MAX_CONFLICTS = 10
#: after a refused commit, wait up to 20 ms (doubling per attempt, full jitter, capped at a
#: second) so shards that update the same keys stop colliding in lockstep
CONFLICT_RETRIES = RetryPolicy(0.02, 1.0)


class StatefulProcessor(abc.ABC):
    """Subclass this for exactly-once state. ``apply`` must depend only on the record and
    what it reads from ``txn``: it may run more than once for one record (a conflicting
    writer, a failover), and only the run that committed counts."""

    def initialize(self, initialize_input: InitializeInput) -> None:  # noqa: B027 (optional)
        """Called once per shard tenure, before any record."""

    @abc.abstractmethod
    def apply(self, record: Record, txn: StateTransaction) -> None:
        """Apply one record: read and stage writes through ``txn``."""

    def lease_lost(self, lease_lost_input: LeaseLostInput) -> None:  # noqa: B027 (optional)
        """The lease moved on; staged writes not yet committed were dropped."""


class ExactlyOnceProcessor(IRecordProcessor):
    """Runs a ``StatefulProcessor`` for one shard (see the module docstring)."""

    def __init__(
        self,
        processor: StatefulProcessor,
        store: StateStore,
        *,
        max_records: int = 10_000,
        max_seconds: float = 10.0,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if max_records < 1 or max_seconds <= 0:
            raise ValueError("max_records must be >= 1 and max_seconds > 0")
        self.processor = processor
        self._store = store
        self._max_records = max_records
        self._max_seconds = max_seconds
        self._metrics = metrics
        self._m: Scope = NOWHERE
        self._clock = clock
        self._sleep = sleep
        self._lease_key = ""
        #: the last live position committed (records at or before it are skipped on a retry)
        self._committed = Position.trim_horizon()
        #: the same for each lag-recovery gap (by the position it starts after): a gap's
        #: records are older than every live one, so the two are never compared
        self._gaps: dict[Position, Position] = {}
        #: the lines (None: live, else the gap) whose commit at the position failed with
        #: its outcome unknown and is not known to have landed or to be unable to land
        self._in_doubt: dict[Position | None, Position] = {}
        self._tenure_begun = False

    def initialize(self, initialize_input: InitializeInput) -> None:
        self._lease_key = initialize_input.shard_id
        if self._metrics is not None:
            self._m = self._metrics.shard(self._lease_key)
        self._committed = Position.of(initialize_input.sequence_number,
                                      initialize_input.sub_sequence_number)
        self._gaps = {}
        self._in_doubt = {}
        self.processor.initialize(initialize_input)

    def process_records(self, process_records_input: ProcessRecordsInput) -> None:
        """Apply and commit the batch. A lag-recovery batch (its checkpointer names its gap)
        is skipped up to the gap's own committed position and committed as the gap's
        progress, through the gap's checkpointer; a live batch likewise with the live
        position. Records skipped as committed before (by this tenure or, on the SQL store,
        by an earlier one whose lease write was lost) are checkpointed, so the lease item
        catches up and a gap finished that way is removed."""
        checkpointer = process_records_input.checkpointer
        if not self._tenure_begun:
            # Claimed from whichever batch comes first: a closed shard gets only gap batches.
            stored = checkpointer.fenced(self._store.begin_tenure)
            if stored is not None:
                self._committed = max(self._committed, stored)
            self._tenure_begun = True
        gap = checkpointer.gap
        if process_records_input.is_recovery and gap is None:
            raise ValueError(f"shard {self._lease_key}: a recovery batch's checkpointer must "
                             "name its gap")
        if gap in self._in_doubt:
            self._read_back(checkpointer)
        committed = self._committed_of(gap, checkpointer).extended
        txn = self._begin()
        covered: list[Record] = []
        skipped: Record | None = None
        started = self._clock()
        for record in process_records_input.records:
            if record.extended_sequence_number <= committed:
                skipped = record  # committed before this batch failed and came again
                continue
            if not self._apply(record, txn):
                self._commit(checkpointer, txn, covered)
                committed = self._committed_of(gap, checkpointer).extended
                txn, covered, started = self._begin(), [], self._clock()
                if record.extended_sequence_number <= committed:
                    skipped = record  # a commit read back landed with this record
                    continue
                if not self._apply(record, txn):
                    raise TransactionTooLarge(
                        f"shard {self._lease_key}: record {record.sequence_number}/"
                        f"{record.sub_sequence_number} alone writes more than one transaction "
                        f"holds ({self._store.limits})")
            covered.append(record)
            if len(covered) >= self._max_records or self._clock() - started >= self._max_seconds:
                self._commit(checkpointer, txn, covered)
                committed = self._committed_of(gap, checkpointer).extended
                txn, covered, started = self._begin(), [], self._clock()
        if covered:
            self._commit(checkpointer, txn, covered)
        elif skipped is not None and Position.after(skipped) > checkpointer.position:
            checkpointer.checkpoint(skipped)

    def lease_lost(self, lease_lost_input: LeaseLostInput) -> None:
        self.processor.lease_lost(lease_lost_input)

    def shard_ended(self, shard_ended_input: ShardEndedInput) -> None:
        shard_ended_input.checkpointer.checkpoint()

    def shutdown_requested(self, shutdown_requested_input: ShutdownRequestedInput) -> None:
        """Nothing to do: every delivered batch was committed before the next one came."""

    # -- internals ---------------------------------------------------------------------------

    def _committed_of(self, gap: Position | None, checkpointer: Checkpointer
                      ) -> Position:
        """The last committed position of the live shard (``gap`` None) or of ``gap``: what
        this processor committed, the checkpoint the gap's checkpointer starts from, and -
        asked once per gap - what the store holds for it."""
        if gap is None:
            return self._committed
        if gap not in self._gaps:
            stored = self._store.gap_position(self._lease_key, gap)
            self._gaps[gap] = stored if stored is not None else Position.trim_horizon()
        self._gaps[gap] = max(self._gaps[gap], checkpointer.position)
        return self._gaps[gap]

    def _read_back(self, checkpointer: Checkpointer, *, landed: bool = False) -> bool:
        """Ask the store what it holds for ``checkpointer``'s line, which is in doubt, and
        take it as committed when it is further: a commit whose answer was lost landed.
        True if it was. Asked only while in doubt, or when the fence found that an earlier
        commit of the tenure ``landed`` (``EarlierTransactionLanded``: its sender may be a
        processor this one replaced, so this one's ``_in_doubt`` cannot know of it): a
        refused commit is otherwise a conflict, and the read would wait on the very lock
        that refused it (SQLite)."""
        gap = checkpointer.gap
        doubted = self._in_doubt.get(gap)
        if doubted is None and not landed:
            return False
        known = self._committed_of(gap, checkpointer)
        durable = checkpointer.fenced(partial(self._store.durable_position, gap=gap))
        if durable is not None and doubted is not None and durable >= doubted:
            del self._in_doubt[gap]  # it landed (or a later commit did): it cannot land now
        if durable is None or durable <= known:
            return False
        log.info("shard %s: a commit whose answer was lost had landed: %s is committed, not "
                 "%s; the records up to it are not applied again", self._lease_key, durable,
                 known)
        if gap is None:
            self._committed = durable
        else:
            self._gaps[gap] = durable
        return True

    def _begin(self) -> StateTransaction:
        return StateTransaction(self._store.read, self._store.limits)

    def _apply(self, record: Record, txn: StateTransaction) -> bool:
        """Apply ``record``; False (and its writes undone) if it does not fit in ``txn``."""
        txn.begin_record()
        self.processor.apply(record, txn)
        if txn.over_limits():
            txn.undo_record()
            return False
        return True

    def _commit(self, checkpointer: Checkpointer, txn: StateTransaction,
                covered: Sequence[Record]) -> None:
        """Commit ``txn`` with the checkpoint of ``covered[-1]``. Each time a conflicting
        writer got there first, the first half of the records still to commit is applied
        again to the state as it now is and committed alone, the rest after it: a large
        transaction competing with other shards' small ones over shared keys would otherwise
        lose every race and never commit (simulator seed 341: 55 records refused four times
        in a row while their oldest aged out of the stream). Every commit that lands moves
        the checkpoint forward, so only conflicts in a row count against the limit."""
        batch: list[Record] = list(covered)
        rest: list[Record] = []
        conflicts = 0
        while batch:
            try:
                checkpointer.commit(batch[-1], partial(self._store.commit, txn=txn,
                                                       gap=checkpointer.gap))
            except TransactionRejected as exc:
                self._store.forget(list(txn.versions))
                landed = isinstance(exc, EarlierTransactionLanded)
                if landed:
                    # maybe a replaced predecessor's commit, which this processor never knew
                    # was in doubt: the lease's checkpoint may be past this checkpointer's.
                    # The fence took it up, so this line's next commit is not refused again:
                    # the line stays in doubt, read back before each batch, until a commit
                    # of it lands - also when a read below fails and the batch comes again
                    self._in_doubt[checkpointer.gap] = Position.after(batch[-1])
                    checkpointer.catch_up()
                if self._read_back(checkpointer, landed=landed) or landed:
                    # refused because an earlier commit had landed: the records it did not
                    # cover are applied again, to the state that holds that commit
                    done = self._committed_of(checkpointer.gap, checkpointer).extended
                    batch = [r for r in [*batch, *rest] if r.extended_sequence_number > done]
                    rest = []
                    if batch:
                        txn = self._applied_again(batch)
                    continue
                self._m.inc(STATE_CONFLICTS)
                if conflicts == MAX_CONFLICTS:
                    raise TransactionRejected(
                        f"shard {self._lease_key}: state keys kept changing under "
                        f"{MAX_CONFLICTS + 1} attempts; the batch fails and is delivered "
                        "again", []) from None
                half = max(1, len(batch) // 2)
                log.info("shard %s: a state key changed under a transaction of %d record(s) "
                         "(conflict %d in a row); applying %d of them again", self._lease_key,
                         len(batch), conflicts + 1, half)
                self._sleep(CONFLICT_RETRIES.delay(conflicts))
                conflicts += 1
                batch, rest = batch[:half], batch[half:] + rest
                txn = self._applied_again(batch)
                continue
            except Exception:
                # no answer (or the lease lost): the commit may have landed, and then the
                # cached values of its keys are stale and its records must not be applied
                # again; the next batch of this line reads back what landed
                self._store.forget(list(txn.versions))
                self._in_doubt[checkpointer.gap] = Position.after(batch[-1])
                raise
            self._landed(checkpointer, batch)
            conflicts = 0
            batch, rest = rest, []
            if batch:
                txn = self._applied_again(batch)

    def _applied_again(self, records: Sequence[Record]) -> StateTransaction:
        txn = self._begin()
        for record in records:
            if not self._apply(record, txn):
                raise TransactionTooLarge(
                    f"shard {self._lease_key}: records no longer fit one transaction "
                    "when applied again")
        return txn

    def _landed(self, checkpointer: Checkpointer, records: Sequence[Record]) -> None:
        """A commit landed; one of the line in doubt no longer can, fenced on the lease's
        counter (or the SQL store's row) this commit moved past it."""
        self._in_doubt.pop(checkpointer.gap, None)
        after = Position.after(records[-1])
        if checkpointer.gap is None:
            self._committed = after
        else:
            self._gaps[checkpointer.gap] = after
        self._m.inc(STATE_COMMITS)
        self._m.inc(STATE_RECORDS, by=len(records))


def exactly_once_factory(
    factory: Callable[[], object],
    store: StateStore,
    *,
    max_records: int,
    max_seconds: float,
    metrics: Metrics | None = None,
) -> Callable[[], IRecordProcessor]:
    """The worker's processor factory for a factory of ``StatefulProcessor``s."""

    def make() -> IRecordProcessor:
        processor = factory()
        if not isinstance(processor, StatefulProcessor):
            raise TypeError(f"{processor!r} is not a kclpy.StatefulProcessor; exactly-once "
                            "state needs one")
        return ExactlyOnceProcessor(processor, store, max_records=max_records,
                                    max_seconds=max_seconds, metrics=metrics)

    return make
