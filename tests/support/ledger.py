"""An SQLite ledger that producers, worker processes and the audit share.

Producers write one row per user record they put (its unique id, plain or KPL, and where
Kinesis placed it). Every :class:`LedgerProcessor` - one per shard in each ``kclpy-worker``
process, ``--processor tests.support.ledger:LedgerProcessor`` - appends a journal row per
record it is handed and per lifecycle event, before it checkpoints. The journal's row number
is the global order in which things were committed, across processes: SQLite serialises
writers, so a row's number is assigned under the write lock of the transaction that commits
it. A ``kill -9`` can lose a batch that was being written, never half of it, and that batch
was not checkpointed either, so the audit sees it delivered again later. The lease table
samples and the disruptions of a chaos run are kept in the same file, so that a failed run
can be examined afterwards.

The database is in WAL mode with a busy timeout so that several worker processes and the
test's readers never fail on a lock, and with ``synchronous=NORMAL``, which survives a killed
process (only an OS crash could lose the last commits).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import kclpy
from kclpy.errors import KinesisClientLibDependencyException, ShutdownException, ThrottlingException
from kclpy.position import Position

#: Environment of a worker process: the ledger's path, the worker's id as the lease table
#: names it, and after how many batches its processors checkpoint.
LEDGER_ENV = "KCLPY_TEST_LEDGER_DB"
WORKER_ENV = "KCLPY_TEST_WORKER_ID"
CHECKPOINT_EVERY_ENV = "KCLPY_TEST_CHECKPOINT_EVERY"
#: seconds a processor takes to let go after ``shutdown_requested`` (one that flushes
#: before a handoff), so that a test can act while a handoff is surely under way
HANDOFF_HOLD_ENV = "KCLPY_TEST_HANDOFF_HOLD_S"

PLAIN = "plain"
KPL = "kpl"

# Journal events besides RECORD. CHECKPOINT is written only after the checkpoint call
# returned, so the lease table held that position before the row was committed.
RECORD = "record"
INITIALIZE = "initialize"
CHECKPOINT = "checkpoint"
CHECKPOINT_FAILED = "checkpoint_failed"
LEASE_LOST = "lease_lost"
SHARD_ENDED = "shard_ended"
SHUTDOWN_REQUESTED = "shutdown_requested"

# Long enough to outlast any other writer's transaction even on a loaded machine: a lock
# timeout would make a processor raise and its batch be delivered again for the wrong reason.
_BUSY_TIMEOUT_S = 60.0

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS produced (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    shard TEXT NOT NULL,
    seq TEXT NOT NULL,
    subseq INTEGER NOT NULL,
    at REAL NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS journal (
    n INTEGER PRIMARY KEY AUTOINCREMENT,
    event TEXT NOT NULL,
    session TEXT NOT NULL,
    shard TEXT NOT NULL,
    seq TEXT,
    subseq INTEGER,
    id TEXT,
    pid INTEGER NOT NULL,
    worker TEXT NOT NULL,
    at REAL NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS lease_samples (
    at REAL NOT NULL,
    shard TEXT NOT NULL,
    checkpoint TEXT NOT NULL,
    subseq INTEGER NOT NULL,
    owner TEXT,
    counter INTEGER NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS disruptions (
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    worker TEXT NOT NULL
)""",
)


@dataclass(frozen=True)
class Produced:
    """One user record as the producer put it: ``seq`` is the Kinesis record's sequence
    number and ``subseq`` the user record's index in its aggregate (0 when plain)."""

    id: str
    kind: str
    shard: str
    seq: str
    subseq: int
    at: float

    @property
    def position(self) -> Position:
        return Position(self.seq, self.subseq)


@dataclass(frozen=True)
class Entry:
    """One journal row. ``session`` names one processor instance (one shard, one tenure);
    for INITIALIZE ``seq``/``subseq`` are the checkpoint it starts from (a sentinel or a
    sequence number), for CHECKPOINT the position it wrote."""

    n: int
    event: str
    session: str
    shard: str
    seq: str | None
    subseq: int | None
    id: str | None
    pid: int
    worker: str
    at: float


@dataclass(frozen=True)
class LeaseSample:
    """One lease item as a scan of the lease table saw it."""

    at: float
    shard: str
    checkpoint: str
    subseq: int
    owner: str | None
    counter: int

    @property
    def position(self) -> Position:
        return Position.of(self.checkpoint, self.subseq)


def connect(path: str | Path) -> sqlite3.Connection:
    """A connection set up for several writer processes; creates the tables if needed.

    Autocommit mode (``isolation_level=None``): transactions are explicit ``BEGIN IMMEDIATE``
    blocks, so a writer takes the write lock up front and waits for it under the busy
    timeout instead of failing when a read turns into a write.
    """
    connection = sqlite3.connect(
        str(path), timeout=_BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
    )
    connection.execute(f"PRAGMA busy_timeout = {int(_BUSY_TIMEOUT_S * 1000)}")
    connection.execute("PRAGMA journal_mode = WAL")
    connection.execute("PRAGMA synchronous = NORMAL")
    with _transaction(connection):
        for statement in _SCHEMA:
            connection.execute(statement)
    return connection


@contextmanager
def _transaction(connection: sqlite3.Connection) -> Iterator[None]:
    connection.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        connection.execute("ROLLBACK")
        raise
    connection.execute("COMMIT")


class Ledger:
    """The test process's view: producers record into it, the audit and waits read it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._connection = connect(self.path)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._connection.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def record_produced(self, rows: Iterable[Produced]) -> None:
        with self._lock, _transaction(self._connection):
            self._connection.executemany(
                "INSERT INTO produced (id, kind, shard, seq, subseq, at) VALUES (?, ?, ?, ?, ?, ?)",
                [(r.id, r.kind, r.shard, r.seq, r.subseq, r.at) for r in rows],
            )

    def produced(self) -> list[Produced]:
        with self._lock:
            rows = self._connection.execute(
                "SELECT id, kind, shard, seq, subseq, at FROM produced"
            ).fetchall()
        return [Produced(*row) for row in rows]

    def journal(self) -> list[Entry]:
        with self._lock:
            rows = self._connection.execute(
                "SELECT n, event, session, shard, seq, subseq, id, pid, worker, at "
                "FROM journal ORDER BY n"
            ).fetchall()
        return [Entry(*row) for row in rows]

    def record_lease_samples(self, samples: Iterable[LeaseSample]) -> None:
        """Kept with the journal so that a failed run can be examined after the fact."""
        with self._lock, _transaction(self._connection):
            self._connection.executemany(
                "INSERT INTO lease_samples (at, shard, checkpoint, subseq, owner, counter) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                [(s.at, s.shard, s.checkpoint, s.subseq, s.owner, s.counter) for s in samples],
            )

    def record_disruption(self, kind: str, worker: str) -> None:
        """What the chaos did to which worker, on the journal's clock."""
        with self._lock, _transaction(self._connection):
            self._connection.execute(
                "INSERT INTO disruptions (at, kind, worker) VALUES (?, ?, ?)",
                (time.time(), kind, worker),
            )

    def missing_count(self) -> int:
        """Produced ids not processed yet: what a test polls while workers catch up."""
        with self._lock:
            row = self._connection.execute(
                "SELECT COUNT(*) FROM produced WHERE id NOT IN "
                "(SELECT id FROM journal WHERE event = ?)",
                (RECORD,),
            ).fetchone()
        return int(row[0])

    def count(self, event: str) -> int:
        with self._lock:
            row = self._connection.execute(
                "SELECT COUNT(*) FROM journal WHERE event = ?", (event,)
            ).fetchone()
        return int(row[0])


_Row = tuple[str, str | None, int | None, str | None]


class _Journal:
    """One per worker process: every processor of the process writes through it."""

    def __init__(self, path: str, worker: str) -> None:
        self._connection = connect(path)
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._worker = worker

    def write(self, session: str, shard: str, rows: Sequence[_Row]) -> None:
        """``rows`` of (event, seq, subseq, id), committed together."""
        now = time.time()
        values = [
            (event, session, shard, seq, subseq, record_id, self._pid, self._worker, now)
            for event, seq, subseq, record_id in rows
        ]
        with self._lock, _transaction(self._connection):
            self._connection.executemany(
                "INSERT INTO journal (event, session, shard, seq, subseq, id, pid, worker, at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                values,
            )


_journal: _Journal | None = None
_journal_lock = threading.Lock()


def _process_journal() -> _Journal:
    global _journal
    with _journal_lock:
        if _journal is None:
            _journal = _Journal(os.environ[LEDGER_ENV], os.environ.get(WORKER_ENV, "unknown"))
        return _journal


def record_id(record: kclpy.Record) -> str:
    """The unique id a producer put in the payload; anything else (a corrupt aggregate
    delivered raw, say) is named by its bytes so the audit reports it as unknown."""
    data = record.binary_data
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        return "undecodable:" + data[:32].hex()


class LedgerProcessor(kclpy.IRecordProcessor):
    """Journals every record before checkpointing it, then checkpoints every
    ``$KCLPY_TEST_CHECKPOINT_EVERY`` batches (default 1), at shard end and on shutdown.

    A checkpoint that fails because the lease is gone or DynamoDB keeps failing is journalled
    and not retried here: the next batch's checkpoint covers it, as a real application does.
    Any other error (``InvalidStateException``) is a bug and propagates, so the consumer
    retries the batch and the audit reports the duplicates it causes.
    """

    def __init__(self) -> None:
        self._journal = _process_journal()
        self._session = uuid.uuid4().hex
        self._shard_id = ""
        self._every = int(os.environ.get(CHECKPOINT_EVERY_ENV, "1"))
        self._batches = 0

    def _event(self, event: str, seq: str | None = None, subseq: int | None = None) -> None:
        self._journal.write(self._session, self._shard_id, [(event, seq, subseq, None)])

    def _checkpoint(self, checkpointer: kclpy.Checkpointer) -> None:
        try:
            checkpointer.checkpoint()
        except (ShutdownException, ThrottlingException, KinesisClientLibDependencyException):
            self._event(CHECKPOINT_FAILED)
            return
        self._batches = 0
        seq, subseq = checkpointer.last_checkpoint
        self._event(CHECKPOINT, seq, subseq)

    def initialize(self, initialize_input: kclpy.InitializeInput) -> None:
        self._shard_id = initialize_input.shard_id
        self._event(
            INITIALIZE, initialize_input.sequence_number, initialize_input.sub_sequence_number
        )

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        records = process_records_input.records
        if not records:
            return
        self._journal.write(
            self._session,
            self._shard_id,
            [(RECORD, r.sequence_number, r.sub_sequence_number, record_id(r)) for r in records],
        )
        self._batches += 1
        if self._batches >= self._every:
            self._checkpoint(process_records_input.checkpointer)

    def lease_lost(self, lease_lost_input: kclpy.LeaseLostInput) -> None:
        self._event(LEASE_LOST)

    def shard_ended(self, shard_ended_input: kclpy.ShardEndedInput) -> None:
        self._checkpoint(shard_ended_input.checkpointer)
        self._event(SHARD_ENDED)

    def shutdown_requested(self, shutdown_requested_input: kclpy.ShutdownRequestedInput) -> None:
        self._checkpoint(shutdown_requested_input.checkpointer)
        self._event(SHUTDOWN_REQUESTED)
        time.sleep(float(os.environ.get(HANDOFF_HOLD_ENV, "0")))
