"""An amazon_kclpy v3 application that writes the fleet ledger (``tests/support/fleet.py``'s
format): one JSON line per record and per event, appended with one ``write`` per batch to
the file named by ``KCLPY_TEST_LEDGER``, tagged with the daemon's name
(``KCLPY_TEST_WORKER``). It checkpoints at the last record of every batch (again in
``shutdown_requested``) and at ``shard_ended``, as a careful application does. Run unchanged
by the Java MultiLangDaemon and by ``kclpy-worker --properties``.

Its ``initialize`` line also says when the daemon started this process (``spawned``): the
consumer's start, which a test can time without the interpreter's own start-up, slow on a
loaded machine.
"""

import json
import os
import time

from amazon_kclpy import kcl
from amazon_kclpy.v3 import processor


def spawned():
    """When this process was started (``time.time()`` scale), from its start tick in
    ``/proc/self/stat`` and ``/proc/uptime`` (both counted from boot, 10 ms apart); None off
    Linux."""
    try:
        with open("/proc/self/stat") as stat:
            # fields after the command, which may hold spaces, in parentheses; starttime is
            # field 22, the 20th after it
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as uptime:
            up = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (up - ticks / os.sysconf("SC_CLK_TCK"))


class FleetChild(processor.RecordProcessorBase):
    def __init__(self):
        self.shard_id = ""
        self.last = None
        self.worker = os.environ["KCLPY_TEST_WORKER"]
        self.path = os.environ["KCLPY_TEST_LEDGER"]

    def _write(self, *entries):
        now = time.time()
        text = "".join(
            json.dumps({**entry, "shard": self.shard_id, "worker": self.worker,
                        "pid": os.getpid(), "t": now}) + "\n"
            for entry in entries)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def _checkpoint(self, checkpointer, during, sequence_number=None, sub=None):
        try:
            checkpointer.checkpoint(sequence_number, sub)
        except kcl.CheckpointError as exc:
            self._write({"event": "checkpoint", "during": during, "ok": False,
                         "error": exc.value})
            return
        self._write({"event": "checkpoint", "during": during, "ok": True,
                     "seq": sequence_number, "sub": sub})

    def initialize(self, initialize_input):
        self.shard_id = initialize_input.shard_id
        self._write({"event": "initialize", "checkpoint": initialize_input.sequence_number,
                     "checkpoint_sub": initialize_input.sub_sequence_number,
                     "spawned": spawned()})

    def process_records(self, process_records_input):
        records = process_records_input.records
        self._write(*({"seq": r.sequence_number, "sub": r.sub_sequence_number,
                       "data": r.binary_data.decode()} for r in records))
        if records:
            self.last = (records[-1].sequence_number, records[-1].sub_sequence_number)
            self._checkpoint(process_records_input.checkpointer, "process_records", *self.last)

    def lease_lost(self, lease_lost_input):
        self._write({"event": "lease_lost"})

    def shard_ended(self, shard_ended_input):
        self._checkpoint(shard_ended_input.checkpointer, "shard_ended")
        self._write({"event": "shard_ended"})

    def shutdown_requested(self, shutdown_requested_input):
        self._write({"event": "shutdown_requested"})
        if self.last is not None:
            self._checkpoint(shutdown_requested_input.checkpointer, "shutdown_requested",
                             *self.last)


if __name__ == "__main__":
    kcl.KCLProcess(FleetChild()).run()
