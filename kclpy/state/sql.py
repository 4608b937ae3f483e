"""State in a SQL database (SQLAlchemy Core): SQLite on one host, PostgreSQL across hosts.

Three tables, named after ``prefix``: ``<prefix>`` holds one row per key (``state_key``,
``state_value`` as JSON text, ``version``, ``incarnation``: drawn when the key is created,
so a key deleted and created again - its version starting over - is told from its former
life; NULL in rows written before the column), ``<prefix>_checkpoints`` one row per shard
(``lease_key``, ``tenure``, ``checkpoint``, ``sub_sequence_number``, ``incarnation``) and
``<prefix>_gaps`` one row per lag-recovery gap queued (``lease_key``, ``gap``: the position the
gap starts after, ``checkpoint``, ``sub_sequence_number``: what its commits reached, and
``gap_end``: the gap as it was queued, where it ends among it; NULL in rows an older kclpy wrote,
which learnt of a gap only at its first commit). A commit is one database
transaction that locks the shard's checkpoint row, checks that it still carries this worker's
tenure (the lease counter the tenure started at: ``LeaseFence.guard``), writes every state
change conditioned on the version and incarnation it was read at, and moves the checkpoint. A
worker that takes a shard first stamps the row with its own, larger tenure (``begin_tenure``),
so a zombie's commit finds a newer tenure and is rejected whole; it waits on the row lock for a
commit already under way, so the position it then reads includes that commit.

Here the store, not the lease table, holds the truth: the lease item's checkpoint is brought
up to date right after each commit (for ``kclpy leases`` and for the next owner's start), and
when that write fails the commit still stands - the next owner reads the store's position and
skips records it covers. A commit that finds its own position already stored (the previous
attempt landed, but its answer was lost) is taken as done. A gap's commit is fenced by the
shard's row the same way but moves the gap's row, never the shard's.

The gap queue itself lives in the lease item (``kclpyRecovery``), which a lease-table reset
deletes while this store keeps the shard's position past the gap: so the holder records each
gap here before it queues it (``record_gaps``), and the next tenure queues again every gap
the store holds that its lease's queue lacks (``ShardRecovery``, simulator seed 186). Rows
go when their gap leaves the queue (``drop_gaps``), after that write.

A claim or a commit holds the lease's lock (``LeaseFence.guard``), which the lease's renewals
wait for; its lock waits therefore end after a quarter of the failover time (``Guard.wait_s``,
2.5 s by default, never more than ``lock_timeout_s``), and a commit whose wait ran out is
refused like a version conflict and applied again with the lease's lock let go (``_locked``).

Tenures are counted per lease incarnation (``Lease.incarnation``, written when the lease
item is created): the checkpoint row names the one its tenure belongs to, so a lease or a
stream created again - its counter starting over - is recognised instead of being refused
for ever or, worse, having its records skipped as committed (``_claim``).

No wait on the database is unbounded: a host that accepts connections and never answers (a
dead backend behind a load balancer, a half-open route) would otherwise hang start-up or a
shard for ever. PostgreSQL connections give up after ``connect_timeout_s`` (libpq's
``connect_timeout``, whole seconds, at least 2) and statements after
``statement_timeout_s``; SQLite has no network, and its only wait, for the file's lock, is
``lock_timeout_s`` (its busy timeout). Opening a store that cannot be reached raises
:class:`StateStoreUnavailable` naming the timeout.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, IntegrityError

from kclpy.checkpoint import CheckpointWriter
from kclpy.errors import (
    CheckpointError,
    KCLError,
    KinesisClientLibDependencyException,
    LeaseLostError,
    ShutdownException,
    TransactionRejected,
)
from kclpy.leases.lease import incarnation_epoch, other_streams
from kclpy.position import Position
from kclpy.recovery.queue import RecoveryRequest
from kclpy.redaction import redact
from kclpy.state.store import CommittedCache
from kclpy.state.transaction import DELETED, Limits, StateTransaction, Versioned

if TYPE_CHECKING:
    from kclpy.leases.fence import Guard

log = logging.getLogger(__name__)

#: generous: one database transaction has no item limit worth the name, but a commit that
#: stays small keeps row locks short
MAX_ITEMS = 10_000
MAX_BYTES = 64_000_000
#: the checkpoint row's column naming the lease incarnation its tenures belong to, and the
#: state row's naming the life of its key (``Versioned.incarnation``)
INCARNATION = "incarnation"
INCARNATION_LENGTH = 100
KEY_INCARNATION_LENGTH = 32
#: the gaps row's column holding the gap as it was queued (``RecoveryRequest`` JSON)
GAP_END = "gap_end"
#: marks a key the transaction read but did not write
_READ_ONLY = object()
#: ``Connection.info`` key of the time past which a commit stops before its next statement
_DEADLINE = "kclpy_state_deadline"
#: SQLite's primary result code for a lock wait that ran out (extended codes share it)
SQLITE_BUSY = 5


def _is_sqlite(engine: Engine) -> bool:
    return engine.dialect.name == "sqlite"


def _begin_immediate(engine: Engine) -> None:
    """SQLite: take the write lock when a transaction begins, not at its first write, so two
    committers never deadlock upgrading read locks (the pysqlite recipe of SQLAlchemy's docs)."""

    @sa.event.listens_for(engine, "connect")
    def _no_implicit_begin(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None

    @sa.event.listens_for(engine, "begin")
    def _begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


class SQLStateStore:
    """State and per-shard checkpoints in a SQL database, given a SQLAlchemy URL
    (``sqlite:///state.db``, ``postgresql+psycopg://user@host/db``) or an ``Engine``."""

    limits = Limits(items=MAX_ITEMS, bytes=MAX_BYTES)
    #: its checkpoint rows: a stateful processor resumes after the later of this position
    #: and the lease item's
    keeps_position = True

    def __init__(
        self, url: str | Engine, *, prefix: str = "kclpy_state", lock_timeout_s: float = 10.0,
        connect_timeout_s: float = 10.0, statement_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        #: the longest lock wait of a read; a claim's or a commit's is shorter still when the
        #: lease's failover time asks for it (``_locked``)
        self.lock_timeout_s = lock_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._clock = clock
        if isinstance(url, Engine):
            self.engine = url
        else:
            # A row lock held by a frozen or partitioned worker must not stall a shard (and
            # its shutdown) for ever: the wait ends in an error and the batch is retried;
            # and on PostgreSQL the server ends a transaction left idle that long (a
            # SIGSTOPped holder, a host cut off mid-commit), which frees its locks: the
            # holder's COMMIT then fails, so nothing of it lands.
            sqlite = url.startswith("sqlite")
            connect_args: dict[str, Any] = {}
            if sqlite:
                connect_args = {"timeout": lock_timeout_s}
            elif url.startswith("postgresql"):
                connect_args = {
                    "connect_timeout": _libpq_seconds(connect_timeout_s),
                    "options": f"-c lock_timeout={int(lock_timeout_s * 1000)} "
                               f"-c statement_timeout={int(statement_timeout_s * 1000)} "
                               "-c idle_in_transaction_session_timeout="
                               f"{int(lock_timeout_s * 1000)}"}
            self.engine = sa.create_engine(url, connect_args=connect_args,
                                           pool_pre_ping=not sqlite)
            if sqlite:
                _begin_immediate(self.engine)
        meta = sa.MetaData()
        self.state = sa.Table(
            prefix, meta,
            sa.Column("state_key", sa.String(1024), primary_key=True),
            sa.Column("state_value", sa.Text, nullable=False),
            sa.Column("version", sa.BigInteger, nullable=False),
            sa.Column(INCARNATION, sa.String(KEY_INCARNATION_LENGTH)))
        self.checkpoints = sa.Table(
            f"{prefix}_checkpoints", meta,
            sa.Column("lease_key", sa.String(1024), primary_key=True),
            sa.Column("tenure", sa.BigInteger, nullable=False),
            sa.Column("checkpoint", sa.String(256)),
            sa.Column("sub_sequence_number", sa.BigInteger, nullable=False),
            sa.Column(INCARNATION, sa.String(INCARNATION_LENGTH)))
        self.gaps = sa.Table(
            f"{prefix}_gaps", meta,
            sa.Column("lease_key", sa.String(1024), primary_key=True),
            sa.Column("gap", sa.String(300), primary_key=True),
            sa.Column("checkpoint", sa.String(256), nullable=False),
            sa.Column("sub_sequence_number", sa.BigInteger, nullable=False),
            sa.Column(GAP_END, sa.Text))
        self._meta = meta
        self._cache = CommittedCache()
        self._sql = _Statements(self.state, self.checkpoints)

    def __repr__(self) -> str:
        return f"SQLStateStore({self.engine.url.render_as_string(hide_password=True)!r})"

    def open(self, dynamodb: Any) -> None:
        """Create the tables when missing. Workers starting together race to create them;
        the loser's CREATE fails once the winner's is committed, and a second look finds
        them."""
        try:
            with self.engine.connect():
                pass
        except DBAPIError as exc:
            raise StateStoreUnavailable(
                f"cannot connect to the state store {self!r} (connect timeout "
                f"{self.connect_timeout_s:g}s): {redact(str(exc.orig)).strip()}") from None
        try:
            self._meta.create_all(self.engine)
        except DBAPIError:
            self._meta.create_all(self.engine)
        self._add_column(self.checkpoints, INCARNATION, f"VARCHAR({INCARNATION_LENGTH})")
        self._add_column(self.state, INCARNATION, f"VARCHAR({KEY_INCARNATION_LENGTH})")
        self._add_column(self.gaps, GAP_END, "TEXT")

    def _add_column(self, table: sa.Table, name: str, sql_type: str) -> None:
        """A table created by an older kclpy gets the column, nullable. Checkpoint rows
        without an incarnation are judged by tenure alone, as they were; state rows without
        one are read and updated as they were (their NULL is checked like any incarnation);
        gap rows without an end are kept while their gap is queued (the holder's next queue
        write fills it in) and dropped when it is not (``stored_gaps``)."""
        def missing() -> bool:
            columns = sa.inspect(self.engine).get_columns(table.name)
            return name not in {column["name"] for column in columns}

        if not missing():
            return
        quote = self.engine.dialect.identifier_preparer.quote
        try:
            with self.engine.begin() as conn:
                conn.exec_driver_sql(
                    f"ALTER TABLE {quote(table.name)} ADD COLUMN {quote(name)} {sql_type}")
        except DBAPIError:
            if missing():  # not another worker's ALTER that won the race
                raise

    def read(self, key: str) -> Versioned:
        return self._cache.read(key, self._fetch)

    def _fetch(self, key: str) -> Versioned:
        with self.engine.connect() as conn:
            row = conn.execute(self._sql.fetch, {"key": key}).first()
        return (Versioned(None, 0) if row is None
                else Versioned(json.loads(row.state_value), row.version, row.incarnation))

    def begin_tenure(
        self, writer: CheckpointWriter, lease_key: str, token: str
    ) -> Position | None:
        try:
            try:
                return self._claim(writer, lease_key, token)
            except IntegrityError:  # another tenure inserted the row first: lock it this time
                return self._claim(writer, lease_key, token)
        except DBAPIError as exc:
            raise _unavailable(lease_key, "claim", exc) from exc

    def _claim(
        self, writer: CheckpointWriter, lease_key: str, token: str
    ) -> Position | None:
        """Stamp the shard's row with this tenure and return its position. The row names
        the lease incarnation (``Lease.incarnation``) its tenures belong to: a tenure counter
        is only compared within one incarnation. A later incarnation - the lease or the
        stream created again, its counter starting over - takes the row over; its position
        is kept when the stream is the same one (every record up to it was applied), dropped
        when the stream was created again (its sequence numbers are another stream's)."""
        with writer.guard(lease_key, token, what="state claim") as guard, \
                self._locked(guard) as conn:
            row = self._lock_checkpoint(conn, lease_key)
            incarnation = guard.lease.incarnation
            if row is None:
                conn.execute(sa.insert(self.checkpoints).values(
                    lease_key=lease_key, tenure=guard.tenure, checkpoint=None,
                    sub_sequence_number=0, incarnation=incarnation))
                return None
            position = (None if row.checkpoint is None
                        else Position.of(row.checkpoint, row.sub_sequence_number))
            stored = row.incarnation
            if incarnation is not None and stored is not None and incarnation != stored:
                position = self._take_over(conn, guard, incarnation, stored, position)
            elif row.tenure > guard.tenure:
                if incarnation is None or stored is None:
                    log.error(
                        "shard %s: the state store holds tenure %d, above this lease's "
                        "counter %d, and no lease incarnation tells whether the lease was "
                        "created again: refused. If the lease or its stream was created "
                        "again, delete the shard's row from %s", lease_key, row.tenure,
                        guard.tenure, self.checkpoints.name)
                raise LeaseLostError(f"state store holds tenure {row.tenure} > {guard.tenure}")
            conn.execute(sa.update(self.checkpoints)
                         .where(self.checkpoints.c.lease_key == lease_key)
                         .values(tenure=guard.tenure, incarnation=incarnation or stored,
                                 checkpoint=None if position is None else position.checkpoint,
                                 sub_sequence_number=(0 if position is None
                                                      else position.sub_sequence_number)))
            return position

    def _take_over(self, conn: Connection, guard: Guard, incarnation: str, stored: str,
                   position: Position | None) -> Position | None:
        """The row is of another incarnation of the lease. Taken over only when this
        worker's is the one the lease table holds now (a consistent read, made while the row
        is locked): one lease item per key exists at a time, so every incarnation that
        stamped the row before is an earlier, deleted one, and a holder of a deleted one
        finds another incarnation in the table and is refused. Creation times do not
        order incarnations: different workers' clocks stamp them (simulator seed 139).
        Returns the position to resume from."""
        lease_key = guard.lease.lease_key
        current = guard.current()
        if current is None or current.incarnation != incarnation:
            raise LeaseLostError(
                f"state store holds lease incarnation {stored}; the lease table holds "
                f"{'none' if current is None else current.incarnation}, not {incarnation}")
        epoch, stored_epoch = incarnation_epoch(incarnation), incarnation_epoch(stored)
        if other_streams(epoch, stored_epoch):
            log.warning(
                "shard %s: its stream was created again (creation epoch %s; the state store's "
                "position %s is of the stream created at %s): that position and its gaps' "
                "are dropped and the shard is read from its lease's checkpoint; the state is "
                "kept", lease_key, epoch, position, stored_epoch)
            conn.execute(sa.delete(self.gaps).where(self.gaps.c.lease_key == lease_key))
            return None
        log.warning("shard %s: its lease was created again (incarnation %s; the state store's "
                    "rows are of %s): resuming from the store's position %s, records up to it "
                    "are not applied again", lease_key, incarnation, stored, position)
        return position

    def commit(
        self,
        writer: CheckpointWriter,
        lease_key: str,
        token: str,
        position: Position,
        txn: StateTransaction,
        gap: Position | None = None,
    ) -> None:
        """A gap's commit is fenced by the shard's row like a live one, but checks and moves
        the gap's own row (``<prefix>_gaps``); the lease item's copy is then updated
        through ``writer`` - the gap's, which moves the gap in the recovery queue."""
        landed_before = False
        try:
            with writer.guard(lease_key, token, what="state commit") as guard, \
                    self._locked(guard) as conn:
                row = self._fenced_row(conn, guard, lease_key)
                stored = row if gap is None else conn.execute(
                    sa.select(self.gaps.c.checkpoint, self.gaps.c.sub_sequence_number)
                    .where(self._gap_row(lease_key, gap)).with_for_update()).first()
                if (stored is not None and stored.checkpoint is not None and Position.of(
                        stored.checkpoint, stored.sub_sequence_number) >= position):
                    log.info("shard %s: commit at %s had landed already", lease_key, position)
                    landed_before = True
                else:
                    self._write(conn, txn)
                    columns = {"checkpoint": position.checkpoint,
                               "sub_sequence_number": position.sub_sequence_number}
                    if gap is None:
                        conn.execute(self._sql.move_checkpoint, {
                            "key": lease_key, "to_checkpoint": position.checkpoint,
                            "to_sub_sequence_number": position.sub_sequence_number})
                    elif stored is None:
                        conn.execute(sa.insert(self.gaps).values(
                            lease_key=lease_key, gap=gap_name(gap), **columns))
                    else:
                        conn.execute(sa.update(self.gaps)
                                     .where(self._gap_row(lease_key, gap)).values(**columns))
        except IntegrityError as exc:  # a key this transaction saw missing was inserted
            raise TransactionRejected(f"shard {lease_key}: {exc.orig}", []) from exc
        except DBAPIError as exc:
            if _is_conflict(exc):
                raise TransactionRejected(f"shard {lease_key}: {exc.orig}", []) from exc
            raise _unavailable(lease_key, "commit", exc) from exc
        if landed_before:
            # What landed was an earlier attempt's: its keys created then carry that
            # attempt's incarnations, not this one's, and its values need not be these
            self._cache.forget(list(txn.versions))
        else:
            self._cache.committed(txn)
        try:
            writer.update_checkpoint(lease_key, token, position)
        except ShutdownException:
            # The lease is gone from this worker: no later commit of this tenure can land,
            # so the processor must stop here rather than apply the batch's next records
            # (simulator seed 836: applied after the shard was parked). It treats the
            # commit as in doubt, which the next tenure reads back from this store.
            log.warning("shard %s: state committed at %s; the lease was lost before the "
                        "lease table's checkpoint was updated", lease_key, position)
            raise
        except CheckpointError as exc:
            log.warning("shard %s: state committed at %s; the lease table's checkpoint "
                        "was not updated (%s) and will be on the next commit", lease_key,
                        position, exc)

    def durable_position(
        self, writer: CheckpointWriter, lease_key: str, token: str, gap: Position | None
    ) -> Position | None:
        """The shard's checkpoint row (or its gap's row): the store's, not the lease item's
        copy, which may lag behind it."""
        if gap is not None:
            return self.gap_position(lease_key, gap)
        try:
            with self.engine.connect() as conn:
                row = conn.execute(
                    sa.select(self.checkpoints.c.checkpoint,
                              self.checkpoints.c.sub_sequence_number)
                    .where(self.checkpoints.c.lease_key == lease_key)).first()
        except DBAPIError as exc:
            raise _unavailable(lease_key, "checkpoint read", exc) from exc
        if row is None or row.checkpoint is None:
            return None
        return Position.of(row.checkpoint, row.sub_sequence_number)

    def gap_position(self, lease_key: str, gap: Position) -> Position | None:
        try:
            with self.engine.connect() as conn:
                row = conn.execute(
                    sa.select(self.gaps.c.checkpoint, self.gaps.c.sub_sequence_number)
                    .where(self._gap_row(lease_key, gap))).first()
        except DBAPIError as exc:
            raise _unavailable(lease_key, "gap read", exc) from exc
        return None if row is None else Position.of(row.checkpoint, row.sub_sequence_number)

    def record_gaps(self, writer: CheckpointWriter, lease_key: str, token: str,
                    queue: Sequence[RecoveryRequest]) -> None:
        """Before the holder writes ``queue`` to the lease item: each gap's row gets the gap
        as queued (where it ends), a new one its checkpoint from the queue. Written first, so
        a crash between the two writes leaves a row whose gap is not queued - queued again by
        the next tenure, its committed records skipped by the row's own position - never a
        queued gap this store could lose to a reset. Fenced like a commit: a previous
        tenure's row would send the next one back over records it applied live."""
        with self._fenced(writer, lease_key, token, "gap record") as conn:
            for request in queue:
                found = conn.execute(sa.select(self.gaps.c.gap).where(
                    self._gap_row(lease_key, request.start_position))
                    .with_for_update()).first()
                end = json.dumps(request.to_json(), separators=(",", ":"))
                if found is None:
                    conn.execute(sa.insert(self.gaps).values(
                        lease_key=lease_key, gap=gap_name(request.start_position),
                        checkpoint=request.done, sub_sequence_number=request.done_sub,
                        **{GAP_END: end}))
                else:
                    conn.execute(sa.update(self.gaps).where(
                        self._gap_row(lease_key, request.start_position))
                        .values(**{GAP_END: end}))

    def drop_gaps(self, writer: CheckpointWriter, lease_key: str, token: str,
                  gaps: Collection[Position]) -> None:
        """``gaps`` left the lease item's queue (finished, cancelled, merged into another),
        in a write that landed: their rows go. Fenced, so a holder that lost the lease
        meanwhile never drops a row its successor queued again."""
        with self._fenced(writer, lease_key, token, "gap drop") as conn:
            conn.execute(sa.delete(self.gaps).where(
                self.gaps.c.lease_key == lease_key,
                self.gaps.c.gap.in_([gap_name(gap) for gap in gaps])))

    def forget_gaps(self, lease_key: str, gaps: Collection[Position]) -> None:
        """Unfenced: the lease is parked and nobody holds it, so no tenure writes the rows
        meanwhile (``StateStore.forget_gaps``)."""
        with self.engine.begin() as conn:
            conn.execute(sa.delete(self.gaps).where(
                self.gaps.c.lease_key == lease_key,
                self.gaps.c.gap.in_([gap_name(gap) for gap in gaps])))

    def stored_gaps(self, lease_key: str) -> dict[Position, RecoveryRequest | None]:
        """Every gap of ``lease_key`` the store holds, by where it starts: as it was queued,
        checkpointed where the store's commits reached; None for a row an older kclpy wrote
        (its end unknown)."""
        try:
            with self.engine.connect() as conn:
                rows = conn.execute(sa.select(
                    self.gaps.c.gap, self.gaps.c.checkpoint, self.gaps.c.sub_sequence_number,
                    self.gaps.c[GAP_END]).where(self.gaps.c.lease_key == lease_key)).all()
        except DBAPIError as exc:
            raise _unavailable(lease_key, "gap read", exc) from exc
        held: dict[Position, RecoveryRequest | None] = {}
        for row in rows:
            start, _, sub = str(row.gap).rpartition("/")
            end = row[3]
            held[Position.of(start, int(sub))] = None if end is None else (
                RecoveryRequest.from_json(json.loads(end)).checkpointed(
                    Position.of(row.checkpoint, row.sub_sequence_number), None))
        return held

    def move_position(self, lease_key: str, position: Position, *, tenure: int,
                      incarnation: str | None, gaps: Collection[Position]) -> None:
        """The checkpoint row moved to ``position`` (when the store has one) with its tenure
        raised to ``tenure``, so a commit of the previous holder's tenure is refused from
        then on - set to it with the ``incarnation`` of a lease created again, since the
        store would otherwise resume after its own, later, position (``_take_over``); and
        the progress of every gap not in ``gaps`` dropped: a gap found later after the same
        position would resume from it."""
        columns = self.checkpoints.c
        with self.engine.begin() as conn:
            row = conn.execute(sa.select(columns.tenure).where(
                columns.lease_key == lease_key).with_for_update()).first()
            if row is not None:
                values: dict[str, Any] = {
                    "checkpoint": position.checkpoint,
                    "sub_sequence_number": position.sub_sequence_number,
                    "tenure": tenure if incarnation is not None else max(int(row.tenure),
                                                                         tenure)}
                if incarnation is not None:
                    values[INCARNATION] = incarnation
                conn.execute(sa.update(self.checkpoints)
                             .where(columns.lease_key == lease_key).values(**values))
            conn.execute(sa.delete(self.gaps).where(
                self.gaps.c.lease_key == lease_key,
                self.gaps.c.gap.not_in([gap_name(gap) for gap in gaps])))

    def forget(self, keys: Sequence[str]) -> None:
        self._cache.forget(keys)

    # -- internals ---------------------------------------------------------------------------

    @contextmanager
    def _locked(self, guard: Guard) -> Iterator[Connection]:
        """A database transaction run while the lease's lock is held (a claim, a commit):
        its lock waits end within ``guard.wait_s`` (a quarter of the failover time) in all,
        not ``lock_timeout_s`` each, so hot rows or a busy SQLite file never hold up the
        lease's renewal until the lease is lost. A wait that runs out raises (nothing written): a
        commit is then refused like a conflict (``_is_conflict``) and applied again after
        the conflict backoff, its lease's lock let go in between; a claim fails its batch,
        which is delivered again."""
        budget_s = min(self.lock_timeout_s, guard.wait_s)
        postgresql = self.engine.dialect.name == "postgresql"
        # PostgreSQL bounds each lock wait, not their sum: each gets half the budget, and a
        # commit past the other half stops before its next statement (``_write``). SQLite
        # waits once, at BEGIN: the whole budget.
        wait_ms = max(1, int(budget_s * (500 if postgresql else 1000)))
        deadline = self._clock() + budget_s / 2 if postgresql else None
        with self.engine.connect() as conn:
            # SQLite waits at BEGIN (IMMEDIATE), before any statement of ours: its busy
            # timeout is the connection's, set before and put back after
            raw: Any = conn.connection.driver_connection if _is_sqlite(self.engine) else None
            before = None if raw is None else raw.execute("PRAGMA busy_timeout").fetchone()[0]
            if raw is not None:
                raw.execute(f"PRAGMA busy_timeout = {wait_ms}")
            try:
                with conn.begin():
                    if postgresql:
                        conn.exec_driver_sql(f"SET LOCAL lock_timeout = {wait_ms}")
                    if deadline is not None:
                        conn.info[_DEADLINE] = deadline
                    yield conn
            finally:
                conn.info.pop(_DEADLINE, None)
                if raw is not None:
                    # a connection broken meanwhile is the pool's to drop; its error, not
                    # this one, is the commit's
                    with suppress(Exception):
                        raw.execute(f"PRAGMA busy_timeout = {before}")

    @contextmanager
    def _fenced(self, writer: CheckpointWriter, lease_key: str, token: str,
                what: str) -> Iterator[Connection]:
        """A transaction of this tenure's, its lease's lock held and the shard's row locked
        and checked as a commit checks it; database failures as a commit's."""
        try:
            with writer.guard(lease_key, token, what=f"state {what}") as guard, \
                    self._locked(guard) as conn:
                self._fenced_row(conn, guard, lease_key)
                yield conn
        except DBAPIError as exc:
            raise _unavailable(lease_key, what, exc) from exc

    def _fenced_row(self, conn: Connection, guard: Guard, lease_key: str) -> Any:
        """The shard's row, locked, when it carries this worker's tenure; else the lease is
        lost (``LeaseLostError``)."""
        row = self._lock_checkpoint(conn, lease_key)
        incarnation = guard.lease.incarnation
        if row is None or row.tenure != guard.tenure or (
                incarnation is not None and row.incarnation != incarnation):
            raise LeaseLostError(
                f"state store holds tenure {None if row is None else row.tenure} of "
                f"{None if row is None else row.incarnation}, this worker "
                f"{guard.tenure} of {incarnation}")
        return row

    def _gap_row(self, lease_key: str, gap: Position) -> sa.ColumnElement[bool]:
        return sa.and_(self.gaps.c.lease_key == lease_key, self.gaps.c.gap == gap_name(gap))

    def _lock_checkpoint(self, conn: Connection, lease_key: str) -> Any:
        return conn.execute(self._sql.lock_checkpoint, {"key": lease_key}).first()

    def _write(self, conn: Connection, txn: StateTransaction) -> None:
        """Every key in sorted order (two committers lock shared keys in the same order, so
        PostgreSQL never has to break a deadlock between them). A key is as it was read
        when both its version and its incarnation are: the version alone starts over when
        the key is deleted and created again."""
        sql = self._sql
        deadline: float | None = conn.info.get(_DEADLINE)
        for key in sorted(txn.versions):
            if deadline is not None and self._clock() > deadline:
                raise TransactionRejected(
                    "state commit: lock waits took longer than the lease's renewals allow; "
                    "applied again", [])
            version, incarnation = txn.versions[key], txn.incarnations[key]
            # a NULL incarnation is matched by IS NULL, which takes a statement of its own
            same = {"key": key, "read_version": version}
            if incarnation is not None:
                same["read_incarnation"] = incarnation
            value = txn.writes.get(key, _READ_ONLY)
            if version == 0 and (value is _READ_ONLY or value is DELETED):
                self._check_absent(conn, key)
            elif value is _READ_ONLY:
                found = conn.execute(sql.read_locked, {"key": key}).first()
                if found is None or (found.version, found.incarnation) != (version, incarnation):
                    raise _conflict(key, version)
            elif value is DELETED:
                delete = sql.delete_null if incarnation is None else sql.delete_same
                if conn.execute(delete, same).rowcount != 1:
                    raise _conflict(key, version)
            elif version == 0:
                conn.execute(sql.insert, {"state_key": key, "state_value": _json(value),
                                          "version": 1, INCARNATION: incarnation})
            elif conn.execute(sql.update_null if incarnation is None else sql.update_same,
                              {**same, "new_value": _json(value),
                               "new_version": version + 1}).rowcount != 1:
                raise _conflict(key, version)
        for statement in txn.outgoing:
            conn.execute(statement)

    def _check_absent(self, conn: Connection, key: str) -> None:
        """``key`` was read as absent and is not written: it must still be absent, and stay
        so until this transaction ends. A SELECT cannot lock a row that does not exist (a
        PostgreSQL transaction could insert it right after), so a placeholder row is
        inserted and deleted again: the insert fails (``IntegrityError``, a conflict) when
        the key exists, and until this transaction ends any other insert of the key waits
        on it."""
        conn.execute(self._sql.insert, {"state_key": key, "state_value": "null", "version": 0})
        conn.execute(self._sql.delete_key, {"key": key})


class _Statements:
    """The statements a read and a commit run, built once per store with bind parameters:
    building them per call (and SQLAlchemy working out each one's cache key again) was most
    of a commit's own CPU. The SQL sent is the same as that of statements built per call."""

    def __init__(self, state: sa.Table, checkpoints: sa.Table) -> None:
        s, cp = state.c, checkpoints.c
        key: sa.BindParameter[str] = sa.bindparam("key")
        version: sa.BindParameter[int] = sa.bindparam("read_version")
        self.fetch = sa.select(s.state_value, s.version, s.incarnation).where(s.state_key == key)
        self.read_locked = (sa.select(s.version, s.incarnation).where(s.state_key == key)
                            .with_for_update(read=True))
        self.lock_checkpoint = (
            sa.select(cp.tenure, cp.checkpoint, cp.sub_sequence_number, cp.incarnation)
            .where(cp.lease_key == key).with_for_update())
        self.move_checkpoint = sa.update(checkpoints).where(cp.lease_key == key).values(
            checkpoint=sa.bindparam("to_checkpoint"),
            sub_sequence_number=sa.bindparam("to_sub_sequence_number"))
        # a key is as it was read when its version and incarnation both are
        null = sa.and_(s.state_key == key, s.version == version, s.incarnation.is_(None))
        same = sa.and_(s.state_key == key, s.version == version,
                       s.incarnation == sa.bindparam("read_incarnation"))
        self.delete_null = sa.delete(state).where(null)
        self.delete_same = sa.delete(state).where(same)
        new: dict[str, Any] = {"state_value": sa.bindparam("new_value"),
                               "version": sa.bindparam("new_version")}
        self.update_null = sa.update(state).where(null).values(new)
        self.update_same = sa.update(state).where(same).values(new)
        self.insert = sa.insert(state)
        self.delete_key = sa.delete(state).where(s.state_key == key)


def gap_name(gap: Position) -> str:
    """A gap's key in ``<prefix>_gaps``: the position it starts after."""
    return f"{gap.checkpoint}/{gap.sub_sequence_number}"


class StateStoreUnavailable(KCLError):
    """The state store's database could not be reached (refused, or silent past the
    connect timeout); the worker's start-up retries it like any other start-up failure."""


def _libpq_seconds(seconds: float) -> int:
    """libpq's ``connect_timeout``: whole seconds, and it takes anything below 2 as 2."""
    return max(2, round(seconds))


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _conflict(key: str, version: int) -> TransactionRejected:
    return TransactionRejected(f"state key {key!r} changed since version {version}", [])


def _unavailable(lease_key: str, what: str, exc: DBAPIError) -> KinesisClientLibDependencyException:
    """The database failed (lock timeout, lost connection): nothing is known to be written,
    so the batch is delivered again; a commit that did land is recognised by its position."""
    return KinesisClientLibDependencyException(
        f"shard {lease_key}: state store {what} failed: {type(exc.orig).__name__}: {exc.orig}")


def _is_conflict(exc: DBAPIError) -> bool:
    """PostgreSQL broke a deadlock or a serialization conflict, or a lock wait ran out its
    budget (PostgreSQL ``lock_not_available``, SQLite ``SQLITE_BUSY``: a hot row or file):
    apply again, like a version conflict."""
    if getattr(exc.orig, "sqlstate", None) in {"40001", "40P01", "55P03"}:
        return True
    code = getattr(exc.orig, "sqlite_errorcode", None)
    return code is not None and code & 0xFF == SQLITE_BUSY
