"""Where the executors record the end a budgeted batch reached (``metadataPath``).

Spark fixes a batch's end offset before any task runs, and offers a Python source no way for
a task to tell the driver anything. A batch cut after N rows, N bytes or N seconds of
reading ends where an executor stops, which the driver could only learn by reading the same
records itself. So the end in the offset log is the budget (an ``UPTO`` position), and the
executor that reads it writes the concrete position it reached here, under a name derived
from that end. The driver reads it back to plan the next batch, and a batch Spark re-runs
(after a failed task or a killed driver) reads exactly to the recorded position.

One file per (shard, planned end), created once: the first attempt to finish wins and any
later attempt is held to its result, so a re-run yields the same rows even when the budget
was time. A directory that the driver and every executor see (the same machine in
``local[N]``, a shared mount on a cluster); files are written to a temporary name, flushed
and linked into place, which is atomic and refuses to replace on POSIX filesystems.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

from kclpy.errors import KCLError
from kclpy.position import Position
from kclpy.spark.offsets import UptoEnd

__all__ = ["ConflictingEndError", "PositionStore"]


class ConflictingEndError(KCLError, RuntimeError):
    """Another attempt at the same part of a batch recorded a different end first: this
    attempt's rows are not the batch's, so the task fails and Spark's retry reads to the
    recorded end."""


class PositionStore:
    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def _path(self, shard_key: str, end: UptoEnd) -> Path:
        shard = hashlib.sha256(shard_key.encode()).hexdigest()[:24]
        name = hashlib.sha256(end.encode().encode()).hexdigest()[:40]
        return self.root / shard / f"{name}.json"

    def get(self, shard_key: str, end: UptoEnd) -> Position | None:
        """The position the end was recorded to have reached, None if it was not."""
        try:
            text = self._path(shard_key, end).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        item = json.loads(text)
        if item.get("end") != end.encode():
            raise ValueError(f"{self.root}: the record for {end.encode()} names "
                             f"{item.get('end')!r} (a hash collision or a foreign file)")
        return Position.decode(item["reached"])

    def put(self, shard_key: str, end: UptoEnd, reached: Position) -> Position:
        """Record ``reached`` unless a position is recorded already; the recorded one."""
        path = self._path(shard_key, end)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        body = json.dumps({"shard": shard_key, "end": end.encode(),
                           "reached": reached.encode()})
        with open(tmp, "w", encoding="utf-8") as out:
            out.write(body)
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        recorded = self.get(shard_key, end)
        assert recorded is not None
        return recorded

    def forget_older(self, shard_key: str, end: UptoEnd) -> None:
        """Drop the records written before ``end``'s: once ``end`` is committed no batch
        starts from an earlier end again. Older by the time written, since a later batch's
        parts are always read (and recorded) after an earlier one's committed."""
        keep = self._path(shard_key, end)
        try:
            since = keep.stat().st_mtime_ns
            entries = list(keep.parent.iterdir())
        except FileNotFoundError:
            return
        for entry in entries:
            if entry.name.startswith("."):  # a record being written
                continue
            try:
                if entry != keep and entry.stat().st_mtime_ns < since:
                    entry.unlink()
            except FileNotFoundError:
                continue
