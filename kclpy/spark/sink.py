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

The rename is atomic on local and POSIX filesystems (and HDFS); object stores have no atomic
rename, so there use a table format and MERGE on (shard_id, sequence_number,
sub_sequence_number) instead (docs/spark.md).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kclpy.position import Position
from kclpy.spark.batcher import BatchInfo, current_batch

__all__ = ["ParquetSink"]

RANGES_FILE = "_kclpy_ranges.json"



class ParquetSink:
    """``foreach_batch`` writing each micro-batch once under ``root/batch_id=<id>/``.

    Read the result with ``spark.read.parquet(root)`` (Spark skips the ``_``-prefixed
    staging folder and range files). One sink per output folder; workers that share a
    folder see each other's committed ranges, since the ranges are re-read from disk.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._staging = self.root / "_staging"
        #: per shard, the (first, last) positions of every committed range
        self._committed: dict[str, list[tuple[Position, Position]]] = {}
        self._seen: set[str] = set()

    def __call__(self, df: Any, batch_id: str) -> None:
        info = current_batch()
        if info is None or info.batch_id != batch_id:
            raise RuntimeError("ParquetSink needs the MicroBatcher's batch (current_batch())")
        self.write(df, info)

    def write(self, df: Any, info: BatchInfo) -> None:
        final = self.root / f"batch_id={info.batch_id}"
        if final.exists():
            return
        df = self._drop_committed(df, info, self._committed_ranges())
        staging = self._staging / f"{info.batch_id}-{uuid.uuid4().hex}"
        df.write.parquet(str(staging))
        ranges = [{"shard_id": r.shard_id,
                   "first_sequence_number": r.first_sequence_number,
                   "first_sub_sequence_number": r.first_sub_sequence_number,
                   "last_sequence_number": r.last_sequence_number,
                   "last_sub_sequence_number": r.last_sub_sequence_number,
                   "is_recovery": r.is_recovery}
                  for r in info.ranges]
        (staging / RANGES_FILE).write_text(json.dumps(ranges), encoding="utf-8")
        try:
            staging.rename(final)
        except OSError:
            # Someone committed this batch id first (a concurrent retry): theirs stands.
            shutil.rmtree(staging, ignore_errors=True)
            if not final.exists():
                raise

    def _committed_ranges(self) -> Mapping[str, Sequence[tuple[Position, Position]]]:
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
                self._committed.setdefault(str(r["shard_id"]), []).append((first, last))
            self._seen.add(folder.name)
        return self._committed

    @staticmethod
    def _drop_committed(df: Any, info: BatchInfo,
                        committed: Mapping[str, Sequence[tuple[Position, Position]]]) -> Any:
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
            for first, last in committed.get(r.shard_id, ()):
                if first > high or last < low:
                    continue
                inside = ~after(last) if not first.is_record else ~before(first) & ~after(last)
                condition = (f.col("shard_id") == r.shard_id) & inside
                written = condition if written is None else written | condition
        return df if written is None else df.filter(~written)
