"""The MultiLang child of the chaos run: speaks the protocol by hand and journals into the
chaos ledger exactly what ``tests.support.ledger.LedgerProcessor`` journals, so the same
audit judges it; and misbehaves as ``KCLPY_CHAOS_CHILD`` says (``crash=P,hang=P,flood=P``):

- ``crash``: exits at once when a batch arrives (before journalling it, and only when its
  last checkpoint succeeded, so the restart from that checkpoint repeats nothing);
- ``hang``: in ``shutdownRequested``, after checkpointing, ignores SIGTERM and sleeps instead
  of answering, as a slow shutdown handler does (the worker must end it);
- ``flood``: after answering a batch, writes 4 MiB of lines to stdout (the protocol channel)
  nobody asked for.

Each misbehaviour is also appended to ``<run folder>/behaviours.log`` (the run folder is the
first argument, which also lets the test find its children in the process table). It
checkpoints after every batch.
"""

import base64
import json
import os
import random
import signal
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.ledger import (
    CHECKPOINT,
    CHECKPOINT_FAILED,
    INITIALIZE,
    LEASE_LOST,
    RECORD,
    SHARD_ENDED,
    SHUTDOWN_REQUESTED,
    _process_journal,
)

CHILD_ENV = "KCLPY_CHAOS_CHILD"
SEED_ENV = "KCLPY_CHAOS_CHILD_SEED"
FLOOD_LINES = 64
FLOOD_LINE = "f" * 65535 + "\n"


def rates():
    configured = dict(part.split("=") for part in os.environ.get(CHILD_ENV, "").split(",")
                      if part)
    return {name: float(configured.get(name, 0.0)) for name in ("crash", "hang", "flood")}


class Child:
    def __init__(self, run_folder):
        self.run_folder = Path(run_folder)
        self.journal = _process_journal()
        self.session = uuid.uuid4().hex
        self.shard_id = ""
        self.rates = rates()
        self.rng = random.Random()
        self.last_delivered = None
        self.last_checkpoint = None
        self.checkpointed = True

    def earlier_starts(self, start):
        """How many children of this run began this shard at ``start`` before this one.
        Part of the seed: the run's seed alone would make a restarted child draw what its
        predecessor drew, and crash at the same record for ever."""
        starts = self.run_folder / "starts.log"
        mine = f"{self.shard_id} {start}"
        before = (sum(line == mine for line in starts.read_text().splitlines())
                  if starts.exists() else 0)
        with starts.open("a") as out:
            out.write(mine + "\n")
        return before

    def note(self, behaviour):
        with (self.run_folder / "behaviours.log").open("a") as out:
            out.write(f"{behaviour} {self.shard_id}\n")

    def event(self, event, seq=None, sub=None, record_id=None):
        self.journal.write(self.session, self.shard_id, [(event, seq, sub, record_id)])

    def send(self, message):
        sys.stdout.write("\n" + json.dumps(message) + "\n")
        sys.stdout.flush()

    def read(self):
        line = sys.stdin.readline()
        if not line:
            sys.exit(0)
        return json.loads(line)

    def status(self, action):
        self.send({"action": "status", "responseFor": action})

    def checkpoint(self, seq, sub):
        """Checkpoint at (seq, sub) (None: SHARD_END in shardEnded) and journal it."""
        self.send({"action": "checkpoint", "sequenceNumber": seq, "subSequenceNumber": sub})
        reply = self.read()
        self.checkpointed = reply.get("error") is None
        if not self.checkpointed:
            self.event(CHECKPOINT_FAILED)
        elif seq is None:
            self.event(CHECKPOINT, "SHARD_END", 0)
        else:
            self.event(CHECKPOINT, seq, sub)

    def run(self):
        while True:
            message = self.read()
            action = message["action"]
            if action == "initialize":
                self.shard_id = message["shardId"]
                start = message["sequenceNumber"]
                self.rng.seed(f"{os.environ.get(SEED_ENV, '')}:{self.shard_id}:{start}:"
                              f"{self.earlier_starts(start)}")
                self.event(INITIALIZE, message["sequenceNumber"], message["subSequenceNumber"])
            elif action == "processRecords":
                self.process(message["records"])
            elif action == "leaseLost":
                self.event(LEASE_LOST)
            elif action == "shardEnded":
                self.checkpoint(None, None)
                self.event(SHARD_ENDED)
            elif action == "shutdownRequested":
                if self.last_delivered is not None and not self.checkpointed_last:
                    self.checkpoint(*self.last_delivered)
                self.event(SHUTDOWN_REQUESTED)
                if self.rng.random() < self.rates["hang"]:
                    self.note("hang")
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
                    time.sleep(3600)
            self.status(action)
            if action == "processRecords" and self.rng.random() < self.rates["flood"]:
                self.note("flood")
                for _ in range(FLOOD_LINES):
                    sys.stdout.write(FLOOD_LINE)
                sys.stdout.flush()

    @property
    def checkpointed_last(self):
        return self.checkpointed and self.last_checkpoint == self.last_delivered

    def process(self, records):
        if not records:
            return
        if self.checkpointed and self.rng.random() < self.rates["crash"]:
            self.note("crash")
            sys.stdout.flush()
            os._exit(3)
        rows = []
        for record in records:
            data = base64.b64decode(record["data"])
            try:
                record_id = data.decode("ascii")
            except UnicodeDecodeError:
                record_id = "undecodable:" + data[:32].hex()
            rows.append((RECORD, record["sequenceNumber"], record["subSequenceNumber"],
                         record_id))
        self.journal.write(self.session, self.shard_id, rows)
        last = records[-1]
        self.last_delivered = (last["sequenceNumber"], last["subSequenceNumber"])
        self.checkpoint(*self.last_delivered)
        self.last_checkpoint = self.last_delivered if self.checkpointed else None


if __name__ == "__main__":
    Child(sys.argv[1]).run()
