"""An exactly-once Parquet sink for the micro-batch path (local or POSIX filesystems).

The batcher gives at-least-once: a batch is retried until ``foreach_batch`` returns, and
records written but not checkpointed (a crash, a lost lease) are read again later, in a
batch with other ranges and another id. Exactly-once in the files therefore needs two
things, both done here:

- a batch is committed by renaming its staging directory to ``batch_id=<id>``, so a retry
  of a batch that was already committed is recognised and skipped, and a half-written
  attempt is never visible;
- every committed batch records its shard ranges next to its files, and before writing, rows
  that fall inside a range already committed for their shard are dropped. A range is one run
  of records read in order - the shard's live records, or one recovered gap's (lag
  recovery): the batcher never mixes the two in a part - so every record between its first
  and last position was written. A replay (after a crash or a lost lease) starts at a
  checkpoint, and lies inside ranges already committed exactly as far as it was written
  before; a recovered gap lies before the live position, outside the live ranges, and
  reaches the files however far live reading went meanwhile. A single high-water mark per
  shard would take the whole gap for a replay and drop it.

Several workers may write one shard's records: a zombie whose ``foreach_batch`` was still
running when its lease moved (a process paused, or a write that outlasted a graceful
handoff), and the shard's new owner, which reads again from the last checkpoint. So the
commit - re-reading the committed ranges, checking them, renaming - is one critical section
for all writers of the folder (an ``flock`` on ``_kclpy_commit.lock``, plus a thread lock,
since on NFS Linux emulates ``flock`` with per-process ``fcntl`` locks), entered inside
the batcher's ``BatchInfo.commit_fence`` (the lease fence's ``guard`` of every part: a
lease this worker no longer holds, or let go of when a handoff timed out, is refused, and
the release that lets a handoff's new owner adopt the lease waits for the block). Inside it:

- a range committed for one of the batch's shards by a later tenure (a larger lease counter
  of the same lease incarnation; the range files record it) means this writer is a zombie:
  it raises ``FencedOut`` and commits nothing, and the batcher drops that shard's part;
- a range committed since this batch's rows were filtered, that overlaps them, means the
  staged files may hold rows committed meanwhile: they are written again, filtered against
  everything committed, and the check repeats.

The precondition: every writer of the folder sees the same files, takes ``flock`` locks
that the others honour, and renames atomically - a local disk, or a shared POSIX
filesystem with working locks (NFSv4). An object store has neither atomic rename nor
locks: there, use a table format and MERGE on (shard_id, sequence_number,
sub_sequence_number) instead (docs/spark.md).

Staging folders live under ``_staging/<sink id>/`` and each sink holds an ``flock`` on
``_staging/<sink id>.lock`` for its life; a new sink removes the staging folders of sinks
whose lock nobody holds any more (a process killed part way through a write), and the
folders an earlier kclpy staged directly under ``_staging/``.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from kclpy.position import Position
from kclpy.spark.batcher import BatchInfo, FencedOut, current_batch

if TYPE_CHECKING:
    from kclpy.leases.fence import Guard

__all__ = ["ParquetSink"]

RANGES_FILE = "_kclpy_ranges.json"
COMMIT_LOCK = "_kclpy_commit.lock"

#: per commit-lock path, the lock of this process's threads
_THREAD_LOCKS: dict[str, threading.Lock] = {}
#: the ids of this process's live sinks: their staging is never another sink's to clean
_LIVE_SINKS: set[str] = set()
_GUARD = threading.Lock()


@dataclass(frozen=True)
class _Committed:
    """One committed range of one shard, and who committed it."""

    first: Position
    last: Position
    #: the ``batch_id=`` folder it is in
    folder: str
    #: the lease counter its writer's tenure started at, and the lease's incarnation
    #: (None: written without a fence, or by a kclpy before this was recorded)
    tenure: int | None
    incarnation: str | None


@contextmanager
def _commit_lock(root: Path) -> Iterator[None]:
    """The folder's commit lock: one committer at a time, across threads and processes.
    (``fcntl`` is imported here: POSIX only, and ``kclpy.spark`` must still import
    elsewhere.)"""
    import fcntl

    path = root / COMMIT_LOCK
    with _GUARD:
        thread_lock = _THREAD_LOCKS.setdefault(str(path.resolve()), threading.Lock())
    with thread_lock, open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class ParquetSink:
    """``foreach_batch`` writing each micro-batch once under ``root/batch_id=<id>/``.

    Read the result with ``spark.read.parquet(root)`` (Spark skips the ``_``-prefixed
    staging folder, lock and range files). One sink per output folder and process; workers
    that share a folder see each other's committed ranges, since the ranges are re-read from
    disk inside the commit lock.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._staging_root = self.root / "_staging"
        self._id = uuid.uuid4().hex
        self._staging = self._staging_root / self._id
        self._staging_lock: IO[bytes] | None = None
        #: per shard, every committed range
        self._committed: dict[str, list[_Committed]] = {}
        self._seen: set[str] = set()

    def __call__(self, df: Any, batch_id: str) -> None:
        info = current_batch()
        if info is None or info.batch_id != batch_id:
            raise RuntimeError("ParquetSink needs the MicroBatcher's batch (current_batch())")
        self.write(df, info)

    def write(self, df: Any, info: BatchInfo) -> None:
        """Commit ``df``'s rows that no committed range holds; raises ``FencedOut`` (nothing
        committed) when a shard of the batch was committed by a later tenure."""
        final = self.root / f"batch_id={info.batch_id}"
        if final.exists():
            return
        self._start()
        committed = self._committed_ranges()
        considered = set(self._seen)
        staging = self._stage(df, info, committed)
        fence = info.commit_fence
        try:
            while True:
                with (fence() if fence is not None else nullcontext({})) as guards, \
                        _commit_lock(self.root):
                    if final.exists():
                        return
                    committed = self._committed_ranges()
                    self._check_tenures(info, guards, committed)
                    if not self._overlapping_since(info, committed, considered):
                        self._write_ranges(staging, info, guards)
                        staging.rename(final)
                        return
                    considered = set(self._seen)
                # Rows of this batch were committed by another writer since they were
                # filtered: write them again, without those.
                shutil.rmtree(staging, ignore_errors=True)
                staging = self._stage(df, info, committed)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)

    # -- staging ---------------------------------------------------------------------------

    def _start(self) -> None:
        """Once per sink: take this sink's staging lock and remove the staging folders of
        sinks that hold theirs no more (killed part way through a write)."""
        import fcntl

        if self._staging_lock is not None:
            return
        self._staging_root.mkdir(parents=True, exist_ok=True)
        handle = open(self._staging_root / f"{self._id}.lock", "a+b")  # noqa: SIM115
        fcntl.flock(handle, fcntl.LOCK_EX)
        self._staging_lock = handle
        with _GUARD:
            _LIVE_SINKS.add(self._id)
            live = set(_LIVE_SINKS)
        for lock_file in self._staging_root.glob("*.lock"):
            owner = lock_file.stem
            if owner in live:
                continue
            with open(lock_file, "a+b") as other:
                try:
                    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # a live sink's, in another process
                shutil.rmtree(self._staging_root / owner, ignore_errors=True)
                lock_file.unlink(missing_ok=True)
        # what a kclpy before sink ids staged (``<batch id>-<uuid>``): nobody finishes it
        for folder in self._staging_root.glob("kclpy-*"):
            if folder.is_dir():
                shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        """Let go of the staging lock (a later sink may then clean this one's staging)."""
        if self._staging_lock is not None:
            self._staging_lock.close()
            self._staging_lock = None
            with _GUARD:
                _LIVE_SINKS.discard(self._id)

    def _stage(self, df: Any, info: BatchInfo,
               committed: Mapping[str, Sequence[_Committed]]) -> Path:
        staging = self._staging / f"{info.batch_id}-{uuid.uuid4().hex}"
        self._drop_committed(df, info, committed).write.parquet(str(staging))
        return staging

    @staticmethod
    def _write_ranges(staging: Path, info: BatchInfo, guards: Mapping[str, Guard]) -> None:
        def tenure(shard_id: str) -> dict[str, Any]:
            guard = guards.get(shard_id)
            return {"tenure": None if guard is None else guard.tenure,
                    "incarnation": None if guard is None else guard.lease.incarnation}

        ranges = [{"shard_id": r.shard_id,
                   "first_sequence_number": r.first_sequence_number,
                   "first_sub_sequence_number": r.first_sub_sequence_number,
                   "last_sequence_number": r.last_sequence_number,
                   "last_sub_sequence_number": r.last_sub_sequence_number,
                   "is_recovery": r.is_recovery,
                   **tenure(r.shard_id)}
                  for r in info.ranges]
        (staging / RANGES_FILE).write_text(json.dumps(ranges), encoding="utf-8")

    # -- the checks inside the commit lock ----------------------------------------------

    @staticmethod
    def _check_tenures(info: BatchInfo, guards: Mapping[str, Guard],
                       committed: Mapping[str, Sequence[_Committed]]) -> None:
        """FencedOut when a later tenure of the same lease incarnation committed a range of
        one of the batch's shards. Ranges of another incarnation (the lease created again,
        its counter starting over) are not compared; their rows are still never written
        twice, by the overlap check."""
        fenced = set()
        for shard_id, guard in guards.items():
            mine = guard.lease.incarnation
            if any(c.tenure is not None and c.tenure > guard.tenure
                   and (c.incarnation is None or mine is None or c.incarnation == mine)
                   for c in committed.get(shard_id, ())):
                fenced.add(shard_id)
        if fenced:
            raise FencedOut(fenced, "a later tenure committed to the sink")

    @staticmethod
    def _overlapping_since(info: BatchInfo, committed: Mapping[str, Sequence[_Committed]],
                           considered: set[str]) -> bool:
        """Whether a range committed outside ``considered`` overlaps one of the batch's."""
        for r in info.ranges:
            low = Position(r.first_sequence_number, r.first_sub_sequence_number)
            high = Position(r.last_sequence_number, r.last_sub_sequence_number)
            for c in committed.get(r.shard_id, ()):
                if c.folder not in considered and not (c.first > high or c.last < low):
                    return True
        return False

    def _committed_ranges(self) -> Mapping[str, Sequence[_Committed]]:
        """Per shard, every range committed so far (new commits read from disk)."""
        if not self.root.is_dir():
            return self._committed
        for folder in self.root.iterdir():
            if folder.name in self._seen or not folder.name.startswith("batch_id="):
                continue
            ranges_file = folder / RANGES_FILE
            if not ranges_file.is_file():
                continue
            for r in json.loads(ranges_file.read_text(encoding="utf-8")):
                last = Position(str(r["last_sequence_number"]),
                                int(r["last_sub_sequence_number"]))
                # A range file of an earlier kclpy holds only the last position: as then,
                # everything up to it counts as written (from before every record).
                first = (Position.trim_horizon() if "first_sequence_number" not in r else
                         Position(str(r["first_sequence_number"]),
                                  int(r["first_sub_sequence_number"])))
                tenure = r.get("tenure")
                self._committed.setdefault(str(r["shard_id"]), []).append(_Committed(
                    first, last, folder.name, None if tenure is None else int(tenure),
                    r.get("incarnation")))
            self._seen.add(folder.name)
        return self._committed

    @staticmethod
    def _drop_committed(df: Any, info: BatchInfo,
                        committed: Mapping[str, Sequence[_Committed]]) -> Any:
        from pyspark.sql import functions as f

        # Sequence numbers exceed every Spark integer type; without leading zeros, a shorter
        # decimal string is the smaller number and equal lengths compare as text.
        col_seq, col_sub = f.col("sequence_number"), f.col("sub_sequence_number")

        def after(position: Position) -> Any:
            seq, sub = position.sequence_number, position.sub_sequence_number
            return ((f.length(col_seq) > len(seq))
                    | ((f.length(col_seq) == len(seq)) & (col_seq > seq))
                    | ((col_seq == seq) & (col_sub > sub)))

        def before(position: Position) -> Any:
            seq, sub = position.sequence_number, position.sub_sequence_number
            return ((f.length(col_seq) < len(seq))
                    | ((f.length(col_seq) == len(seq)) & (col_seq < seq))
                    | ((col_seq == seq) & (col_sub < sub)))

        written = None
        for r in info.ranges:
            low = Position(r.first_sequence_number, r.first_sub_sequence_number)
            high = Position(r.last_sequence_number, r.last_sub_sequence_number)
            for c in committed.get(r.shard_id, ()):
                first, last = c.first, c.last
                if first > high or last < low:
                    continue
                inside = ~after(last) if not first.is_record else ~before(first) & ~after(last)
                condition = (f.col("shard_id") == r.shard_id) & inside
                written = condition if written is None else written | condition
        return df if written is None else df.filter(~written)
