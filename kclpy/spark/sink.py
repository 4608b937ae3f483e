"""An exactly-once Parquet sink for the micro-batch path (local or POSIX filesystems).

The batcher gives at-least-once: a batch is retried until ``foreach_batch`` returns, and
records written but not checkpointed (a crash, a lost lease) are read again later, in a
batch with other ranges and another id. Exactly-once in the files therefore needs two
things, both done here:

- a batch is committed by renaming its staging directory to ``batch_id=<id>``, so a retry
  of a batch that was already committed is recognised and skipped, and a half-written
  attempt is never visible;
- every committed batch records its shard ranges next to its files; before writing, rows at
  or before a shard's highest committed position are dropped. A shard is read in order and
  replays start at its checkpoint, so a replay is always a prefix of what follows, and the
  high-water mark removes exactly that prefix.

The rename is atomic on local and POSIX filesystems (and HDFS); object stores have no atomic
rename, so there use a table format and MERGE on (shard_id, sequence_number,
sub_sequence_number) instead (docs/spark.md).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
        self._marks: dict[str, tuple[int, int]] = {}
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
        df = self._drop_committed(df, info, self._high_water_marks())
        staging = self._staging / f"{info.batch_id}-{uuid.uuid4().hex}"
        df.write.parquet(str(staging))
        ranges = [{"shard_id": r.shard_id, "last_sequence_number": r.last_sequence_number,
                   "last_sub_sequence_number": r.last_sub_sequence_number}
                  for r in info.ranges]
        (staging / RANGES_FILE).write_text(json.dumps(ranges), encoding="utf-8")
        try:
            staging.rename(final)
        except OSError:
            # Someone committed this batch id first (a concurrent retry): theirs stands.
            shutil.rmtree(staging, ignore_errors=True)
            if not final.exists():
                raise

    def _high_water_marks(self) -> Mapping[str, tuple[int, int]]:
        """Per shard, the highest position committed so far (new commits read from disk)."""
        if not self.root.is_dir():
            return self._marks
        for folder in self.root.iterdir():
            if folder.name in self._seen or not folder.name.startswith("batch_id="):
                continue
            ranges_file = folder / RANGES_FILE
            if not ranges_file.is_file():
                continue
            for r in json.loads(ranges_file.read_text(encoding="utf-8")):
                position = (int(r["last_sequence_number"]), int(r["last_sub_sequence_number"]))
                shard = str(r["shard_id"])
                self._marks[shard] = max(self._marks.get(shard, (-1, 0)), position)
            self._seen.add(folder.name)
        return self._marks

    @staticmethod
    def _drop_committed(df: Any, info: BatchInfo,
                        marks: Mapping[str, tuple[int, int]]) -> Any:
        from pyspark.sql import functions as f

        replayed = None
        for r in info.ranges:
            mark = marks.get(r.shard_id)
            if mark is None or (int(r.first_sequence_number), r.first_sub_sequence_number) > mark:
                continue
            seq, sub = str(mark[0]), mark[1]
            # Sequence numbers exceed every Spark integer type; without leading zeros, a
            # shorter decimal string is the smaller number and equal lengths compare as text.
            col_seq = f.col("sequence_number")
            at_or_before = (
                (f.length(col_seq) < len(seq))
                | ((f.length(col_seq) == len(seq)) & (col_seq < seq))
                | ((col_seq == seq) & (f.col("sub_sequence_number") <= sub)))
            condition = (f.col("shard_id") == r.shard_id) & at_or_before
            replayed = condition if replayed is None else replayed | condition
        return df if replayed is None else df.filter(~replayed)
